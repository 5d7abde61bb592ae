"""A chunk's copy gives each copy thread at least ``--copy-share`` bytes: a small
chunk is the calling thread's alone (waking a helper costs more than it saves on
it: bench/copy_share_bench.py), a large one is split as before."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from dataplane.transfer import CopyPool, gather_chunk, scatter_chunk
from tests.dataplane.support import attention_plans


def _threads(pool: CopyPool, nbytes: int | None, *, expect_helper: bool) -> set[int]:
    """The threads that ran 4 jobs of ``nbytes`` in all. With a helper expected, the
    jobs wait for two threads at once (so the caller cannot take them all); without,
    the caller's first job waits a while for another thread to take one, so a helper
    woken by mistake is seen."""
    seen: set[int] = set()
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=10) if expect_helper else None
    helped = threading.Event()
    caller = threading.get_ident()

    def job() -> int:
        me = threading.get_ident()
        with lock:
            first = not seen
            seen.add(me)
        if barrier is not None:
            barrier.wait()
        elif me != caller:
            helped.set()
        elif first:
            helped.wait(0.5)
        return 1

    assert pool.run([job] * 4, nbytes) == 4
    return seen


def test_a_chunk_under_two_shares_is_copied_by_the_caller_alone() -> None:
    pool = CopyPool(4, share_bytes=1000)
    try:
        assert _threads(pool, 1999, expect_helper=False) == {threading.get_ident()}
        assert _threads(pool, 0, expect_helper=False) == {threading.get_ident()}
        assert len(_threads(pool, 2000, expect_helper=True)) >= 2
        assert len(_threads(pool, None, expect_helper=True)) >= 2  # size unknown: split
    finally:
        pool.close()


def test_without_a_share_every_chunk_is_split() -> None:
    pool = CopyPool(2)
    try:
        assert len(_threads(pool, 1, expect_helper=True)) == 2
    finally:
        pool.close()


class _Sizes(CopyPool):
    """A serial pool that notes the size each chunk copy announces."""

    def __init__(self) -> None:
        super().__init__(1)
        self.sizes: list[int | None] = []

    def run(self, jobs: Sequence[Callable[[], int]], nbytes: int | None = None) -> int:
        self.sizes.append(nbytes)
        return super().run(jobs, nbytes)


def test_stores_and_retrieves_tell_the_pool_their_chunk_size() -> None:
    """The split is decided on the chunk's bytes, whichever way it is copied, and the
    bytes still move (a chunk copied alone is the same chunk)."""
    tensors = [(torch.rand(2, 9, 4, 2, 8) * 100).bfloat16() for _ in range(3)]
    plans, chunk_bytes = attention_plans(tensors, 16, 4)
    entry = torch.zeros(chunk_bytes, dtype=torch.uint8)
    pool = _Sizes()
    ids = [np.array([5, 6, 7, 8])]
    gather_chunk(plans, ids, entry, pool)
    copies = [torch.zeros_like(t) for t in tensors]
    back, _ = attention_plans(copies, 16, 4)
    scatter_chunk(back, [np.array([1, 2, 3, 4])], entry, pool)
    assert pool.sizes == [chunk_bytes, chunk_bytes]
    for src, dst in zip(tensors, copies, strict=True):
        assert torch.equal(src[:, 5:9], dst[:, 1:5])


@pytest.mark.parametrize(("setting", "share"), [(None, 2 << 20), ("1MiB", 1 << 20), ("0", 0)])
def test_the_server_copies_with_the_configured_share(setting: str | None, share: int) -> None:
    from app.settings import Settings
    from app.state import build_runtime

    extra = {} if setting is None else {"copy_share": setting}
    runtime = build_runtime(
        Settings(pool_size="1MiB", pool_prefault=False, copy_threads=2, **extra)
    )
    try:
        assert runtime.copier.share_bytes == share
        one = _threads(runtime.copier, share * 2 - 1, expect_helper=False) if share else None
        assert one in (None, {threading.get_ident()})
    finally:
        runtime.close()


def test_a_negative_share_is_refused() -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="copy_share"):
        Settings(copy_share="-1")
