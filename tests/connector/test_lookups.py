"""The lookup path's own units: the lookup area's life cycle, the shared set-up, the
failure log (the protocol itself is driven through the adapter in
test_scheduler_adapter.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from connector.config import ConnectorConfig
from connector.errors import (
    ConnectorError,
    ServerRejected,
    ServerUnreachable,
    StartupError,
)
from connector.failures import FailureLog
from connector.lookups import _AREA_RETRY_S, _AreaSlot
from connector.servers import close_links, join, negotiate_request, open_links
from tests.connector.fakes import FakeServer

URL = "http://fake:8000"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _RefusingClient:
    """A client whose lookup-area registration fails with ``error`` (counted)."""

    timeout_s = 0.5

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.tries = 0

    def registration_info(self) -> Any:
        self.tries += 1
        raise self.error


def _slot(client: _RefusingClient, clock: _Clock, *, enabled: bool = True) -> _AreaSlot:
    return _AreaSlot(URL, client, enabled=enabled, clock=clock)  # type: ignore[arg-type]


def test_a_failed_area_registration_is_retried_after_the_retry_interval() -> None:
    client, clock = _RefusingClient(ServerUnreachable("down", url=URL)), _Clock()
    slot = _slot(client, clock)
    slot.setup()
    assert slot.ready(64) is None and client.tries == 1  # not due yet: the body form
    clock.now += _AREA_RETRY_S - 1
    assert slot.ready(64) is None and client.tries == 1
    clock.now += 1
    assert slot.ready(64) is None and client.tries == 2  # due: tried again
    slot.close()


@pytest.mark.parametrize("status", [404, 405])
def test_a_server_without_lookup_areas_is_never_asked_again(status: int) -> None:
    client, clock = _RefusingClient(ServerRejected("no", url=URL, status=status)), _Clock()
    slot = _slot(client, clock)
    slot.setup()
    clock.now += 100 * _AREA_RETRY_S
    assert slot.ready(64) is None and client.tries == 1


def test_a_forgotten_area_is_replaced_at_the_next_batch() -> None:
    client, clock = _RefusingClient(ServerUnreachable("down", url=URL)), _Clock()
    slot = _slot(client, clock)
    slot.setup()
    slot.forget()  # a call through the area failed: the next batch tries at once
    assert slot.ready(64) is None and client.tries == 2


def test_a_disabled_slot_never_registers() -> None:
    client, clock = _RefusingClient(ServerUnreachable("down", url=URL)), _Clock()
    slot = _slot(client, clock, enabled=False)
    assert slot.ready(64) is None and client.tries == 0


def _config(*servers: FakeServer) -> ConnectorConfig:
    return ConnectorConfig(server_urls=tuple(s.url for s in servers), startup_timeout_s=0.3)


def test_join_agrees_checks_the_layout_and_marks_every_server_healthy() -> None:
    a, b = FakeServer("http://a:1", 256), FakeServer("http://b:2", 200)
    by_url = {s.url: s for s in (a, b)}
    links = open_links(
        [a.url, b.url], _config(a, b), lambda url: by_url[url].transport(), role="test"
    )
    try:
        assert not any(link.healthy for link in links.values())
        request = negotiate_request(96, model="m", role="scheduler", instance_id="i")
        assert join(links, request, timeout_s=0.3, spans=[32, 48]) == 288
        assert [link.boot_id for link in links.values()] == [a.boot_id, b.boot_id]
    finally:
        close_links(links)


def test_join_hands_each_answer_to_agree() -> None:
    """The worker's rule: its one server's error, in its own words."""
    server = FakeServer()
    server.up = False
    links = open_links([server.url], _config(server), lambda url: server.transport(), role="w")
    seen: dict[str, int | ConnectorError] = {}

    def agree(answers: Any) -> int:
        seen.update(answers)
        raise StartupError("mine")

    try:
        request = negotiate_request(16, model="m", role="worker", instance_id="i/0")
        with pytest.raises(StartupError, match="mine"):
            join(links, request, timeout_s=0.05, spans=[16], agree=agree)
        assert isinstance(seen[server.url], ServerUnreachable)
        assert not links[server.url].healthy
    finally:
        close_links(links)


def test_failure_log_reports_each_kind_in_full_once(caplog: pytest.LogCaptureFixture) -> None:
    log = FailureLog(logging.getLogger("mpcache.connector"))
    error = ValueError("bad")
    with caplog.at_level(logging.DEBUG, logger="mpcache.connector"):
        log("a", "first %s", "a", exc=error)
        log("a", "again %s", "a", exc=error)
        log("b", "first %s", "b", exc=None)
    levels = [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert levels == [
        (logging.ERROR, "first a", True),
        (logging.DEBUG, "again a", False),
        (logging.ERROR, "first b", False),
    ]
