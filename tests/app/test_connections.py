"""The HTTP connection guard's rules, without sockets (issue 25, item 2).

Real connections against a real server: tests/reliability/test_hostile_process.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from app.connections import RESERVED_DESCRIPTORS, ConnectionGuard, Watch, fit_connections
from app.logs import RepeatFilter


class _Transport(asyncio.BaseTransport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _guard(limit: int) -> ConnectionGuard:
    return ConnectionGuard(max_connections=limit, header_timeout_s=10, body_timeout_s=30)


def _open(guard: ConnectionGuard, loop: asyncio.AbstractEventLoop, phase: str) -> Watch:
    watch = Watch(guard, _Transport())
    assert guard.admit(watch)
    watch.enter(phase, object(), loop)  # type: ignore[arg-type]
    return watch


def _closed(watch: Watch) -> bool:
    transport = watch.transport
    assert isinstance(transport, _Transport)
    return transport.closed


def test_at_the_limit_the_connection_that_waited_longest_for_a_head_makes_room(
    loop: asyncio.AbstractEventLoop,
) -> None:
    guard = _guard(3)
    body = _open(guard, loop, "body")
    old, new = _open(guard, loop, "head"), _open(guard, loop, "head")
    newest = _open(guard, loop, "head")
    assert _closed(old) and not any(map(_closed, (body, new, newest)))
    assert guard.open_count == 3 and guard.closed["evicted"] == 1


def test_then_one_whose_body_is_still_arriving(loop: asyncio.AbstractEventLoop) -> None:
    guard = _guard(2)
    busy, slow = _open(guard, loop, "busy"), _open(guard, loop, "body")
    newest = _open(guard, loop, "head")
    assert _closed(slow) and not _closed(busy) and not _closed(newest)


def test_a_connection_serving_a_request_is_never_closed_for_room(
    loop: asyncio.AbstractEventLoop,
) -> None:
    guard = _guard(2)
    busy = [_open(guard, loop, "busy") for _ in range(2)]
    refused = Watch(guard, _Transport())
    assert not guard.admit(refused)
    assert _closed(refused) and not any(map(_closed, busy))
    assert guard.open_count == 2 and guard.closed["refused"] == 1


def test_a_connection_that_moves_on_waits_at_the_end_again(
    loop: asyncio.AbstractEventLoop,
) -> None:
    guard = _guard(2)
    first, second = _open(guard, loop, "head"), _open(guard, loop, "head")
    first.enter("busy", object(), loop)
    first.enter("head", None, loop)  # its reply sent: it waits for its next request
    _open(guard, loop, "head")
    assert _closed(second) and not _closed(first)


def test_a_timer_runs_per_phase_and_more_bytes_of_one_head_keep_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    guard = _guard(4)
    watch = _open(guard, loop, "head")
    timer = watch.timer
    assert timer is not None
    watch.enter("head", watch.cycle, loop)  # more bytes of the same head
    assert watch.timer is timer
    watch.enter("body", object(), loop)
    assert timer.cancelled() and watch.timer is not None
    watch.enter("busy", watch.cycle, loop)
    assert watch.timer is None
    watch.expire("header_timeout")  # as its timer would
    assert _closed(watch) and guard.closed["header_timeout"] == 1 and guard.open_count == 0


def test_forgotten_connections_count_no_more(loop: asyncio.AbstractEventLoop) -> None:
    guard = _guard(1)
    watch = _open(guard, loop, "head")
    guard.forget(watch)
    assert guard.open_count == 0
    assert not _closed(_open(guard, loop, "head")) and not _closed(watch)


@pytest.mark.parametrize(
    ("wanted", "soft", "fits"),
    [
        pytest.param(256, 1024, 256, id="fits"),
        pytest.param(1000, 1024, 1024 - RESERVED_DESCRIPTORS, id="lowered"),
        pytest.param(256, 200, 16, id="at-least-16"),
    ],
)
def test_the_connection_limit_leaves_descriptors_for_the_rest(
    wanted: int, soft: int, fits: int
) -> None:
    assert fit_connections(wanted, soft) == fits


def test_a_repeated_uvicorn_warning_is_passed_once_a_minute_with_a_count() -> None:
    now = [0.0]
    repeats = RepeatFilter(interval_s=60, clock=lambda: now[0])

    def record(level: int = logging.WARNING) -> logging.LogRecord:
        msg = "Invalid HTTP request received."
        return logging.LogRecord("uvicorn.error", level, __file__, 1, msg, None, None)

    assert repeats.filter(record())
    assert not any(repeats.filter(record()) for _ in range(1000))
    assert repeats.filter(record(logging.ERROR))  # errors always pass
    now[0] = 61.0
    passed = record()
    assert repeats.filter(passed)
    assert passed.getMessage().endswith("(1000 more since the last such warning)")
