"""Copy kernels: gather a chunk's blocks into a pool entry, scatter them back.

Each registered tensor gets a ``TensorPlan``: a *block view* of it and the region
of the entry its blocks go to (``dataplane.layout``). Where the bytes of one
block's inner dimensions are contiguous, the block view is reinterpreted as
``[outer, num_blocks, words]`` of the widest integer type that fits, so a chunk
moves with one call per tensor. Other layouts fall back to the tensor's own shape
(same bytes, reinterpreted as an integer type of the same width).

Kernels, chosen by measurement (bench/dataplane_bench.py; figures in
``dataplane.streaming`` and the README), all releasing the GIL:

- CPU tensors move with numpy, whose contiguous copies are one ``memmove`` each,
  so a long one streams past the cache (``dataplane.streaming``): block ids that
  form runs (consecutive ids in consecutive slots, as vLLM hands out fresh blocks)
  move with one slice assignment per run; scattered ids move with the streaming
  block kernel (``dataplane.blockcopy``: non-temporal stores) when the ``CopyPool``
  has one: every tensor's block addresses of a chunk are computed in one numpy
  expression from row addresses the plans keep, then one C call per lane moves
  them (per tensor, working out the addresses had cost as much as moving a 1 MiB
  tensor's blocks, and held the GIL the other lanes needed); else they are gathered
  on store with one
  unbuffered ``np.take`` straight into the entry region and scattered on retrieve
  with one fancy-index assignment (a cached staging buffer streamed out afterwards
  measured slower through the server, 0.45-0.64x against 0.78x). torch's
  strided ``copy_``, ``index_select`` and ``index_copy_`` use their own loops, which
  never stream: the old kernels ran at 0.5-0.7x a large numpy copy.
- CUDA tensors use torch: ``index_select`` gathers on the device, then one copy per
  tensor crosses to the pool; a retrieve copies the region to the device, then
  ``index_copy_``. The design for bandwidth there is the same shape as on CPU: one
  large transfer per tensor and chunk between the pool and a contiguous device
  buffer, scattered on the device. (Pinning the pool with ``cudaHostRegister`` so
  those transfers are DMA instead of staged through pageable memory is the next
  step; it needs a GPU to be measured.)

Threads: a ``CopyPool`` splits one chunk's tensors across lanes (the caller plus
helpers); copies are memory-bound, so the right count depends on the machine's
memory system, not its core count. ``measure_copy_threads`` times scattered
copies with 1, 2, 4, 8 threads at server start (~0.2 s) and keeps the fastest
(or a smaller count within 5% of it); ``--copy-threads`` overrides it. On the 2-core
development VM two numpy lanes beat one (scattered 32 KiB blocks ~5 -> ~7.5 GB/s),
where two torch intra-op threads through HTTP had been slower than one.

Null blocks: on store their slot is filled from block 0 (always a valid index)
and marked absent in the entry's ``present`` mask, so the copy stays one call;
on retrieve they are never written.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from dataplane.blockcopy import BlockCopier
from dataplane.descriptors import TensorGeometry
from dataplane.layout import Region

__all__ = [
    "CopyPool",
    "Run",
    "TensorPlan",
    "block_runs",
    "configure_copy_threads",
    "gather_chunk",
    "make_plan",
    "measure_copy_threads",
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
    rows: np.ndarray | None = None
    """Streamable plans (``_streamable``): the address of each outer row of
    ``array`` (int64), so the block kernel's addresses need no per-tensor work."""
    region_rows: np.ndarray | None = None
    """Streamable plans: the byte offset in an entry of each outer row of the region."""

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


def configure_copy_threads(threads: int) -> int:
    """Set torch's intra-op threads (its CUDA copies, fallbacks) to ``threads``.

    Process-wide: the server does no other torch work.
    """
    threads = max(1, threads)
    torch.set_num_threads(threads)
    return threads


