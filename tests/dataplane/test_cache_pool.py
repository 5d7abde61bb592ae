"""The pool: page allocation, all-or-nothing visibility, pins, leases, LRU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataplane.pool import PRESENT, Entry, PageAllocator, Pool
from dataplane.segments import segment_name

PAGE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> Iterator[Pool]:
    p = Pool.create(segment_name("pool"), 4 * PAGE, PAGE, clock=clock)
    try:
        yield p
    finally:
        p.close()


def put(pool: Pool, key: bytes, *, pages: int = 1, present: int = 1, rank: int = 0) -> Entry:
    entry = pool.begin_store(key, rank, nbytes=pages * PAGE, layout=b"L", present=present)
    assert isinstance(entry, Entry)
    pool.view(entry).fill_(key[0])
    pool.commit(entry)
    return entry


def test_allocator_first_fit_and_coalescing() -> None:
    alloc = PageAllocator(10)
    a, b, c = alloc.alloc(3), alloc.alloc(3), alloc.alloc(3)
    assert (a, b, c) == (0, 3, 6)
    assert alloc.alloc(2) is None
    alloc.free(3, 3)
    assert alloc.largest_run() == 3
    alloc.free(0, 3)
    assert alloc.largest_run() == 6  # merged with the next run
    alloc.free(6, 3)
    assert alloc.largest_run() == 10 and alloc.free_pages == 10
    with pytest.raises(ValueError, match="double free"):
        alloc.free(2, 2)


def test_pending_entries_are_invisible_until_commit(pool: Pool) -> None:
    entry = pool.begin_store(b"k", 0, nbytes=100, layout=b"L", present=1)
    assert isinstance(entry, Entry)
    assert pool.lookup([b"k"], 1) == 0
    assert pool.pin(b"k", 0, b"L", 1) is None
    assert pool.begin_store(b"k", 0, nbytes=100, layout=b"L", present=1) == PRESENT
    pool.commit(entry)
    assert pool.lookup([b"k"], 1) == 1
    assert pool.begin_store(b"k", 0, nbytes=100, layout=b"L", present=1) == PRESENT


def test_abort_frees_the_reservation(pool: Pool) -> None:
    entry = pool.begin_store(b"k", 0, nbytes=4 * PAGE, layout=b"L", present=1)
    assert isinstance(entry, Entry)
    pool.abort(entry)
    assert pool.stats().used_bytes == 0
    assert pool.lookup([b"k"], 1) == 0


def test_lru_eviction_skips_pinned_and_leased(pool: Pool, clock: FakeClock) -> None:
    dropped: list[tuple[bytes, str]] = []
    pool.on_drop = lambda entries, reason: dropped.extend((e.key, reason) for e in entries)
    for key in (b"a", b"b", b"c", b"d"):
        put(pool, key)
    pinned = pool.pin(b"a", 0, b"L", 1)
    assert pinned is not None
    assert pool.lookup([b"b"], 1, holder="req", lease_ttl_s=10) == 1
    put(pool, b"e")  # a is pinned, b leased: c goes
    assert dropped == [(b"c", "evicted")]
    pool.unpin(pinned)
    clock.now = 11  # the lease lapsed
    put(pool, b"f")
    put(pool, b"g")
    assert [k for k, _ in dropped] == [b"c", b"d", b"a"]
    assert pool.lookup([b"b"], 1) == 1


def test_a_pinned_entry_keeps_its_pages_when_replaced(pool: Pool) -> None:
    old = put(pool, b"x", present=0b01)
    pinned = pool.pin(b"x", 0, b"L", 0b01)
    assert pinned is old
    new = pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"L", present=0b11)
    assert isinstance(new, Entry) and new.offset_bytes != old.offset_bytes
    pool.view(new).fill_(7)
    pool.commit(new)
    assert int(pool.view(old)[0]) == ord("x")  # still readable, not reused
    assert pool.stats().used_bytes == 2 * PAGE
    pool.unpin(old)
    assert pool.stats().used_bytes == PAGE
    assert pool.pin(b"x", 0, b"L", 0b10) is new


def test_subset_or_other_layout_is_present_not_replaced(pool: Pool) -> None:
    put(pool, b"x", present=0b11)
    assert pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"L", present=0b01) == PRESENT
    assert pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"M", present=0b111) == PRESENT
    assert pool.pin(b"x", 0, b"M", 0) is None  # another layout never reads it


def test_lookup_needs_every_rank_and_stops_at_first_miss(pool: Pool) -> None:
    put(pool, b"a", rank=0)
    put(pool, b"a", rank=1)
    put(pool, b"b", rank=0)
    put(pool, b"c", rank=1)
    assert pool.lookup([b"a", b"b", b"c"], 1) == 2
    assert pool.lookup([b"a", b"b", b"c"], 2) == 1


def test_too_large_and_full_pool(pool: Pool) -> None:
    assert pool.begin_store(b"big", 0, nbytes=5 * PAGE, layout=b"L", present=1) is None
    entries = [
        pool.begin_store(bytes([i]), 0, nbytes=PAGE, layout=b"L", present=1) for i in range(4)
    ]
    assert all(isinstance(e, Entry) for e in entries)
    # Everything is pending (not evictable): no room.
    assert pool.begin_store(b"z", 0, nbytes=PAGE, layout=b"L", present=1) is None


def test_release_leases_and_close(pool: Pool) -> None:
    put(pool, b"a")
    pool.lookup([b"a"], 1, holder="r", lease_ttl_s=100)
    assert pool.stats().leased_keys == 1
    pool.release_leases("r")
    assert pool.stats().leased_keys == 0
    name = pool.segment.name
    pool.close()
    pool.close()  # idempotent
    import os

    assert not os.path.exists(f"/dev/shm/{name}")
