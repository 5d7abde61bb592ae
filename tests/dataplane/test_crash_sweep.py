"""Crashed processes leave segments behind; the next server start removes them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import posix_ipc
import pytest

from contract.shm_naming import SHM_DIR, pid_namespace, segment_name
from tests.support import server_process


@pytest.fixture
def crashed_pool_segment() -> Iterator[str]:
    """A pool segment of our PID namespace whose creator is dead (unlinked after)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    name = segment_name("pool", pid=proc.pid)
    posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        yield name
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)


def test_server_start_sweeps_crashed_servers_pools(
    crashed_pool_segment: str, make_client: Callable[..., Any]
) -> None:
    live = segment_name("pool")  # ours: alive
    posix_ipc.SharedMemory("/" + live, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        make_client(alignment=None)
        assert not os.path.exists(f"{SHM_DIR}/{crashed_pool_segment}")
        assert os.path.exists(f"{SHM_DIR}/{live}")
    finally:
        posix_ipc.unlink_shared_memory("/" + live)


def test_cli_sweeps_before_checking_free_space(
    crashed_pool_segment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    from app.cli import main

    started: list[Any] = []

    def run(server: uvicorn.Server, sockets: list[Any]) -> None:
        started.append(server.config)
        server.started = True
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr("app.logs.configure_logging", lambda *_, **__: None)  # the suite's
    main(["server", "--pool-size", "8MiB", "--port", "0"])
    assert started and started[0].host == "127.0.0.1"
    assert not os.path.exists(f"{SHM_DIR}/{crashed_pool_segment}")


def _pools_of(pid: int) -> list[str]:
    prefix = f"mpcache-pool-{pid_namespace()}-{pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


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
