"""Cache operations: register, lookup, store, retrieve, end, blend match.

``CacheService`` is what the routes call. It ties the per-request sessions (chunk
keys, leases), the pool, the registry and the copy kernels together, and keeps
the telemetry and the CacheBlend index in step with the pool.

Semantics (``contract.schemas`` has the wire shapes):

- Every operation needs a final chunk size (409 ``NotNegotiated`` before that).
- A registration is its registrant's: ``register`` returns a secret token, and
  store, retrieve, unregister and a replacing register of that ``(instance_id,
  rank)`` need it (403 otherwise; ``dataplane.registry``). Its memfds come from
  the registration socket (``dataplane.fdgate``), whose connection's close
  releases it.
- A chunk is identified by its prefix key and a rank. ``lookup`` counts a chunk
  only if every rank in ``range(world_size)`` has it, stops at the first miss, and
  leases the hits to the request (released at end of session, on session expiry,
  or after ``lease_ttl_s``).
- ``store`` copies whole chunks in ``[start_token, end_token)`` (clamped to the
  tokens given; a partial trailing chunk is ignored). Per chunk all-or-nothing; a
  chunk already cached is reported ``present`` and not copied. When the pool has
  no room the chunk and the rest of that request fail (a later chunk is useless
  without its prefix).
- ``retrieve`` loads chunks from ``start_token`` while each one is cached with the
  caller's layout *and* holds every block the caller needs (its non-null block
  ids); ``loaded_tokens`` counts those; every non-null block of the chunks after
  that, up to the last whole chunk, is listed in ``failed_block_ids``.
- ``timeout_s`` on store and retrieve: the deadline is the request's receipt time
  (stamped on the event loop, ``app.deps``) plus ``timeout_s``. Store checks it
  before copying each chunk and again after, before commit: a chunk whose copy
  ended late is aborted, never made visible (the client may have reused those
  blocks while it was copied). Retrieve checks it before writing each chunk. What
  is left once it has passed is reported failed.
- Shutdown (``stop_transfers``): store and retrieve calls still running stop at
  the next chunk as if their deadline had passed (a late chunk is aborted, never
  committed), new ones are refused with 503, and the caller waits, bounded, until
  none is left, before the pool and the registrations are released.
- Store and retrieve items must use their registration's namespace, start on a
  chunk boundary, carry one block-id list per registered group (in registration
  order) and only block ids the registered tensors hold; otherwise the whole call
  is refused with 422 before anything is copied. Positions past the end of a
  block-id list read as null.

- With an L2 tier (``app.l2``): a committed chunk is queued for write-behind; a
  lookup adds the chunks that follow its L1 hits and that L2 holds for every rank
  (``LookupBatch.check_l2``, off the event loop); a retrieve that misses L1 fetches
  the chunk from L2, checks it and promotes it into L1 before serving it.

Lock order: the session manager's lock, then the pool's (``on_release`` runs
under the former and takes the latter); the pool never calls back into sessions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np
from pydantic import ByteSize

from app.blend import BlendMatcher
from app.hashing import TokenHasher
from app.l2 import CorruptValue, L2Tier, WriteJob, decode_value, l2_key
from app.sessions import Session, SessionManager
from app.telemetry import Telemetry
from contract.errors import (
    ChunkSizeMismatch,
    FeatureDisabled,
    InvalidDescriptor,
    InvalidRequest,
    NotNegotiated,
    Unavailable,
)
from contract.schemas import (
    BlendChunk,
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    LookupRequest,
    LookupResponse,
    LookupResult,
    LookupTarget,
    RegisterRequest,
    RegisterResponse,
    RetrieveRequest,
    RetrieveResponse,
    RetrieveResult,
    StoreRequest,
    StoreResponse,
    StoreResult,
    TokenSpan,
    TransferItem,
)
from dataplane.descriptors import Redeemed
from dataplane.fdgate import FdGate
from dataplane.layout import chunk_block_ids, slot_mask
from dataplane.pool import PRESENT, DropReason, Entry, Pool
from dataplane.registry import Registration, Registry, build_registration, memfd_tickets
from dataplane.transfer import CopyPool, gather_chunk, scatter_chunk

__all__ = ["CacheService", "LookupBatch", "PoolPressureLog"]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _timed(
    op: str,
) -> Callable[
    [Callable[Concatenate[CacheService, _P], _R]], Callable[Concatenate[CacheService, _P], _R]
]:
    """Observe the method's duration in ``mpcache_cache_op_duration_seconds{op=...}``."""

    def wrap(
        method: Callable[Concatenate[CacheService, _P], _R],
    ) -> Callable[Concatenate[CacheService, _P], _R]:
        def timed(self: CacheService, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self._telemetry.op_seconds.labels(op).time():
                return method(self, *args, **kwargs)

        timed.__doc__ = method.__doc__
        return timed

    return wrap


class PoolPressureLog:
    """Evictions and chunks the full pool could not take, summarised in the log.

    The first event is logged at once; after that, at most one summary line per
    ``interval_s`` (counted when the next event arrives), and ``flush`` logs what is
    left at shutdown. Per-chunk detail is in the metrics, not the log.
    """

    def __init__(self, *, interval_s: float = 60.0, clock: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()  # stores run on several threads at once
        self._since: float | None = None
        self._last_log: float | None = None
        self._evicted = self._evicted_bytes = self._not_stored = 0

    def evicted(self, chunks: int, nbytes: int) -> None:
        with self._lock:
            self._evicted += chunks
            self._evicted_bytes += nbytes
            self._maybe_log()

    def not_stored(self, chunks: int) -> None:
        with self._lock:
            self._not_stored += chunks
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = self._clock()
        if self._since is None:
            self._since = now
        if self._last_log is None or now - self._last_log >= self._interval_s:
            self._log()

    def flush(self) -> None:
        with self._lock:
            self._log()

    def _log(self) -> None:
        if self._since is None:
            return
        now = self._clock()
        parts = []
        if self._evicted:
            parts.append(
                f"evicted {self._evicted} least recently used chunk(s) "
                f"({ByteSize(self._evicted_bytes).human_readable()}) to make room"
            )
        if self._not_stored:
            parts.append(
                f"{self._not_stored} chunk(s) not stored: no room that could be freed "
                "(the rest is pinned or leased)"
            )
        logger.info("cache pool full: %s in the last %.0fs", "; ".join(parts), now - self._since)
        self._last_log = now
        self._since = None
        self._evicted = self._evicted_bytes = self._not_stored = 0


class LookupBatch:
    """One lookup call, served item by item (``CacheService.lookup_batch``).

    ``add`` answers one item at once: its session opens and its hits are leased, so a
    binary lookup is served while the rest of its body still arrives
    (``app.routes.cache``); ``finish`` returns the reply, counts the chunks and
    observes the call's duration, from the batch's creation.
    """

    def __init__(self, service: CacheService, size: int) -> None:
        self._service = service
        self._size = size
        self._results: list[LookupResult] = []
        self._hits = self._misses = 0
        self._l2_hits = 0
        # (result index, target, keys past the L1 hits) of items L2 may extend
        self._l2_candidates: list[tuple[int, LookupTarget, list[bytes]]] = []
        self._started = time.perf_counter()

    def add(self, item: LookupTarget, tokens: np.ndarray) -> None:
        self.add_many([(item, tokens)])

    def add_many(self, items: Sequence[tuple[LookupTarget, np.ndarray]]) -> None:
        """Answer ``items`` in order (``add`` of each, with one hold of each lock)."""
        for item, (result, hits, misses, rest) in zip(
            (item for item, _ in items),
            self._service._lookup_many(items, self._size),
            strict=True,
        ):
            if rest:
                self._l2_candidates.append((len(self._results), item, rest))
            self._results.append(result)
            self._hits += hits
            self._misses += misses

    @property
    def needs_l2(self) -> bool:
        """True when ``check_l2`` has Redis calls to make (run it off the event loop)."""
        return bool(self._l2_candidates)

    def check_l2(self) -> None:
        """Extend each item's L1 hits by the chunks that follow them in L2 (blocking I/O)."""
        candidates, self._l2_candidates = self._l2_candidates, []
        for index, item, rest in candidates:
            extra = self._service._l2_leading(item, rest)
            if extra:
                old = self._results[index]
                self._results[index] = LookupResult(
                    request_id=old.request_id, hit_tokens=old.hit_tokens + extra * self._size
                )
                self._hits += extra
                self._misses -= extra
                self._l2_hits += extra

    def finish(self) -> LookupResponse:
        telemetry = self._service._telemetry
        telemetry.chunks_hit.inc(self._hits)
        telemetry.chunks_l2_hit.inc(self._l2_hits)
        telemetry.chunks_missed.inc(self._misses)
        telemetry.op_seconds.labels("lookup").observe(time.perf_counter() - self._started)
        return LookupResponse(results=self._results)


@dataclass(frozen=True)
class _Item:
    """A validated store/retrieve item."""

    item: TransferItem
    tokens: np.ndarray
    block_ids: tuple[np.ndarray, ...]


class CacheService:
    def __init__(
        self,
        *,
        hasher: TokenHasher,
        sessions: SessionManager,
        blend: BlendMatcher,
        telemetry: Telemetry,
        pool: Pool,
        registry: Registry,
        final_size: Callable[[], int | None],
        lease_ttl_s: float,
        copier: CopyPool | None = None,
        gate: FdGate | None = None,
        clock: Callable[[], float] = time.monotonic,
        l2: L2Tier | None = None,
    ) -> None:
        self._hasher = hasher
        self._sessions = sessions
        self._blend = blend
        self._telemetry = telemetry
        self.pool = pool
        self.registry = registry
        self._final_size = final_size
        self._lease_ttl_s = lease_ttl_s
        self._copier = copier or CopyPool(1)
        self._gate = gate
        self._clock = clock  # deadlines: the clock ``received_at`` stamps are taken on
        self._pool_pressure = PoolPressureLog(clock=clock)
        self._stopping = threading.Event()
        self._in_flight = 0
        self._idle = threading.Condition()
        self.l2 = l2
        sessions.on_release = self._on_session_release
        pool.on_drop = self._on_pool_drop
        telemetry.pool_capacity_bytes.set(pool.capacity_bytes)
        telemetry.copy_threads.set(self._copier.threads)
        telemetry.track(
            sessions=sessions.live_count,
            registrations=registry.count,
            pool_used_bytes=lambda: pool.stats().used_bytes,
        )

    # ------------------------------------------------------------------ hooks

    def _on_session_release(self, session: Session) -> None:
        self.pool.release_leases(session.request_id)

    def _on_pool_drop(self, entries: Sequence[Entry], reason: DropReason) -> None:
        if reason == "evicted":
            self._telemetry.chunks_evicted.inc(len(entries))
            self._pool_pressure.evicted(len(entries), sum(e.nbytes for e in entries))
        if self._blend.enabled:
            for entry in entries:
                if entry.content_key is not None:
                    self._blend.discard(entry.content_key)

    def close(self) -> None:
        """Log what the pool-pressure summary still holds."""
        self._pool_pressure.flush()

    def stop_transfers(self, timeout_s: float) -> int:
        """Stop store and retrieve (see the module docstring); wait up to ``timeout_s``
        for those in flight. Returns how many are still running (0: all stopped)."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            return self._in_flight

    @contextlib.contextmanager
    def _transfer(self, op: str) -> Iterator[None]:
        """Count a store or retrieve in flight; refuse one once shutdown began."""
        with self._idle:
            if self._stopping.is_set():
                raise Unavailable(f"the server is shutting down; {op} refused")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.notify_all()

    # ------------------------------------------------------------------ helpers

    def _size(self) -> int:
        size = self._final_size()
        if size is None:
            raise NotNegotiated("no chunk size is final yet; negotiate first (POST /negotiate)")
        return size

    def _deadline(self, timeout_s: float | None, received_at: float | None) -> float | None:
        if timeout_s is None:
            return None
        return (self._clock() if received_at is None else received_at) + timeout_s

    def _expired(self, deadline: float | None) -> bool:
        if self._stopping.is_set():  # shutting down: as if the deadline had passed
            return True
        return deadline is not None and self._clock() >= deadline

    @staticmethod
    def _tokens(span: TokenSpan, request_id: str) -> np.ndarray:
        try:
            return span.token_array()
        except ValueError as exc:
            raise InvalidRequest(
                f"request {request_id!r}: bad tokens: {exc}", request_id=request_id
            ) from exc

    def _check_items(
        self, reg: Registration, items: Sequence[TransferItem], size: int
    ) -> list[_Item]:
        checked = []
        num_groups = len(reg.layout.groups)
        for item in items:
            rid = item.request_id
            if item.namespace != reg.namespace:
                raise InvalidRequest(
                    f"request {rid!r}: namespace {item.namespace!r} differs from the "
                    f"registration's {reg.namespace!r}",
                    request_id=rid,
                )
            if item.start_token % size:
                raise InvalidRequest(
                    f"request {rid!r}: start_token {item.start_token} is not a multiple "
                    f"of the chunk size {size}",
                    request_id=rid,
                )
            if item.end_token < item.start_token:
                raise InvalidRequest(
                    f"request {rid!r}: end_token {item.end_token} is before start_token "
                    f"{item.start_token}",
                    request_id=rid,
                )
            if len(item.block_ids) != num_groups:
                raise InvalidRequest(
                    f"request {rid!r}: {len(item.block_ids)} block-id lists for "
                    f"{num_groups} registered groups",
                    request_id=rid,
                )
            arrays = []
            for g, ids in enumerate(item.block_ids):
                arr = np.asarray(ids, dtype=np.int64)
                limit = reg.group_num_blocks[g]
                if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
                    raise InvalidRequest(
                        f"request {rid!r}: group {reg.layout.groups[g].group_id} block ids "
                        f"must lie in [0, {limit})",
                        request_id=rid,
                    )
                arrays.append(arr)
            checked.append(_Item(item, self._tokens(item, rid), tuple(arrays)))
        return checked

    def _chunk_range(self, it: _Item, keys: Sequence[bytes], size: int) -> range:
        end = min(it.item.end_token, len(it.tokens))
        return range(it.item.start_token // size, min(end // size, len(keys)))

    @staticmethod
    def _chunk_ids(reg: Registration, it: _Item, chunk: int) -> list[np.ndarray]:
        return [
            chunk_block_ids(ids, chunk, n)
            for ids, n in zip(it.block_ids, reg.layout.blocks_per_chunk, strict=True)
        ]

    # ------------------------------------------------------------------ registration

    def _redeem(self, req: RegisterRequest) -> Redeemed | None:
        tickets = memfd_tickets(req)
        if not tickets:
            return None
        if self._gate is None:
            raise InvalidDescriptor(
                "this server takes no memfd tickets (no registration socket)",
                reason="unknown-ticket",
            )
        return self._gate.take(tickets)

    @_timed("register")
    def register(self, req: RegisterRequest, *, token: str | None = None) -> RegisterResponse:
        """Register ``req``; ``token`` is needed to replace an existing registration.

        Its tickets are used up whatever the outcome: a refused registration leaves
        nothing mapped. A given ``token`` becomes the registration's secret."""
        redeemed = self._redeem(req)
        try:
            return self._register(req, token, redeemed)
        except BaseException:
            for memory in (redeemed or (0, {}))[1].values():
                memory.close()
            raise

    def _register(
        self, req: RegisterRequest, token: str | None, redeemed: Redeemed | None
    ) -> RegisterResponse:
        size = self._final_size()
        if size is None:
            raise NotNegotiated(
                "this server has no final chunk size yet; negotiate (POST /negotiate) "
                "before registering KV caches"
            )
        if req.chunk_size != size:
            raise ChunkSizeMismatch(
                f"the registration carries chunk size {req.chunk_size} but this server's "
                f"chunk size is {size}; re-negotiate and register with {size}",
                chunk_size=size,
                requested_chunk_size=req.chunk_size,
            )
        reg = build_registration(req, redeemed)
        gate = self._gate
        refreshed = self.registry.add(
            reg, token=token, alive=gate.alive if gate is not None else None
        )
        peer = gate.peer(reg.conn_id) if gate is not None and reg.conn_id is not None else None
        logger.info(
            "%s instance %r rank %d: %d tensors, %d bytes per chunk%s",
            "refreshed" if refreshed else "registered",
            req.instance_id,
            req.rank,
            len(reg.layout.tensors),
            reg.chunk_bytes,
            f" (worker pid {peer.pid})" if peer is not None else "",
        )
        return RegisterResponse(
            instance_id=req.instance_id,
            rank=req.rank,
            chunk_size=size,
            num_layers=len(req.layers),
            chunk_bytes=reg.chunk_bytes,
            refreshed=refreshed,
            registration_token=reg.token,
        )

    @_timed("unregister")
    def unregister(self, instance_id: str, rank: int, token: str | None) -> None:
        self.registry.remove(instance_id, rank, token)

    # ------------------------------------------------------------------ cache ops

    def lookup(self, req: LookupRequest) -> LookupResponse:
        """Look up the JSON form (tokens as a list or base64): every item is decoded
        before any is served."""
        # Decode every item first: a malformed one refuses the call before any
        # session is opened or lease taken.
        return self.lookup_tokens(
            [(item, self._tokens(item, item.request_id)) for item in req.requests]
        )

    def lookup_tokens(self, items: Sequence[tuple[LookupTarget, np.ndarray]]) -> LookupResponse:
        """Look up decoded items: each target with its int32 token ids."""
        batch = self.lookup_batch()
        batch.add_many(items)
        if batch.needs_l2:
            batch.check_l2()
        return batch.finish()

    def lookup_batch(self) -> LookupBatch:
        """A lookup served item by item, as its items arrive (``LookupBatch``)."""
        return LookupBatch(self, self._size())

    def _lookup_many(
        self, items: Sequence[tuple[LookupTarget, np.ndarray]], size: int
    ) -> list[tuple[LookupResult, int, int, list[bytes]]]:
        """Each item's result, its hit and missed chunks, and the keys L2 may still hold."""
        opened = self._sessions.keys_for_many(
            [(item.request_id, item.namespace, item.cache_salt, tokens) for item, tokens in items]
        )
        ttl = self._lease_ttl_s
        hits_of = self.pool.lookup_many(
            [
                (keys, item.world_size, item.request_id)
                for (item, _), (_, keys) in zip(items, opened, strict=True)
            ],
            lease_ttl_s=ttl,
        )
        l2 = self.l2 is not None and self.l2.up
        out = []
        for (item, _), (session, keys), hits in zip(items, opened, hits_of, strict=True):
            if hits and ttl > 0:
                session.holds_leases = True
            # Validated: pydantic's model_construct runs in Python and costs twice as
            # much (4.5 against 2 us).
            result = LookupResult(request_id=item.request_id, hit_tokens=hits * size)
            out.append((result, hits, len(keys) - hits, keys[hits:] if l2 else []))
        return out

    # ------------------------------------------------------------------ L2

    def _l2_key(
        self, namespace: str, layout: bytes, world_size: int, rank: int, chunk_key: bytes
    ) -> bytes:
        l2 = self.l2
        assert l2 is not None
        return l2_key(
            deployment=l2.deployment,
            namespace=namespace,
            chunk_size=self._size(),
            layout=layout,
            world_size=world_size,
            rank=rank,
            chunk_key=chunk_key,
        )

    def _l2_leading(self, item: LookupTarget, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` L2 holds for every rank, in order (blocking I/O)."""
        if self.l2 is None:
            return 0
        # A lookup names no registration: the chunk layout is that of the
        # namespace's registrations here (none: nothing could be served anyway).
        layout = self.registry.layout_for(item.namespace, item.world_size)
        if layout is None:
            return 0
        ws = item.world_size
        return self.l2.count_leading(
            [[self._l2_key(item.namespace, layout, ws, r, key) for r in range(ws)] for key in keys]
        )

    def _l2_promote(self, reg: Registration, chunk_key: bytes, needed: int) -> Entry | None:
        """Fetch a chunk L1 lacks from L2, check it, commit it to L1; return it pinned."""
        l2 = self.l2
        if l2 is None or not l2.up:
            return None
        layout = reg.layout.signature
        key = self._l2_key(reg.namespace, layout, reg.world_size, reg.rank, chunk_key)
        raw = l2.fetch(key)
        if raw is None:
            return None
        try:
            value = decode_value(
                raw, chunk_key=chunk_key, rank=reg.rank, layout=layout, max_bytes=l2.max_value_bytes
            )
            expected = reg.chunk_bytes if value.present else 1
            if len(value.payload) != expected:
                raise CorruptValue(f"{len(value.payload)} payload bytes, expected {expected}")
        except CorruptValue as exc:
            l2.discard(key, str(exc))
            return None
        if needed & ~value.present:
            return None  # L2's copy lacks a block the caller needs: a miss
        entry = self.pool.begin_store(
            chunk_key, reg.rank, nbytes=expected, layout=layout, present=value.present
        )
        if isinstance(entry, Entry):
            try:
                self.pool.view(entry).numpy()[:] = np.frombuffer(value.payload, dtype=np.uint8)
            except BaseException:
                self.pool.abort(entry)
                raise
            self.pool.commit(entry)
            l2.served()
        return self.pool.pin(chunk_key, reg.rank, layout, needed)

    @_timed("store")
    def store(
        self, req: StoreRequest, *, received_at: float | None = None, token: str | None = None
    ) -> StoreResponse:
        """Store the batch; ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        size = self._size()
        deadline = self._deadline(req.timeout_s, received_at)
        with (
            self._transfer("store"),
            self.registry.acquire(req.instance_id, req.rank, token) as reg,
        ):
            items = self._check_items(reg, req.requests, size)
            results = [self._store_item(reg, it, size, deadline) for it in items]
        late = sum(r.failed_chunks for r, timed_out in results if timed_out)
        self._note_late("store", req, results, f"{late} chunk(s) not stored")
        return StoreResponse(results=[r for r, _ in results])

    def _store_item(
        self, reg: Registration, it: _Item, size: int, deadline: float | None
    ) -> tuple[StoreResult, bool]:
        """The item's result, and whether the deadline cut it short."""
        item = it.item
        _, keys = self._sessions.keys_for(
            item.request_id, item.namespace, item.cache_salt, it.tokens
        )
        stored = present = failed = 0
        copied = 0
        timed_out = False
        chunks = self._chunk_range(it, keys, size)
        for chunk in chunks:
            if self._expired(deadline):
                timed_out = True
                failed = chunks.stop - chunk
                break
            ids = self._chunk_ids(reg, it, chunk)
            mask = slot_mask(ids)
            content_key = None
            if self._blend.enabled:
                chunk_tokens = it.tokens[chunk * size : (chunk + 1) * size]
                content_key = self._hasher.content_keys(
                    item.namespace, item.cache_salt, chunk_tokens
                )[0]
            entry = self.pool.begin_store(
                keys[chunk],
                reg.rank,
                # A chunk with no data (every block null) is recorded, not copied.
                nbytes=reg.chunk_bytes if mask else 1,
                layout=reg.layout.signature,
                present=mask,
                content_key=content_key,
            )
            if entry == PRESENT:
                present += 1
                continue
            if entry is None:
                failed = chunks.stop - chunk
                self._pool_pressure.not_stored(failed)
                break
            assert isinstance(entry, Entry)
            try:
                if mask:
                    copied += gather_chunk(reg.plans, ids, self.pool.view(entry), self._copier)
            except BaseException:
                self.pool.abort(entry)
                raise
            if self._expired(deadline):
                # The client has given up and may have reused these blocks while they
                # were copied: the bytes may be torn, so they are never committed.
                self.pool.abort(entry)
                timed_out = True
                failed = chunks.stop - chunk
                break
            self.pool.commit(entry)
            if content_key is not None:
                self._blend.add(content_key)
            if self.l2 is not None:
                layout = reg.layout.signature
                self.l2.enqueue(
                    WriteJob(
                        key=self._l2_key(
                            item.namespace, layout, reg.world_size, reg.rank, keys[chunk]
                        ),
                        chunk_key=keys[chunk],
                        rank=reg.rank,
                        layout=layout,
                        present=mask,
                        nbytes=entry.nbytes,
                    )
                )
            stored += 1
        self._telemetry.chunks_stored.inc(stored)
        self._telemetry.copied_bytes.labels("store").inc(copied)
        result = StoreResult(
            request_id=item.request_id,
            stored_chunks=stored,
            present_chunks=present,
            failed_chunks=failed,
        )
        return result, timed_out

    @_timed("retrieve")
    def retrieve(
        self, req: RetrieveRequest, *, received_at: float | None = None, token: str | None = None
    ) -> RetrieveResponse:
        """Retrieve the batch; ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        size = self._size()
        deadline = self._deadline(req.timeout_s, received_at)
        with (
            self._transfer("retrieve"),
            self.registry.acquire(req.instance_id, req.rank, token) as reg,
        ):
            items = self._check_items(reg, req.requests, size)
            results = [self._retrieve_item(reg, it, size, deadline) for it in items]
        late = sum(len(r.failed_block_ids) for r, timed_out in results if timed_out)
        self._note_late("retrieve", req, results, f"{late} block(s) not loaded")
        return RetrieveResponse(results=[r for r, _ in results])

    def _note_late(
        self,
        op: str,
        req: StoreRequest | RetrieveRequest,
        results: Sequence[tuple[object, bool]],
        what: str,
    ) -> None:
        """Count and log a batch that its deadline cut short (no-op otherwise)."""
        if not any(timed_out for _, timed_out in results):
            return
        if self._stopping.is_set():
            logger.warning(
                "%s for %r rank %d stopped by shutdown: %s", op, req.instance_id, req.rank, what
            )
            return
        self._telemetry.transfer_timeouts.labels(op).inc()
        logger.warning(
            "%s for %r rank %d passed its %.3gs deadline: %s",
            op,
            req.instance_id,
            req.rank,
            req.timeout_s,
            what,
        )

    def _retrieve_item(
        self, reg: Registration, it: _Item, size: int, deadline: float | None
    ) -> tuple[RetrieveResult, bool]:
        """The item's result, and whether the deadline cut it short."""
        item = it.item
        _, keys = self._sessions.keys_for(
            item.request_id, item.namespace, item.cache_salt, it.tokens
        )
        chunks = self._chunk_range(it, keys, size)
        pinned: list[tuple[list[np.ndarray], Entry]] = []
        timed_out = self._expired(deadline)
        if not timed_out:
            for chunk in chunks:
                ids = self._chunk_ids(reg, it, chunk)
                needed = slot_mask(ids)
                entry = self.pool.pin(keys[chunk], reg.rank, reg.layout.signature, needed)
                if entry is None and not self._expired(deadline):
                    entry = self._l2_promote(reg, keys[chunk], needed)
                if entry is None:
                    break
                pinned.append((ids, entry))
        loaded = 0
        copied = 0
        try:
            for ids, entry in pinned:
                if self._expired(deadline):
                    # The client has given up and may reuse its blocks: write no more.
                    timed_out = True
                    break
                try:
                    copied += scatter_chunk(reg.plans, ids, self.pool.view(entry), self._copier)
                except Exception:
                    logger.exception("retrieve of %r failed at a chunk", item.request_id)
                    break
                loaded += 1
        finally:
            for _, entry in pinned:
                self.pool.unpin(entry)
        failed: list[int] = []
        seen: set[int] = set()
        for chunk in chunks[loaded:]:
            for group_ids in self._chunk_ids(reg, it, chunk):
                for block in group_ids[group_ids != 0].tolist():
                    if block not in seen:
                        seen.add(block)
                        failed.append(block)
        self._telemetry.copied_bytes.labels("retrieve").inc(copied)
        result = RetrieveResult(
            request_id=item.request_id,
            loaded_tokens=loaded * size,
            failed_block_ids=failed,
        )
        return result, timed_out

    @_timed("end")
    def end(self, req: EndSessionsRequest) -> EndSessionsResponse:
        ended = self._sessions.end(req.request_ids)
        for rid in req.request_ids:
            # Also drops a lease taken while the session was ending.
            self.pool.release_leases(rid)
        return EndSessionsResponse(ended=ended)

    @_timed("blend_match")
    def blend_match(self, req: BlendMatchRequest) -> BlendMatchResponse:
        if not self._blend.enabled:
            raise FeatureDisabled(
                "the CacheBlend matcher is disabled; start the server with --enable-blend "
                "(MPCACHE_ENABLE_BLEND=1)"
            )
        size = self._size()
        tokens = self._tokens(req, "blend")
        keys = self._hasher.content_keys(req.namespace, req.cache_salt, tokens)
        cached = self._blend.match(keys)
        return BlendMatchResponse(
            chunk_size=size,
            chunks=[
                BlendChunk(index=i, start_token=i * size, cached=hit)
                for i, hit in enumerate(cached)
            ],
        )
