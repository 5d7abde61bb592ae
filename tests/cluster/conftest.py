"""Cluster tests: a real ``redis-server`` (Debian's package) per test, on a free
127.0.0.1 port with a temporary directory, stopped even when the test fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import RedisServer, redis_server, require_redis_server


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    with redis_server(tmp_path) as server:
        yield server
