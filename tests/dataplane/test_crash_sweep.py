"""A SIGKILLed server leaves its pool behind; the next start removes it."""

from __future__ import annotations

import os
import signal

import pytest

from dataplane.segments import SHM_DIR
from tests.support import server_process


def _pools_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"mpcache-pool-{pid}-"))


@pytest.mark.slow
def test_killed_server_leaves_no_segment_after_next_start() -> None:
    leftovers: list[str] = []
    try:
        with server_process("--pool-size", "8MiB") as (_, first):
            pools = _pools_of(first.pid)
            assert len(pools) == 1, pools
            leftovers = pools
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
        assert os.path.exists(f"{SHM_DIR}/{pools[0]}"), "SIGKILL should leave the pool"

        with server_process("--pool-size", "8MiB") as (_, second):
            assert not os.path.exists(f"{SHM_DIR}/{pools[0]}"), "stale pool not swept"
            own = _pools_of(second.pid)
            assert len(own) == 1
            leftovers = own
        # A clean shutdown (SIGTERM) unlinks the pool too.
        assert not os.path.exists(f"{SHM_DIR}/{own[0]}")
    finally:
        for name in leftovers:
            if os.path.exists(f"{SHM_DIR}/{name}"):
                os.unlink(f"{SHM_DIR}/{name}")


@pytest.mark.slow
def test_server_refuses_a_pool_larger_than_dev_shm() -> None:
    free = os.statvfs(SHM_DIR)
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(RuntimeError) as info, server_process("--pool-size", str(too_big)):
        pass
    assert "lower --pool-size" in str(info.value)
