"""Token encoding: a JSON list vs ``tokens_b64`` (little-endian int32), measured.

The figures are recorded as test properties (``-rP`` or a JUnit report shows
them); the assertions are about results and sizes, never about timings.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.dataplane.support import (
    NAMESPACE,
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

ClientFactory = Callable[..., TestClient]


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
