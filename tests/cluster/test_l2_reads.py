"""A retrieve's L2 reads (``app.l2_reads``) against a real ``redis-server``: every
L1-missing chunk in one pipeline, bytes identical in the pool, corrupt values refused
and deleted, and a Redis that dies or freezes mid-fetch costs a bounded wait."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis as redis_py

import app.l2_reads
from app.l2 import L2Tier
from app.l2_reads import Owner, Promoter, Want
from app.l2_values import encode_header, seal
from app.redis_io import connect
from app.redis_wire import Wires, wire_params
from app.telemetry import Telemetry
from contract.shm_naming import segment_name
from dataplane.pool import Entry, Pool
from tests.support import RedisServer, wait_until

CHUNK_BYTES = 256 << 10
CHUNKS = 6
LAYOUT = bytes(range(16))
OWNER = Owner("tiny@l2/ws1", 1, 0, LAYOUT, CHUNK_BYTES)
TIMEOUT_S = 0.5


def _chunk_key(n: int) -> bytes:
    return bytes([n]) * 16


def _payload(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, CHUNK_BYTES, np.uint8).tobytes()


def _value(n: int) -> bytes:
    header = encode_header(_chunk_key(n), OWNER.rank, LAYOUT, 0b1)
    buf = bytearray(header + _payload(n))
    seal(buf, len(header))
    return bytes(buf)


class Node:
    """One server's pool and L2 tier on the test's Redis (raw reads, or redis-py's)."""

    def __init__(self, redis: RedisServer, *, raw: bool) -> None:
        self.telemetry = Telemetry()
        self.pool = Pool.create(segment_name("pool"), CHUNKS * CHUNK_BYTES + (1 << 20), 4096)
        params = wire_params(redis.url, password=None, timeout_s=TIMEOUT_S, name="t-reads")
        client = connect(redis.url, password=None, timeout_s=TIMEOUT_S, name="t-l2")
        self.l2 = L2Tier(
            client,
            url=redis.url,
            deployment="t",
            pool=self.pool,
            telemetry=self.telemetry,
            queue_chunks=4,
            max_value_bytes=CHUNK_BYTES,
            wires=Wires(params) if raw and params is not None else None,
        )
        self.l2.connect()
        self.promoter = Promoter(self.l2, self.pool)

    def key(self, n: int) -> bytes:
        return self.l2.key(OWNER.namespace, 64, LAYOUT, 1, 0, _chunk_key(n))

    def promote(self, n: int, passed: Callable[[], bool] = lambda: False) -> list[Entry | None]:
        wants = [Want(_chunk_key(i), 0b1, None) for i in range(n)]
        return self.promoter.promote(OWNER, 64, wants, passed)

    def reads(self, outcome: str) -> float:
        return self.telemetry.l2_reads.labels(outcome)._value.get()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.l2.close()
        self.pool.close()


@pytest.fixture(params=["raw", "redis-py"])
def node(request: pytest.FixtureRequest, redis: RedisServer) -> Iterator[Node]:
    node = Node(redis, raw=request.param == "raw")
    try:
        yield node
    finally:
        node.close()


@pytest.fixture
def client(redis: RedisServer) -> Iterator[redis_py.Redis]:
    client = redis_py.Redis.from_url(redis.url)
    try:
        yield client
    finally:
        client.close()


def _fill(node: Node, client: redis_py.Redis, skip: int | None = None) -> None:
    for n in range(CHUNKS):
        if n != skip:
            client.set(node.key(n), _value(n))


def _gets(client: redis_py.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def test_one_pipeline_bytes_identical(node: Node, client: redis_py.Redis) -> None:
    _fill(node, client, skip=2)
    before = _gets(client)
    out = node.promote(CHUNKS)
    assert _gets(client) - before == CHUNKS  # one GET each, nothing more
    assert out[2] is None  # not in L2: a miss, the others still promoted
    for n, entry in enumerate(out):
        if n == 2:
            continue
        assert entry is not None
        assert node.pool.view(entry).numpy().tobytes() == _payload(n)
        node.pool.unpin(entry)
    assert (node.reads("hit"), node.reads("miss")) == (CHUNKS - 1, 1)
    again = node.promote(1)  # from the pool now: present, pinned, the same bytes
    assert again[0] is not None and node.pool.view(again[0]).numpy().tobytes() == _payload(0)
    node.pool.unpin(again[0])


def test_corrupt_values_refused_deleted_never_served(node: Node, client: redis_py.Redis) -> None:
    _fill(node, client)
    flipped = bytearray(_value(1))
    flipped[-7] ^= 0x10  # one payload bit
    client.set(node.key(1), bytes(flipped))
    client.set(node.key(3), _value(3)[:-5])  # truncated
    client.set(node.key(4), _value(5))  # another chunk's value under this key
    out = node.promote(CHUNKS)
    assert [e is not None for e in out] == [True, False, True, False, False, True]
    for n in (1, 3, 4):
        assert client.exists(node.key(n)) == 0  # deleted
        assert node.pool.pin(_chunk_key(n), 0, LAYOUT, 0b1) is None  # never committed
    assert node.reads("corrupt") == 3
    for entry in out:
        if entry is not None:
            node.pool.unpin(entry)


def test_redis_killed_mid_fetch(
    redis: RedisServer, client: redis_py.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node(redis, raw=True)
    try:
        _fill(node, client)
        monkeypatch.setattr(app.l2_reads, "PIPELINE_BYTES", 2 * CHUNK_BYTES)  # 2 GETs ahead
        calls = []

        def passed() -> bool:  # asked before each further GET: kill Redis at the third
            calls.append(1)
            if len(calls) == 3:
                redis.stop()
            return False

        out = node.promote(CHUNKS, passed)  # returns: the lost connection ends the call
        assert out[0] is not None  # promoted before the fault: served
        assert out[-1] is None and not node.l2.up
        assert node.reads("unavailable") == 1
        node.pool.unpin(out[0])
        for entry in out[1:]:
            if entry is not None:
                node.pool.unpin(entry)
        assert node.promote(2) == [None, None]  # down: L1 only, no wait

        redis.start()  # back (empty): the tier probes, reads resume on a new connection
        wait_until(lambda: node.l2.up, what="the L2 tier back up")
        restarted = redis_py.Redis.from_url(redis.url)
        try:
            restarted.set(node.key(5), _value(5))
        finally:
            restarted.close()
        again = node.promoter.promote(OWNER, 64, [Want(_chunk_key(5), 0b1, None)], lambda: False)
        assert again[0] is not None
        node.pool.unpin(again[0])
    finally:
        node.close()


def test_a_frozen_redis_costs_one_timeout(redis: RedisServer, client: redis_py.Redis) -> None:
    node = Node(redis, raw=True)
    try:
        _fill(node, client)
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            # Returns (the socket timeout ends the call), every chunk a miss, tier down.
            assert node.promote(CHUNKS) == [None] * CHUNKS
            assert not node.l2.up
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
    finally:
        node.close()
