"""Copy kernels: gather a chunk's blocks into a pool entry, scatter them back.

Each registered tensor gets a ``TensorPlan``: a *block view* of it and the region
of the entry its blocks go to (``dataplane.layout``). Where the bytes of one
block's inner dimensions are contiguous, the block view is reinterpreted as
``[outer, num_blocks, words]`` of the widest integer type that fits, so a chunk
moves with one call per tensor. Other layouts fall back to the tensor's own shape
(same bytes, reinterpreted as an integer type of the same width).

Kernels, chosen by measurement (bench/dataplane_bench.py), all releasing the GIL:

- block ids that form runs (consecutive ids in consecutive slots, as vLLM hands
  out fresh blocks) move with one slice ``copy_`` per run: torch's multi-threaded
  strided copy, faster than a plain memcpy;
- fragmented ids: store gathers with torch's ``index_select``; retrieve scatters
  CPU tensors with a numpy fancy-index assignment, because torch's CPU
  ``index_copy_`` collapses to ~0.1 GB/s with more than one intra-op thread
  (torch 2.13). CUDA tensors always use torch.

Threads: copies are memory-bound, so a few threads reach the memory bandwidth
and more only contend, while the server runs several requests (one per TP rank)
at once. ``configure_copy_threads`` caps torch's intra-op threads at
``min(4, cores)`` by default (on a 2-vCPU VM, two threads measured better than one
for run-ordered copies through HTTP).

Null blocks: on store their slot is filled from block 0 (always a valid index)
and marked absent in the entry's ``present`` mask, so the copy stays one call;
on retrieve they are never written.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane.descriptors import TensorGeometry
from dataplane.layout import Region

__all__ = [
    "Run",
    "TensorPlan",
    "block_runs",
    "configure_copy_threads",
    "gather_chunk",
    "make_plan",
    "scatter_chunk",
]

_WORDS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorPlan:
    region: Region
    view: torch.Tensor
    """The registered tensor seen as blocks along ``dim`` (zero copy, integer dtype)."""
    dim: int
    region_shape: tuple[int, ...]
    """Shape of the entry region, in ``view``'s dtype and dimensions."""
    region_stride: tuple[int, ...]
    """Contiguous strides of ``region_shape``."""
    array: np.ndarray | None
    """``view`` as a numpy array (CPU tensors only), for the scatter kernel."""

    @property
    def is_cuda(self) -> bool:
        return self.view.is_cuda

    def region_in(self, entry_typed: torch.Tensor) -> torch.Tensor:
        """The region, from the entry already viewed as this plan's dtype (one call)."""
        offset = entry_typed.storage_offset() + self.region.offset_bytes // self.view.itemsize
        return entry_typed.as_strided(self.region_shape, self.region_stride, offset)

    def region_array(self, entry_array: np.ndarray) -> np.ndarray:
        assert self.array is not None
        start = self.region.offset_bytes
        raw = entry_array[start : start + self.region.nbytes]
        return raw.view(self.array.dtype).reshape(self.region_shape)


def configure_copy_threads(threads: int = 0) -> int:
    """Set torch's intra-op threads for copies (0: ``min(4, cores)``); return the count.

    Process-wide: the server does no other torch work.
    """
    if threads <= 0:
        threads = max(1, min(4, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    return threads


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
    return TensorPlan(region, view, dim, shape, stride, array)


Run = tuple[int, int, int]
"""(first slot in the region, first block id, number of blocks)."""


def block_runs(slots: np.ndarray, ids: np.ndarray) -> list[Run] | None:
    """Runs where slot and block id both advance by one; None when too fragmented.

    Fragmented means fewer than 4 blocks per run on average: then one index
    kernel beats many small copies.
    """
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero((np.diff(ids) != 1) | (np.diff(slots) != 1)) + 1
    if len(breaks) + 1 > max(1, len(ids) // 4):
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(ids)]
    return [(int(slots[a]), int(ids[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def _index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    idx = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    return idx if device.type == "cpu" else idx.to(device)


def gather_chunk(
    plans: Sequence[TensorPlan], group_ids: Sequence[np.ndarray], entry_bytes: torch.Tensor
) -> int:
    """Copy one chunk's blocks (``group_ids[g]``, nulls read block 0) into an entry.

    Returns the bytes copied.
    """
    runs: dict[int, list[Run] | None] = {}
    indices: dict[tuple[int, torch.device], torch.Tensor] = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    copied = 0
    for plan in plans:
        g = plan.region.group_index
        if g not in runs:
            ids = group_ids[g]
            runs[g] = block_runs(np.arange(len(ids)), ids)
        entry_typed = typed.get(plan.view.dtype)
        if entry_typed is None:
            entry_typed = typed[plan.view.dtype] = entry_bytes.view(plan.view.dtype)
        dst = plan.region_in(entry_typed)
        group_runs = runs[g]
        if group_runs is not None:
            for slot, block, n in group_runs:
                dst.narrow(plan.dim, slot, n).copy_(plan.view.narrow(plan.dim, block, n))
        else:
            device = plan.view.device
            idx = indices.get((g, device))
            if idx is None:
                idx = indices[(g, device)] = _index(group_ids[g], device)
            if plan.is_cuda:
                dst.copy_(plan.view.index_select(plan.dim, idx))
            else:
                torch.index_select(plan.view, plan.dim, idx, out=dst)
        copied += plan.region.nbytes
    return copied


def scatter_chunk(
    plans: Sequence[TensorPlan], group_ids: Sequence[np.ndarray], entry_bytes: torch.Tensor
) -> int:
    """Copy an entry's blocks into the non-null blocks of ``group_ids``.

    Returns the bytes written. CUDA copies are synchronised before returning.
    """
    selected: dict[int, tuple[np.ndarray, np.ndarray | None, list[Run] | None]] = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    entry_array: np.ndarray | None = None
    copied = 0
    cuda_devices: set[torch.device] = set()
    for plan in plans:
        g = plan.region.group_index
        if g not in selected:
            ids = group_ids[g]
            slots = np.flatnonzero(ids)
            full = len(slots) == len(ids)
            sel = ids.astype(np.int64) if full else ids[slots]
            selected[g] = (sel, None if full else slots, block_runs(slots, sel))
        idx, positions, group_runs = selected[g]
        if idx.size == 0:
            continue
        block_bytes = plan.region.nbytes // plan.region_shape[plan.dim]
        copied += block_bytes * int(idx.size)
        if plan.is_cuda:
            cuda_devices.add(plan.view.device)
        if group_runs is not None or plan.array is None:
            entry_typed = typed.get(plan.view.dtype)
            if entry_typed is None:
                entry_typed = typed[plan.view.dtype] = entry_bytes.view(plan.view.dtype)
            src_t = plan.region_in(entry_typed)
            if group_runs is not None:
                for slot, block, n in group_runs:
                    plan.view.narrow(plan.dim, block, n).copy_(src_t.narrow(plan.dim, slot, n))
                continue
            device = plan.view.device
            if positions is not None:
                src_t = src_t.index_select(plan.dim, torch.from_numpy(positions))
            plan.view.index_copy_(plan.dim, _index(idx, device), src_t.to(device))
            continue
        if entry_array is None:
            entry_array = entry_bytes.numpy()
        src = plan.region_array(entry_array)
        if positions is not None:
            src = np.take(src, positions, axis=plan.dim)
        target: Any = (*(slice(None),) * plan.dim, idx)
        plan.array[target] = src
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return copied
