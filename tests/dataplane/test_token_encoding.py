"""Token forms of a lookup: a JSON list, ``tokens_b64`` and the binary form.

The figures are recorded as test properties (``-rP`` or a JUnit report shows
them); the assertions are about results and sizes, never about timings.
"""

from __future__ import annotations

import json
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, encode_lookup_frame
from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import pack_tokens
from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    post_ok,
    random_tokens,
    register_body,
    store,
    token_field,
    transfer_item,
    vllm_layer,
)

CHUNK = 256
PROMPT_TOKENS = 32768

ClientFactory = Callable[..., CacheClient]


def test_b64_and_json_tokens_agree_and_b64_is_compact(
    make_client: ClientFactory,
    shm_kv: KVFactory,
    record_property: Callable[[str, object], None],
) -> None:
    client = make_client(chunk_size=CHUNK)
    kv = shm_kv([vllm_layer("l0", 0, 80)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=CHUNK))
    tokens = random_tokens(PROMPT_TOKENS, seed=1)
    store(client, "w", transfer_item("s", tokens[: 4 * CHUNK], [list(range(1, 65))]))

    timings: dict[str, list[float]] = {"json": [], "b64": []}
    sizes: dict[str, int] = {}
    for encoding in ("json", "b64"):
        for i in range(7):
            item = {
                "request_id": f"{encoding}-{i}",  # a new request: hashes every chunk
                "namespace": NAMESPACE,
                **token_field(tokens, b64=encoding == "b64"),
            }
            body = json.dumps({"requests": [item]})
            sizes[encoding] = len(body)
            start = time.perf_counter()
            reply = client.post(
                "/cache/lookup", content=body, headers={"content-type": "application/json"}
            )
            timings[encoding].append(time.perf_counter() - start)
            assert reply.status_code == 200
            assert reply.json()["results"][0]["hit_tokens"] == 4 * CHUNK
    medians = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
    record_property("lookup_32k_json_ms", round(medians["json"], 3))
    record_property("lookup_32k_b64_ms", round(medians["b64"], 3))
    record_property("body_json_bytes", sizes["json"])
    record_property("body_b64_bytes", sizes["b64"])
    print(
        f"32k-token lookup: json {medians['json']:.2f} ms ({sizes['json']} B), "
        f"b64 {medians['b64']:.2f} ms ({sizes['b64']} B)"
    )
    # 5.33 characters per token against ~6.6 for 5-digit ids and ", ".
    assert sizes["b64"] < sizes["json"]


@pytest.mark.parametrize("b64", [pytest.param(True, id="b64"), pytest.param(False, id="json")])
def test_both_encodings_name_the_same_chunks(
    make_client: ClientFactory, shm_kv: KVFactory, b64: bool
) -> None:
    client = make_client(chunk_size=64)
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=64))
    tokens = random_tokens(128, seed=2)
    # Stored with one encoding, looked up with the other.
    store(client, "w", transfer_item("s", tokens, [list(range(1, 9))], b64=not b64))
    item = {"request_id": "l", "namespace": NAMESPACE, **token_field(tokens, b64=b64)}
    assert post_ok(client, "/cache/lookup", {"requests": [item]})["results"][0]["hit_tokens"] == 128


# ------------------------------------------------------------------ binary form


def _frame(*items: tuple[str, np.ndarray]) -> bytes:
    header = LookupFrameHeader(
        requests=[
            LookupFrameItem(request_id=rid, namespace=NAMESPACE, num_tokens=len(tokens))
            for rid, tokens in items
        ]
    )
    return encode_lookup_frame(header, [pack_tokens(t.tolist()) for _, t in items])


def _post_frame(client: TestClient, body: bytes, media: str = LOOKUP_FRAME_MEDIA_TYPE) -> Any:
    return client.post("/cache/lookup", content=body, headers={"content-type": media})


def test_binary_form_names_the_same_chunks_and_keeps_item_order(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client(chunk_size=64)
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=64))
    tokens = random_tokens(128, seed=2)
    store(client, "w", transfer_item("s", tokens, [list(range(1, 9))]))  # stored from base64
    other = random_tokens(128, seed=3)
    reply = _post_frame(
        client, _frame(("a", tokens), ("miss", other), ("half", tokens[:100]), ("none", other[:0]))
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [(r["request_id"], r["hit_tokens"]) for r in results] == [
        ("a", 128),
        ("miss", 0),
        ("half", 64),
        ("none", 0),
    ]
    # And a JSON-list lookup of what the frame looked up agrees.
    item = {"request_id": "j", "namespace": NAMESPACE, **token_field(tokens, b64=False)}
    assert post_ok(client, "/cache/lookup", {"requests": [item]})["results"][0]["hit_tokens"] == 128


def test_items_past_the_inline_size_keep_their_place(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items small enough are answered together on the event loop, larger ones one by
    one in the thread pool: the reply keeps the frame's order either way."""
    import app.lookup

    monkeypatch.setattr(app.lookup, "INLINE_LOOKUP_TOKENS", 100)
    client = make_client(chunk_size=64)
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=64))
    tokens = random_tokens(128, seed=6)
    store(client, "w", transfer_item("s", tokens, [list(range(1, 9))]))
    other = random_tokens(128, seed=7)
    items = [
        ("small", tokens[:64]),
        ("large", tokens),
        ("small-miss", other[:70]),
        ("small-half", tokens[:100]),
        ("large-miss", other),
    ]
    reply = _post_frame(client, _frame(*items))
    assert reply.status_code == 200, reply.text
    assert [(r["request_id"], r["hit_tokens"]) for r in reply.json()["results"]] == [
        ("small", 64),
        ("large", 128),
        ("small-miss", 0),
        ("small-half", 64),
        ("large-miss", 0),
    ]


