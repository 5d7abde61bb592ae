"""The CacheBlend matcher: position-independent chunk matches, kept in step with the pool."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from fastapi.testclient import TestClient

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

CHUNK = 64
ClientFactory = Callable[..., CacheClient]


def _match(client: TestClient, tokens: np.ndarray) -> list[bool]:
    body = {"namespace": NAMESPACE, **token_field(tokens)}
    reply = post_ok(client, "/cache/blend/match", body)
    assert reply["chunk_size"] == CHUNK
    assert [c["start_token"] for c in reply["chunks"]] == [
        i * CHUNK for i in range(len(reply["chunks"]))
    ]
    return [c["cached"] for c in reply["chunks"]]


def test_blend_finds_chunks_at_other_positions_and_forgets_evicted_ones(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    # Room for two 4 KiB entries.
    client = make_client(enable_blend=True, pool_size=8192)
    assert client.get("/chunk-size").json()["bindings"]["blend_matcher"] == "done"
    kv = shm_kv([vllm_layer("l0", 0, 32)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=CHUNK))
    doc, a, b = (random_tokens(CHUNK, seed=s) for s in (1, 2, 3))

    store(client, "w", transfer_item("s1", np.concatenate([a, doc]), [list(range(1, 9))]))
    # ``doc`` was cached as chunk 1 of [a, doc]; here it is chunk 0 of [doc, b].
    assert _match(client, np.concatenate([doc, b, doc[:10]])) == [True, False]

    store(client, "w", transfer_item("s2", np.concatenate([b, b]), [list(range(9, 17))]))
    # Both entries of [a, doc] were evicted, so doc is no longer cached anywhere.
    assert _match(client, np.concatenate([doc, b])) == [False, True]


def test_blend_disabled_reads_disabled_and_refuses_matches(make_client: ClientFactory) -> None:
    client = make_client()
    assert client.get("/chunk-size").json()["bindings"]["blend_matcher"] == "disabled"
    reply = client.post(
        "/cache/blend/match", json={"namespace": NAMESPACE, **token_field(random_tokens(64, 1))}
    )
    assert reply.status_code == 409
    assert reply.json()["type"] == "urn:mpcache:problem:feature-disabled"
    assert "--enable-blend" in reply.json()["detail"]
