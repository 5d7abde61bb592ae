"""A blocked event loop and slow requests are said in the log and the metrics."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from app.stalls import STALL_S, SlowRequests
from tests.support import wait_until


def _stalled_seconds(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("mpcache_event_loop_stall_seconds_total "):
            return float(line.split()[1])
    raise AssertionError("no mpcache_event_loop_stall_seconds_total in /metrics")


def test_a_blocked_event_loop_is_logged_and_counted(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """What an operator reads when connectors report /health timeouts: the server's
    event loop could not run (here: a call that blocks it, as a GIL-holding thread
    or a starved process would)."""
    assert _stalled_seconds(client) == 0.0
    caplog.set_level(logging.WARNING, logger="app.stalls")
    assert client.portal is not None
    client.portal.call(time.sleep, STALL_S + 0.5)  # runs on the app's event loop
    wait_until(lambda: _stalled_seconds(client) > 0, what="the stall counted")
    assert _stalled_seconds(client) >= STALL_S
    (record,) = [r for r in caplog.records if "event loop could not run" in r.getMessage()]
    assert record.levelno == logging.WARNING


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_slow_requests_are_warned_once_per_route_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    slow = SlowRequests(threshold_s=2.0, repeat_s=60.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="app.stalls")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "app.stalls"]

    slow.observe("GET", "/health", 200, 1.9)
    assert warnings() == []
    slow.observe("GET", "/health", 200, 12.5)
    assert warnings() == ["slow request: GET /health answered 200 after 12.5 s"]
    clock.now += 10
    slow.observe("GET", "/health", 200, 3.0)
    slow.observe("POST", "/cache/store", 200, 4.0)  # another route has its own minute
    assert len(warnings()) == 2 and "POST /cache/store" in warnings()[1]
    clock.now += 60
    slow.observe("GET", "/health", 200, 2.5)
    assert warnings()[2] == (
        "slow request: GET /health answered 200 after 2.5 s "
        "(1 more slower than 2 s since the last warning)"
    )
