"""Eviction cost is bounded when (nearly) every entry is leased (issue 8, item 4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contract.shm_naming import segment_name
from dataplane.pool import MAX_EVICTION_SCAN, Entry, Pool

PAGE = 4096
ENTRIES = MAX_EVICTION_SCAN + 300  # ~2.2 MiB of /dev/shm


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool.create(segment_name("pool"), ENTRIES * PAGE, PAGE)
    try:
        for i in range(ENTRIES):
            entry = p.begin_store(i.to_bytes(4, "little"), 0, nbytes=PAGE, layout=b"L", present=1)
            assert isinstance(entry, Entry)
            p.commit(entry)
        yield p
    finally:
        p.close()


def _keys(first: int, last: int) -> list[bytes]:
    return [i.to_bytes(4, "little") for i in range(first, last)]


def _count_examined(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record every entry an eviction examines (each unpinned one is lease-checked)."""
    seen: list[bytes] = []
    original = pool._leased

    def leased(key: bytes, now: float) -> bool:
        seen.append(key)
        return original(key, now)

    monkeypatch.setattr(pool, "_leased", leased)
    return seen


def test_a_store_into_a_full_all_leased_pool_fails_after_a_bounded_scan(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every entry is leased, one request per lookup call (as a burst of requests).
    for i in range(0, ENTRIES, 64):
        keys = _keys(i, min(i + 64, ENTRIES))
        assert pool.lookup(keys, 1, holder=f"r{i}", lease_ttl_s=3600) == len(keys)
    examined = _count_examined(pool, monkeypatch)
    assert pool.begin_store(b"new", 0, nbytes=PAGE, layout=b"L", present=1) is None
    assert 0 < len(examined) <= MAX_EVICTION_SCAN  # was: every entry, each time
    examined.clear()
    assert pool.begin_store(b"new2", 0, nbytes=PAGE, layout=b"L", present=1) is None
    assert 0 < len(examined) <= MAX_EVICTION_SCAN
    assert pool.stats().entries == ENTRIES  # nothing leased was evicted


def test_evictable_entries_behind_many_leased_ones_are_still_reached(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    leased = _keys(0, MAX_EVICTION_SCAN + 50)
    assert pool.lookup(leased, 1, holder="long-prompt", lease_ttl_s=3600) == len(leased)
    # Touch the others after: the leased entries are now the least recently used.
    others = _keys(len(leased), ENTRIES)
    assert pool.lookup(others, 1) == len(others)
    examined = _count_examined(pool, monkeypatch)
    attempts = [
        # a failed scan moves what it passed over out of the way of the next
        pool.begin_store(b"new", 0, nbytes=PAGE, layout=b"L", present=1)
        for _ in range(2)
    ]
    stored = next((e for e in attempts if e is not None), None)
    assert isinstance(stored, Entry), "no room after 2 attempts"
    assert len(examined) <= 2 * MAX_EVICTION_SCAN
    pool.abort(stored)
    assert pool.lookup(leased, 1) == len(leased)  # every leased entry survived


def test_entries_of_other_sizes_never_stall_eviction() -> None:
    """Two layouts share the pool: many small entries, each between two larger ones,
    are the least recently used. Freeing them all makes no run large enough; the walk
    goes on to the larger ones (it used to stop after MAX_EVICTION_SCAN entries and
    refuse every such store)."""
    pairs = MAX_EVICTION_SCAN + 10  # 1 + 3 pages each: ~4.2 MiB of /dev/shm
    pool = Pool.create(segment_name("pool"), pairs * 4 * PAGE, PAGE)
    try:
        small, large = _keys(0, pairs), _keys(pairs, 2 * pairs)
        for s, g in zip(small, large, strict=True):
            for key, pages in ((s, 1), (g, 3)):
                entry = pool.begin_store(key, 0, nbytes=pages * PAGE, layout=b"L", present=1)
                assert isinstance(entry, Entry)
                pool.commit(entry)
        assert pool.lookup(large, 1) == pairs  # the small ones are now the oldest
        stored = pool.begin_store(b"new", 0, nbytes=3 * PAGE, layout=b"L", present=1)
        assert isinstance(stored, Entry)
        pool.commit(stored)
        assert pool.lookup([b"new"], 1) == 1
    finally:
        pool.close()
