"""Prometheus metrics, one registry per server (so tests can build many apps).

Served at ``GET /metrics``. The chunk size is bound like every other
chunk-dependent part; data-plane counters live here too so every metric has one
home.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["Telemetry"]


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.chunks_hit = Counter("mpcache_chunks_hit", "Chunks found by lookups.", registry=r)
        self.chunks_missed = Counter(
            "mpcache_chunks_missed", "Chunks looked up but not cached.", registry=r
        )
        self.chunks_evicted = Counter("mpcache_chunks_evicted", "Chunks evicted.", registry=r)
        self.bytes_copied = Counter(
            "mpcache_bytes_copied", "Bytes copied by store and retrieve.", ["op"], registry=r
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
        self._bound: int | None = None

    def bind(self, chunk_size: int) -> None:
        self.chunk_size.set(chunk_size)
        self._bound = chunk_size

    def render(self) -> bytes:
        return generate_latest(self.registry)