def measure_copy_threads(
    max_threads: int | None = None,
    *,
    nbytes: int = 32 << 20,
    block_bytes: int = 32 << 10,
    rounds: int = 7,
    attempts: int = 4,
) -> tuple[int, dict[int, float]]:
    """The copy thread count that moves scattered blocks fastest on this machine.

    Copies ``nbytes`` in blocks of ``block_bytes`` in random order (a retrieve's
    shape) between two shared-memory buffers (MAP_SHARED anonymous memory is shmem,
    like the pool and the workers' segments) with 1, 2, 4, ... threads up to
    ``max_threads`` (default ``min(8, cores)``), ``rounds`` rounds interleaved, and
    rates each count by its fastest round (noise from other processes only ever slows
    a round down; a median picked one thread about one start in three on the busy
    2-core VM, where two are 1.3-1.5x faster). When the two fastest counts come out
    within ``CLEAR_MARGIN`` of each other, it measures again, up to ``attempts``
    times in all, keeping every round: a burst of noise that slowed the larger counts
    picked one thread about one start in eight on that VM, where a real tie is rare.
    Returns the fastest count (a smaller one within 5% of it: fewer threads leave
    more cores to concurrent requests) and GB/s per count. About 0.2-0.3 s at start
    on the 2-core VM, up to ``attempts`` times that on a tie.
    """
    cores = os.cpu_count() or 1
    limit = max(1, min(8, cores) if max_threads is None else max_threads)
    counts = [n for n in (1, 2, 4, 8) if n <= limit]
    if len(counts) == 1:
        return 1, {}
    blocks = nbytes // block_bytes
    buf = mmap.mmap(-1, 2 * blocks * block_bytes)
    try:
        times: dict[int, list[float]] = {n: [] for n in counts}
        for attempt in range(max(1, attempts)):
            if attempt:
                time.sleep(0.05)  # let a burst of noise pass
            for n, more in _time_scatter(buf, counts, blocks, block_bytes, rounds).items():
                times[n] += more
            rates = {n: nbytes / min(t) / 1e9 for n, t in times.items()}
            first, second = sorted(rates.values(), reverse=True)[:2]
            if first >= CLEAR_MARGIN * second:
                break
    finally:
        buf.close()  # every view of it died with _time_scatter's frame
    best = max(rates.values())
    return min(n for n, rate in rates.items() if rate >= 0.95 * best), rates


CLEAR_MARGIN = 1.1
"""``measure_copy_threads`` measures again while its two fastest counts are closer
than this ratio."""


def _time_scatter(
    buf: mmap.mmap, counts: Sequence[int], blocks: int, block_bytes: int, rounds: int
) -> dict[int, list[float]]:
    raw = np.frombuffer(buf, dtype=np.int64)
    raw.fill(1)  # fault every page in before timing
    words = block_bytes // 8
    src = raw[: blocks * words].reshape(blocks, words)
    dst = raw[blocks * words :].reshape(blocks, words)
    order = np.random.default_rng(0).permutation(blocks)
    times: dict[int, list[float]] = {n: [] for n in counts}
    pools = {n: CopyPool(n) for n in counts}
    try:
        for _ in range(rounds):
            for n, pool in pools.items():
                jobs = [partial(_scatter_rows, dst, src, part) for part in np.array_split(order, n)]
                begin = time.perf_counter()
                pool.run(jobs)
                times[n].append(time.perf_counter() - begin)
    finally:
        for pool in pools.values():
            pool.close()
    return times


def _scatter_rows(dst: np.ndarray, src: np.ndarray, rows: np.ndarray) -> int:
    dst[rows] = src[: len(rows)]
    return int(rows.size) * int(src.shape[1]) * int(src.itemsize)


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
    plan = TensorPlan(region, view, dim, shape, stride, array)
    if not _streamable(plan):
        return plan
    assert array is not None
    outer = np.arange(array.shape[0], dtype=np.int64)
    rows = array.ctypes.data + outer * array.strides[0]
    region_rows = region.offset_bytes + outer * (stride[0] * array.itemsize)
    return dataclasses.replace(plan, rows=rows, region_rows=region_rows)


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


