"""A SIGKILLed worker's registration is released and its memory returns.

Real processes: a server (``mpcache server``) and a worker process running the
connector's ``WorkerAdapter``, whose CPU KV cache (2 x 256 KiB) moves into sealed
memfds and is registered over the server's socket. The worker is then SIGKILLed,
as a crashing vLLM would be; the server notices its socket close and unmaps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.support import ROOT, server_process, wait_until

pytestmark = pytest.mark.slow

WORKER = """
import sys, time, torch
from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.worker import WorkerAdapter
from tests.connector.fakes import AttnSpec, Group

worker = WorkerAdapter(
    ConnectorConfig(server_urls=(sys.argv[1],), request_timeout_s=30.0),
    layout_from_groups([Group(AttnSpec(16), ["l0", "l1"])]),
    model="tiny", instance_id=sys.argv[2], namespace="ns", rank=0, world_size=1,
    num_blocks=32, start_heartbeat=False,
)
kv = {name: torch.ones(32, 2, 16, 2, 32, dtype=torch.float16) for name in ("l0", "l1")}
worker.register_kv_caches(kv)
print("registered" if worker.registered else "not registered", flush=True)
time.sleep(3600)
"""

KV_LABEL = "/memfd:mpcache-kv-r0-"


def _memfd_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if KV_LABEL in line)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def _worker(url: str, instance_id: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, url, instance_id],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


def test_a_killed_workers_registration_is_released_and_unmapped() -> None:
    """Was: its registration stayed mapped forever, and each crash (a new instance id
    every start) leaked a whole KV cache."""
    with (
        server_process("--chunk-size", "64") as (url, server),
        httpx.Client(base_url=url, timeout=30.0) as http,
    ):
        assert http.get("/health").json()["registrations"] == 0  # our connection is open
        fds_before = _open_fds(server.pid)
        for cycle in range(2):  # vLLM's instance id changes at every start
            with _worker(url, f"engine-{cycle}") as worker:
                assert worker.stdout is not None
                line = worker.stdout.readline().decode().strip()
                assert line == "registered", line + worker.stdout.read().decode()
                assert http.get("/health").json()["registrations"] == 1
                assert _memfd_mappings(server.pid) == 2  # l0 and l1, one memfd each
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
            wait_until(
                lambda: http.get("/health").json()["registrations"] == 0,
                what="the dead worker's registration released",
            )
            wait_until(lambda: _memfd_mappings(server.pid) == 0, what="its memfds unmapped")
        # No descriptor per registration, and none left behind by the dead workers.
        assert _open_fds(server.pid) <= fds_before
        assert server.poll() is None
