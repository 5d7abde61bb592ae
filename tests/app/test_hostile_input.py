"""Hostile input, in process (issue 25): bodies decoded off the event loop, small
error replies, strings checked to what they can be, a bounded label set.

Real processes (``/health`` while such bodies are handled, idle connections, session
memory against RSS): tests/reliability/test_hostile_process.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.bodies import INLINE_BODY_BYTES, BodyParser
from app.problems import MAX_REPORTED_ERRORS
from contract.schemas import LookupFrameHeader, RegisterRequest
from tests.app.conftest import MakeClient

PROBLEM = "application/problem+json"
FEW_KB = 4096
"""What a 422 may weigh, whatever its request held."""


def _negotiated(make_client: MakeClient, **settings: Any) -> TestClient:
    client = make_client(chunk_size=16, pool_prefault=False, **settings)
    assert client.post("/negotiate", json={"required_alignment": 16}).status_code == 200
    return client


def _malformed(reply: Any) -> dict[str, Any]:
    assert reply.status_code == 422, reply.text
    assert reply.headers["content-type"] == PROBLEM
    body: dict[str, Any] = reply.json()
    assert body["type"] == "urn:mpcache:problem:malformed-request"
    return body


def _register(**overrides: Any) -> dict[str, Any]:
    tensor = {
        "transport": "memfd",
        "ticket": "no-such-ticket",
        "offset_bytes": 0,
        "shape": [2, 4, 16, 8, 128],
        "stride": [65536, 16384, 1024, 128, 1],
        "dtype": "bfloat16",
        "block_dim": 1,
    }
    body: dict[str, Any] = {
        "instance_id": "w",
        "rank": 0,
        "chunk_size": 16,
        "namespace": "ns",
        "groups": [{"group_id": 0, "kind": "attention", "token_span": 16}],
        "layers": [{"name": "l0", "group_id": 0, "tensors": [tensor]}],
    }
    body.update(overrides)
    return body


def _spy_on_the_decoder(client: TestClient) -> list[type[Any]]:
    """The models the runtime's helper process decodes from now on."""
    parser: BodyParser = client.app.state.runtime.parser  # type: ignore[attr-defined]
    decoded: list[type[Any]] = []
    decode = parser.decode

    async def spy(model: type[Any], raw: bytes) -> Any:
        decoded.append(model)
        return await decode(model, raw)

    parser.decode = spy  # type: ignore[method-assign]
    return decoded


# ------------------------------------------------------------ off the event loop


def test_a_large_registration_is_decoded_off_the_event_loop(make_client: MakeClient) -> None:
    client = _negotiated(make_client)
    decoded = _spy_on_the_decoder(client)
    groups = [{"group_id": i, "kind": "attention", "token_span": 16} for i in range(5000)]
    body = json.dumps(_register(groups=groups)).encode()
    assert len(body) > INLINE_BODY_BYTES
    reply = client.post("/register", content=body, headers={"content-type": "application/json"})
    problem = _malformed(reply)
    assert decoded == [RegisterRequest]
    assert problem["errors"][0]["type"] == "too_long"  # groups past MAX_GROUPS


def test_a_large_frame_header_is_decoded_off_the_event_loop(make_client: MakeClient) -> None:
    client = _negotiated(make_client)
    decoded = _spy_on_the_decoder(client)
    items = [{"request_id": f"r{i}", "namespace": "ns", "num_tokens": 1} for i in range(3000)]
    head = json.dumps({"requests": items}).encode()
    assert len(head) > INLINE_BODY_BYTES
    tokens = b"\x07\x00\x00\x00" * len(items)
    frame = b"MPL1" + len(head).to_bytes(4, "little") + head + b"\0" * (-len(head) % 4) + tokens
    reply = client.post(
        "/cache/lookup", content=frame, headers={"content-type": "application/octet-stream"}
    )
    assert reply.status_code == 200, reply.text
    assert decoded == [LookupFrameHeader]
    assert len(reply.json()["results"]) == len(items)


# ------------------------------------------------------------ small error replies


def _json_post(client: TestClient, path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(
            "/cache/lookup",
            b'{"requests": [{"request_id": "r", "namespace": "ns", "tokens": ['
            + b",".join([b"-1"] * 300_000)
            + b"]}]}",
            id="lookup-300k-negative-tokens",
        ),
        pytest.param(
            "/register",
            json.dumps(_register(groups=[1] * 300_000)).encode(),
            id="register-300k-bad-groups",
        ),
        pytest.param(
            "/cache/lookup",
            json.dumps({"requests": [{}] * 4096}).encode(),
            id="lookup-4096-empty-items",
        ),
        pytest.param(
            "/cache/end",
            json.dumps({"request_ids": ["x" * 1000] * 20_000}).encode(),
            id="end-20k-long-ids",
        ),
        pytest.param(
            "/negotiate",
            json.dumps({f"unknown-{i}-" + "k" * 500: 1 for i in range(2000)}).encode(),
            id="negotiate-2000-long-unknown-keys",
        ),
    ],
)
def test_a_422_stays_small_whatever_the_body(
    make_client: MakeClient, path: str, body: bytes
) -> None:
    client = _negotiated(make_client)
    reply = _json_post(client, path, body)
    problem = _malformed(reply)
    assert len(reply.content) < FEW_KB, len(reply.content)
    assert len(problem["errors"]) <= MAX_REPORTED_ERRORS
    assert problem["error_count"] >= len(problem["errors"])