def _at(dim: int, start: int, n: int) -> tuple[slice, ...]:
    """Index of ``n`` blocks from ``start`` along ``dim``."""
    return (*(slice(None),) * dim, slice(start, start + n))


class CopyPool:
    """Threads that share one chunk's copies (its tensors split into lanes), and the
    streaming block kernel they use for scattered blocks when there is one
    (``dataplane.blockcopy``; numpy otherwise).

    ``threads`` counts the calling thread, which always takes a lane, so a copy
    progresses even when another request holds every helper. numpy and the kernel
    release the GIL while they move bytes, so lanes copy in parallel. ``run``
    returns only once every lane has stopped, so a chunk that fails is never written
    to after its caller aborts it. Owned by the server's runtime (``close`` at
    shutdown).
    """

    def __init__(self, threads: int = 1, kernel: BlockCopier | None = None) -> None:
        self.threads = max(1, threads)
        self.kernel = kernel
        self._helpers = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="mpcache-copy")
            if self.threads > 1
            else None
        )

    def run(self, jobs: Sequence[Callable[[], int]]) -> int:
        """Run ``jobs`` (each returns bytes copied) across the lanes; their sum."""
        if self._helpers is None or len(jobs) < 2:
            return sum(job() for job in jobs)
        lanes = [jobs[i :: self.threads] for i in range(min(self.threads, len(jobs)))]
        futures = [self._helpers.submit(_run_lane, lane) for lane in lanes[1:]]
        total = 0
        error: BaseException | None = None
        try:
            total += _run_lane(lanes[0])
        except BaseException as exc:
            error = exc
        for future in futures:  # every lane stops before the caller sees the outcome
            try:
                total += future.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return total

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)


def _run_lane(jobs: Sequence[Callable[[], int]]) -> int:
    return sum(job() for job in jobs)


_SERIAL = CopyPool(1)


def _streamable(plan: TensorPlan) -> bool:
    """Whether ``plan``'s blocks are contiguous rows of a ``[outer, blocks, words]``
    array (every word view is), so the block kernel can move them."""
    a = plan.array
    return a is not None and plan.dim == 1 and a.ndim == 3 and a.strides[2] == a.itemsize


StreamKey = tuple[int, int, int]
"""(group, block stride in the tensor, block bytes): plans that share it move their
blocks with one kernel call per lane (``_stream_jobs``)."""


def _streams_take(
    streams: dict[StreamKey, list[TensorPlan]],
    plan: TensorPlan,
    runs: list[Run] | None,
    kernel: BlockCopier | None,
) -> bool:
    """Add ``plan`` to ``streams`` if the block kernel moves its scattered blocks."""
    a = plan.array
    if runs is not None or kernel is None or plan.rows is None or a is None:
        return False
    key = (plan.region.group_index, a.strides[1], a.shape[2] * a.itemsize)
    streams.setdefault(key, []).append(plan)
    return True


