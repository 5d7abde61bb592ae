"""The held-blocks mirror on a real ``redis-server``: in step with the ledger, expiring
with its member, and whole again after Redis restarts empty."""

from __future__ import annotations

import pytest
import redis as redis_py

from app.cluster_lookup import RETRY_S, HeldMirror, held_key
from app.kv_events import BlockLedger, Change
from app.redis_io import connect
from tests.support import RedisServer

pytestmark = pytest.mark.slow  # a real redis-server process


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _held(client: redis_py.Redis, key: str) -> set[int]:
    return {int.from_bytes(h, "big") for h in client.smembers(key)}


def test_the_mirror_follows_the_ledger_and_rewrites_itself_after_a_restart(
    redis: RedisServer,
) -> None:
    ledger = BlockLedger(events=False)
    clock = Clock()
    mirror = HeldMirror(
        connect(redis.url, password=None, timeout_s=1.0, name="test-held"),
        ledger=ledger,
        deployment="t",
        member_id="m1",
        ttl_s=3.0,
        up=lambda: True,
        clock=clock,
    )
    reader = redis_py.Redis.from_url(redis.url)
    key = held_key("t", "m1")
    try:
        ledger.announced.update({1, 2, 3})
        mirror(Change([], [1, 2, 3], []), False)
        assert _held(reader, key) == {1, 2, 3}
        assert 0 < reader.pttl(key) <= 9000  # three membership TTLs
        ledger.announced.discard(2)
        ledger.announced.add(2**64 - 1)
        mirror(Change([], [2**64 - 1], [2]), False)
        assert _held(reader, key) == {1, 3, 2**64 - 1}

        redis.stop()  # a crash: the next write fails, and the mirror waits RETRY_S
        ledger.announced.add(4)
        mirror(Change([], [4], []), False)
        redis.start()  # back, empty
        reader = redis_py.Redis.from_url(redis.url)
        mirror(Change([], [], []), False)
        assert not reader.exists(key)  # not yet: within RETRY_S of the failure
        clock.now += RETRY_S
        mirror(Change([], [], []), False)
        assert _held(reader, key) == {1, 3, 4, 2**64 - 1}
    finally:
        mirror.close()
        assert not reader.exists(key)  # a member that leaves takes its set along
        reader.close()
