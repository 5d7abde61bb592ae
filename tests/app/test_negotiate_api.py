"""POST /negotiate, GET /chunk-size and GET /health through the HTTP API."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.hashing import TokenHasher
from app.main import create_app
from app.settings import Settings
from tests.app.conftest import MakeClient


def negotiate(client: TestClient, alignment: Any, **extra: Any) -> httpx.Response:
    return client.post("/negotiate", json={"required_alignment": alignment, **extra})


def assert_unselected(client: TestClient) -> None:
    body = client.get("/chunk-size").json()
    assert body["chunk_size"] is None and body["final"] is False
    assert body["alignments"] == []
    assert client.get("/health").json()["chunk_size"] is None


def assert_problem(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = reply.json()
    assert body["status"] == status
    assert body["type"].startswith("urn:mpcache:problem:")
    assert body["title"] and body["detail"]
    return body


@pytest.mark.parametrize(
    ("min_chunk_size", "alignment", "expected"),
    [
        pytest.param(256, 256, 256, id="256->256"),
        pytest.param(256, 544, 544, id="544->544"),
        pytest.param(600, 544, 1088, id="544-min600->1088"),
        pytest.param(256, 96, 288, id="spans32+48->96->288"),
    ],
)
def test_seed_examples(
    make_client: MakeClient, min_chunk_size: int, alignment: int, expected: int
) -> None:
    client = make_client(chunk_size=min_chunk_size)
    reply = negotiate(client, alignment, model="m", role="scheduler", instance_id="e0")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["chunk_size"] == expected
    assert body["min_chunk_size"] == min_chunk_size
    assert body["required_alignment"] == alignment
    assert body["boot_id"] == client.get("/health").json()["boot_id"]
    state = client.get("/chunk-size").json()
    assert state["chunk_size"] == expected and state["final"] is True
    assert state["alignments"] == [alignment]
    assert set(state["bindings"].values()) <= {"done", "disabled"}


def test_size_is_immutable_across_models(client: TestClient) -> None:
    assert negotiate(client, 96).json()["chunk_size"] == 288
    assert negotiate(client, 48).json()["chunk_size"] == 288  # compatible second model
    body = assert_problem(negotiate(client, 64), 409)
    assert body["chunk_size"] == 288 and body["required_alignment"] == 64
    assert "288" in body["detail"] and "64" in body["detail"]
    assert "separate" in body["detail"]
    state = client.get("/chunk-size").json()
    assert state["chunk_size"] == 288 and state["alignments"] == [96, 48]


def test_reads_never_select(client: TestClient) -> None:
    for _ in range(3):
        assert_unselected(client)
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["final"] is False
    bindings = client.get("/chunk-size").json()["bindings"]
    assert bindings == {
        "token_hasher": "pending",
        "session_manager": "pending",
        "blend_matcher": "disabled",
        "telemetry": "pending",
        "disk_tier": "disabled",
        "coordinator": "pending",
    }
    # The first negotiation after the reads still selects freely.
    assert negotiate(client, 544).json()["chunk_size"] == 544


BAD_BODIES = [
    pytest.param({"required_alignment": 0}, "required_alignment", id="zero"),
    pytest.param({"required_alignment": -96}, "required_alignment", id="negative"),
    pytest.param({"required_alignment": "96"}, "required_alignment", id="string"),
    pytest.param({"required_alignment": 96.5}, "required_alignment", id="fraction"),
    pytest.param({"required_alignment": True}, "required_alignment", id="bool"),
    pytest.param({"required_alignment": None}, "required_alignment", id="null"),
    pytest.param({"required_alignment": 10**30}, "max_chunk_size", id="absurdly-large"),
    pytest.param({"required_alignment": 70000}, "max_chunk_size 65536", id="above-max"),
    pytest.param({}, "required_alignment: Field required", id="missing-field"),
    pytest.param({"required_alignment": 96, "role": "driver"}, "role", id="bad-role"),
    pytest.param({"required_alignment": 96, "typo": 1}, "typo", id="unknown-field"),
    pytest.param([96], "body", id="not-an-object"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_BODIES)
def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    client: TestClient, body: Any, needle: str
) -> None:
    problem = assert_problem(client.post("/negotiate", json=body), 422)
    assert needle in problem["detail"]
    assert_unselected(client)
    # After a size is final, bad input still changes nothing.
    assert negotiate(client, 96).json()["chunk_size"] == 288
    assert_problem(client.post("/negotiate", json=body), 422)
    assert client.get("/chunk-size").json()["alignments"] == [96]


def test_an_integral_number_is_an_integer(client: TestClient) -> None:
    # JSON has one number type and JSON Schema counts 96.0 as an integer: the schema
    # says "integer", so the server takes it as 96 (strings, bools, 96.5 stay 422).
    reply = client.post("/negotiate", json={"required_alignment": 96.0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["chunk_size"] == 288


def test_malformed_json(client: TestClient) -> None:
    reply = client.post(
        "/negotiate",
        content=b'{"required_alignment": 9',
        headers={"content-type": "application/json"},
    )
    problem = assert_problem(reply, 422)
    assert "JSON" in problem["detail"]
    assert_unselected(client)


def test_absurd_alignment_names_the_bound(client: TestClient) -> None:
    problem = assert_problem(negotiate(client, 10**30), 422)
    assert "max_chunk_size" in problem["detail"]


def test_unknown_route_is_a_problem(client: TestClient) -> None:
    assert_problem(client.get("/nope"), 404)


@pytest.mark.anyio
async def test_concurrent_negotiations_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    bind_calls: list[int] = []
    original = TokenHasher.bind

    def counting_bind(self: TokenHasher, chunk_size: int) -> None:
        bind_calls.append(chunk_size)
        original(self, chunk_size)

    monkeypatch.setattr(TokenHasher, "bind", counting_bind)
    app = create_app(Settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            replies = await asyncio.gather(
                *(
                    http.post("/negotiate", json={"required_alignment": 96, "instance_id": f"w{i}"})
                    for i in range(32)
                )
            )
            state = (await http.get("/chunk-size")).json()
    assert [r.status_code for r in replies] == [200] * 32
    assert {r.json()["chunk_size"] for r in replies} == {288}
    assert len({r.json()["boot_id"] for r in replies}) == 1
    assert bind_calls == [288]  # bound once, however many callers raced
    assert state["chunk_size"] == 288 and state["alignments"] == [96]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_metrics_report_size_and_outcomes(client: TestClient) -> None:
    negotiate(client, 96)
    negotiate(client, 64)
    negotiate(client, 0)
    text = client.get("/metrics").text
    assert "mpcache_chunk_size_tokens 288.0" in text
    assert 'mpcache_negotiations_total{outcome="ok"} 1.0' in text
    assert 'mpcache_negotiations_total{outcome="incompatible"} 1.0' in text