def _refusals() -> list[Any]:
    tokens = np.arange(8, dtype=np.int32)
    good = _frame(("r", tokens))
    negative = good[:-4] + struct.pack("<i", -5)
    header_len = struct.unpack_from("<I", good, 4)[0]
    no_num_tokens = _rebuild_header(good, b'{"requests": [{"request_id": "r", "namespace": "n"}]}')
    return [
        pytest.param(good[:-4], 422, "token section holds 28 bytes", id="short"),
        pytest.param(good + b"\0\0\0\0", 422, "token section holds 36 bytes", id="long"),
        pytest.param(good[:6], 422, "starts with 8 bytes", id="truncated-prefix"),
        pytest.param(b"MPX1" + good[4:], 422, "starts with b'MPL1'", id="magic"),
        pytest.param(
            good[:4] + struct.pack("<I", header_len + 4096) + good[8:],
            422,
            "runs past",
            id="header-length",
        ),
        pytest.param(negative, 422, "negative token id", id="negative-id"),
        pytest.param(no_num_tokens, 422, "header.requests.0.num_tokens", id="header-invalid"),
        pytest.param(_rebuild_header(good, b"{not json"), 422, "header", id="header-not-json"),
    ]


def _rebuild_header(frame: bytes, head: bytes) -> bytes:
    old = struct.unpack_from("<I", frame, 4)[0]
    start = 8 + old + (-old % 4)
    return b"MPL1" + struct.pack("<I", len(head)) + head + b"\0" * (-len(head) % 4) + frame[start:]


@pytest.mark.parametrize(("body", "status", "detail"), _refusals())
def test_malformed_frames_are_refused_with_a_problem_body(
    make_client: ClientFactory, body: bytes, status: int, detail: str
) -> None:
    client = make_client(chunk_size=64)
    reply = _post_frame(client, body)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert problem["type"] == "urn:mpcache:problem:malformed-request"
    assert detail in problem["detail"]
    assert client.get("/health").json()["sessions"] == 0  # refused before any session


@pytest.mark.parametrize(
    "media",
    [
        pytest.param("text/plain", id="text"),
        pytest.param("application/x-www-form-urlencoded", id="form"),
        pytest.param("application/x-protobuf", id="other-binary"),
    ],
)
def test_lookup_in_an_unknown_form_is_415(make_client: ClientFactory, media: str) -> None:
    client = make_client(chunk_size=64)
    reply = _post_frame(client, _frame(("r", np.arange(8, dtype=np.int32))), media)
    assert reply.status_code == 415, reply.text
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert problem["type"] == "urn:mpcache:problem:unsupported-media-type"
    assert LOOKUP_FRAME_MEDIA_TYPE in problem["detail"] and problem["media_type"] == media


def test_json_lookup_errors_keep_their_problem_shape(make_client: ClientFactory) -> None:
    client = make_client(chunk_size=64)
    bad_b64 = {"requests": [{"request_id": "r", "namespace": "n", "tokens_b64": "!!"}]}
    reply = client.post("/cache/lookup", json=bad_b64)
    assert reply.status_code == 422
    assert "not valid base64" in reply.json()["detail"]
    reply = client.post("/cache/lookup", json={"requests": [{"request_id": "r"}]})
    assert reply.status_code == 422
    assert reply.json()["type"] == "urn:mpcache:problem:malformed-request"
    assert "requests.0.namespace" in reply.json()["detail"]
    # No content-type at all is read as JSON, as FastAPI did.
    reply = client.post("/cache/lookup", content=b'{"requests": []}')
    assert reply.status_code == 200 and reply.json() == {"results": []}


def test_binary_form_sent_in_pieces(make_client: ClientFactory, shm_kv: KVFactory) -> None:
    """The connector streams its frames (chunked, packed as sent): same answers."""
    from contract.frames import lookup_frame_parts

    client = make_client(chunk_size=64)
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=64))
    tokens = random_tokens(128, seed=4)
    store(client, "w", transfer_item("s", tokens, [list(range(1, 9))]))
    items = [("a", tokens), ("b", tokens[:64]), ("c", random_tokens(100, seed=5))]
    header = LookupFrameHeader(
        requests=[
            LookupFrameItem(request_id=rid, namespace=NAMESPACE, num_tokens=len(t))
            for rid, t in items
        ]
    )
    parts = lookup_frame_parts(header, (pack_tokens(t.tolist()) for _, t in items))
    reply = client.post(
        "/cache/lookup", content=parts, headers={"content-type": LOOKUP_FRAME_MEDIA_TYPE}
    )
    assert reply.status_code == 200, reply.text
    assert [r["hit_tokens"] for r in reply.json()["results"]] == [128, 64, 0]
