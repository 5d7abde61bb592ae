"""Prometheus metrics, one registry per server (so tests can build many apps).

Served at ``GET /metrics`` by prometheus_client's own ASGI app (text format, or
OpenMetrics when the scraper asks for it; gzip when accepted). The chunk-size gauge
is set by the ``telemetry`` binding; data-plane counters live here too so every
metric has one home.

Names follow Prometheus conventions: base units (seconds, bytes) in the name,
``_total`` on counters, no ``_created`` series. Durations are histograms:
``mpcache_http_request_duration_seconds`` per route (the route's template, never
the raw path) and ``mpcache_cache_op_duration_seconds`` per cache operation.

Every label value comes from a set the server fixes, never from what a client
sends: an unknown method or path is ``other`` (``RequestTimer``), so a scan of made-up
methods or paths cannot grow ``/metrics`` (docs/design.md s.4.2).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    make_asgi_app,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.stalls import SlowRequests
from contract import __version__

__all__ = [
    "HTTP_METHODS",
    "LATENCY_BUCKETS_S",
    "OTHER",
    "MetricsEndpoint",
    "RequestTimer",
    "Telemetry",
]

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods the request histogram names; any other is counted as ``OTHER``."""
OTHER = "other"
"""The label value of a method outside ``HTTP_METHODS``, or a path no route matches."""

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""From half a millisecond (a lookup hit) to seconds (a large store under load)."""


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


class Telemetry:
    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide: no _created
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("mpcache_build", "Versions this server runs.", registry=r)
        self.build_info.info(
            {
                "version": __version__,
                "python": platform.python_version(),
                "torch": _dist_version("torch"),
            }
        )
        self.chunk_size = Gauge(
            "mpcache_chunk_size_tokens", "Final chunk size (0 until selected).", registry=r
        )
        self.negotiations = Counter(
            "mpcache_negotiations", "Negotiation requests by outcome.", ["outcome"], registry=r
        )
        self.binding_failures = Counter(
            "mpcache_binding_failures", "Chunk-size binding failures.", ["binding"], registry=r
        )
        self.sessions = Gauge("mpcache_sessions", "Live cache sessions.", registry=r)
        self.registrations = Gauge(
            "mpcache_registrations", "Registered worker KV caches.", registry=r
        )
        self.chunks_stored = Counter("mpcache_chunks_stored", "Chunks stored.", registry=r)
        self.chunks_hit = Counter(
            "mpcache_chunks_hit",
            "Chunks found by lookups (HTTP lookups only: a connector reading the key index "
            "asks none; chunks_loaded counts what was served).",
            registry=r,
        )
        self.chunks_loaded = Counter(
            "mpcache_chunks_loaded",
            "Chunks, and tails of units, copied into a KV cache by retrieves.",
            registry=r,
        )
        self.chunks_missed = Counter(
            "mpcache_chunks_missed", "Chunks looked up but not cached.", registry=r
        )
        self.chunks_evicted = Counter("mpcache_chunks_evicted", "Chunks evicted.", registry=r)
        self.copied_bytes = Counter(
            "mpcache_copied_bytes",
            "Bytes copied between KV caches and the pool, by op (store, retrieve).",
            ["op"],
            registry=r,
        )
        self.transfer_timeouts = Counter(
            "mpcache_transfer_timeouts",
            "Store/retrieve calls cut short by their timeout_s.",
            ["op"],
            registry=r,
        )
        self.pool_used_bytes = Gauge("mpcache_pool_used_bytes", "Pool bytes in use.", registry=r)
        self.pool_capacity_bytes = Gauge(
            "mpcache_pool_capacity_bytes", "Pool capacity in bytes.", registry=r
        )
        self.copy_threads = Gauge(
            "mpcache_copy_threads", "Threads one chunk's copy uses (measured at start).", registry=r
        )
        self.copies_alone = Counter(
            "mpcache_copies_alone",
            "Chunk copies made by one thread where the copy threads would have shared "
            "them: threads on the host were waiting for a core (/proc/pressure/cpu).",
            registry=r,
        )
        self.chunks_l2_hit = Counter(
            "mpcache_chunks_l2_hit",
            "Chunks lookups found in the shared L2 tier only (also counted in chunks_hit).",
            registry=r,
        )
        self.l2_up = Gauge(
            "mpcache_l2_up", "1 while the L2 tier answers, else 0 (0 without --l2-url).", registry=r
        )
        self.coordinator_up = Gauge(
            "mpcache_coordinator_up",
            "1 while the coordinator answers and agrees with this server's size, else 0 "
            "(1 when standalone).",
            registry=r,
        )
        self.l2_writes = Counter(
            "mpcache_l2_writes",
            "Committed chunks offered to L2, by outcome: written, queue_full, unavailable, "
            "evicted (left L1 before written), too_large, error.",
            ["outcome"],
            registry=r,
        )
        self.l2_reads = Counter(
            "mpcache_l2_reads",
            "Chunks fetched from L2 by retrieves, by outcome: hit (promoted into L1), miss, "
            "corrupt (refused and deleted), unavailable.",
            ["outcome"],
            registry=r,
        )
        self.l2_bytes = Counter(
            "mpcache_l2_bytes", "Bytes written to and read from L2, by op.", ["op"], registry=r
        )
        self.l2_queue_chunks = Gauge(
            "mpcache_l2_queue_chunks", "Committed chunks waiting to be written to L2.", registry=r
        )
        self.chunks_disk_hit = Counter(
            "mpcache_chunks_disk_hit",
            "Chunks lookups found on the local disk tier, past L1's (also in chunks_hit).",
            registry=r,
        )
        self.disk_writes = Counter(
            "mpcache_disk_writes",
            "Committed chunks offered to the disk tier, by outcome: written, present "
            "(already on disk), queue_full, evicted (left L1 before queued), too_large "
            "(over --disk-size), shutdown, error.",
            ["outcome"],
            registry=r,
        )
        self.disk_reads = Counter(
            "mpcache_disk_reads",
            "Chunk files read by retrieves, by outcome: hit (promoted into L1), miss (gone, "
            "or no room in L1), corrupt (torn or foreign: refused and deleted, also at start).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("written", "queue_full", "error"):
            self.disk_writes.labels(outcome)
        for outcome in ("hit", "miss", "corrupt"):
            self.disk_reads.labels(outcome)
        self.disk_bytes = Counter(
            "mpcache_disk_bytes", "Bytes written to and read from disk, by op.", ["op"], registry=r
        )
        self.disk_evicted = Counter(
            "mpcache_disk_evicted", "Chunk files evicted from disk (LRU).", registry=r
        )
        self.disk_used_bytes = Gauge(
            "mpcache_disk_used_bytes", "Bytes the disk tier's chunk files take.", registry=r
        )
        self.disk_capacity_bytes = Gauge(
            "mpcache_disk_capacity_bytes", "The disk tier's --disk-size (0: off).", registry=r
        )
        self.disk_queue_bytes = Gauge(
            "mpcache_disk_queue_bytes",
            "Bytes of committed chunks waiting to be written to disk (pinned in L1).",
            registry=r,
        )
        self.tokens_loaded = Counter(
            "mpcache_tokens_loaded",
            "Tokens copied into KV caches by retrieves: the prefix tokens vLLM did not "
            "recompute (the Grafana panel 'hit tokens per server').",
            registry=r,
        )
        self.kv_event_batches = Counter(
            "mpcache_kv_event_batches",
            "KV event batches (--kv-events-endpoint), by outcome: published, or dropped "
            "(the queue was full; its sequence number is skipped, a gap consumers see).",
            ["outcome"],
            registry=r,
        )
        self.kv_event_records_lost = Counter(
            "mpcache_kv_event_records_lost",
            "Pool changes the KV events queue had no room for (--kv-events-queue); the "
            "server then starts its block ledger over from the pool.",
            registry=r,
        )
        for outcome in ("published", "dropped"):
            self.kv_event_batches.labels(outcome)
        self.request_seconds = Histogram(
            "mpcache_http_request_duration_seconds",
            "HTTP request latency by method, route template and status code.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.op_seconds = Histogram(
            "mpcache_cache_op_duration_seconds",
            "Cache operation latency inside the server, by op.",
            ["op"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.event_loop_stall_seconds = Counter(
            "mpcache_event_loop_stall_seconds",
            "Seconds the event loop could not run in stalls of 0.5 s or more (app/stalls.py).",
            registry=r,
        )
        self.slow_requests = SlowRequests()
        self.asgi = make_asgi_app(r)

    def bind(self, chunk_size: int) -> None:
        """The ``telemetry`` binding: publish the size in ``mpcache_chunk_size_tokens``."""
        self.chunk_size.set(chunk_size)

    def track(
        self,
        *,
        sessions: Callable[[], float],
        registrations: Callable[[], float],
        pool_used_bytes: Callable[[], float],
    ) -> None:
        """Read these gauges from their owners at scrape time."""
        self.sessions.set_function(sessions)
        self.registrations.set_function(registrations)
        self.pool_used_bytes.set_function(pool_used_bytes)


class MetricsEndpoint:
    """``GET /metrics``: the running server's prometheus_client ASGI app."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        telemetry: Telemetry = scope["app"].state.runtime.telemetry
        await telemetry.asgi(scope, receive, send)


class RequestTimer:
    """ASGI middleware: observe each HTTP request in ``mpcache_http_request_duration_seconds``
    (and warn of a slow one: ``app.stalls.SlowRequests``).

    The route label is the matched route's template (``/register/{instance_id:path}/{rank}``),
    or ``other``, and the method label one of ``HTTP_METHODS`` or ``other``, so a scan
    of random paths or made-up methods cannot grow the label set.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            runtime = getattr(scope["app"].state, "runtime", None)
            if runtime is not None:
                route = getattr(scope.get("route"), "path", None) or OTHER
                method = scope["method"] if scope["method"] in HTTP_METHODS else OTHER
                seconds = time.perf_counter() - start
                telemetry: Telemetry = runtime.telemetry
                telemetry.request_seconds.labels(method, route, str(status)).observe(seconds)
                telemetry.slow_requests.observe(method, route, status, seconds)
