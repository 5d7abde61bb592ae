"""Runtime: every piece of server state, built once by the app's lifespan.

Nothing lives in module globals. ``Runtime.close`` releases what the runtime owns:
it first stops store and retrieve calls still running (each stops at its next
chunk; the wait is bounded by ``--shutdown-timeout-s``), then the registration
socket, sessions (and their leases), every registered KV-cache mapping, the body
decoder's helper process, and the pool's shared-memory segment (unlinked).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from app.bindings import Binding, BindingPipeline
from app.blend import BlendMatcher
from app.bodies import BodyParser
from app.chunk_size import ChunkSizeAuthority
from app.cluster_lookup import ClusterLookups, HeldMirror, member_url
from app.coordinator import (
    Coordinator,
    RedisCoordinator,
    StandaloneCoordinator,
    member_info,
)
from app.disk_dir import DiskRefused, check_directory
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.kv_events import BlockLedger, BlockPublisher, EventRecorder, ZmqSink
from app.l2 import L2Tier
from app.lookup_areas import LookupAreas
from app.negotiation import NegotiationPolicy
from app.ops_socket import OpsSocket
from app.redis_io import RedisUnavailable, connect, ping, redacted
from app.redis_wire import Wires, wire_params
from app.service import CacheService
from app.sessions import SessionManager
from app.settings import Settings
from app.telemetry import Telemetry
from contract import __version__, keychain
from contract.kernels import KernelUnavailable
from contract.schemas import ClusterHealth, ClusterMember, ClusterResponse
from contract.shm_naming import segment_name
from dataplane import blockcopy, key_index
from dataplane.cpu_pressure import CpuPressure
from dataplane.device_path import DevicePath, PoolPinning
from dataplane.fdgate import FdGate, default_socket_path, ops_socket_path
from dataplane.pool import Pool
from dataplane.registry import Registry
from dataplane.segments import sweep_stale_segments
from dataplane.transfer import CopyPool, configure_copy_threads, measure_copy_threads

__all__ = ["BINDING_ORDER", "Runtime", "StartupRefused", "build_runtime", "preflight"]

logger = logging.getLogger(__name__)


class StartupRefused(RuntimeError):
    """The server cannot start as configured (the message names the setting)."""


BINDING_ORDER = (
    "token_hasher",
    "session_manager",
    "blend_matcher",
    "telemetry",
    "disk_tier",
    "coordinator",
)


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
    ops: OpsSocket
    """Store and retrieve for this host's workers, without HTTP (``app.ops_socket``)."""
    lookup_areas: LookupAreas
    device: DevicePath
    """The GPU path: the pool pinned for DMA, the server's CUDA streams."""
    events: BlockPublisher
    """The block ledger's thread: KV events, the held-blocks mirror (``app.kv_events``)."""
    cluster_lookups: ClusterLookups
    key_index: key_index.KeyIndex | None = None
    """Published for connectors on this host (``GET /cache/key-index``); None when off."""
    parser: BodyParser = field(default_factory=BodyParser)
    l2: L2Tier | None = None
    disk: DiskTier | None = None
    """The local-disk tier (``--disk-path``); None when off."""
    copy_rates: dict[int, float] = field(default_factory=dict)
    """GB/s per thread count measured at start (empty when --copy-threads was given)."""
    block_kernel: str = "off"
    """How scattered blocks move, for the startup log (``_block_kernel``)."""
    key_chain: str = "off"
    """How chunk keys are hashed, for the startup log (``_key_chain``)."""
    held_mirror: HeldMirror | None = None
    """This member's block hashes in the coordinator's Redis (None when standalone)."""
    closed: bool = field(default=False)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    def cluster_health(self) -> ClusterHealth:
        """Coordinator and L2 state from what the background threads last saw (no I/O)."""
        status = self.coordinator.status()
        return ClusterHealth(
            mode=status.mode,
            deployment=status.deployment,
            coordinator=status.state,
            l2="off" if self.l2 is None else self.l2.state,
        )

    def cluster(self) -> ClusterResponse:
        """``GET /cluster``: asks the coordinator for the live members (blocking I/O)."""
        try:
            members = self.coordinator.members()
        except RedisUnavailable:
            members = []
        status = self.coordinator.status()
        state = self.chunk_size.state
        l2 = self.l2
        details = [d for d in (status.detail, l2.detail if l2 else None) if d]
        return ClusterResponse(
            deployment=status.deployment,
            mode=status.mode,
            coordinator=status.state,
            coordinator_url=status.url,
            deployment_chunk_size=status.deployment_chunk_size,
            chunk_size=state.selected if state.final else None,
            members=[
                ClusterMember(
                    member_id=m.member_id,
                    chunk_size=m.info.get("chunk_size"),
                    host=m.info.get("host"),
                    port=m.info.get("port"),
                    hostname=m.info.get("hostname"),
                    version=m.info.get("version"),
                    l2=m.info.get("l2"),
                    expires_in_s=m.expires_in_s,
                )
                for m in members
            ],
            l2="off" if l2 is None else l2.state,
            l2_url=None if l2 is None else l2.url,
            l2_queued_chunks=0 if l2 is None else l2.queued(),
            detail="; ".join(details) or None,
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        running = self.cache.stop_transfers(self.settings.shutdown_timeout_s)
        if running:
            logger.warning("%d store/retrieve call(s) still copying at shutdown", running)
        try:
            self.ops.close()
            self.gate.close()
            self.parser.close()
            if self.l2 is not None:
                self.l2.close()
            if self.disk is not None:
                self.disk.close(self.settings.shutdown_timeout_s)  # before the pool goes
            self.cache.close()
            self.sessions.close()
            self.registry.close()
        finally:
            self.copier.close()
            self.device.close()  # unpinned before the pool is unmapped
            self.pool.close()
            if self.key_index is not None:
                self.key_index.close()
            self.events.close()
            if self.held_mirror is not None:
                self.held_mirror.close()
            self.coordinator.leave()


class _Kernel(Protocol):
    @property
    def path(self) -> Path: ...  # the library loaded


_K = TypeVar("_K", bound=_Kernel)


def _kernel(load: Callable[[], _K], fast: str, slow: str) -> tuple[_K | None, str]:
    """A C kernel (``contract.kernels``) and a note for the log: ``fast`` and its
    library, or ``slow`` and why (said as a warning too)."""
    try:
        kernel = load()
    except KernelUnavailable as exc:
        logger.warning("%s, slower: %s", slow, exc)
        return None, f"{slow} ({exc})"
    return kernel, f"{fast} ({kernel.path})"


def _block_kernel(wanted: bool) -> tuple[blockcopy.BlockCopier | None, str]:
    """The streaming block kernel (``dataplane.blockcopy``) and a note for the log."""
    if not wanted:
        return None, "scattered blocks by numpy (--no-block-kernel)"
    return _kernel(
        blockcopy.load, "scattered blocks by the streaming kernel", "scattered blocks by numpy"
    )


def _key_chain() -> tuple[keychain.KeyChain | None, str]:
    """The C loop for chunk keys (``contract.keychain``) and a note for the log."""
    return _kernel(keychain.load, "chunk keys by the C loop", "chunk keys in Python")


def _key_index(
    settings: Settings, pool: Pool, hasher: TokenHasher, boot_id: str, *, authoritative: bool
) -> key_index.KeyIndex | None:
    """The key index the pool keeps in step (None with --no-key-index, or where its
    publication is not sound: ``dataplane.key_index.supported``)."""
    if not settings.key_index:
        return None
    if not key_index.supported():
        logger.info("key index off: its lock-free publication needs x86-64")
        return None
    slots = key_index.index_slots(pool.capacity_bytes // pool.page_size)
    index = key_index.KeyIndex.create(
        slots, secret=hasher.secret, boot_id=boot_id, authoritative=authoritative
    )
    pool.attach_index(index)
    return index


def _events(
    settings: Settings, coordinator: Coordinator, pool: Pool, telemetry: Telemetry, boot_id: str
) -> tuple[BlockPublisher, HeldMirror | None]:
    """The block ledger's publisher, observing ``pool`` (empty yet), with the KV events'
    sockets if configured and the held-blocks mirror if there is a coordinator's Redis."""
    recorder = EventRecorder(settings.kv_events_queue)
    pool.attach_index(observer=recorder)
    ledger = BlockLedger(events=settings.kv_events_endpoint is not None)
    sink = None
    if settings.kv_events_endpoint is not None:
        try:
            sink = ZmqSink(
                settings.kv_events_endpoint,
                settings.kv_events_replay_endpoint,
                settings.kv_events_topic,
                settings.kv_events_buffer,
            )
        except ValueError as exc:
            raise StartupRefused(f"{exc} (MPCACHE_KV_EVENTS_ENDPOINT)") from exc
    mirror = None
    if isinstance(coordinator, RedisCoordinator) and settings.coordinator_url is not None:
        client = connect(
            settings.coordinator_url,
            password=settings.redis_password,
            timeout_s=settings.redis_timeout_s,
            name=f"mpcache-held-{boot_id[:8]}",
        )
        mirror = HeldMirror(
            client,
            ledger=ledger,
            deployment=settings.deployment,
            member_id=boot_id,
            ttl_s=settings.membership_ttl_s,
            up=lambda: coordinator.status().state == "up",
        )
    publisher = BlockPublisher(
        pool=pool, recorder=recorder, ledger=ledger, telemetry=telemetry, sink=sink, mirror=mirror
    )
    return publisher, mirror


def _unbound(chunk_size: int) -> None:
    """A disabled binding's stand-in (never run)."""


def build_runtime(settings: Settings) -> Runtime:
    boot_id = uuid.uuid4().hex
    telemetry = Telemetry()
    coordinator = _coordinator(settings, boot_id, telemetry)
    try:
        return _build(settings, boot_id, telemetry, coordinator)
    except BaseException:
        coordinator.leave()
        raise


def _unreachable(setting: str, url: str, exc: Exception) -> StartupRefused:
    return StartupRefused(
        f"cannot reach {setting} {redacted(url)} ({exc}); start Redis/Valkey there, fix "
        f"the URL, or pass --coordinator-optional (MPCACHE_COORDINATOR_OPTIONAL=1) to run "
        "standalone, L1 only"
    )


def preflight(settings: Settings) -> None:
    """Raise ``StartupRefused`` if a configured Redis does not answer (and the
    coordinator is not optional): the CLI calls it before serving, for a one-line
    error instead of a failed lifespan."""
    if settings.disk_path is not None:
        try:
            check_directory(
                settings.disk_path,
                int(settings.disk_size),
                settings.chunk_size,
                settings.max_chunk_size,
            )
        except DiskRefused as exc:
            raise StartupRefused(str(exc)) from exc
    if settings.coordinator_optional:
        return
    for setting, url in (
        ("the coordinator (MPCACHE_COORDINATOR_URL)", settings.coordinator_url),
        ("the L2 tier (MPCACHE_L2_URL)", settings.l2_url),
    ):
        if url is None:
            continue
        try:
            ping(url, password=settings.redis_password, timeout_s=settings.redis_timeout_s)
        except RedisUnavailable as exc:
            raise _unreachable(setting, url, exc) from exc


def _coordinator(settings: Settings, boot_id: str, telemetry: Telemetry) -> Coordinator:
    """The deployment's coordinator; standalone without --coordinator-url (or, under
    --coordinator-optional, when it cannot be reached at start)."""
    telemetry.coordinator_up.set(1)
    url = settings.coordinator_url
    if url is None:
        return StandaloneCoordinator(boot_id, settings.deployment)
    client = connect(
        url,
        password=settings.redis_password,
        timeout_s=settings.redis_timeout_s,
        name=f"mpcache-coordinator-{boot_id[:8]}",
    )
    coordinator = RedisCoordinator(
        client,
        url=url,
        deployment=settings.deployment,
        member_id=boot_id,
        info=member_info(settings.host, settings.port, __version__, settings.l2_url is not None),
        ttl_s=settings.membership_ttl_s,
        optional=settings.coordinator_optional,
        on_state=lambda state: telemetry.coordinator_up.set(1 if state == "up" else 0),
    )
    try:
        coordinator.connect()
    except RedisUnavailable as exc:
        client.close()
        refusal = _unreachable("the coordinator (MPCACHE_COORDINATOR_URL)", url, exc)
        if not settings.coordinator_optional:
            raise refusal from exc
        logger.warning("%s; --coordinator-optional: running standalone", refusal)
        return StandaloneCoordinator(boot_id, settings.deployment)
    return coordinator


def _l2(settings: Settings, boot_id: str, pool: Pool, telemetry: Telemetry) -> L2Tier | None:
    """The L2 tier, connected (None without --l2-url, or when unreachable under
    --coordinator-optional)."""
    url = settings.l2_url
    if url is None:
        return None
    client = connect(
        url,
        password=settings.redis_password,
        timeout_s=settings.redis_timeout_s,
        name=f"mpcache-l2-{boot_id[:8]}",
    )
    params = wire_params(
        url,
        password=settings.redis_password,
        timeout_s=settings.redis_timeout_s,
        name=f"mpcache-l2-reads-{boot_id[:8]}",
    )
    l2 = L2Tier(
        client,
        url=url,
        deployment=settings.deployment,
        pool=pool,
        telemetry=telemetry,
        queue_chunks=settings.l2_queue_chunks,
        max_value_bytes=int(settings.l2_max_value_size),
        wires=None if params is None else Wires(params),
    )
    try:
        l2.connect()
    except RedisUnavailable as exc:
        l2.close()
        refusal = _unreachable("the L2 tier (MPCACHE_L2_URL)", url, exc)
        if not settings.coordinator_optional:
            raise refusal from exc
        logger.warning("%s; --coordinator-optional: running without L2", refusal)
        return None
    return l2


def _build(
    settings: Settings, boot_id: str, telemetry: Telemetry, coordinator: Coordinator
) -> Runtime:
    # The L2 tier needs the pool (write-behind reads it) and gives the hasher its
    # deployment-wide seed, so the pool comes first.
    sweep_stale_segments()  # pools of crashed servers, KV caches of crashed workers
    pool = Pool.create(segment_name("pool"), settings.pool_size, settings.pool_page_size)
    l2 = disk = None
    try:
        l2 = _l2(settings, boot_id, pool, telemetry)
        disk = _disk(settings, pool, telemetry, l2)
        return _assemble(settings, boot_id, telemetry, coordinator, pool, l2, disk)
    except BaseException:
        if disk is not None:
            disk.close(0)
        if l2 is not None:
            l2.close()
        pool.close()
        raise


def _disk(
    settings: Settings, pool: Pool, telemetry: Telemetry, l2: L2Tier | None
) -> DiskTier | None:
    """The local-disk tier, its directory checked and indexed (None without
    --disk-path). With L2 the deployment's seed wins over the directory's."""
    if settings.disk_path is None:
        return None
    try:
        return DiskTier.open(
            settings.disk_path,
            size_bytes=int(settings.disk_size),
            pool=pool,
            telemetry=telemetry,
            l2_seed=l2.seed if l2 is not None else None,
            min_chunk_size=settings.chunk_size,
            max_chunk_size=settings.max_chunk_size,
        )
    except DiskRefused as exc:
        raise StartupRefused(str(exc)) from exc


def _assemble(
    settings: Settings,
    boot_id: str,
    telemetry: Telemetry,
    coordinator: Coordinator,
    pool: Pool,
    l2: L2Tier | None,
    disk: DiskTier | None,
) -> Runtime:
    chain, chain_note = _key_chain()
    # The seed of the keys the tiers below the pool hold: L2's (shared by the
    # deployment), else the disk directory's (kept across restarts), else a new one.
    seed = l2.seed if l2 is not None else disk.seed if disk is not None else None
    hasher = TokenHasher(seed, chain=chain)
    index: key_index.KeyIndex | None = None
    sessions = SessionManager(
        hasher,
        settings.session_ttl_s,
        max_bytes=int(settings.session_memory),
        max_sessions=settings.max_sessions,
        evict_idle_s=settings.lease_ttl_s,
    )
    blend = BlendMatcher(settings.enable_blend)
    pipeline = BindingPipeline(
        [
            Binding("token_hasher", hasher.bind),
            Binding("session_manager", sessions.bind),
            Binding("blend_matcher", blend.bind, enabled=blend.enabled),
            Binding("telemetry", telemetry.bind),
            Binding("disk_tier", disk.bind if disk else _unbound, enabled=disk is not None),
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
    kernel, kernel_note = _block_kernel(settings.block_kernel)
    pressure = CpuPressure() if settings.copy_alone_when_busy else None
    copier = CopyPool(
        threads,
        kernel,
        share_bytes=int(settings.copy_share),
        pressure=pressure,
        on_alone=telemetry.copies_alone.inc,
    )
    registry = Registry()
    device = DevicePath(PoolPinning(pool.address, pool.capacity_bytes, enabled=settings.pin_pool))
    socket_path = settings.register_socket or default_socket_path(settings.port)
    areas: LookupAreas | None = None

    def on_disconnect(conn_id: int) -> None:  # a client's socket connection closed
        registry.release_connection(conn_id)
        if areas is not None:
            areas.release_connection(conn_id)

    gate = FdGate(
        socket_path,
        on_disconnect=on_disconnect,
        owns_directory=settings.register_socket is None,
    )
    areas = LookupAreas(gate)
    ops: OpsSocket | None = None
    try:
        index = _key_index(
            settings, pool, hasher, boot_id, authoritative=l2 is None and disk is None
        )
        gate.start()
        cache = CacheService(
            chunk_size=authority,
            hasher=hasher,
            sessions=sessions,
            blend=blend,
            telemetry=telemetry,
            pool=pool,
            registry=registry,
            areas=areas,
            lease_ttl_s=settings.lease_ttl_s,
            copier=copier,
            gate=gate,
            l2=l2,
            disk=disk,
            device=device,
        )
        ops = OpsSocket(
            ops_socket_path(socket_path),
            cache,
            boot_id=boot_id,
            max_body_bytes=int(settings.max_body_size),
            api_token=settings.api_token,
        )
        ops.start()
        if settings.pool_prefault:
            pool.start_prefault()
        events, mirror = _events(settings, coordinator, pool, telemetry, boot_id)
        lookups = ClusterLookups(
            chunk_size=authority,
            coordinator=coordinator,
            ledger=events.ledger,
            member_id=boot_id,
            url=member_url(
                {"host": settings.host, "port": settings.port, "hostname": socket.gethostname()}
            ),
            deployment=settings.deployment,
            hasher=hasher,
            registry=registry,
            client=mirror.client if mirror is not None else None,
            l2=l2,
        )
        events.start()
        if disk is not None:
            disk.start()
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
            ops=ops,
            lookup_areas=areas,
            device=device,
            events=events,
            cluster_lookups=lookups,
            held_mirror=mirror,
            key_index=index,
            l2=l2,
            disk=disk,
            copy_rates=copy_rates,
            block_kernel=kernel_note,
            key_chain=chain_note,
        )
    except BaseException:
        if ops is not None:
            ops.close()
        gate.close()
        copier.close()
        if index is not None:
            index.close()
        raise
