"""Session ends on their way to each server: a failed call keeps its ids for that
server's next round, a refusal does not, and what is kept is bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from connector import session_ends
from connector.errors import ServerError, ServerFailure, ServerRejected, ServerTimeout
from connector.session_ends import SessionEnds
from contract.schemas import EndSessionsRequest

A, B = "http://a:1", "http://b:2"


class Client:
    """A server's client: records each call's ids; call n (from 1) raises ``fail[n]``."""

    def __init__(self, fail: dict[int, ServerError] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail or {}

    def _end(self, body: EndSessionsRequest) -> None:
        self.calls.append(list(body.request_ids))
        error = self.fail.get(len(self.calls))
        if error is not None:
            raise error

    async def end_sessions(self, body: EndSessionsRequest) -> None:
        self._end(body)

    def ended(self) -> list[str]:
        """The ids of every call that did not fail, in order."""
        return [rid for call in self.calls for rid in call]


class SyncClient(Client):
    def end_sessions(self, body: EndSessionsRequest) -> None:  # type: ignore[override]
        self._end(body)


def _round(ends: SessionEnds, clients: dict[str, Any], healthy: bool = True) -> None:
    asyncio.run(ends.send(clients, lambda url: healthy))


def test_a_server_whose_call_failed_gets_its_ends_next_round_and_the_other_at_once() -> None:
    a, b = Client({1: ServerTimeout("timed out", url=A)}), Client()
    ends = SessionEnds([A, B])
    ends.put(["r1"])
    _round(ends, {A: a, B: b})
    assert b.calls == [["r1"]]  # a's failure cost b nothing
    ends.put(["r2"])
    _round(ends, {A: a, B: b})
    assert a.calls == [["r1"], ["r1", "r2"]]  # the kept end first, in one call
    assert b.calls == [["r1"], ["r2"]]
    _round(ends, {A: a, B: b})  # nothing owed: no call
    assert len(a.calls) == 2 and len(b.calls) == 2


def test_a_5xx_is_retried_a_refusal_is_not() -> None:
    failing = Client({1: ServerFailure("503", url=A, status=503)})
    refusing = Client({1: ServerRejected("422", url=B, status=422)})
    ends = SessionEnds([A, B])
    ends.put(["r1"])
    _round(ends, {A: failing, B: refusing})
    _round(ends, {A: failing, B: refusing})
    assert failing.calls == [["r1"], ["r1"]]
    assert refusing.calls == [["r1"]]
    assert ends.dropped == 1


def test_an_unhealthy_server_is_not_called_and_keeps_its_ends() -> None:
    a = Client()
    ends = SessionEnds([A])
    ends.put(["r1"])
    _round(ends, {A: a}, healthy=False)
    assert a.calls == []
    _round(ends, {A: a})
    assert a.calls == [["r1"]]


def test_ends_go_in_batches_and_a_failed_batch_keeps_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(session_ends, "BATCH", 2)
    a = Client({2: ServerTimeout("timed out", url=A)})
    ends = SessionEnds([A])
    ends.put([f"r{i}" for i in range(5)])
    _round(ends, {A: a})
    assert a.calls == [["r0", "r1"], ["r2", "r3"]]  # stopped at the failed batch
    _round(ends, {A: a})
    assert a.calls[2:] == [["r2", "r3"], ["r4"]]


def test_what_a_server_keeps_is_bounded_and_the_newest_survive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(session_ends, "RETRY_CAP", 3)
    a = Client()
    ends = SessionEnds([A])
    for i in range(5):
        ends.put([f"r{i}"])
        _round(ends, {A: a}, healthy=False)
    assert ends.dropped == 2
    _round(ends, {A: a})
    assert a.calls == [["r2", "r3", "r4"]]


def test_flush_at_shutdown_ends_kept_and_queued_ids_on_healthy_servers_only() -> None:
    ends = SessionEnds([A, B])
    ends.put(["r1"])
    _round(ends, {A: Client({1: ServerTimeout("timed out", url=A)}), B: Client()})  # A keeps r1
    ends.put(["r2"])
    a, b = SyncClient(), SyncClient()
    ends.flush({A: a, B: b}, lambda url: url == A, extra=["r0"])  # type: ignore[dict-item]
    assert a.calls == [["r1", "r0", "r2"]]
    assert b.calls == []


def test_a_queue_longer_than_the_contract_admits_still_ends_every_session() -> None:
    """The contract admits 65536 ids a call: a longer queue (a loop that stalled)
    goes out in several calls instead of failing to build one."""
    a = Client()
    ends = SessionEnds([A])
    ids = [f"r{i}" for i in range(65537)]
    ends.put(ids)
    _round(ends, {A: a})
    assert a.ended() == ids
    assert max(len(call) for call in a.calls) <= session_ends.BATCH
