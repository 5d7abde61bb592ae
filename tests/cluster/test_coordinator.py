"""``RedisCoordinator`` against a real Redis: agreement, membership, leaving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_py

from app.coordinator import DeploymentConflict, RedisCoordinator, deployment_keys
from app.redis_io import connect
from tests.support import RedisServer, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def members(redis: RedisServer) -> Iterator[list[RedisCoordinator]]:
    made: list[RedisCoordinator] = []
    yield made
    for coordinator in made:
        coordinator.leave()


def _member(
    redis: RedisServer, made: list[RedisCoordinator], name: str, *, optional: bool = False
) -> RedisCoordinator:
    coordinator = RedisCoordinator(
        connect(redis.url, password=None, timeout_s=1.0, name=name),
        url=redis.url,
        deployment="d",
        member_id=name,
        info={"host": "127.0.0.1", "port": 1},
        ttl_s=1.0,
        optional=optional,
    )
    coordinator.connect()
    made.append(coordinator)
    return coordinator


def test_first_final_size_wins_and_others_must_match(
    redis: RedisServer, members: list[RedisCoordinator]
) -> None:
    a, b, c = (_member(redis, members, n) for n in ("a", "b", "c"))
    assert a.join(256).chunk_size == 256
    assert b.join(256).chunk_size == 256
    with pytest.raises(DeploymentConflict) as refused:
        c.join(512)
    assert refused.value.extras == {
        "deployment": "d",
        "deployment_chunk_size": 256,
        "server_chunk_size": 512,
    }
    listed = {m.member_id: m.info["chunk_size"] for m in a.members()}
    assert listed == {"a": 256, "b": 256, "c": None}
    assert a.status().deployment_chunk_size == 256


def test_membership_expires_unless_renewed_and_last_leaver_resets(
    redis: RedisServer, members: list[RedisCoordinator]
) -> None:
    a, b = _member(redis, members, "a"), _member(redis, members, "b")
    a.join(128)
    client = redis_py.Redis.from_url(redis.url)
    try:
        size_key, _, _ = deployment_keys("d")
        client.flushall()  # as a Redis restarted without persistence
        wait_until(lambda: client.get(size_key) == b"128", what="the size re-published")
        wait_until(lambda: {m.member_id for m in a.members()} == {"a", "b"}, what="renewals")
        b.leave()
        members.remove(b)
        assert {m.member_id for m in a.members()} == {"a"}
        a.leave()
        members.remove(a)
        assert client.get(size_key) is None  # the last member took the size along
    finally:
        client.close()
