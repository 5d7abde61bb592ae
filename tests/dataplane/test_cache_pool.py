"""The pool: page allocation, all-or-nothing visibility, pins, leases, LRU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contract.shm_naming import segment_name
from dataplane.pool import PRESENT, Entry, PageAllocator, Pool

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


def _evicts(pool: Pool, key: bytes) -> list[bytes]:
    """Store ``key`` into the full pool; the keys it evicted."""
    dropped: list[bytes] = []
    pool.on_drop = lambda entries, reason: dropped.extend(e.key for e in entries)
    put(pool, key)
    pool.on_drop = None
    return dropped


def test_lookup_many_answers_as_lookup_of_each(pool: Pool) -> None:
    for key in (b"a", b"b", b"c"):
        put(pool, key)
    put(pool, b"d", rank=1)
    asked = [([b"a", b"b", b"x", b"c"], 1, None), ([b"c", b"d"], 2, None), ([], 1, None)]
    assert pool.lookup_many(asked) == [2, 0, 0]
    assert pool.lookup_many([([b"d"], 1, None)]) == [0]  # rank 0 of d is not cached
    assert [pool.lookup(keys, ws) for keys, ws, _ in asked] == [2, 0, 0]


def test_lookup_many_leases_to_each_holder(pool: Pool) -> None:
    for key in (b"a", b"b", b"c", b"d"):
        put(pool, key)
    hits = pool.lookup_many([([b"a"], 1, "r1"), ([b"b", b"x"], 1, "r2")], lease_ttl_s=10)
    assert hits == [1, 1]
    assert pool.stats().leased_keys == 2
    # LRU order c, d, a, b: the leased a and b outlive every other entry.
    assert [_evicts(pool, k) for k in (b"e", b"f", b"g")] == [[b"c"], [b"d"], [b"e"]]
    pool.release_leases("r1")
    assert pool.stats().leased_keys == 1


def test_a_lookup_renews_every_lease_of_its_holder(pool: Pool, clock: FakeClock) -> None:
    put(pool, b"a")
    put(pool, b"b")
    pool.lookup([b"a"], 1, holder="r", lease_ttl_s=10)
    clock.now = 8
    pool.lookup([b"b"], 1, holder="r", lease_ttl_s=10)  # a's lease now runs to 18 too
    clock.now = 12
    assert pool.stats().leased_keys == 2
    clock.now = 18
    assert pool.stats().leased_keys == 0


def test_a_short_lease_lapses_behind_a_long_one(pool: Pool, clock: FakeClock) -> None:
    put(pool, b"a")
    put(pool, b"b")
    pool.lookup([b"a"], 1, holder="long", lease_ttl_s=100)
    pool.lookup([b"b"], 1, holder="short", lease_ttl_s=5)  # taken later, ends first
    clock.now = 6
    assert pool.stats().leased_keys == 1
    put(pool, b"c")
    put(pool, b"d")
    assert _evicts(pool, b"e") == [b"b"]  # the oldest entry, b, is no longer leased


def test_a_released_holder_that_leases_again_keeps_its_new_lease(
    pool: Pool, clock: FakeClock
) -> None:
    put(pool, b"a")
    pool.lookup([b"a"], 1, holder="r", lease_ttl_s=5)
    pool.release_leases("r")
    assert pool.stats().leased_keys == 0
    clock.now = 3
    pool.lookup([b"a"], 1, holder="r", lease_ttl_s=5)  # until 8
    clock.now = 6  # the first lease's deadline (5) has passed, not this one's
    assert pool.stats().leased_keys == 1
    clock.now = 8
    assert pool.stats().leased_keys == 0


def test_renewals_under_a_long_lease_keep_the_deadline_heap_bounded(
    pool: Pool, clock: FakeClock
) -> None:
    put(pool, b"a")
    for i in range(5000):  # a request re-looked up every step for an hour's lease
        clock.now = i * 0.01
        pool.lookup([b"a"], 1, holder="r", lease_ttl_s=3600)
    assert len(pool._leases.deadlines) <= 2 + 1024 + 1  # stale entries dropped, not kept
    assert pool.stats().leased_keys == 1
    clock.now = 49.99 + 3600
    assert pool.stats().leased_keys == 0  # the last renewal's deadline still holds


def test_two_holders_lease_one_key(pool: Pool) -> None:
    put(pool, b"a")
    pool.lookup_many([([b"a"], 1, "r1"), ([b"a"], 1, "r2")], lease_ttl_s=10)
    assert pool.stats().leased_keys == 1
    pool.release_leases("r1")
    assert pool.stats().leased_keys == 1  # r2 still leases it
    pool.release_leases("r2")
    pool.release_leases("r2")  # twice: nothing more to release
    assert pool.stats().leased_keys == 0


@pytest.mark.parametrize("hold", ["pinned", "leased"])
def test_eviction_that_cannot_make_room_evicts_nothing(
    pool: Pool, hold: str, clock: FakeClock
) -> None:
    dropped: list[bytes] = []
    pool.on_drop = lambda entries, reason: dropped.extend(e.key for e in entries)
    for key in (b"a", b"b", b"c", b"d"):
        put(pool, key)
    # b sits on page 1, so no run of 3 free pages can form in 4 pages.
    if hold == "pinned":
        assert pool.pin(b"b", 0, b"L", 1) is not None
    else:
        assert pool.lookup([b"b"], 1, holder="req", lease_ttl_s=10) == 1
    assert pool.begin_store(b"big", 0, nbytes=3 * PAGE, layout=b"L", present=1) is None
    assert dropped == []
    assert pool.stats().entries == 4
    assert pool.lookup([b"a", b"b", b"c", b"d"], 1) == 4


def test_eviction_evicts_only_the_entries_under_the_window(clock: FakeClock) -> None:
    pool = Pool.create(segment_name("pool"), 4 * PAGE, PAGE, clock=clock)
    try:
        dropped: list[bytes] = []
        pool.on_drop = lambda entries, reason: dropped.extend(e.key for e in entries)
        for key in (b"p", b"q", b"r", b"s"):  # pages 0, 1, 2, 3
            put(pool, key)
        for key in (b"s", b"q", b"r"):  # LRU order now: p, s, q, r
            pool.lookup([key], 1)
        new = pool.begin_store(b"two", 0, nbytes=2 * PAGE, layout=b"L", present=1)
        assert isinstance(new, Entry) and new.first_page == 0
        # p and q free pages 0-1; s is older than q but freeing it does not help.
        assert sorted(dropped) == [b"p", b"q"]
        assert pool.lookup([b"s"], 1) == 1 and pool.lookup([b"r"], 1) == 1
        pool.abort(new)
    finally:
        pool.close()


def _brute_force_plan(
    num_pages: int,
    entries: list[tuple[int, int, int | None]],
    need: int,
) -> tuple[int, int] | None:
    """Best (oldest newest-victim, fewest victims) window, by looking at every window.

    ``entries``: (first page, pages, LRU rank or None when not evictable).
    """
    owner: list[int | None] = [None] * num_pages  # index into entries
    for i, (first, n, _) in enumerate(entries):
        for page in range(first, first + n):
            owner[page] = i
    best: tuple[int, int] | None = None
    for start in range(num_pages - need + 1):
        touched = {owner[p] for p in range(start, start + need)} - {None}
        ranks = [entries[i][2] for i in touched if i is not None]
        if any(r is None for r in ranks):
            continue
        cost = (max(r for r in ranks if r is not None), len(ranks))
        if best is None or cost < best:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(60))
def test_eviction_plan_matches_brute_force(seed: int, clock: FakeClock) -> None:
    import random

    rng = random.Random(seed)
    num_pages = rng.randint(4, 12)
    pool = Pool.create(segment_name("pool"), num_pages * PAGE, PAGE, clock=clock)
    try:
        made: list[Entry] = []
        key = 0
        while True:  # fill with pending entries of 1-3 pages, then keep some
            size = rng.randint(1, 3)
            entry = pool.begin_store(bytes([key]), 0, nbytes=size * PAGE, layout=b"L", present=1)
            key += 1
            if entry is None:
                if pool.stats().used_bytes >= (num_pages - 2) * PAGE or key > 64:
                    break
                continue
            assert isinstance(entry, Entry)
            made.append(entry)
        kept: list[Entry] = []
        for entry in made:
            if rng.random() < 0.2:
                pool.abort(entry)  # a hole
            else:
                pool.commit(entry)
                kept.append(entry)
        leased = {e.key for e in kept if rng.random() < 0.15}
        if leased:
            pool.lookup(sorted(leased), 1, holder="h", lease_ttl_s=100)
        order = kept[:]
        rng.shuffle(order)
        for entry in order:
            pool.lookup([entry.key], 1)  # LRU order = `order`
        pinned = [e for e in kept if rng.random() < 0.15]
        for entry in pinned:
            assert pool.pin(entry.key, 0, b"L", 1) is entry
        rank = {id(e): i for i, e in enumerate(order)}
        evictable = {id(e) for e in kept if e not in pinned and e.key not in leased}
        layout = [
            (e.first_page, e.num_pages, rank[id(e)] if id(e) in evictable else None) for e in kept
        ]
        need = rng.randint(1, num_pages)
        free_run = pool._alloc.largest_run()
        dropped: list[Entry] = []
        pool.on_drop = lambda entries, reason: dropped.extend(entries)

        got = pool.begin_store(b"new", 0, nbytes=need * PAGE, layout=b"L", present=1)

        if need <= free_run:
            assert isinstance(got, Entry) and dropped == []
            return
        expected = _brute_force_plan(num_pages, layout, need)
        if expected is None:
            assert got is None
            assert dropped == []
            assert pool.stats().entries == len(kept)
        else:
            assert isinstance(got, Entry)
            assert (max(rank[id(e)] for e in dropped), len(dropped)) == expected
            for e in dropped:  # every victim lies under the new entry
                assert got.first_page < e.first_page + e.num_pages
                assert e.first_page < got.first_page + got.num_pages
        for entry in pinned:
            pool.unpin(entry)
    finally:
        pool.close()


def test_store_with_other_slots_does_not_replace_the_cached_entry(pool: Pool) -> None:
    old = put(pool, b"x", present=0b011)
    # Holds slot 2 but not slot 0: replacing would lose slot 0.
    assert pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"L", present=0b110) == PRESENT
    assert pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"L", present=0b011) == PRESENT
    assert pool.pin(b"x", 0, b"L", 0b001) is old
    pool.unpin(old)
    new = pool.begin_store(b"x", 0, nbytes=PAGE, layout=b"L", present=0b111)
    assert isinstance(new, Entry)
    pool.commit(new)
    assert pool.pin(b"x", 0, b"L", 0b101) is new
    pool.unpin(new)


def _at_pages(*runs: tuple[int, int]) -> list[Entry]:
    """Entries on ``(first_page, num_pages)``, oldest first."""
    return [
        Entry(bytes([i]), 0, b"L", 1, None, first, n, n * PAGE, first * PAGE)
        for i, (first, n) in enumerate(runs)
    ]


@pytest.mark.parametrize(
    ("freed", "free_starts", "run", "num_pages", "victims"),
    [
        pytest.param([(0, 4)], [], (0, 4), 4, [0], id="the-run-is-one-entry"),
        pytest.param(
            [(0, 2), (2, 2), (4, 2)], [6], (0, 8), 3, [2], id="a-free-piece-saves-victims"
        ),
        pytest.param(
            [(0, 1), (1, 1), (2, 1), (3, 3)], [], (0, 6), 3, [3], id="one-large-over-three"
        ),
        pytest.param([(9, 1), (0, 2), (2, 2)], [], (0, 4), 4, [1, 2], id="outside-the-run"),
    ],
)
def test_eviction_takes_the_window_with_the_fewest_victims(
    freed: list[tuple[int, int]],
    free_starts: list[int],
    run: tuple[int, int],
    num_pages: int,
    victims: list[int],
) -> None:
    from dataplane.pool import _fewest_victims

    entries = _at_pages(*freed)
    got = _fewest_victims(entries, free_starts, run[0], run[1], num_pages)
    assert got == [entries[i] for i in victims]


def _put_units(pool: Pool, key: bytes, units: tuple[bytes, ...], *, rank: int = 0) -> Entry:
    entry = pool.begin_store(key, rank, nbytes=PAGE, layout=b"L", present=1, unit_keys=units)
    assert isinstance(entry, Entry)
    pool.commit(entry)
    return entry


def test_unit_keys_hit_for_every_rank_or_not_at_all(pool: Pool, clock: FakeClock) -> None:
    units = (b"u1", b"u2", b"u3")
    _put_units(pool, b"chunk", units, rank=0)
    assert pool.lookup_units_many([(list(units), 1, None)]) == [3]
    assert pool.lookup_units_many([([*units, b"u4"], 1, None)]) == [3]
    assert pool.lookup_units_many([(list(units), 2, None)]) == [0]  # rank 1 lacks them
    _put_units(pool, b"tail", (b"u1", b"u2"), rank=1)
    assert pool.lookup_units_many([(list(units), 2, "req")], lease_ttl_s=5) == [2]
    assert pool.stats().leased_keys == 2  # the entries answering the hit, per rank
    assert pool.pin_unit(b"u2", 1, b"L", 1) is not None
    assert pool.pin_unit(b"u3", 1, b"L", 1) is None


def test_an_entry_gone_takes_its_unit_keys_with_it(pool: Pool) -> None:
    _put_units(pool, b"a", (b"u1",))
    for key in (b"b", b"c", b"d", b"e"):  # four more one-page entries into four pages
        put(pool, key)
    assert pool.lookup_units_many([([b"u1"], 1, None)]) == [0]
    assert pool.pin_unit(b"u1", 0, b"L", 1) is None
