"""A copy wakes its helper threads only for cores no runnable thread wants
(``dataplane.idle_cores``): beside a busy vLLM engine a chunk is copied by the
calling thread alone, on a quiet host its helpers share it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dataplane.idle_cores import IdleCores, idle_cores
from dataplane.transfer import CopyPool


@pytest.mark.parametrize(
    ("text", "cores", "idle"),
    [
        (b"0.52 0.58 0.79 1/121 4242\n", 2, 1),  # only the caller runs
        (b"2.10 1.90 1.50 3/121 4242\n", 2, 0),  # vLLM's worker and engine core spin
        (b"9.00 9.00 9.00 12/900 4242\n", 8, 0),  # more runnable threads than cores
        (b"4.00 4.00 4.00 5/900 4242\n", 16, 11),
        (b"", 2, None),  # not /proc/loadavg's text: unknown
        (b"0.1 0.2 0.3 x/121 4242", 2, None),
    ],
)
def test_idle_cores_are_the_cores_less_the_runnable_threads(
    text: bytes, cores: int, idle: int | None
) -> None:
    assert idle_cores(text, cores) == idle


def _loadavg(path: Path, running: int) -> None:
    path.write_bytes(f"1.00 1.00 1.00 {running}/150 777\n".encode())


def test_the_probe_reads_the_count_afresh_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "loadavg"
    _loadavg(path, 1)
    probe = IdleCores(str(path), cores=4)
    try:
        assert probe() == 3
        _loadavg(path, 4)
        assert probe() == 0
    finally:
        probe.close()
    assert probe() is None  # closed
    assert IdleCores(str(tmp_path / "missing"), cores=4)() is None
    assert IdleCores().cores >= 1


def _threads_per_job(pool: CopyPool, jobs: int, barrier: threading.Barrier | None) -> set[int]:
    seen: set[int] = set()
    lock = threading.Lock()

    def job() -> int:
        with lock:
            seen.add(threading.get_ident())
        if barrier is not None:
            barrier.wait()  # passes only while two threads copy at once
        return 1

    assert pool.run([job] * jobs) == jobs
    return seen


def test_a_busy_host_gets_no_helper_and_an_idle_one_does(tmp_path: Path) -> None:
    path = tmp_path / "loadavg"
    _loadavg(path, 3)  # the caller and two of vLLM's threads: no core idle
    alone: list[None] = []
    pool = CopyPool(
        2, idle_cores=IdleCores(str(path), cores=2), on_alone=lambda: alone.append(None)
    )
    try:
        for _ in range(5):
            assert _threads_per_job(pool, 8, None) == {threading.get_ident()}
        assert len(alone) == 5
        _loadavg(path, 1)  # only the caller: a helper shares the chunk
        both = threading.Barrier(2, timeout=10)
        assert len(_threads_per_job(pool, 2, both)) == 2
        assert len(alone) == 5
        path.write_bytes(b"")  # unknown: every helper is used
        assert len(_threads_per_job(pool, 2, threading.Barrier(2, timeout=10))) == 2
    finally:
        pool.close()
