"""A copy wakes its helper threads only while no thread on the host waits for a
core (``dataplane.cpu_pressure``): beside a busy vLLM engine a chunk is copied by
the calling thread alone, on a quiet host its helpers share it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dataplane.cpu_pressure import CpuPressure, stalled_us
from dataplane.transfer import CopyPool

QUIET = (
    b"some avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
    b"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


@pytest.mark.parametrize(
    ("text", "stalled"),
    [
        (QUIET.replace(b"{}", b"1127920781"), 1127920781),
        (b"some avg10=1.00 avg60=2.00 avg300=3.00 total=42\n", 42),
        (b"", None),  # not the pressure file's text
        (b"full avg10=0.00 avg60=0.00 avg300=0.00 total=7\n", None),
        (b"some avg10=0.00 total=x\n", None),
    ],
)
def test_the_stall_total_is_read_from_the_some_line(text: bytes, stalled: int | None) -> None:
    assert stalled_us(text) == stalled


class _Host:
    """A stand-in for /proc/pressure/cpu (a regular file reads the same way) and the
    clock, moved by the test."""

    def __init__(self, path: Path) -> None:
        self.path, self.now, self.stalled_us = path, 100.0, 5_000_000
        self.advance(0.0, 0.0)

    def advance(self, seconds: float, waited_share: float) -> None:
        self.now += seconds
        self.stalled_us += round(seconds * waited_share * 1e6)
        self.path.write_bytes(QUIET.replace(b"{}", str(self.stalled_us).encode()))


def test_the_probe_says_busy_when_threads_waited_for_a_core(tmp_path: Path) -> None:
    host = _Host(tmp_path / "cpu")
    probe = CpuPressure(str(host.path), clock=lambda: host.now)
    try:
        assert probe.busy() is None  # nothing to compare with yet
        host.advance(0.002, 0.6)  # beside a busy engine: waits most of the time
        assert probe.busy() is True
        host.advance(0.5, 0.001)  # a quiet host: a moment's wait now and then
        assert probe.busy() is False
        host.advance(0.0, 0.0)  # no time passed: no share to tell
        assert probe.busy() is None
    finally:
        probe.close()
    assert probe.busy() is None  # closed
    assert CpuPressure(str(tmp_path / "missing")).busy() is None


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


def test_a_busy_host_gets_no_helper_and_a_quiet_one_does(tmp_path: Path) -> None:
    host = _Host(tmp_path / "cpu")
    alone: list[None] = []
    pool = CopyPool(
        2,
        pressure=CpuPressure(str(host.path), clock=lambda: host.now),
        on_alone=lambda: alone.append(None),
    )
    try:
        # The first chunk has nothing to compare with: its helper copies.
        assert len(_threads_per_job(pool, 2, threading.Barrier(2, timeout=10))) == 2
        for _ in range(5):  # vLLM's threads wait for cores between chunks
            host.advance(0.003, 0.5)
            assert _threads_per_job(pool, 8, None) == {threading.get_ident()}
        assert len(alone) == 5
        host.advance(0.003, 0.0)  # no one waited: a helper shares the chunk
        assert len(_threads_per_job(pool, 2, threading.Barrier(2, timeout=10))) == 2
        assert len(alone) == 5
    finally:
        pool.close()


class _AlwaysBusy(CpuPressure):
    """The probe of a host where vLLM's threads always wait for a core."""

    def busy(self) -> bool | None:
        return True


@pytest.mark.parametrize(("setting", "alone"), [(True, 3), (False, 0)])
def test_the_server_copies_alone_on_a_busy_host_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, setting: bool, alone: int
) -> None:
    from app.settings import Settings
    from app.state import build_runtime

    monkeypatch.setattr("app.state.CpuPressure", _AlwaysBusy)
    runtime = build_runtime(
        Settings(
            pool_size="1MiB", pool_prefault=False, copy_threads=2, copy_alone_when_busy=setting
        )
    )
    try:
        barrier = None if setting else threading.Barrier(2, timeout=10)
        for _ in range(3):
            threads = _threads_per_job(runtime.copier, 2, barrier)
            assert len(threads) == (1 if setting else 2)
        assert runtime.telemetry.copies_alone._value.get() == alone
    finally:
        runtime.close()