def test_a_422_says_how_many_errors_it_did_not_list(make_client: MakeClient) -> None:
    client = _negotiated(make_client)
    body = {f"unknown{i}": 1 for i in range(40)}
    problem = _malformed(client.post("/negotiate", json=body))
    assert problem["error_count"] == 41  # 40 unknown fields, and required_alignment missing
    assert len(problem["errors"]) == MAX_REPORTED_ERRORS
    assert problem["detail"].endswith(f"and {41 - MAX_REPORTED_ERRORS} more error(s)")


# ------------------------------------------------------------------ strings


_REGISTER_STRINGS = [
    ("instance_id",),
    ("namespace",),
    ("layers", 0, "name"),
    ("layers", 0, "tensors", 0, "ticket"),
    ("layers", 0, "tensors", 0, "dtype"),
]


def _with_raw_string(body: dict[str, Any], where: tuple[Any, ...], raw: str) -> bytes:
    """``body`` as JSON with the string at ``where`` replaced by the JSON text ``raw``."""
    marker = "\u2603marker\u2603"
    node = body
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = marker
    return json.dumps(body).replace(json.dumps(marker), raw).encode()


@pytest.mark.parametrize("raw", [r'"\ud800"', r'"\udfff\ud800"', r'"\u0000"', r'"a\nb"'])
@pytest.mark.parametrize("where", _REGISTER_STRINGS, ids=lambda w: ".".join(map(str, w)))
def test_a_bad_string_in_a_registration_is_a_422(
    make_client: MakeClient, where: tuple[Any, ...], raw: str
) -> None:
    """Was: a lone surrogate as a dtype reached the registry and became a 500 (or a
    dropped connection); now every string field is checked by the model."""
    client = _negotiated(make_client)
    body = _with_raw_string(_register(), where, raw)
    reply = _json_post(client, "/register", body)
    assert reply.status_code == 422, reply.text
    assert reply.headers["content-type"] == PROBLEM


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("namespace", "m\u00e9trique", id="namespace-non-ascii"),
        pytest.param("namespace", "a\tb", id="namespace-tab"),
        pytest.param("dtype", "complex64", id="dtype-unknown"),
        pytest.param("ticket", "fd:3", id="ticket-not-url-safe"),
        pytest.param("instance_id", "w\x1b[2J", id="instance-control-character"),
    ],
)
def test_string_fields_take_only_what_they_can_be(
    make_client: MakeClient, field: str, value: str
) -> None:
    client = _negotiated(make_client)
    body = _register()
    if field in ("dtype", "ticket"):
        body["layers"][0]["tensors"][0][field] = value
    else:
        body[field] = value
    problem = _malformed(client.post("/register", json=body))
    assert field in problem["detail"]


def test_request_ids_and_salts_take_any_text(make_client: MakeClient) -> None:
    """They come from vLLM's users unchanged: refusing one would fail its batch."""
    client = _negotiated(make_client)
    item = {"request_id": "r\n\u00e9\u2603", "namespace": "ns", "cache_salt": "s\x00\u00e9"}
    reply = client.post("/cache/lookup", json={"requests": [{**item, "tokens": [1, 2]}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["results"][0]["request_id"] == item["request_id"]


def test_a_tensor_names_its_transport(make_client: MakeClient) -> None:
    """The schema says ``transport`` is required, and the server requires it."""
    client = _negotiated(make_client)
    body = _register()
    del body["layers"][0]["tensors"][0]["transport"]
    _malformed(client.post("/register", json=body))
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("MemfdTensor", "CudaIpcTensor"):
        assert "transport" in schema[name]["required"]
        assert "default" not in schema[name]["properties"]["transport"]


@pytest.mark.parametrize("value", ['"1"', "true", "0", "-1", "3601"])
def test_timeout_s_is_a_number_of_seconds(make_client: MakeClient, value: str) -> None:
    client = _negotiated(make_client)
    body = b'{"instance_id": "w", "rank": 0, "requests": [], "timeout_s": ' + value.encode() + b"}"
    problem = _malformed(_json_post(client, "/cache/store", body))
    assert "timeout_s" in problem["detail"]


def test_the_served_schema_bounds_the_alignment_by_the_servers_max_chunk_size(
    make_client: MakeClient,
) -> None:
    client = make_client(max_chunk_size=4096, pool_prefault=False)
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["NegotiateRequest"]["properties"]["required_alignment"]["maximum"] == 4096
    reply = client.post("/negotiate", json={"required_alignment": 4097})
    assert reply.status_code == 422


# --------------------------------------------------------------------- metrics


def test_metrics_stay_the_same_size_whatever_methods_and_paths_clients_send(
    make_client: MakeClient,
) -> None:
    """Was: each made-up method became a label value, and /metrics grew without end."""
    client = make_client(pool_prefault=False)

    def scrape() -> tuple[int, int]:
        text = client.get("/metrics").text
        series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        return series, len(text)

    for i in range(3):  # one of each kind, so that each kind's series exist
        client.request(f"X{i}", "/health")
        client.request(f"X{i}", f"/made/up/{i}")
        client.get(f"/no/such/{i}")
    scrape()  # and the scrape's own
    series, size = scrape()
    for i in range(3000):
        client.request(f"XABC{i:05d}", "/health" if i % 2 else f"/made/up/{i}")
    after_series, after_size = scrape()
    assert after_series == series
    assert after_size < size * 1.02  # only the counts grew a few digits
    text = client.get("/metrics").text
    assert "XABC" not in text and "/made/up" not in text
    assert 'method="other"' in text and 'route="other"' in text
