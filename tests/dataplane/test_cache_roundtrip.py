"""Store from one registered instance, retrieve into another: the bytes agree."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from contract.schemas import NULL_BLOCK_ID
from contract.shm_naming import SHM_DIR
from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    LayerSpec,
    ShmKV,
    mamba_layer,
    mla_layer,
    random_tokens,
    register_body,
    token_field,
    transfer_item,
    vllm_layer,
)

CHUNK = 64
ATTN = [(0, "attention", 16)]

ClientFactory = Callable[..., CacheClient]


def _register(
    client: TestClient, kv: ShmKV, instance: str, groups: list[tuple[int, str, int]]
) -> None:
    r = client.post("/register", json=register_body(kv, instance, groups, chunk_size=CHUNK))
    assert r.status_code == 200, r.text


def _assert_blocks_equal(
    src: ShmKV, dst: ShmKV, pairs: Sequence[tuple[int, int]], layers: Sequence[LayerSpec]
) -> None:
    for layer in layers:
        for t_index in range(len(layer.tensors)):
            for a, b in pairs:
                assert torch.equal(
                    src.block(layer.name, t_index, a).view(torch.uint8),
                    dst.block(layer.name, t_index, b).view(torch.uint8),
                ), (layer.name, t_index, a, b)


def _assert_untouched(kv: ShmKV, block_ids: Sequence[int], layers: Sequence[LayerSpec]) -> None:
    for layer in layers:
        for t_index in range(len(layer.tensors)):
            for b in block_ids:
                assert not kv.block(layer.name, t_index, b).view(torch.uint8).any(), (layer.name, b)


@pytest.mark.parametrize(
    "layer_fn",
    [pytest.param(vllm_layer, id="vllm-kv"), pytest.param(mla_layer, id="mla")],
)
def test_store_from_one_instance_retrieve_into_another(
    make_client: ClientFactory, shm_kv: KVFactory, layer_fn: Callable[[str, int, int], LayerSpec]
) -> None:
    client = make_client()
    layers = [layer_fn(f"model.layers.{i}.attn", 0, 40) for i in range(3)]
    a, b = shm_kv(layers), shm_kv(layers)
    assert a.name != b.name
    a.fill_random(seed=1)
    _register(client, a, "engine-a", ATTN)
    _register(client, b, "engine-b", ATTN)

    tokens = random_tokens(3 * CHUNK + 10, seed=7)  # 3 whole chunks + a partial one
    ids_a = list(range(1, 14))  # 13 blocks of 16 tokens
    ids_b = list(range(39, 26, -1))  # other blocks, other order
    r = client.post(
        "/cache/store",
        json={
            "instance_id": "engine-a",
            "rank": 0,
            "requests": [transfer_item("req-a", tokens, [ids_a])],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [
        {"request_id": "req-a", "stored_chunks": 3, "present_chunks": 0, "failed_chunks": 0}
    ]

    r = client.post(
        "/cache/lookup",
        json={"requests": [{"request_id": "req-b", "namespace": a_ns(), **token_field(tokens)}]},
    )
    assert r.json()["results"] == [{"request_id": "req-b", "hit_tokens": 3 * CHUNK}]

    r = client.post(
        "/cache/retrieve",
        json={
            "instance_id": "engine-b",
            "rank": 0,
            "requests": [transfer_item("req-b", tokens, [ids_b])],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [
        {"request_id": "req-b", "loaded_tokens": 3 * CHUNK, "failed_block_ids": []}
    ]
    _assert_blocks_equal(a, b, list(zip(ids_a[:12], ids_b[:12], strict=True)), layers)
    # The partial chunk's block and every other block of B are untouched.
    _assert_untouched(b, [ids_b[12], NULL_BLOCK_ID, *range(1, 27)], layers)

    # Storing again copies nothing: every chunk is present.
    r = client.post(
        "/cache/store",
        json={
            "instance_id": "engine-b",
            "rank": 0,
            "requests": [transfer_item("req-b", tokens, [ids_b])],
        },
    )
    assert r.json()["results"][0] | {} == {
        "request_id": "req-b",
        "stored_chunks": 0,
        "present_chunks": 3,
        "failed_chunks": 0,
    }


def a_ns() -> str:

    return NAMESPACE


def test_retrieve_with_other_layout_is_a_miss(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    a = shm_kv([vllm_layer("l0", 0, 20)])
    b = shm_kv([mla_layer("l0", 0, 20)])  # same namespace, other layout: must not read a's bytes
    a.fill_random(seed=2)
    _register(client, a, "a", ATTN)
    _register(client, b, "b", ATTN)
    tokens = random_tokens(CHUNK, seed=3)
    client.post(
        "/cache/store",
        json={
            "instance_id": "a",
            "rank": 0,
            "requests": [transfer_item("r", tokens, [[1, 2, 3, 4]])],
        },
    )
    r = client.post(
        "/cache/retrieve",
        json={
            "instance_id": "b",
            "rank": 0,
            "requests": [transfer_item("r", tokens, [[5, 6, 7, 8]])],
        },
    )
    assert r.json()["results"] == [
        {"request_id": "r", "loaded_tokens": 0, "failed_block_ids": [5, 6, 7, 8]}
    ]
    assert not b.base.any()


HYBRID_GROUPS = [(0, "attention", 16), (1, "sliding_window", 16), (2, "recurrent", 64)]


def _hybrid_layers(num_blocks: int) -> list[LayerSpec]:
    return [
        vllm_layer("layers.0.attn", 0, num_blocks),
        vllm_layer("layers.1.swa", 1, num_blocks),
        mamba_layer("layers.2.mamba", 2, num_blocks),
        vllm_layer("layers.3.swa", 1, num_blocks),
    ]


def test_hybrid_layout_round_trips_with_null_blocks(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client(alignment=64)
    layers = _hybrid_layers(48)
    a, b = shm_kv(layers), shm_kv(layers)
    a.fill_random(seed=11)
    _register(client, a, "hy-a", HYBRID_GROUPS)
    _register(client, b, "hy-b", HYBRID_GROUPS)
    tokens = random_tokens(3 * CHUNK + 8, seed=12)

    # Store: full attention everywhere; the sliding window lost its first 8 blocks;
    # the recurrent group kept only the state at the end of chunk 2.
    attn_a = list(range(1, 14))
    swa_a = [0] * 8 + list(range(20, 25))
    rec_a = [0, 0, 30, 0]
    r = client.post(
        "/cache/store",
        json={
            "instance_id": "hy-a",
            "rank": 0,
            "requests": [transfer_item("h", tokens, [attn_a, swa_a, rec_a])],
        },
    )
    assert r.json()["results"][0]["stored_chunks"] == 3

    # Retrieve what a prefix hit needs: all attention blocks, the window at the
    # end (blocks 10, 11) and the recurrent state at the end of chunk 2.
    attn_b = list(range(40, 27, -1))
    swa_b = [0] * 10 + [15, 16]
    rec_b = [0, 0, 44]
    r = client.post(
        "/cache/retrieve",
        json={
            "instance_id": "hy-b",
            "rank": 0,
            "requests": [transfer_item("h2", tokens, [attn_b, swa_b, rec_b])],
        },
    )
    assert r.json()["results"] == [
        {"request_id": "h2", "loaded_tokens": 3 * CHUNK, "failed_block_ids": []}
    ]
    _assert_blocks_equal(a, b, list(zip(attn_a[:12], attn_b[:12], strict=True)), layers[:1])
    swa_layers = [layers[1], layers[3]]
    _assert_blocks_equal(a, b, [(swa_a[10], 15), (swa_a[11], 16)], swa_layers)
    _assert_blocks_equal(a, b, [(30, 44)], layers[2:3])
    # Null blocks are never written.
    _assert_untouched(b, [NULL_BLOCK_ID], layers)


def test_hybrid_chunk_lacking_needed_state_is_a_miss(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client(alignment=64)
    layers = _hybrid_layers(48)
    a, b = shm_kv(layers), shm_kv(layers)
    a.fill_random(seed=21)
    _register(client, a, "a", HYBRID_GROUPS)
    _register(client, b, "b", HYBRID_GROUPS)
    tokens = random_tokens(3 * CHUNK, seed=22)
    client.post(
        "/cache/store",
        json={
            "instance_id": "a",
            "rank": 0,
            "requests": [
                transfer_item("h", tokens, [list(range(1, 13)), list(range(13, 25)), [0, 0, 30]])
            ],
        },
    )
    # This retrieve needs recurrent state at the end of chunk 1, which was never stored.
    attn_b = list(range(1, 13))
    r = client.post(
        "/cache/retrieve",
        json={
            "instance_id": "b",
            "rank": 0,
            "requests": [transfer_item("h", tokens, [attn_b, [0] * 12, [0, 40, 41]])],
        },
    )
    result = r.json()["results"][0]
    assert result["loaded_tokens"] == CHUNK
    assert result["failed_block_ids"] == [*attn_b[4:8], 40, *attn_b[8:12], 41]
    _assert_blocks_equal(a, b, list(zip(range(1, 5), attn_b[:4], strict=True)), layers[:1])
    _assert_untouched(b, [*attn_b[4:], 40, 41], layers[:1] + layers[2:3])


def test_lookup_counts_chunks_present_on_every_rank(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    layers = [vllm_layer("l0", 0, 16)]
    kv0, kv1 = shm_kv(layers), shm_kv(layers)
    for rank, kv in enumerate((kv0, kv1)):
        body = register_body(kv, "tp", ATTN, chunk_size=CHUNK, rank=rank, world_size=2)
        assert client.post("/register", json=body).status_code == 200
    tokens = random_tokens(2 * CHUNK, seed=5)
    ids = list(range(1, 9))

    def lookup() -> int:
        item = {"request_id": "q", "namespace": a_ns(), "world_size": 2, **token_field(tokens)}
        return int(
            client.post("/cache/lookup", json={"requests": [item]}).json()["results"][0][
                "hit_tokens"
            ]
        )

    store0 = {"instance_id": "tp", "rank": 0, "requests": [transfer_item("s", tokens, [ids])]}
    assert client.post("/cache/store", json=store0).status_code == 200
    assert lookup() == 0  # rank 1 has nothing yet
    short = {
        "instance_id": "tp",
        "rank": 1,
        "requests": [transfer_item("s", tokens[:CHUNK], [ids])],
    }
    assert client.post("/cache/store", json=short).status_code == 200
    assert lookup() == CHUNK


def test_close_unlinks_the_pool(make_client: ClientFactory) -> None:
    import os

    client = make_client()
    name = client.app.state.runtime.pool.segment.name  # type: ignore[attr-defined]
    assert os.path.exists(f"{SHM_DIR}/{name}")
    client.__exit__(None, None, None)
    assert not os.path.exists(f"{SHM_DIR}/{name}")


def test_tokens_shorter_than_end_token_clamp_the_range(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    _register(client, kv, "a", ATTN)
    tokens = random_tokens(CHUNK + 5, seed=9)
    item = transfer_item("r", tokens, [list(range(1, 9))], end_token=4 * CHUNK)
    r = client.post("/cache/store", json={"instance_id": "a", "rank": 0, "requests": [item]})
    assert r.json()["results"][0]["stored_chunks"] == 1
    assert np.array_equal(tokens, tokens)
