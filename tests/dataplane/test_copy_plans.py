"""Copy plans: fast word views where possible, the same bytes either way."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from contract.schemas import MemfdTensor
from dataplane.descriptors import tensor_geometry
from dataplane.layout import BlockTensorSpec, ChunkLayout, GroupSpec, chunk_layout
from dataplane.plans import TensorPlan, make_plan
from dataplane.transfer import block_runs, gather_chunk, scatter_chunk
from tests.dataplane.support import streaming_kernel


def _plan_for(
    tensor: torch.Tensor, block_dim: int, n_per_chunk: int = 4
) -> tuple[TensorPlan, ChunkLayout]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    geo = tensor_geometry(
        MemfdTensor(
            ticket="t",
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

    def blocks(t: torch.Tensor, ids: list[int]) -> list[torch.Tensor]:
        return [t.select(block_dim, i).contiguous().view(torch.uint8) for i in ids]

    for store_ids, load_ids in ID_PAIRS:
        dst.zero_()
        copied = gather_chunk([plan], [np.array(store_ids)], entry)
        assert copied == layout.regions[0].nbytes
        pairs = [(a, b) for a, b in zip(store_ids, load_ids, strict=True) if a and b]
        written = scatter_chunk([dst_plan], [np.array(load_ids)], entry)
        assert written == copied // 4 * sum(1 for b in load_ids if b)  # nulls never written
        for a, b in zip(
            blocks(src, [a for a, _ in pairs]), blocks(dst, [b for _, b in pairs]), strict=True
        ):
            assert torch.equal(a, b)
        assert not dst.select(block_dim, 0).contiguous().view(torch.uint8).any()


ID_PAIRS = [
    ([3, 0, 7, 5], [9, 0, 1, 2]),  # fragmented: index kernels
    ([4, 5, 6, 7], [8, 9, 10, 11]),  # one run each: slice copies
    ([4, 5, 6, 7], [0, 0, 2, 3]),  # a run after nulls
    ([1, 2, 0, 0], [5, 4, 3, 2]),  # run in, fragmented out
]


@pytest.mark.parametrize(
    ("slots", "ids", "runs"),
    [
        pytest.param([0, 1, 2, 3], [4, 5, 6, 7], [(0, 4, 4)], id="one-run"),
        pytest.param(list(range(8)), [1, 2, 3, 4, 9, 10, 11, 12], [(0, 1, 4), (4, 9, 4)], id="two"),
        pytest.param([2, 3], [7, 8], [(2, 7, 2)], id="after-nulls"),
        pytest.param([0, 2], [7, 8], None, id="slot-gap"),
        pytest.param([0, 1, 2, 3], [4, 3, 2, 1], None, id="descending"),
        pytest.param([0], [9], [(0, 9, 1)], id="single"),
        pytest.param([], [], [], id="empty"),
    ],
)
def test_block_runs(
    slots: list[int], ids: list[int], runs: list[tuple[int, int, int]] | None
) -> None:
    assert block_runs(np.array(slots, dtype=np.int64), np.array(ids, dtype=np.int64)) == runs


def test_after_a_copy_job_fails_none_starts_and_every_started_one_ends_first() -> None:
    """A chunk whose copy fails is aborted by its caller: no thread may still be
    writing into the entry by then, nor start writing afterwards."""
    import threading
    import time

    from dataplane.transfer import CopyPool

    pool = CopyPool(3)
    started: set[int] = set()
    finished: set[int] = set()
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            started.add(i)
        if i == 0:
            time.sleep(0.01)  # the helpers have started theirs
            raise RuntimeError("job 0 failed")
        time.sleep(0.05)
        with lock:
            finished.add(i)
        return i

    try:
        jobs = [lambda i=i: job(i) for i in range(8)]  # type: ignore[misc]
        with pytest.raises(RuntimeError, match="job 0 failed"):
            pool.run(jobs)
        with lock:
            at_raise = set(finished), set(started)
        time.sleep(0.1)
        assert at_raise[0] == at_raise[1] - {0}  # every started job had ended
        assert started == at_raise[1]  # and none started after
        assert len(started) < len(jobs)
        assert pool.run([lambda: 1, lambda: 2, lambda: 3]) == 6
    finally:
        pool.close()


def test_a_busy_helper_never_holds_a_copy_back() -> None:
    """The caller copies every job no helper took: a helper that cannot start (here:
    busy with another request's copy; on a loaded host: waiting for a core) does
    not delay the chunk."""
    import threading

    from dataplane.transfer import CopyPool

    pool = CopyPool(2)
    release = threading.Event()
    released: list[bool] = []
    both_blocked = threading.Barrier(3, timeout=10)

    def blocker() -> int:
        both_blocked.wait()
        released.append(release.wait(5))
        return 0

    other = threading.Thread(target=pool.run, args=([blocker, blocker],))
    other.start()
    try:
        both_blocked.wait()  # the other request holds the caller and the one helper
        assert pool.run([lambda i=i: i for i in range(8)]) == 28  # type: ignore[misc]
        assert released == []  # returned while the helper was still busy
    finally:
        release.set()
        other.join(10)
        pool.close()
    assert released == [True, True]


@pytest.mark.parametrize("kernel", ["numpy", "streaming"])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float64],
    ids=str,
)
def test_every_path_and_lane_count_moves_the_same_bytes(
    threads: int, dtype: torch.dtype, kernel: str
) -> None:
    """Runs, scattered blocks, null blocks, several tensors split across lanes, with
    numpy or the streaming block kernel: the entry and the retrieved blocks hold
    exactly the source bytes."""
    from dataplane.transfer import CopyPool

    gen = torch.Generator().manual_seed(threads)
    shape = (2, 24, 16, 2, 8)
    srcs = [(torch.rand(shape, generator=gen) * 100).to(dtype) for _ in range(3)]  # three "layers"
    dsts = [torch.zeros_like(t) for t in srcs]
    plans = [_plan_for(t, 1)[0] for t in srcs]
    dst_plans = [_plan_for(t, 1)[0] for t in dsts]
    layout = _plan_for(srcs[0], 1)[1]
    # Regions of one layer each: give each plan its own entry.
    pool = CopyPool(threads, streaming_kernel() if kernel == "streaming" else None)
    try:
        for store_ids, load_ids in ID_PAIRS:
            for d in dsts:
                d.zero_()
            entries = [torch.zeros(layout.chunk_bytes, dtype=torch.uint8) for _ in plans]
            for plan, dst_plan, entry in zip(plans, dst_plans, entries, strict=True):
                copied = gather_chunk([plan], [np.array(store_ids)], entry, pool)
                assert copied == layout.regions[0].nbytes
                scatter_chunk([dst_plan], [np.array(load_ids)], entry, pool)
            both = gather_chunk(plans[:1] * 2, [np.array(store_ids)], entries[0], pool)
            assert both == 2 * layout.regions[0].nbytes
            for src, dst in zip(srcs, dsts, strict=True):
                for a, b in zip(store_ids, load_ids, strict=True):
                    if a and b:
                        assert torch.equal(src[:, a].view(torch.uint8), dst[:, b].view(torch.uint8))
                assert not dst[:, 0].view(torch.uint8).any()  # null block never written
    finally:
        pool.close()


def test_the_block_kernel_never_writes_outside_the_tensors() -> None:
    """Block ids are validated before any copy; should one slip through, the kernel
    path refuses it as numpy's indexing would, instead of writing past a tensor."""
    from dataplane.transfer import CopyPool

    src = torch.randn(2, 12, 16, 2, 8).bfloat16()
    dst = torch.zeros_like(src)
    plan, layout = _plan_for(src, 1)
    dst_plan, _ = _plan_for(dst, 1)
    entry = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
    pool = CopyPool(1, streaming_kernel())
    with pytest.raises(IndexError, match="outside"):
        gather_chunk([plan], [np.array([3, 12, 7, 5])], entry, pool)
    with pytest.raises(ValueError, match="5 block ids for a region of 4"):
        gather_chunk([plan], [np.array([3, 1, 7, 5, 2])], entry, pool)
    with pytest.raises(IndexError, match="outside"):
        scatter_chunk([dst_plan], [np.array([9, 2, 13, 4])], entry, pool)
    assert not dst.view(torch.uint8).any()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kernel", ["numpy", "streaming"])
def test_a_chunk_of_many_layers_lands_in_their_own_regions(threads: int, kernel: str) -> None:
    """Several layers share one entry, each in its own region, and the streaming
    kernel moves all of them in one call per lane: every layer's blocks land in its
    region and come back to the right blocks, whatever the lane count."""
    from dataplane.transfer import CopyPool

    n_per_chunk, layers = 4, 5
    gen = torch.Generator().manual_seed(threads)
    srcs = [torch.randn(2, 20, 16, 2, 8, generator=gen).bfloat16() for _ in range(layers)]
    dsts = [torch.zeros_like(t) for t in srcs]
    specs = []
    geos = {}
    for i, t in enumerate(srcs):
        geo = tensor_geometry(
            MemfdTensor(
                ticket="t",
                offset_bytes=0,
                shape=list(t.shape),
                stride=list(t.stride()),
                dtype="bfloat16",
                block_dim=1,
            )
        )
        geos[i] = geo
        specs.append(BlockTensorSpec(f"l{i}", 0, geo.dtype_name, geo.itemsize, geo.shape, 1))
    layout = chunk_layout(16 * n_per_chunk, [GroupSpec(0, "attention", 16)], specs)
    plans = [make_plan(t, geos[i], layout.regions[i]) for i, t in enumerate(srcs)]
    back = [make_plan(t, geos[i], layout.regions[i]) for i, t in enumerate(dsts)]
    entry = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
    pool = CopyPool(threads, streaming_kernel() if kernel == "streaming" else None)
    try:
        store_ids, load_ids = [17, 3, 11, 6], [2, 19, 0, 8]  # scattered; one null slot
        copied = gather_chunk(plans, [np.array(store_ids)], entry, pool)
        assert copied == layout.chunk_bytes == sum(r.nbytes for r in layout.regions)
        for i, region in enumerate(layout.regions):
            got = entry[region.offset_bytes : region.offset_bytes + region.nbytes]
            want = srcs[i][:, store_ids].contiguous().view(torch.uint8).flatten()
            assert torch.equal(got, want), f"layer {i}'s region"
        scatter_chunk(back, [np.array(load_ids)], entry, pool)
        for src, dst in zip(srcs, dsts, strict=True):
            for a, b in zip(store_ids, load_ids, strict=True):
                if b:
                    assert torch.equal(src[:, a].view(torch.uint8), dst[:, b].view(torch.uint8))
            assert not dst[:, 0].view(torch.uint8).any()
    finally:
        pool.close()


@pytest.mark.parametrize("layers", [1, 3])
def test_the_device_path_moves_the_same_bytes(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch kernels CUDA tensors use (``index_select`` into a staging buffer on
    store, ``index_copy_`` out of one on retrieve), run here on CPU tensors seen as a
    device's: plans without a numpy array take that path. Runs, scattered ids and
    nulls all land where the numpy path puts them, and each chunk synchronises its
    stream once each way (the current stream, never the device)."""
    import dataclasses

    from dataplane import transfer

    synced: list[torch.device] = []
    monkeypatch.setattr(transfer, "_sync_current_stream", synced.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: pytest.fail("a device-wide sync"))

    def device_plan(t: torch.Tensor) -> TensorPlan:
        plan = _plan_for(t, 1)[0]
        return dataclasses.replace(plan, array=None, rows=None, region_rows=None)

    gen = torch.Generator().manual_seed(layers)
    srcs = [torch.randn(2, 12, 16, 2, 8, generator=gen).bfloat16() for _ in range(layers)]
    dsts = [torch.zeros_like(t) for t in srcs]
    layout = _plan_for(srcs[0], 1)[1]
    for store_ids, load_ids in ID_PAIRS:
        for d in dsts:
            d.zero_()
        synced.clear()
        for src, dst in zip(srcs, dsts, strict=True):
            entry = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
            want = torch.zeros_like(entry)
            gather_chunk([_plan_for(src, 1)[0]], [np.array(store_ids)], want)
            copied = gather_chunk([device_plan(src)], [np.array(store_ids)], entry)
            assert copied == layout.regions[0].nbytes and torch.equal(entry, want)
            written = scatter_chunk([device_plan(dst)], [np.array(load_ids)], entry)
            assert written == copied // 4 * sum(1 for b in load_ids if b)
            for a, b in zip(store_ids, load_ids, strict=True):
                if a and b:
                    assert torch.equal(src[:, a].view(torch.uint8), dst[:, b].view(torch.uint8))
            assert not dst[:, 0].view(torch.uint8).any()
        assert synced == [torch.device("cpu")] * (2 * layers)
