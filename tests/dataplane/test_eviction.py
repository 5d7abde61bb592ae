"""Eviction under a small pool: lookups report only what is really there."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from fastapi.testclient import TestClient

from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    ShmKV,
    lookup,
    metric,
    post_ok,
    random_tokens,
    register_body,
    retrieve,
    store,
    transfer_item,
    vllm_layer,
)

CHUNK = 64
GROUPS = [(0, "attention", 16)]
# 4 layers x 4 blocks x 1 KiB = 16 KiB per chunk: 4 pages of 4 KiB.
LAYERS = [vllm_layer(f"l{i}", 0, 64) for i in range(4)]
ENTRY_PAGES = 4

ClientFactory = Callable[..., CacheClient]


def _setup(
    make_client: ClientFactory, shm_kv: KVFactory, entries: int, **settings: object
) -> tuple[TestClient, ShmKV, ShmKV]:
    client = make_client(pool_size=entries * ENTRY_PAGES * 4096, **settings)
    a, b = shm_kv(LAYERS), shm_kv(LAYERS)
    a.fill_random(seed=3)
    for name, kv in (("a", a), ("b", b)):
        post_ok(client, "/register", register_body(kv, name, GROUPS, chunk_size=CHUNK))
    return client, a, b


def _blocks(first: int, n_chunks: int) -> list[int]:
    return list(range(first, first + 4 * n_chunks))


def _evicted(client: TestClient) -> float:
    return metric(client, "mpcache_chunks_evicted_total")


def test_lru_entry_is_evicted_and_lookup_reports_it_gone(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client, _, _ = _setup(make_client, shm_kv, entries=3)
    p1, p2 = random_tokens(2 * CHUNK, seed=1), random_tokens(2 * CHUNK, seed=2)
    assert store(client, "a", transfer_item("p1", p1, [_blocks(1, 2)]))[0]["stored_chunks"] == 2
    assert store(client, "a", transfer_item("p2", p2, [_blocks(9, 2)]))[0]["stored_chunks"] == 2
    assert _evicted(client) == 1
    # p1's first chunk (least recently used) went, so p1 has no cached prefix.
    assert lookup(client, p1, "q1") == 0
    assert lookup(client, p2, "q2") == 2 * CHUNK
    result = retrieve(client, "b", transfer_item("r1", p1, [_blocks(20, 2)]))[0]
    assert result == {"request_id": "r1", "loaded_tokens": 0, "failed_block_ids": _blocks(20, 2)}
    stats = client.app.state.runtime.pool.stats()  # type: ignore[attr-defined]
    assert stats.entries == 3
    assert metric(client, "mpcache_pool_used_bytes") == 3 * ENTRY_PAGES * 4096


def test_lookup_hits_always_retrieve_with_right_bytes(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Random stores into a pool too small for them; after each, every lookup's
    answer is exactly what a retrieve can load, and the loaded bytes are right."""
    client, a, b = _setup(make_client, shm_kv, entries=5, lease_ttl_s=0)
    rng = np.random.default_rng(0)
    prompts = [random_tokens(3 * CHUNK, seed=100 + i) for i in range(5)]
    src_blocks = [_blocks(1 + 12 * i, 3) for i in range(5)]
    dst = _blocks(1, 3)
    for step in range(25):
        p = int(rng.integers(len(prompts)))
        n = int(rng.integers(1, 4))
        store(client, "a", transfer_item(f"s{step}", prompts[p][: n * CHUNK], [src_blocks[p]]))
        for q, tokens in enumerate(prompts):
            hit = lookup(client, tokens, f"l{step}-{q}")
            b.zero()
            got = retrieve(client, "b", transfer_item(f"l{step}-{q}", tokens, [dst]))[0]
            assert got["loaded_tokens"] == hit, (step, q)
            loaded_blocks = hit // 16
            for layer in LAYERS:
                for j in range(12):
                    dst_block = b.block(layer.name, 0, dst[j])
                    if j < loaded_blocks:
                        want = a.block(layer.name, 0, src_blocks[q][j])
                        assert torch.equal(dst_block.view(torch.uint8), want.view(torch.uint8))
                    else:
                        assert not dst_block.view(torch.uint8).any(), (step, q, j)
    assert _evicted(client) > 0


def test_leased_chunks_survive_until_the_session_ends(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client, _, _ = _setup(make_client, shm_kv, entries=3)
    p1 = random_tokens(3 * CHUNK, seed=1)
    p2 = random_tokens(2 * CHUNK, seed=2)
    store(client, "a", transfer_item("p1", p1, [_blocks(1, 3)]))
    assert lookup(client, p1, "reader") == 3 * CHUNK  # leases all three chunks

    # Every entry is leased: the store fails cleanly (no 5xx) and evicts nothing.
    result = store(client, "a", transfer_item("p2", p2, [_blocks(20, 2)]))[0]
    assert result == {
        "request_id": "p2",
        "stored_chunks": 0,
        "present_chunks": 0,
        "failed_chunks": 2,
    }
    assert lookup(client, p1, "reader") == 3 * CHUNK

    assert post_ok(client, "/cache/end", {"request_ids": ["reader", "p1", "p2"]})["ended"] == 3
    result = store(client, "a", transfer_item("p2b", p2, [_blocks(20, 2)]))[0]
    assert result["stored_chunks"] == 2
    assert lookup(client, p1, "after") == 0
    assert lookup(client, p2, "after2") == 2 * CHUNK


def test_leases_lapse_after_their_ttl(make_client: ClientFactory, shm_kv: KVFactory) -> None:
    client, _, _ = _setup(make_client, shm_kv, entries=2, lease_ttl_s=0.05)
    p1, p2 = random_tokens(2 * CHUNK, seed=1), random_tokens(2 * CHUNK, seed=2)
    store(client, "a", transfer_item("p1", p1, [_blocks(1, 2)]))
    assert lookup(client, p1, "reader") == 2 * CHUNK
    import time

    time.sleep(0.1)  # the reader never ends its session; its lease lapses anyway
    assert store(client, "a", transfer_item("p2", p2, [_blocks(20, 2)]))[0]["stored_chunks"] == 2
