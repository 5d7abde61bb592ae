"""Copy plans: fast word views where possible, the same bytes either way."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from app.schemas import ShmTensor
from dataplane.descriptors import tensor_geometry
from dataplane.layout import BlockTensorSpec, ChunkLayout, GroupSpec, chunk_layout
from dataplane.transfer import TensorPlan, gather_chunk, make_plan, scatter_chunk


def _plan_for(
    tensor: torch.Tensor, block_dim: int, n_per_chunk: int = 4
) -> tuple[TensorPlan, ChunkLayout]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    geo = tensor_geometry(
        ShmTensor(
            segment="mpcache-w-1-x",
            offset_bytes=tensor.storage_offset() * tensor.element_size(),
            shape=list(tensor.shape),
            stride=list(tensor.stride()),
            dtype=dtype,
            block_dim=block_dim,
        )
    )
    spec = BlockTensorSpec("l", 0, geo.dtype_name, geo.itemsize, geo.shape, block_dim)
    layout = chunk_layout(16 * n_per_chunk, [GroupSpec(0, "attention", 16)], [spec])
    return make_plan(tensor, geo, layout.regions[0]), layout


@pytest.mark.parametrize(
    ("make", "block_dim", "fast_dtype"),
    [
        pytest.param(lambda: torch.randn(2, 12, 16, 2, 8).bfloat16(), 1, torch.int64, id="vllm-kv"),
        pytest.param(lambda: torch.randn(12, 16, 24).bfloat16(), 0, torch.int64, id="mla"),
        pytest.param(lambda: torch.randn(12, 3).float(), 0, torch.int32, id="odd-inner-words"),
        pytest.param(lambda: torch.randn(12, 3).bfloat16(), 0, torch.int16, id="6-byte-blocks"),
        pytest.param(
            lambda: torch.randn(2, 16, 12, 8).bfloat16().transpose(1, 2),
            1,
            torch.int16,
            id="strided-inner",
        ),
    ],
)
def test_gather_then_scatter_moves_exact_bytes(
    make: Callable[[], torch.Tensor], block_dim: int, fast_dtype: torch.dtype
) -> None:
    src = make()
    dst = torch.zeros_like(src)
    plan, layout = _plan_for(src, block_dim)
    assert plan.view.dtype == fast_dtype
    dst_plan, _ = _plan_for(dst, block_dim)
    entry = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)

    copied = gather_chunk([plan], [np.array([3, 0, 7, 5])], entry)
    assert copied == layout.regions[0].nbytes
    written = scatter_chunk([dst_plan], [np.array([9, 0, 1, 2])], entry)
    assert written == copied // 4 * 3  # the null slot is never written

    def blocks(t: torch.Tensor, ids: list[int]) -> list[torch.Tensor]:
        return [t.select(block_dim, i).contiguous().view(torch.uint8) for i in ids]

    for a, b in zip(blocks(src, [3, 7, 5]), blocks(dst, [9, 1, 2]), strict=True):
        assert torch.equal(a, b)
    assert not dst.select(block_dim, 0).contiguous().view(torch.uint8).any()
