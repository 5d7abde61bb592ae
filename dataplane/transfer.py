"""Copy kernels: gather a chunk's blocks into a pool entry, scatter them back.

``gather_chunk`` (a store) and ``scatter_chunk`` (a retrieve) keep only their
direction: which blocks of each group move (``_Blocks``) and the kernel calls that
move them. What both share is ``_ChunkCopy``: the entry's views, the streaming block
kernel's addresses and the ``CopyPool`` threads that run the copies. Each tensor's
kernel follows from its ``TensorPlan`` (``dataplane.plans``) and its block ids:

- CPU, ids in runs (as vLLM hands out fresh blocks): one numpy slice copy per run;
- CPU, scattered ids: the streaming block kernel (``dataplane.blockcopy``) when the
  ``CopyPool`` has one, else one numpy index kernel per tensor;
- CUDA: torch on the device, on the current stream (the server's own,
  ``dataplane.device_path``): the chunk's tensors are gathered into (or scattered
  out of) a staging buffer laid out as the entry, which crosses to the pool in one
  asynchronous copy (one DMA where the pool is pinned); the stream, never the
  device, is synchronised before the call returns.

Why each was chosen is on the functions that run it; bench/dataplane_bench.py
measures them. Null blocks: on store their slot is filled from block 0 (always a
valid index) and marked absent in the entry's ``present`` mask, so the copy stays
one call; on retrieve they are never written.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from dataplane.blockcopy import BlockCopier
from dataplane.cpu_pressure import CpuPressure
from dataplane.plans import TensorPlan

__all__ = [
    "CopyPool",
    "Run",
    "block_runs",
    "configure_copy_threads",
    "gather_chunk",
    "measure_copy_threads",
    "scatter_chunk",
]


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
    rates each count by its fastest round: noise from other processes only ever
    slows a round down, and on a busy machine a median often picked one thread
    where more were faster. When the two fastest counts come out within
    ``CLEAR_MARGIN`` of each other, it measures again, up to ``attempts`` times in
    all, keeping every round: a burst of noise that slowed only the larger counts
    must not decide, and a real tie is rare. Returns the fastest count (a smaller one
    within 5% of it: fewer threads leave more cores to concurrent requests) and GB/s
    per count. Run once at server start (unless ``--copy-threads`` is given), so the
    defaults keep it short; a tie repeats it up to ``attempts`` times.
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
                parts = np.array_split(order, pool.pieces)
                jobs = [partial(_scatter_rows, dst, src, part) for part in parts]
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


JOBS_PER_THREAD = 4
"""A kernel call is split into this many jobs per copy thread (``CopyPool.pieces``)."""


class _Jobs:
    """One ``CopyPool.run``'s jobs, taken one at a time by whichever thread is free;
    after a job fails, none is started."""

    def __init__(self, jobs: Sequence[Callable[[], int]]) -> None:
        self._jobs = jobs
        self._next = 0
        self._failed = False
        self._lock = threading.Lock()

    def _take(self) -> Callable[[], int] | None:
        with self._lock:
            if self._failed or self._next >= len(self._jobs):
                return None
            job = self._jobs[self._next]
            self._next += 1
            return job

    def drain(self) -> int:
        """Run jobs until none is left (or one failed); the bytes this thread copied."""
        copied = 0
        while (job := self._take()) is not None:
            try:
                copied += job()
            except BaseException:
                with self._lock:
                    self._failed = True
                raise
        return copied


class CopyPool:
    """Threads that share one chunk's copies (its tensors split into jobs), and the
    streaming block kernel they use for scattered blocks when there is one
    (``dataplane.blockcopy``; numpy otherwise).

    ``threads`` counts the calling thread, which always copies: the helpers take
    jobs from the same queue (``_Jobs``) as they get a core, so a helper that waits
    for one (the server shares its host with vLLM's busy processes) holds the chunk
    back by at most the job it has started, never by its share of the chunk: the
    caller copies what no helper took, and a helper that never started is cancelled.
    With ``pressure`` (``dataplane.cpu_pressure``; the pool closes it), a chunk wakes
    no helper while threads on the host wait for a core, so a copy does not take
    one from vLLM's step; ``on_alone`` is called for each chunk the caller then
    copies alone that helpers would have shared. A chunk gives each thread at least
    ``share_bytes`` (``run``'s ``nbytes``): waking a helper and waiting for it costs
    tens of microseconds, more than it saves on a small chunk (bench/
    copy_share_bench.py), so a chunk under twice that is the caller's alone. numpy
    and the kernel release
    the GIL while they move bytes, so jobs copy in parallel. Copies are memory-bound:
    the right count depends on the machine's memory system, not its core count, so
    the server measures it at start (``measure_copy_threads``; ``--copy-threads``
    overrides it). Threads of numpy
    copies are used rather than torch's intra-op threads, which through the server
    were slower than one. ``run`` returns only once every started job has stopped,
    so a chunk that fails is never written to after its caller aborts it. Owned by
    the server's runtime (``close`` at shutdown).
    """

    def __init__(
        self,
        threads: int = 1,
        kernel: BlockCopier | None = None,
        *,
        share_bytes: int = 0,
        pressure: CpuPressure | None = None,
        on_alone: Callable[[], None] | None = None,
    ) -> None:
        self.threads = max(1, threads)
        self.kernel = kernel
        self.share_bytes = max(0, share_bytes)
        self._pressure = pressure
        self._on_alone = on_alone
        self._helpers = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="mpcache-copy")
            if self.threads > 1
            else None
        )

    @property
    def pieces(self) -> int:
        """Jobs to split one kernel call into: enough that the caller can take a slow
        helper's share."""
        return 1 if self.threads == 1 else JOBS_PER_THREAD * self.threads

    def run(self, jobs: Sequence[Callable[[], int]], nbytes: int | None = None) -> int:
        """Run ``jobs`` (each returns bytes copied, ``nbytes`` in all where known) on
        the caller and the helpers that get to them; their sum."""
        helpers = self._helpers_for(len(jobs), nbytes)
        if self._helpers is None or helpers == 0:
            return sum(job() for job in jobs)
        queue = _Jobs(jobs)
        futures = [self._helpers.submit(queue.drain) for _ in range(helpers)]
        total = 0
        error: BaseException | None = None
        try:
            total += queue.drain()
        except BaseException as exc:
            error = exc
        for future in futures:  # every started job stops before the caller sees the outcome
            if future.cancel():
                continue
            try:
                total += future.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return total

    def _helpers_for(self, jobs: int, nbytes: int | None) -> int:
        """Helpers to wake for ``jobs`` jobs of ``nbytes``: one fewer threads than jobs
        at most, fewer than ``share_bytes`` a thread never, and none while the host's
        threads wait for a core."""
        threads = min(self.threads, jobs)
        if nbytes is not None and self.share_bytes:
            threads = min(threads, nbytes // self.share_bytes)
        helpers = threads - 1
        if helpers <= 0 or self._pressure is None or not self._pressure.busy():
            return max(0, helpers)
        if self._on_alone is not None:
            self._on_alone()
        return 0

    def close(self) -> None:
        """Stop the helpers (after the jobs they run), then the ``pressure`` probe."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
        if self._pressure is not None:
            self._pressure.close()


_SERIAL = CopyPool(1)


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


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The blocks of one group that one chunk's copy moves (worked out once per
    group, shared by the group's tensors)."""

    group: int
    ids: np.ndarray
    """Block ids (int64, contiguous), one per slot copied."""
    slots: np.ndarray | None
    """Their slots in the group's regions; None: every slot, ``0 .. len(ids) - 1``."""
    runs: list[Run] | None
    """``block_runs`` of the slots and ids (None: too fragmented for slice copies)."""

    def slot_array(self) -> np.ndarray:
        return np.arange(len(self.ids), dtype=np.int64) if self.slots is None else self.slots


def _every_slot(group: int, ids: np.ndarray) -> _Blocks:
    """A store's blocks: every slot of the chunk, nulls read from block 0."""
    ids64 = np.ascontiguousarray(ids, dtype=np.int64)
    return _Blocks(group, ids64, None, block_runs(np.arange(len(ids64)), ids64))


def _non_null_slots(group: int, ids: np.ndarray) -> _Blocks:
    """A retrieve's blocks: the slots whose block id is not null."""
    slots = np.flatnonzero(ids)
    if len(slots) == len(ids):
        every = ids.astype(np.int64)
        return _Blocks(group, every, None, block_runs(slots, every))
    picked = ids[slots].astype(np.int64)
    return _Blocks(group, picked, slots, block_runs(slots, picked))


StreamKey = tuple[int, int, int]
"""(group, block stride in the tensor, block bytes): plans that share it move their
blocks with one kernel call per job (``_stream_jobs``)."""


class _ChunkCopy:
    """One chunk's copy between an entry and the registered tensors, whichever way
    it goes: the direction hands it each tensor, it keeps what the tensors share.

    - ``blocks``: each group's ``_Blocks``, chosen by the direction's ``select``;
    - ``stream``: tensors whose scattered blocks the streaming kernel moves wait
      for ``run``, which works out every such tensor's block addresses in one numpy
      expression from the row addresses their plans keep, then makes one kernel call
      per job (per tensor, working out the addresses had cost as much as moving its
      blocks, and held the GIL the other threads needed);
    - ``jobs``: the direction's numpy copies, one per tensor, which ``run`` splits
      across the ``CopyPool``'s threads with the kernel's;
    - ``region_array``, ``region_tensor``, ``index``: the entry and the block ids as
      each kernel takes them, made once per chunk.
    """

    __slots__ = (
        "_array",
        "_blocks",
        "_group_ids",
        "_indices",
        "_select",
        "_staging",
        "_streams",
        "_typed",
        "entry_bytes",
        "jobs",
        "pool",
    )

    def __init__(
        self,
        group_ids: Sequence[np.ndarray],
        entry_bytes: torch.Tensor,
        pool: CopyPool,
        select: Callable[[int, np.ndarray], _Blocks],
    ) -> None:
        self.entry_bytes = entry_bytes
        self.pool = pool
        self.jobs: list[Callable[[], int]] = []
        self._group_ids = group_ids
        self._select = select
        self._blocks: dict[int, _Blocks] = {}
        self._streams: dict[StreamKey, tuple[_Blocks, list[TensorPlan]]] = {}
        self._array: np.ndarray | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._indices: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._staging: torch.Tensor | None = None

    def blocks(self, group: int) -> _Blocks:
        blocks = self._blocks.get(group)
        if blocks is None:
            blocks = self._blocks[group] = self._select(group, self._group_ids[group])
        return blocks

    def stream(self, plan: TensorPlan, blocks: _Blocks) -> bool:
        """Leave ``plan``'s blocks to the streaming kernel if it moves them (the pool
        has it, the plan is streamable, the ids are scattered)."""
        a = plan.array
        if blocks.runs is not None or self.pool.kernel is None or plan.rows is None or a is None:
            return False
        key = (blocks.group, a.strides[1], a.shape[2] * a.itemsize)
        waiting = self._streams.get(key)
        if waiting is None:
            self._streams[key] = (blocks, [plan])
        else:
            waiting[1].append(plan)
        return True

    def region_array(self, plan: TensorPlan) -> np.ndarray:
        """``plan``'s region of the entry, as numpy sees it (CPU plans)."""
        if self._array is None:
            self._array = self.entry_bytes.numpy()
        return plan.region_array(self._array)

    def staging(self, device: torch.device) -> torch.Tensor:
        """The chunk's staging buffer on ``device``: as many bytes as the entry, made
        on the current stream (the caching allocator reuses it only on that stream,
        after the copies queued there). A registration's tensors are on one device
        (``dataplane.registry``), so a chunk has one."""
        if self._staging is None:
            self._staging = torch.empty(self.entry_bytes.numel(), dtype=torch.uint8, device=device)
        return self._staging

    def staged_region(self, plan: TensorPlan) -> torch.Tensor:
        """``plan``'s region of the staging buffer, in the plan's dtype (CUDA plans)."""
        dtype = plan.view.dtype
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.staging(plan.view.device).view(dtype)
        return plan.region_in(typed)

    def index(self, blocks: _Blocks, device: torch.device, *, slots: bool = False) -> torch.Tensor:
        """``blocks.ids`` (``slots``: ``blocks.slot_array()``) as an index tensor on
        ``device`` (one per group and device). To a GPU it goes from pinned memory,
        asynchronously on the current stream (torch keeps the pinned block until the
        copy has run)."""
        key = (blocks.group * 2 + slots, device)
        idx = self._indices.get(key)
        if idx is None:
            idx = torch.from_numpy(blocks.slot_array() if slots else blocks.ids)
            if device.type != "cpu":
                idx = idx.pin_memory().to(device, non_blocking=True)
            self._indices[key] = idx
        return idx

    def run(self, *, store: bool) -> int:
        """Run the jobs and the streamed blocks (into the entry if ``store``, out of
        it otherwise) on the ``CopyPool``; the bytes they copied."""
        kernel = self.pool.kernel
        for key, (blocks, plans) in self._streams.items():
            assert kernel is not None
            self.jobs += _stream_jobs(
                key, plans, kernel, self.entry_bytes, blocks, self.pool.pieces, store=store
            )
        return self.pool.run(self.jobs, self.entry_bytes.numel())


def _stream_jobs(
    key: StreamKey,
    plans: list[TensorPlan],
    kernel: BlockCopier,
    entry: torch.Tensor,
    blocks: _Blocks,
    pieces: int,
    *,
    store: bool,
) -> list[Callable[[], int]]:
    """Jobs moving ``blocks`` between every plan's tensor and its region of
    ``entry``, the rows of all plans split into ``pieces``."""
    _, block_stride, block_bytes = key
    slots = blocks.slot_array()
    _check_stream(plans, entry, blocks.ids, slots, store=store)
    rows = np.concatenate([p.rows for p in plans if p.rows is not None])
    region_rows = np.concatenate([p.region_rows for p in plans if p.region_rows is not None])
    tensor_side = rows[:, None] + blocks.ids[None, :] * block_stride
    entry_side = (entry.data_ptr() + region_rows)[:, None] + slots[None, :] * block_bytes
    src, dst = (tensor_side, entry_side) if store else (entry_side, tensor_side)
    bounds = np.linspace(0, len(rows), max(1, min(pieces, len(rows))) + 1).astype(int)
    return [
        partial(_stream_rows, kernel, src[a:b], dst[a:b], block_bytes)
        for a, b in itertools.pairwise(bounds.tolist())
        if b > a
    ]


def _check_stream(
    plans: list[TensorPlan], entry: torch.Tensor, ids: np.ndarray, slots: np.ndarray, *, store: bool
) -> None:
    """The kernel writes where the addresses point, so ids and slots are checked
    against the tensors and the regions here, whatever the callers validated; a
    store fills every slot of its regions."""
    per_region = plans[0].region_shape[1]
    if store and len(ids) != per_region:
        raise ValueError(f"{len(ids)} block ids for a region of {per_region} blocks")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= min(p.view.shape[1] for p in plans)):
        raise IndexError("block ids outside the registered tensors")
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= per_region):
        raise IndexError(f"slots outside [0, {per_region})")
    if any(p.region.offset_bytes + p.region.nbytes > entry.numel() for p in plans):
        raise ValueError("the entry is smaller than the registration's regions")


def _stream_rows(kernel: BlockCopier, src: np.ndarray, dst: np.ndarray, block_bytes: int) -> int:
    kernel.copy(src.ravel(), dst.ravel(), block_bytes)
    return int(src.size) * block_bytes


def _sync_current_stream(device: torch.device) -> None:
    """Wait for what this thread queued on ``device``'s current stream: the server's
    own in a call (``dataplane.device_path``); never a device-wide sync."""
    torch.cuda.current_stream(device).synchronize()


def _at(dim: int, start: int, n: int) -> tuple[slice, ...]:
    """Index of ``n`` blocks from ``start`` along ``dim``."""
    return (*(slice(None),) * dim, slice(start, start + n))


# ---------------------------------------------------------------------- store


def gather_chunk(
    plans: Sequence[TensorPlan],
    group_ids: Sequence[np.ndarray],
    entry_bytes: torch.Tensor,
    pool: CopyPool = _SERIAL,
    *,
    wait: bool = True,
) -> int:
    """Copy one chunk's blocks (``group_ids[g]``, nulls read block 0) into an entry.

    Returns the bytes copied. CPU tensors are split across ``pool``'s threads; CUDA
    copies run on the current stream, synchronised (that stream only) before
    returning, or, with ``wait`` False, only queued there: the caller waits for them
    (``dataplane.device_path.CopyWindow``) before the entry counts as written.
    """
    chunk = _ChunkCopy(group_ids, entry_bytes, pool, _every_slot)
    on_device: list[tuple[TensorPlan, _Blocks]] = []
    for plan in plans:
        blocks = chunk.blocks(plan.region.group_index)
        if plan.array is None:
            on_device.append((plan, blocks))
        elif not chunk.stream(plan, blocks):
            chunk.jobs.append(partial(_gather_cpu, plan, blocks, chunk.region_array(plan)))
    copied = _gather_device(on_device, chunk, wait=wait) if on_device else 0
    return copied + chunk.run(store=True)


def _gather_cpu(plan: TensorPlan, blocks: _Blocks, dst: np.ndarray) -> int:
    """numpy: each contiguous copy is one ``memmove``, which streams past the cache
    once long (``dataplane.streaming``); torch's strided ``copy_`` and
    ``index_select`` use their own loops, which never stream."""
    src = plan.array
    assert src is not None
    d = plan.dim
    if blocks.runs is not None:
        for slot, block, n in blocks.runs:
            dst[_at(d, slot, n)] = src[_at(d, block, n)]
    else:
        # Unbuffered only with mode="clip" (ids are validated): "raise" copies via a
        # temporary. Straight into the (contiguous) region beat gathering into a
        # cached buffer first and streaming that out.
        np.take(src, blocks.ids, axis=d, out=dst, mode="clip")
    return plan.region.nbytes


def _gather_device(
    pairs: Sequence[tuple[TensorPlan, _Blocks]], chunk: _ChunkCopy, *, wait: bool
) -> int:
    """torch (CUDA tensors), on the current stream: each tensor's blocks gathered on
    the device into its region of the staging buffer (``index_select``, one kernel a
    tensor, runs or not), then the buffer crosses to the entry in one copy: one DMA
    a chunk where the pool is pinned, at the link's bandwidth (a copy a tensor would
    cost a transfer's overhead each). Returns once the stream has run it (``wait``)."""
    device = pairs[0][0].view.device
    copied = 0
    for plan, blocks in pairs:
        index = chunk.index(blocks, device)
        torch.index_select(plan.view, plan.dim, index, out=chunk.staged_region(plan))
        copied += plan.region.nbytes
    chunk.entry_bytes.copy_(chunk.staging(device), non_blocking=True)
    if wait:
        _sync_current_stream(device)
    return copied


# ---------------------------------------------------------------------- retrieve


def scatter_chunk(
    plans: Sequence[TensorPlan],
    group_ids: Sequence[np.ndarray],
    entry_bytes: torch.Tensor,
    pool: CopyPool = _SERIAL,
    *,
    wait: bool = True,
) -> int:
    """Copy an entry's blocks into the non-null blocks of ``group_ids``.

    Returns the bytes written. CPU tensors are split across ``pool``'s threads; CUDA
    copies run on the current stream, synchronised (that stream only) before
    returning, or only queued there with ``wait`` False (as ``gather_chunk``: the
    entry stays pinned until the caller has waited).
    """
    chunk = _ChunkCopy(group_ids, entry_bytes, pool, _non_null_slots)
    on_device: list[tuple[TensorPlan, _Blocks]] = []
    for plan in plans:
        blocks = chunk.blocks(plan.region.group_index)
        if blocks.ids.size == 0:
            continue
        if plan.array is None:
            on_device.append((plan, blocks))
        elif not chunk.stream(plan, blocks):
            chunk.jobs.append(partial(_scatter_cpu, plan, blocks, chunk.region_array(plan)))
    copied = _scatter_device(on_device, chunk, wait=wait) if on_device else 0
    return copied + chunk.run(store=False)


def _scatter_cpu(plan: TensorPlan, blocks: _Blocks, src: np.ndarray) -> int:
    """numpy, as ``_gather_cpu``: one fancy-index assignment for scattered ids (a
    cached staging buffer streamed out afterwards was slower through the server)."""
    dst = plan.array
    assert dst is not None
    d = plan.dim
    if blocks.runs is not None:
        for slot, block, n in blocks.runs:
            dst[_at(d, block, n)] = src[_at(d, slot, n)]
    else:
        if blocks.slots is not None:
            src = np.take(src, blocks.slots, axis=d)
        target: Any = (*(slice(None),) * d, blocks.ids)
        dst[target] = src
    return plan.block_bytes * int(blocks.ids.size)


def _scatter_device(
    pairs: Sequence[tuple[TensorPlan, _Blocks]], chunk: _ChunkCopy, *, wait: bool
) -> int:
    """torch (CUDA tensors), on the current stream: the entry crosses to the staging
    buffer in one copy (as ``_gather_device``, mirrored), then ``index_copy_``
    scatters each tensor's non-null slots into its blocks. Returns once the stream
    has run it (``wait``): the entry may be unpinned, the worker may read its blocks."""
    device = pairs[0][0].view.device
    chunk.staging(device).copy_(chunk.entry_bytes, non_blocking=True)
    copied = 0
    for plan, blocks in pairs:
        src = chunk.staged_region(plan)
        if blocks.slots is not None:
            src = src.index_select(plan.dim, chunk.index(blocks, device, slots=True))
        plan.view.index_copy_(plan.dim, chunk.index(blocks, device), src)
        copied += plan.block_bytes * int(blocks.ids.size)
    if wait:
        _sync_current_stream(device)
    return copied
