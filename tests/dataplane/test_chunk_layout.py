"""Chunk layout maths (pure)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dataplane.layout import (
    REGION_ALIGN_BYTES,
    BlockTensorSpec,
    GroupSpec,
    chunk_block_ids,
    chunk_layout,
    slot_mask,
)

ATTN = GroupSpec(0, "attention", 16)


def kv(
    layer: str, num_blocks: int = 100, group: int = 0, dtype: str = "bfloat16"
) -> BlockTensorSpec:
    return BlockTensorSpec(layer, group, dtype, 2, (2, num_blocks, 16, 8, 128), 1)


@pytest.mark.parametrize(
    ("chunk_size", "groups", "tensors", "per_chunk", "chunk_bytes"),
    [
        pytest.param(256, [ATTN], [kv("l0")], (16,), 16 * 2 * 16 * 8 * 128 * 2, id="llama-layer"),
        pytest.param(
            256, [ATTN], [kv(f"l{i}") for i in range(32)], (16,), 32 << 20, id="llama-8b-chunk"
        ),
        pytest.param(
            64,
            [ATTN, GroupSpec(1, "recurrent", 64)],
            [kv("a"), BlockTensorSpec("m", 1, "float32", 4, (10, 3, 5), 0)],
            (4, 1),
            4 * 2 * 16 * 8 * 128 * 2 + 64,  # the 60-byte state region rounds up to 64
            id="hybrid",
        ),
        pytest.param(
            288,
            [GroupSpec(0, "attention", 32), GroupSpec(1, "attention", 48)],
            [
                BlockTensorSpec("a", 0, "bfloat16", 2, (7, 32, 1), 0),
                BlockTensorSpec("b", 1, "bfloat16", 2, (7, 48, 1), 0),
            ],
            (9, 6),
            (9 * 64 + 63) // 64 * 64 + 6 * 96,
            id="spans-32-48",
        ),
    ],
)
def test_layout_sizes(
    chunk_size: int,
    groups: list[GroupSpec],
    tensors: list[BlockTensorSpec],
    per_chunk: tuple[int, ...],
    chunk_bytes: int,
) -> None:
    layout = chunk_layout(chunk_size, groups, tensors)
    assert layout.blocks_per_chunk == per_chunk
    assert layout.chunk_bytes == chunk_bytes
    assert all(r.offset_bytes % REGION_ALIGN_BYTES == 0 for r in layout.regions)
    for region, following in itertools.pairwise(layout.regions):
        assert region.offset_bytes + region.nbytes <= following.offset_bytes
    assert layout.num_slots == sum(per_chunk)


def test_region_shape_cuts_the_block_dim_to_the_chunk() -> None:
    layout = chunk_layout(64, [ATTN], [kv("l0")])
    assert layout.regions[0].shape == (2, 4, 16, 8, 128)


@pytest.mark.parametrize(
    ("chunk_size", "groups", "tensors", "message"),
    [
        pytest.param(64, [GroupSpec(0, "attention", 48)], [], "does not divide", id="span"),
        pytest.param(64, [ATTN, ATTN], [], "unique", id="dup-group"),
        pytest.param(64, [ATTN], [kv("l0", group=3)], "unknown group", id="unknown-group"),
        pytest.param(64, [], [], "at least one group", id="no-groups"),
        pytest.param(
            64, [ATTN], [BlockTensorSpec("x", 0, "bfloat16", 2, (4, 4), 2)], "block_dim", id="dim"
        ),
    ],
)
def test_layout_refuses_inconsistent_input(
    chunk_size: int, groups: list[GroupSpec], tensors: list[BlockTensorSpec], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_layout(chunk_size, groups, tensors)


def test_signature_ignores_num_blocks_but_not_geometry() -> None:
    base = chunk_layout(64, [ATTN], [kv("l0", 100)]).signature
    assert chunk_layout(64, [ATTN], [kv("l0", 7)]).signature == base
    assert chunk_layout(64, [ATTN], [kv("l0", dtype="float16")]).signature != base
    assert chunk_layout(64, [ATTN], [kv("other")]).signature != base
    assert chunk_layout(128, [ATTN], [kv("l0")]).signature != base
    assert chunk_layout(64, [GroupSpec(0, "sliding_window", 16)], [kv("l0")]).signature != base
    two = chunk_layout(64, [ATTN], [kv("a"), kv("b")]).signature
    assert chunk_layout(64, [ATTN], [kv("b"), kv("a")]).signature != two


@pytest.mark.parametrize(
    ("ids", "chunk", "n", "expected"),
    [
        pytest.param([5, 6, 7, 8, 9], 0, 4, [5, 6, 7, 8], id="first"),
        pytest.param([5, 6, 7, 8, 9], 1, 4, [9, 0, 0, 0], id="short-list-pads-null"),
        pytest.param([], 2, 2, [0, 0], id="empty"),
    ],
)
def test_chunk_block_ids(ids: list[int], chunk: int, n: int, expected: list[int]) -> None:
    got = chunk_block_ids(np.asarray(ids, dtype=np.int64), chunk, n)
    assert got.tolist() == expected


def test_slot_mask_orders_groups_then_blocks() -> None:
    ids = [np.array([1, 0, 3, 4]), np.array([0]), np.array([0, 9])]
    assert slot_mask(ids) == 0b1_0_0_1101
    assert slot_mask([np.zeros(4, dtype=np.int64)]) == 0
