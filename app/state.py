"""Runtime: every piece of server state, built once by the app's lifespan.

Nothing lives in module globals. ``Runtime.close`` releases what the runtime owns:
it first stops store and retrieve calls still running (each stops at its next
chunk; the wait is bounded by ``--shutdown-timeout-s``), then the registration
socket, sessions (and their leases), every registered KV-cache mapping, the body
decoder's helper process, and the pool's shared-memory segment (unlinked).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from app.bindings import Binding, BindingPipeline
from app.blend import BlendMatcher
from app.bodies import BodyParser
from app.chunk_size import ChunkSizeAuthority
from app.coordinator import Coordinator, StandaloneCoordinator
from app.hashing import TokenHasher
from app.negotiation import NegotiationPolicy
from app.service import CacheService
from app.sessions import SessionManager
from app.settings import Settings
from app.telemetry import Telemetry
from contract.errors import InvalidRequest
from contract.shm_naming import segment_name
from dataplane.fdgate import FdGate, default_socket_path
from dataplane.pool import Pool
from dataplane.registry import Registry
from dataplane.segments import sweep_stale_segments
from dataplane.transfer import CopyPool, configure_copy_threads, measure_copy_threads

__all__ = ["BINDING_ORDER", "Runtime", "build_runtime"]

logger = logging.getLogger(__name__)


BINDING_ORDER = ("token_hasher", "session_manager", "blend_matcher", "telemetry", "coordinator")


@dataclass
class Runtime:
    settings: Settings
    boot_id: str
    started_at: float
    hasher: TokenHasher
    sessions: SessionManager
    blend: BlendMatcher
    telemetry: Telemetry
    coordinator: Coordinator
    pipeline: BindingPipeline
    chunk_size: ChunkSizeAuthority
    pool: Pool
    registry: Registry
    cache: CacheService
    copier: CopyPool
    gate: FdGate
    parser: BodyParser = field(default_factory=BodyParser)
    copy_rates: dict[int, float] = field(default_factory=dict)
    """GB/s per thread count measured at start (empty when --copy-threads was given)."""
    closed: bool = field(default=False)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        running = self.cache.stop_transfers(self.settings.shutdown_timeout_s)
        if running:
            logger.warning("%d store/retrieve call(s) still copying at shutdown", running)
        try:
            self.gate.close()
            self.parser.close()
            self.cache.close()
            self.sessions.close()
            self.registry.close()
        finally:
            self.copier.close()
            self.pool.close()
            self.coordinator.leave()


def build_runtime(settings: Settings) -> Runtime:
    boot_id = uuid.uuid4().hex
    if settings.coordinator_url:
        raise InvalidRequest(
            "MPCACHE_COORDINATOR_URL is set but networked coordinators are not supported "
            "yet; unset it to run standalone"
        )
    hasher = TokenHasher()
    sessions = SessionManager(
        hasher,
        settings.session_ttl_s,
        max_bytes=int(settings.session_memory),
        max_sessions=settings.max_sessions,
        evict_idle_s=settings.lease_ttl_s,
    )
    blend = BlendMatcher(settings.enable_blend)
    telemetry = Telemetry()
    coordinator = StandaloneCoordinator(boot_id)
    pipeline = BindingPipeline(
        [
            Binding("token_hasher", hasher.bind),
            Binding("session_manager", sessions.bind),
            Binding("blend_matcher", blend.bind, enabled=blend.enabled),
            Binding("telemetry", telemetry.bind),
            Binding("coordinator", coordinator.join),
        ]
    )
    assert pipeline.names == BINDING_ORDER
    authority = ChunkSizeAuthority(
        NegotiationPolicy(settings.chunk_size, settings.max_chunk_size),
        pipeline,
        sessions.live_count,
        telemetry,
    )
    copy_rates: dict[int, float] = {}
    threads = settings.copy_threads
    if threads <= 0:
        threads, copy_rates = measure_copy_threads()
    configure_copy_threads(threads)
    copier = CopyPool(threads)
    # Pools of crashed servers (each removal is logged).
    sweep_stale_segments()
    registry = Registry()
    socket_path = settings.register_socket or default_socket_path(settings.port)
    gate = FdGate(
        socket_path,
        on_disconnect=registry.release_connection,
        owns_directory=settings.register_socket is None,
    )
    try:
        pool = Pool.create(segment_name("pool"), settings.pool_size, settings.pool_page_size)
    except BaseException:
        gate.close()
        copier.close()
        raise
    try:
        gate.start()
        cache = CacheService(
            hasher=hasher,
            sessions=sessions,
            blend=blend,
            telemetry=telemetry,
            pool=pool,
            registry=registry,
            final_size=lambda: authority.final_size,
            lease_ttl_s=settings.lease_ttl_s,
            copier=copier,
            gate=gate,
        )
        if settings.pool_prefault:
            pool.start_prefault()
        return Runtime(
            settings=settings,
            boot_id=boot_id,
            started_at=time.monotonic(),
            hasher=hasher,
            sessions=sessions,
            blend=blend,
            telemetry=telemetry,
            coordinator=coordinator,
            pipeline=pipeline,
            chunk_size=authority,
            pool=pool,
            registry=registry,
            cache=cache,
            copier=copier,
            gate=gate,
            copy_rates=copy_rates,
        )
    except BaseException:
        gate.close()
        copier.close()
        pool.close()
        raise
