"""``POST /cluster/lookup``: which member of the deployment holds how much of a prompt.

Each member keeps the block hashes it holds (``app.kv_events.BlockLedger``: what its
KV events announce) in the coordinator's Redis, one set per member (``HeldMirror``);
an answer hashes the prompt once (``contract.chunk_keys.block_hashes``), reads its
own ledger, asks Redis about every other live member in one pipelined round trip
(``SMISMEMBER``), and L2 about the chunks (``EXISTS``, as a lookup does). It opens no
session, takes no lease, touches no LRU order and calls no other server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from app.bodies import span_tokens
from app.chunk_size import ChunkSizeAuthority
from app.coordinator import Coordinator, MemberRecord
from app.hashing import TokenHasher
from app.kv_events import BlockLedger, Change
from app.l2 import KeyBudget, L2Tier
from app.redis_io import RedisUnavailable, translated
from contract.chunk_keys import block_hashes, model_of, namespace_model
from contract.schemas import ClusterLookupRequest, ClusterLookupResponse, ClusterLookupServer
from dataplane.registry import Registry

__all__ = ["RETRY_S", "ClusterLookups", "HeldMirror", "held_key", "member_url"]

logger = logging.getLogger(__name__)

RETRY_S = 1.0
"""After a failed write, the mirror waits this long before it tries Redis again."""
_BATCH = 4096
"""Hashes per SADD when the mirror rewrites its set."""


def held_key(deployment: str, member_id: str) -> str:
    """The Redis set of a member's block hashes (8 bytes each, big-endian)."""
    return f"mpcache:{{{deployment}}}:held:{member_id}"


def _packed(hashes: Sequence[int]) -> list[bytes]:
    return [h.to_bytes(8, "big") for h in hashes]


