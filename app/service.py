"""Cache operations: what the routes call, one home per path.

``CacheService`` builds each path with the collaborators it needs and keeps the
telemetry and the CacheBlend index in step with the pool: lookup (``app.lookup``),
store (``app.store``), retrieve (``app.retrieve``), registration
(``app.registrar``); it serves end of session and blend matching itself. The wire
shapes are ``contract.schemas``'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from app.blend import BlendMatcher
from app.bodies import span_tokens
from app.chunk_size import ChunkSizeAuthority
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.l2 import L2Tier
from app.lookup import LookupContext, Lookups
from app.lookup_areas import LookupAreas
from app.pool_pressure import PoolPressureLog
from app.registrar import Registrar
from app.retrieve import Retrieve
from app.sessions import Session, SessionManager
from app.store import Store
from app.telemetry import Telemetry
from app.transfers import Transfers
from contract.errors import FeatureDisabled
from contract.schemas import (
    BlendChunk,
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    RegisterRequest,
    RegisterResponse,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)
from dataplane.device_path import DevicePath
from dataplane.fdgate import FdGate
from dataplane.pool import DropReason, Entry, Pool
from dataplane.registry import Registry
from dataplane.transfer import CopyPool

__all__ = ["CacheService"]


class CacheService:
    """The cache operations of one server; each needs a final chunk size (409
    ``NotNegotiated`` before that, ``ChunkSizeAuthority.final``).

    Lock order: the session manager's lock, then the pool's (``on_release`` runs
    under the former and takes the latter); the pool never calls back into sessions.
    """

    def __init__(
        self,
        *,
        chunk_size: ChunkSizeAuthority,
        hasher: TokenHasher,
        sessions: SessionManager,
        blend: BlendMatcher,
        telemetry: Telemetry,
        pool: Pool,
        registry: Registry,
        areas: LookupAreas,
        lease_ttl_s: float,
        copier: CopyPool | None = None,
        gate: FdGate | None = None,
        clock: Callable[[], float] = time.monotonic,
        l2: L2Tier | None = None,
        disk: DiskTier | None = None,
        device: DevicePath | None = None,
    ) -> None:
        self._chunk_size = chunk_size
        self._hasher = hasher
        self._sessions = sessions
        self._blend = blend
        self._telemetry = telemetry
        self._pool = pool
        copier = copier or CopyPool(1)
        self._pool_pressure = PoolPressureLog(clock=clock)
        self.lookups = Lookups(
            LookupContext(sessions, hasher, pool, registry, telemetry, lease_ttl_s, l2, disk),
            chunk_size=chunk_size,
            areas=areas,
        )
        self.transfers = Transfers(
            chunk_size=chunk_size,
            sessions=sessions,
            registry=registry,
            telemetry=telemetry,
            device=device,
            clock=clock,
        )
        self._store = Store(
            transfers=self.transfers,
            pool=pool,
            copier=copier,
            hasher=hasher,
            blend=blend,
            telemetry=telemetry,
            pressure=self._pool_pressure,
            l2=l2,
            disk=disk,
        )
        self._retrieve = Retrieve(
            transfers=self.transfers,
            pool=pool,
            copier=copier,
            hasher=hasher,
            telemetry=telemetry,
            l2=l2,
            disk=disk,
        )
        self._registrar = Registrar(
            chunk_size=chunk_size, registry=registry, telemetry=telemetry, gate=gate, device=device
        )
        self._end_seconds = telemetry.op_seconds.labels("end")
        self._blend_seconds = telemetry.op_seconds.labels("blend_match")
        sessions.on_release = self._on_session_release
        pool.on_drop = self._on_pool_drop
        telemetry.pool_capacity_bytes.set(pool.capacity_bytes)
        telemetry.copy_threads.set(copier.threads)
        telemetry.track(
            sessions=sessions.live_count,
            registrations=registry.count,
            pool_used_bytes=lambda: pool.stats().used_bytes,
        )

    # ------------------------------------------------------------------ hooks

    def _on_session_release(self, session: Session) -> None:
        self._pool.release_leases(session.request_id)

    def _on_pool_drop(self, entries: Sequence[Entry], reason: DropReason) -> None:
        if reason == "evicted":
            self._telemetry.chunks_evicted.inc(len(entries))
            self._pool_pressure.evicted(len(entries), sum(e.nbytes for e in entries))
        if self._blend.enabled:
            for entry in entries:
                if entry.content_key is not None:
                    self._blend.discard(entry.content_key)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Log what the pool-pressure summary still holds."""
        self._pool_pressure.flush()

    def stop_transfers(self, timeout_s: float) -> int:
        """Stop store and retrieve (``Transfers.stop``); how many still run after
        ``timeout_s``."""
        return self.transfers.stop(timeout_s)

    # ------------------------------------------------------------------ operations

    def register(self, req: RegisterRequest, *, token: str | None = None) -> RegisterResponse:
        """``Registrar.register``."""
        return self._registrar.register(req, token=token)

    def unregister(self, instance_id: str, rank: int, token: str | None) -> None:
        self._registrar.unregister(instance_id, rank, token)

    def store(
        self, req: StoreRequest, *, received_at: float | None = None, token: str | None = None
    ) -> StoreResponse:
        """``Store.run``: ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        return self._store.run(req, received_at=received_at, token=token)

    def retrieve(
        self, req: RetrieveRequest, *, received_at: float | None = None, token: str | None = None
    ) -> RetrieveResponse:
        """``Retrieve.run``: ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        return self._retrieve.run(req, received_at=received_at, token=token)

    def end(self, req: EndSessionsRequest) -> EndSessionsResponse:
        """End the requests' sessions and release their leases."""
        with self._end_seconds.time():
            ended = self._sessions.end(req.request_ids)
            for rid in req.request_ids:
                # Also drops a lease taken while the session was ending.
                self._pool.release_leases(rid)
            return EndSessionsResponse(ended=ended)

    def blend_match(self, req: BlendMatchRequest) -> BlendMatchResponse:
        """Which whole chunks of the tokens are cached at any position (CacheBlend)."""
        with self._blend_seconds.time():
            if not self._blend.enabled:
                raise FeatureDisabled(
                    "the CacheBlend matcher is disabled; start the server with --enable-blend "
                    "(MPCACHE_ENABLE_BLEND=1)"
                )
            size = self._chunk_size.final().chunk_size
            tokens = span_tokens(req, "blend")
            keys = self._hasher.content_keys(req.namespace, req.cache_salt, tokens, chunk_size=size)
            cached = self._blend.match(keys)
            return BlendMatchResponse(
                chunk_size=size,
                chunks=[
                    BlendChunk(index=i, start_token=i * size, cached=hit)
                    for i, hit in enumerate(cached)
                ],
            )