def _stream_jobs(
    key: StreamKey,
    plans: list[TensorPlan],
    kernel: BlockCopier,
    entry: torch.Tensor,
    blocks: np.ndarray,
    slots: np.ndarray,
    lanes: int,
    *,
    store: bool,
) -> list[Callable[[], int]]:
    """Jobs moving ``blocks`` (ids in every plan's tensor) to or from ``slots`` (in
    every plan's region of ``entry``), the rows of all plans split across ``lanes``.

    The kernel writes where these addresses point, so ids and slots are checked
    against the tensors and the regions here, whatever the callers validated."""
    _, block_stride, block_bytes = key
    if blocks.size and (
        int(blocks.min()) < 0 or int(blocks.max()) >= min(p.view.shape[1] for p in plans)
    ):
        raise IndexError("block ids outside the registered tensors")
    per_region = plans[0].region_shape[1]
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= per_region):
        raise IndexError(f"slots outside [0, {per_region})")
    if any(p.region.offset_bytes + p.region.nbytes > entry.numel() for p in plans):
        raise ValueError("the entry is smaller than the registration's regions")
    rows = np.concatenate([p.rows for p in plans if p.rows is not None])
    region_rows = np.concatenate([p.region_rows for p in plans if p.region_rows is not None])
    tensor_side = rows[:, None] + blocks[None, :] * block_stride
    entry_side = (entry.data_ptr() + region_rows)[:, None] + slots[None, :] * block_bytes
    src, dst = (tensor_side, entry_side) if store else (entry_side, tensor_side)
    bounds = np.linspace(0, len(rows), max(1, min(lanes, len(rows))) + 1).astype(int)
    return [
        partial(_stream_rows, kernel, src[a:b], dst[a:b], block_bytes)
        for a, b in itertools.pairwise(bounds.tolist())
        if b > a
    ]


def _stream_rows(kernel: BlockCopier, src: np.ndarray, dst: np.ndarray, block_bytes: int) -> int:
    kernel.copy(src.ravel(), dst.ravel(), block_bytes)
    return int(src.size) * block_bytes


def _gather_cpu(
    plan: TensorPlan,
    ids: np.ndarray,
    runs: list[Run] | None,
    dst: np.ndarray,
) -> int:
    src = plan.array
    assert src is not None
    d = plan.dim
    if runs is not None:
        for slot, block, n in runs:
            dst[_at(d, slot, n)] = src[_at(d, block, n)]
    else:
        # Unbuffered only with mode="clip" (ids are validated): "raise" copies via a
        # temporary. Straight into the (contiguous) region measured faster than
        # gathering into a cached buffer first and streaming that out.
        np.take(src, ids, axis=d, out=dst, mode="clip")
    return plan.region.nbytes


def gather_chunk(
    plans: Sequence[TensorPlan],
    group_ids: Sequence[np.ndarray],
    entry_bytes: torch.Tensor,
    pool: CopyPool = _SERIAL,
) -> int:
    """Copy one chunk's blocks (``group_ids[g]``, nulls read block 0) into an entry.

    Returns the bytes copied. CPU tensors are split across ``pool``'s lanes.
    """
    runs: dict[int, list[Run] | None] = {}
    indices: dict[tuple[int, torch.device], torch.Tensor] = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    entry_array: np.ndarray | None = None
    jobs: list[Callable[[], int]] = []
    streams: dict[StreamKey, list[TensorPlan]] = {}
    copied = 0
    for plan in plans:
        g = plan.region.group_index
        if g not in runs:
            ids = group_ids[g]
            runs[g] = block_runs(np.arange(len(ids)), ids)
        group_runs = runs[g]
        if plan.array is not None:
            if _streams_take(streams, plan, group_runs, pool.kernel):
                continue
            if entry_array is None:
                entry_array = entry_bytes.numpy()
            dst_array = plan.region_array(entry_array)
            ids64 = np.ascontiguousarray(group_ids[g], dtype=np.int64)
            jobs.append(partial(_gather_cpu, plan, ids64, group_runs, dst_array))
            continue
        entry_typed = typed.get(plan.view.dtype)
        if entry_typed is None:
            entry_typed = typed[plan.view.dtype] = entry_bytes.view(plan.view.dtype)
        dst = plan.region_in(entry_typed)
        if group_runs is not None:
            for slot, block, n in group_runs:
                dst.narrow(plan.dim, slot, n).copy_(plan.view.narrow(plan.dim, block, n))
        else:
            device = plan.view.device
            idx = indices.get((g, device))
            if idx is None:
                idx = indices[(g, device)] = _index(group_ids[g], device)
            dst.copy_(plan.view.index_select(plan.dim, idx))
        copied += plan.region.nbytes
    for key, stream in streams.items():
        assert pool.kernel is not None
        ids64 = np.ascontiguousarray(group_ids[key[0]], dtype=np.int64)
        if len(ids64) != stream[0].region_shape[1]:
            raise ValueError(
                f"{len(ids64)} block ids for a region of {stream[0].region_shape[1]} blocks"
            )
        slots = np.arange(len(ids64), dtype=np.int64)
        jobs += _stream_jobs(
            key, stream, pool.kernel, entry_bytes, ids64, slots, pool.threads, store=True
        )
    return copied + pool.run(jobs)