def member_url(info: dict[str, Any]) -> str | None:
    """``http://host:port`` of a member's published info (its host name when it
    listens on every interface); None without a port."""
    host, port = info.get("host"), info.get("port")
    if not port:
        return None
    if host in (None, "", "0.0.0.0", "::"):
        host = info.get("hostname") or "127.0.0.1"
    if ":" in str(host):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class HeldMirror:
    """This member's block hashes in Redis, kept in step by the publisher's thread
    (``__call__`` is ``app.kv_events.Mirror``).

    Each change is one pipelined ``SADD``/``SREM`` with a ``PEXPIRE`` of three
    membership TTLs, renewed every TTL/3 while idle, so the set of a member that died
    expires with its membership. After a failure (or a ledger that started over) the
    set is rewritten whole from the ledger, at most every ``RETRY_S``; while the
    coordinator is down nothing is written.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        ledger: BlockLedger,
        deployment: str,
        member_id: str,
        ttl_s: float,
        up: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._ledger = ledger
        self.key = held_key(deployment, member_id)
        self._ttl_ms = max(1000, int(3 * ttl_s * 1000))
        self._renew_s = ttl_s / 3
        self._up = up
        self._clock = clock
        self._dirty = True  # the first write is a whole one
        self._next_s = 0.0
        self._failed = False

    def __call__(self, change: Change, resynced: bool) -> None:
        now = self._clock()
        self._dirty |= resynced
        pending = bool(change.stored or change.removed)
        if not (pending or self._dirty) and now < self._next_s:
            return
        if (self._failed and now < self._next_s) or not self._up():
            self._dirty |= pending
            return
        try:
            with translated("held blocks mirror"):
                self._write(change)
        except RedisUnavailable as exc:
            if not self._failed:
                logger.warning("cannot mirror the held blocks to Redis: %s", exc)
            self._failed, self._dirty = True, True
            self._next_s = now + RETRY_S
            return
        if self._failed:
            logger.info("held blocks mirrored to Redis again")
        self._failed, self._dirty = False, False
        self._next_s = now + self._renew_s

    def _write(self, change: Change) -> None:
        pipe = self.client.pipeline(transaction=self._dirty)
        if self._dirty:
            pipe.delete(self.key)
            held = sorted(self._ledger.announced)
            for i in range(0, len(held), _BATCH):
                pipe.sadd(self.key, *_packed(held[i : i + _BATCH]))
        else:
            if change.stored:
                pipe.sadd(self.key, *_packed(change.stored))
            if change.removed:
                pipe.srem(self.key, *_packed(change.removed))
        pipe.pexpire(self.key, self._ttl_ms)
        pipe.execute()

    def close(self) -> None:
        """Remove the set (best effort) and disconnect."""
        try:
            with translated("held blocks mirror"):
                self.client.delete(self.key)
        except RedisUnavailable as exc:
            logger.warning("could not remove the held blocks from Redis: %s", exc)
        finally:
            self.client.close()


class ClusterLookups:
    """Answers ``POST /cluster/lookup`` (blocking I/O: run it off the event loop)."""

    def __init__(
        self,
        *,
        chunk_size: ChunkSizeAuthority,
        coordinator: Coordinator,
        ledger: BlockLedger,
        member_id: str,
        url: str | None,
        deployment: str,
        hasher: TokenHasher,
        registry: Registry,
        client: redis.Redis | None = None,
        l2: L2Tier | None = None,
    ) -> None:
        self._chunk_size = chunk_size
        self._coordinator = coordinator
        self._ledger = ledger
        self._member_id = member_id
        self._url = url
        self._deployment = deployment
        self._hasher = hasher
        self._registry = registry
        self._client = client
        self._l2 = l2

    def answer(self, req: ClusterLookupRequest) -> ClusterLookupResponse:
        size = self._chunk_size.final().chunk_size  # 409 before a final size
        tokens = span_tokens(req, "cluster lookup")
        hashes = block_hashes(req.model, req.cache_salt, tokens, size)
        own = ClusterLookupServer(
            member_id=self._member_id,
            url=self._url,
            l1_tokens=self._ledger.leading(hashes) * size,
        )
        others = [
            ClusterLookupServer(member_id=m.member_id, url=member_url(m.info), l1_tokens=n * size)
            for m, n in self._others(hashes)
        ]
        return ClusterLookupResponse(
            chunk_size=size, servers=[own, *others], l2_tokens=self._l2_chunks(req, tokens) * size
        )

    def _others(self, hashes: Sequence[int]) -> list[tuple[MemberRecord, int]]:
        """Every other live member and how many leading ``hashes`` its set holds."""
        if self._client is None:
            return []
        try:
            members = [m for m in self._coordinator.members() if m.member_id != self._member_id]
            if not members or not hashes:
                return [(m, 0) for m in members]
            packed = _packed(hashes)
            with translated("cluster lookup"):
                pipe = self._client.pipeline(transaction=False)
                for m in members:
                    pipe.smismember(held_key(self._deployment, m.member_id), packed)
                found = pipe.execute()
        except RedisUnavailable as exc:
            logger.warning("cluster lookup answers for this server alone: %s", exc)
            return []
        return [(m, _leading(flags)) for m, flags in zip(members, found, strict=True)]

    def _l2_chunks(self, req: ClusterLookupRequest, tokens: Any) -> int:
        """Leading chunks L2 holds for every rank, for the namespaces of the model
        registered here (L2's keys name a layout and world size; the most of them)."""
        l2 = self._l2
        if l2 is None or not l2.up:
            return 0
        model = namespace_model(req.model)
        size = self._chunk_size.final().chunk_size
        best = 0
        budget = KeyBudget()  # over every namespace: the call's cost has one bound
        for namespace, ws, layout in self._registry.namespaces():
            if model_of(namespace) != model:
                continue
            keys = self._hasher.prefix_keys(namespace, req.cache_salt, tokens, chunk_size=size)
            best = max(best, l2.count_leading(namespace, size, layout, ws, keys, budget))
        return best


def _leading(flags: Sequence[int]) -> int:
    for n, flag in enumerate(flags):
        if not flag:
            return n
    return len(flags)
