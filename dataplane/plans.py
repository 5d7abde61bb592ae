"""Copy plans: how one registered tensor's blocks are seen for copying (``make_plan``).

Built once per tensor at registration (``dataplane.registry``); every store and
retrieve of a chunk then copies through them (``dataplane.transfer``), so nothing
here runs per chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane.descriptors import TensorGeometry
from dataplane.layout import Region

__all__ = ["TensorPlan", "make_plan"]

_WORDS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorPlan:
    """One registered tensor as its copies see it: a *block view* of it, and the
    region of an entry its blocks go to (``dataplane.layout``).

    Where the bytes of one block's inner dimensions are contiguous, the block view
    is ``[outer, num_blocks, words]`` of the widest integer type that fits, so a
    chunk moves with one call per tensor, and such plans (``_streamable``) also
    keep the row addresses the streaming block kernel needs. Other layouts keep
    the tensor's own shape (same bytes, seen as an integer type of the same width).
    """

    region: Region
    view: torch.Tensor
    """The registered tensor seen as blocks along ``dim`` (zero copy, integer dtype)."""
    dim: int
    region_shape: tuple[int, ...]
    """Shape of the entry region, in ``view``'s dtype and dimensions."""
    region_stride: tuple[int, ...]
    """Contiguous strides of ``region_shape``."""
    array: np.ndarray | None
    """``view`` as a numpy array (CPU tensors only), for the numpy kernels."""
    rows: np.ndarray | None = None
    """Streamable plans (``_streamable``): the address of each outer row of
    ``array`` (int64), so the block kernel's addresses need no per-tensor work."""
    region_rows: np.ndarray | None = None
    """Streamable plans: the byte offset in an entry of each outer row of the region."""

    @property
    def is_cuda(self) -> bool:
        return self.view.is_cuda

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the region."""
        return self.region.nbytes // self.region_shape[self.dim]

    def region_in(self, entry_typed: torch.Tensor) -> torch.Tensor:
        """The region, from the entry already viewed as this plan's dtype (one call)."""
        offset = entry_typed.storage_offset() + self.region.offset_bytes // self.view.itemsize
        return entry_typed.as_strided(self.region_shape, self.region_stride, offset)

    def region_array(self, entry_array: np.ndarray) -> np.ndarray:
        assert self.array is not None
        start = self.region.offset_bytes
        raw = entry_array[start : start + self.region.nbytes]
        return raw.view(self.array.dtype).reshape(self.region_shape)


def make_plan(tensor: torch.Tensor, geo: TensorGeometry, region: Region) -> TensorPlan:
    """The copy plan of one registered tensor (``tensor`` viewed as ``geo`` says)."""
    n_per_chunk = region.shape[geo.block_dim]
    fast = _word_view(tensor, geo, n_per_chunk)
    if fast is not None:
        view, dim, shape = fast
    else:
        view, dim, shape = tensor.view(_SAME_WIDTH_INT[geo.itemsize]), geo.block_dim, region.shape
    array = None if view.is_cuda else view.numpy()
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    plan = TensorPlan(region, view, dim, shape, stride, array)
    if not _streamable(plan):
        return plan
    assert array is not None
    outer = np.arange(array.shape[0], dtype=np.int64)
    rows = array.ctypes.data + outer * array.strides[0]
    region_rows = region.offset_bytes + outer * (stride[0] * array.itemsize)
    return dataclasses.replace(plan, rows=rows, region_rows=region_rows)


def _streamable(plan: TensorPlan) -> bool:
    """Whether ``plan``'s blocks are contiguous rows of a ``[outer, blocks, words]``
    array (every word view is), so the block kernel can move them."""
    a = plan.array
    return a is not None and plan.dim == 1 and a.ndim == 3 and a.strides[2] == a.itemsize


def _collapse(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int] | None:
    """(size, stride) of dims that merge into one strided dim, else None."""
    dims = [(n, s) for n, s in zip(shape, stride, strict=True) if n != 1]
    if not dims:
        return 1, 0
    for (_, outer_s), (inner_n, inner_s) in itertools.pairwise(dims):
        if outer_s != inner_s * inner_n:
            return None
    return math.prod(n for n, _ in dims), dims[-1][1]


def _word_view(
    tensor: torch.Tensor, geo: TensorGeometry, n_per_chunk: int
) -> tuple[torch.Tensor, int, tuple[int, ...]] | None:
    """``tensor`` as ``[outer, num_blocks, words]`` (block dim 1) and its region's
    shape, or None where a block's inner bytes are not contiguous."""
    d = geo.block_dim
    shape, stride = geo.shape, geo.stride
    inner_shape = shape[d + 1 :]
    inner_elems = math.prod(inner_shape)
    contiguous = 1
    for n, s in zip(reversed(inner_shape), reversed(stride[d + 1 :]), strict=True):
        if n != 1 and s != contiguous:
            return None
        contiguous *= n
    outer = _collapse(shape[:d], stride[:d])
    if outer is None:
        return None
    outer_size, outer_stride = outer
    item = geo.itemsize
    inner_bytes = inner_elems * item
    base_bytes = tensor.storage_offset() * item
    for word, dtype in _WORDS:
        sizes = (inner_bytes, base_bytes, outer_stride * item, stride[d] * item)
        if all(x % word == 0 for x in sizes):
            view = torch.empty(0, dtype=dtype, device=tensor.device)
            view.set_(
                tensor.untyped_storage(),
                base_bytes // word,
                (outer_size, shape[d], inner_bytes // word),
                (outer_stride * item // word, stride[d] * item // word, 1),
            )
            return view, 1, (outer_size, n_per_chunk, inner_bytes // word)
    return None