def _scatter_cpu(
    plan: TensorPlan,
    idx: np.ndarray,
    positions: np.ndarray | None,
    runs: list[Run] | None,
    src: np.ndarray,
) -> int:
    dst = plan.array
    assert dst is not None
    d = plan.dim
    if runs is not None:
        for slot, block, n in runs:
            dst[_at(d, block, n)] = src[_at(d, slot, n)]
    else:
        if positions is not None:
            src = np.take(src, positions, axis=d)
        target: Any = (*(slice(None),) * d, idx)
        dst[target] = src
    block_bytes = plan.region.nbytes // plan.region_shape[d]
    return block_bytes * int(idx.size)


def scatter_chunk(
    plans: Sequence[TensorPlan],
    group_ids: Sequence[np.ndarray],
    entry_bytes: torch.Tensor,
    pool: CopyPool = _SERIAL,
) -> int:
    """Copy an entry's blocks into the non-null blocks of ``group_ids``.

    Returns the bytes written. CPU tensors are split across ``pool``'s lanes; CUDA
    copies are synchronised before returning.
    """
    selected: dict[int, tuple[np.ndarray, np.ndarray | None, list[Run] | None]] = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    entry_array: np.ndarray | None = None
    jobs: list[Callable[[], int]] = []
    streams: dict[StreamKey, list[TensorPlan]] = {}
    copied = 0
    cuda_devices: set[torch.device] = set()
    for plan in plans:
        g = plan.region.group_index
        if g not in selected:
            ids = group_ids[g]
            slots = np.flatnonzero(ids)
            full = len(slots) == len(ids)
            sel = ids.astype(np.int64) if full else ids[slots].astype(np.int64)
            selected[g] = (sel, None if full else slots, block_runs(slots, sel))
        idx, positions, group_runs = selected[g]
        if idx.size == 0:
            continue
        if plan.array is not None:
            if _streams_take(streams, plan, group_runs, pool.kernel):
                continue
            if entry_array is None:
                entry_array = entry_bytes.numpy()
            src_array = plan.region_array(entry_array)
            jobs.append(partial(_scatter_cpu, plan, idx, positions, group_runs, src_array))
            continue
        cuda_devices.add(plan.view.device)
        entry_typed = typed.get(plan.view.dtype)
        if entry_typed is None:
            entry_typed = typed[plan.view.dtype] = entry_bytes.view(plan.view.dtype)
        src_t = plan.region_in(entry_typed)
        if group_runs is not None:
            for slot, block, n in group_runs:
                plan.view.narrow(plan.dim, block, n).copy_(src_t.narrow(plan.dim, slot, n))
        else:
            device = plan.view.device
            if positions is not None:
                src_t = src_t.index_select(plan.dim, torch.from_numpy(positions))
            plan.view.index_copy_(plan.dim, _index(idx, device), src_t.to(device))
        block_bytes = plan.region.nbytes // plan.region_shape[plan.dim]
        copied += block_bytes * int(idx.size)
    for key, stream in streams.items():
        assert pool.kernel is not None
        idx, positions, _ = selected[key[0]]
        slots = np.arange(len(idx), dtype=np.int64) if positions is None else positions
        jobs += _stream_jobs(
            key, stream, pool.kernel, entry_bytes, idx, slots, pool.threads, store=False
        )
    copied += pool.run(jobs)
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return copied
