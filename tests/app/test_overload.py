"""Overload and hostile input, in process (issue 8, items 4 and 5).

Body limit (413 problem JSON, declared or streamed), bodies that are not UTF-8
(422, never an undocumented 400), bounded session memory (503 when full), and
store/retrieve stopping at shutdown. Real processes: tests/reliability.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from contract.tokens import encode_tokens
from tests.app.conftest import MakeClient

PROBLEM = "application/problem+json"


def _problem(reply: Any, status: int, slug: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == PROBLEM
    body: dict[str, Any] = reply.json()
    assert body["type"] == f"urn:mpcache:problem:{slug}"
    assert body["status"] == status
    return body


def _negotiated(make_client: MakeClient, **settings: Any) -> TestClient:
    client = make_client(chunk_size=16, pool_prefault=False, **settings)
    assert client.post("/negotiate", json={"required_alignment": 16}).status_code == 200
    return client


def _lookup_body(request_id: str, num_tokens: int) -> dict[str, Any]:
    tokens = np.arange(num_tokens, dtype=np.int32) % 1000
    item = {"request_id": request_id, "namespace": "ns", "tokens_b64": encode_tokens(tokens)}
    return {"requests": [item]}


# ------------------------------------------------------------------- body limit


@pytest.mark.parametrize("path", ["/negotiate", "/cache/lookup", "/cache/store", "/register"])
def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read(
    make_client: MakeClient, path: str
) -> None:
    client = make_client(max_body_size="64KiB", pool_prefault=False)
    body = b'{"x": "' + b"a" * (80 << 10) + b'"}'
    reply = client.post(path, content=body, headers={"content-type": "application/json"})
    problem = _problem(reply, 413, "payload-too-large")
    assert problem["max_body_bytes"] == 64 << 10
    assert "--max-body-size" in problem["detail"]


def test_a_chunked_body_over_the_limit_is_413_as_it_streams(make_client: MakeClient) -> None:
    client = _negotiated(make_client, max_body_size="64KiB")
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"requests": [{"request_id": "r", "namespace": "ns", "tokens": ['
        for _ in range(1000):  # 8 MB in all, if it were all read
            sent += 1
            yield b"1," * 4096
        yield b"1]}]}"

    reply = client.post(
        "/cache/lookup", content=chunks(), headers={"content-type": "application/json"}
    )
    _problem(reply, 413, "payload-too-large")
    assert client.get("/health").json()["sessions"] == 0


def test_a_body_under_the_limit_is_served(make_client: MakeClient) -> None:
    client = _negotiated(make_client, max_body_size="64KiB")
    reply = client.post("/cache/lookup", json=_lookup_body("r", 4000))
    assert reply.status_code == 200, reply.text


# ------------------------------------------------------------- bytes, not text


NOT_UTF8 = b'{"required_alignment": 16, "model": "\xff\xfe"}'


@pytest.mark.parametrize(
    "path",
    ["/negotiate", "/register", "/cache/lookup", "/cache/store", "/cache/retrieve", "/cache/end"],
)
def test_a_body_that_is_not_utf8_is_a_documented_422(make_client: MakeClient, path: str) -> None:
    client = _negotiated(make_client)
    reply = client.post(path, content=NOT_UTF8, headers={"content-type": "application/json"})
    _problem(reply, 422, "malformed-request")
    documented = client.get("/openapi.json").json()["paths"][path]["post"]["responses"]
    assert "422" in documented


def test_a_large_body_is_decoded_off_the_event_loop_and_checked_the_same(
    make_client: MakeClient,
) -> None:
    client = _negotiated(make_client)
    big = _lookup_body("big", 200_000)  # > INLINE_BODY_BYTES: the helper process decodes it
    big["requests"][0]["tokens"] = [int(t) for t in range(200_000)]
    del big["requests"][0]["tokens_b64"]
    reply = client.post("/cache/lookup", json=big)
    assert reply.status_code == 200, reply.text
    assert reply.json()["results"] == [{"request_id": "big", "hit_tokens": 0}]
    big["requests"][0]["tokens"][-1] = -1  # the helper's validation errors are 422s too
    bad = client.post("/cache/lookup", json=big)
    body = _problem(bad, 422, "malformed-request")
    assert "tokens" in body["detail"]


# -------------------------------------------------------------- session memory


def test_never_ended_lookups_are_bounded_and_refused_with_503_when_full(
    make_client: MakeClient,
) -> None:
    # Each 8k-token lookup charges ~66 KiB (ids and 16-token chunk keys): 160 KiB holds two.
    client = _negotiated(make_client, session_memory="160KiB", lease_ttl_s=3600)
    for i in range(2):
        assert client.post("/cache/lookup", json=_lookup_body(f"r{i}", 8192)).status_code == 200
    reply = client.post("/cache/lookup", json=_lookup_body("r2", 8192))
    problem = _problem(reply, 503, "sessions-full")
    assert reply.headers["retry-after"]
    assert "POST /cache/end" in problem["detail"]
    assert client.get("/health").json()["sessions"] == 2
    # Ending a finished request makes room at once.
    assert client.post("/cache/end", json={"request_ids": ["r0"]}).json() == {"ended": 1}
    assert client.post("/cache/lookup", json=_lookup_body("r2", 8192)).status_code == 200


def test_idle_sessions_make_room_for_new_ones(make_client: MakeClient) -> None:
    # lease_ttl_s=0: a session is evictable as soon as it is idle.
    client = _negotiated(make_client, session_memory="160KiB", lease_ttl_s=0)
    for i in range(20):
        assert client.post("/cache/lookup", json=_lookup_body(f"r{i}", 8192)).status_code == 200
    assert client.get("/health").json()["sessions"] <= 2


def test_one_request_larger_than_all_session_memory_is_422(make_client: MakeClient) -> None:
    client = _negotiated(make_client, session_memory="16KiB")
    reply = client.post("/cache/lookup", json=_lookup_body("huge", 8192))
    assert "--session-memory" in _problem(reply, 422, "invalid-request")["detail"]


def test_the_session_count_is_capped(make_client: MakeClient) -> None:
    client = _negotiated(make_client, max_sessions=3, lease_ttl_s=3600)
    for i in range(3):
        assert client.post("/cache/lookup", json=_lookup_body(f"r{i}", 16)).status_code == 200
    _problem(client.post("/cache/lookup", json=_lookup_body("r3", 16)), 503, "sessions-full")
    # A session that exists is served: the cap is on new ones.
    assert client.post("/cache/lookup", json=_lookup_body("r1", 32)).status_code == 200


# ----------------------------------------------------------------- shutdown


def test_shutdown_stops_a_long_store_at_its_next_chunk(make_client: MakeClient) -> None:
    """A store copying when the server shuts down commits no further chunk."""
    from app.state import Runtime

    client = _negotiated(make_client)
    runtime: Runtime = client.app.state.runtime  # type: ignore[attr-defined]
    cache = runtime.cache
    entered, release = threading.Event(), threading.Event()

    class _Reg:
        rank = 0

    def fake_store_item(reg: object, it: object, size: int, deadline: float | None) -> Any:
        # One chunk "copying" until released, then the loop's check for the next.
        entered.set()
        release.wait(60)
        return None, cache.transfers.deadline(deadline, None).passed()

    result: dict[str, Any] = {}

    def run() -> None:
        with cache.transfers.admit("store"):
            result["stopped"] = fake_store_item(_Reg(), None, 16, None)[1]

    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(60)
    stopper = threading.Thread(target=lambda: result.update(left=cache.stop_transfers(60)))
    stopper.start()
    # While the store still runs, shutdown waits for it...
    assert not result.get("left") and stopper.is_alive()
    release.set()
    worker.join(60)
    stopper.join(60)
    assert result == {"stopped": True, "left": 0}  # ...and it stopped at its next chunk
    # New transfers are refused once shutdown began.
    reply = client.post("/cache/store", json={"instance_id": "i", "rank": 0, "requests": []})
    _problem(reply, 503, "unavailable")


def test_stop_transfers_waits_no_longer_than_its_deadline(make_client: MakeClient) -> None:
    client = _negotiated(make_client)
    cache = client.app.state.runtime.cache  # type: ignore[attr-defined]
    with cache.transfers.admit("store"):  # a copy that never ends
        assert cache.stop_transfers(0.01) == 1
    assert cache.stop_transfers(0.01) == 0
