"""Warnings a client can repeat are logged once an interval (issue 25, item 2)."""

from __future__ import annotations

import errno
import logging
import socket
import time
from pathlib import Path

import pytest

from dataplane.fdgate import ACCEPT_PAUSE_S, FdGate
from dataplane.repeats import RepeatedWarning
from tests.support import wait_until


def test_a_repeated_warning_is_logged_once_an_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    warn = RepeatedWarning(logging.getLogger("tests.repeats"), 60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tests.repeats"):
        assert warn.warn("accept", "accept failed: %s", "EMFILE")
        assert not any(warn.warn("accept", "accept failed: %s", "EMFILE") for _ in range(500))
        assert warn.warn("other", "another fault")  # each key its own interval
        now[0] = 60.0
        assert warn.warn("accept", "accept failed: %s", "EMFILE")
    assert [r.getMessage() for r in caplog.records] == [
        "accept failed: EMFILE",
        "another fault",
        "accept failed: EMFILE (500 more since the last such warning)",
    ]


class _Exhausted:
    """The gate's listener at "too many open files": every accept fails."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.attempts: list[float] = []

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        self.attempts.append(time.monotonic())
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self.real.close()


def test_the_registration_socket_pauses_at_too_many_open_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: the gate's thread retried accept in a tight loop, 424,196 identical
    warnings in 20 s; now it waits ACCEPT_PAUSE_S between tries, logged once."""
    gate = FdGate(tmp_path / "g.sock", on_disconnect=lambda _: None)
    listener = _Exhausted(gate._listener)
    gate._listener = listener  # type: ignore[assignment]
    gate.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with caplog.at_level(logging.WARNING, logger="dataplane.fdgate"):
            client.connect(str(gate.path))  # waits in the backlog: the listener is readable
            wait_until(lambda: len(listener.attempts) >= 4, what="four accept attempts")
    finally:
        client.close()
        gate.close()
    gaps = [b - a for a, b in zip(listener.attempts, listener.attempts[1:], strict=False)]
    assert min(gaps) >= ACCEPT_PAUSE_S * 0.9, gaps
    assert sum("accept failed" in r.getMessage() for r in caplog.records) == 1
