"""Hits below the chunk: a prompt's tail units are kept, and a prompt sharing only part
of a cached chunk reuses the shared units, byte for byte (``unit_tokens``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    ShmKV,
    post_ok,
    random_tokens,
    register_body,
    retrieve,
    store,
    token_field,
    transfer_item,
    vllm_layer,
)

CHUNK = 64
UNIT = 16  # the alignment: one block of 16 tokens
ATTN = [(0, "attention", 16)]
LAYERS = [vllm_layer(f"model.layers.{i}.attn", 0, 40) for i in range(2)]

ClientFactory = Callable[..., CacheClient]


@pytest.fixture
def pair(make_client: ClientFactory, shm_kv: KVFactory) -> tuple[CacheClient, ShmKV, ShmKV]:
    """A server with two registered instances: A (random blocks) stores, B loads."""
    client = make_client(chunk_size=CHUNK, alignment=UNIT)
    a, b = shm_kv(LAYERS), shm_kv(LAYERS)
    a.fill_random(seed=3)
    for kv, instance in ((a, "a"), (b, "b")):
        body = register_body(kv, instance, ATTN, chunk_size=CHUNK)
        assert client.post("/register", json=body).status_code == 200
    return client, a, b


def _item(rid: str, tokens: np.ndarray, ids: list[int], **kw: Any) -> dict[str, Any]:
    return transfer_item(rid, tokens, [ids], **kw) | {"unit_tokens": UNIT}


def _lookup(client: CacheClient, tokens: np.ndarray, rid: str, unit: int | None = UNIT) -> int:
    item = {"request_id": rid, "namespace": NAMESPACE, **token_field(tokens)}
    if unit is not None:
        item["unit_tokens"] = unit
    return int(post_ok(client, "/cache/lookup", {"requests": [item]})["results"][0]["hit_tokens"])


def _same_blocks(src: ShmKV, dst: ShmKV, pairs: list[tuple[int, int]]) -> bool:
    return all(
        torch.equal(
            src.block(layer.name, t, x).view(torch.uint8),
            dst.block(layer.name, t, y).view(torch.uint8),
        )
        for layer in LAYERS
        for t in range(len(layer.tensors))
        for x, y in pairs
    )


def _untouched(kv: ShmKV, ids: list[int]) -> bool:
    return not any(
        kv.block(layer.name, t, b).view(torch.uint8).any()
        for layer in LAYERS
        for t in range(len(layer.tensors))
        for b in ids
    )


def test_a_prompts_tail_units_are_stored_and_loaded(pair: tuple[CacheClient, ShmKV, ShmKV]) -> None:
    client, a, b = pair
    tokens = random_tokens(2 * CHUNK + 3 * UNIT + 5, seed=1)  # 2 chunks, 3 units, 5 more
    ids_a = list(range(1, 13))
    results = store(client, "a", _item("ra", tokens, ids_a))
    # The two chunks, then the tail of 3 units as one more entry.
    assert results[0]["stored_chunks"] == 3, results

    assert _lookup(client, tokens, "rb") == 2 * CHUNK + 3 * UNIT
    # Without a unit the same lookup counts whole chunks only, as before.
    assert _lookup(client, tokens, "rc", unit=None) == 2 * CHUNK

    ids_b = list(range(30, 18, -1))
    end = 2 * CHUNK + 3 * UNIT
    (got,) = retrieve(client, "b", _item("rb", tokens, ids_b, end_token=end))
    assert got == {"request_id": "rb", "loaded_tokens": end, "failed_block_ids": []}
    assert _same_blocks(a, b, list(zip(ids_a[:11], ids_b[:11], strict=True)))
    assert _untouched(b, ids_b[11:])  # the 12th block (the last 5 tokens) is not written


def test_a_prompt_sharing_part_of_a_chunk_reuses_the_shared_units(
    pair: tuple[CacheClient, ShmKV, ShmKV],
) -> None:
    client, a, b = pair
    stored = random_tokens(2 * CHUNK, seed=2)
    ids_a = list(range(1, 9))
    assert store(client, "a", _item("ra", stored, ids_a))[0]["stored_chunks"] == 2

    # Diverges in the second chunk's third unit: chunk 0 and two units of chunk 1 are shared.
    other = stored.copy()
    other[CHUNK + 2 * UNIT + 3] += 1
    assert _lookup(client, other, "rb") == CHUNK + 2 * UNIT

    ids_b = list(range(20, 28))
    end = CHUNK + 2 * UNIT
    (got,) = retrieve(client, "b", _item("rb", other, ids_b, end_token=end))
    assert got == {"request_id": "rb", "loaded_tokens": end, "failed_block_ids": []}
    assert _same_blocks(a, b, list(zip(ids_a[:6], ids_b[:6], strict=True)))
    assert _untouched(b, ids_b[6:])


def test_a_whole_chunk_replaces_the_tail_it_covers(
    pair: tuple[CacheClient, ShmKV, ShmKV],
) -> None:
    client, _, _ = pair
    tokens = random_tokens(2 * CHUNK, seed=4)
    first = tokens[: CHUNK + 2 * UNIT]
    assert store(client, "a", _item("r1", first, list(range(1, 7))))[0]["stored_chunks"] == 2
    # The same request later completes chunk 1: stored whole, the tail dropped.
    stored = store(client, "a", _item("r1", tokens, list(range(1, 9)), start_token=CHUNK))
    assert stored[0] == {
        "request_id": "r1",
        "stored_chunks": 1,
        "present_chunks": 0,
        "failed_chunks": 0,
    }
    runtime = client.app.state.runtime
    assert runtime.pool.stats().entries == 2  # chunk 0 and chunk 1; no tail left
    assert _lookup(client, first, "r2") == CHUNK + 2 * UNIT  # now answered by chunk 1


def test_a_stored_tail_is_present_when_stored_again(
    pair: tuple[CacheClient, ShmKV, ShmKV],
) -> None:
    client, _, _ = pair
    tokens = random_tokens(CHUNK + UNIT, seed=5)
    assert store(client, "a", _item("r1", tokens, list(range(1, 6))))[0]["stored_chunks"] == 2
    again = store(client, "a", _item("r2", tokens, list(range(1, 6))))[0]
    assert (again["stored_chunks"], again["present_chunks"]) == (0, 2)


def test_the_units_of_another_salt_or_namespace_do_not_hit(
    pair: tuple[CacheClient, ShmKV, ShmKV],
) -> None:
    client, _, _ = pair
    tokens = random_tokens(3 * UNIT, seed=6)  # a tail only, no whole chunk
    assert store(client, "a", _item("r1", tokens, [1, 2, 3]))[0]["stored_chunks"] == 1
    assert _lookup(client, tokens, "r2") == 3 * UNIT
    salted = {"request_id": "r3", "namespace": NAMESPACE, "cache_salt": "tenant-b"}
    reply = post_ok(
        client,
        "/cache/lookup",
        {"requests": [salted | token_field(tokens) | {"unit_tokens": UNIT}]},
    )
    assert reply["results"][0]["hit_tokens"] == 0


def test_an_evicted_tail_is_a_failed_load_not_garbage(
    pair: tuple[CacheClient, ShmKV, ShmKV],
) -> None:
    client, _, b = pair
    tokens = random_tokens(CHUNK + 2 * UNIT, seed=7)
    store(client, "a", _item("r1", tokens, list(range(1, 7))))
    runtime = client.app.state.runtime
    (tail,) = [e for e in runtime.pool._index.values() if e.unit_keys and e.key == e.unit_keys[-1]]
    with runtime.pool._lock:
        runtime.pool._detach(tail)
    ids_b = list(range(20, 26))
    (got,) = retrieve(client, "b", _item("rb", tokens, ids_b))
    assert got == {"request_id": "rb", "loaded_tokens": CHUNK, "failed_block_ids": [24, 25]}
    assert _untouched(b, [24, 25])


@pytest.mark.parametrize(
    ("unit", "problem"),
    [
        pytest.param(24, "does not divide the chunk size", id="not-a-divisor"),
        pytest.param(8, "every registered group's token span", id="below-a-block"),
    ],
)
def test_a_unit_that_cannot_end_on_blocks_is_refused(
    pair: tuple[CacheClient, ShmKV, ShmKV], unit: int, problem: str
) -> None:
    client, _, _ = pair
    tokens = random_tokens(CHUNK, seed=8)
    item = transfer_item("r1", tokens, [[1, 2, 3, 4]]) | {"unit_tokens": unit}
    reply = client.post("/cache/store", json={"instance_id": "a", "rank": 0, "requests": [item]})
    assert reply.status_code == 422, reply.text
    assert problem in reply.json()["detail"]
