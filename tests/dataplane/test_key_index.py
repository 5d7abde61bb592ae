"""The key index: the writer the pool keeps in step, read as a connector reads it."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

import pytest

from contract.key_index import HEADER_BYTES, SLOT_BYTES, IndexBusy, IndexHeader, IndexView
from contract.shm_naming import segment_name
from dataplane.key_index import KeyIndex, index_slots
from dataplane.pool import Entry, Pool

BOOT = "8620557f509d45cb8003db5b5fb5191f"
PAGE = 4096


@pytest.fixture
def index() -> Iterator[KeyIndex]:
    made = KeyIndex.create(64, secret=12345, boot_id=BOOT, authoritative=True)
    try:
        yield made
    finally:
        made.close()


def view(index: KeyIndex) -> IndexView:
    return IndexView(memoryview(index.segment.buffer))


def test_the_header_names_the_secret_and_the_server(index: KeyIndex) -> None:
    header = IndexHeader.read(memoryview(index.segment.buffer))
    assert (header.slots, header.secret, header.boot_id) == (64, 12345, BOOT)
    assert view(index).authoritative


def test_a_key_is_held_by_the_ranks_that_hold_it(index: KeyIndex) -> None:
    key = secrets.token_bytes(16)
    reader = view(index)
    assert not reader.holds(key, 0b1)
    index.set(key, 0, True)
    assert reader.holds(key, 0b1) and not reader.holds(key, 0b11)
    index.set(key, 1, True)
    assert reader.holds(key, 0b11)
    index.set(key, 0, False)
    assert not reader.holds(key, 0b11) and reader.holds(key, 0b10)
    index.set(key, 1, False)
    assert not reader.holds(key, 0b10)


def test_leading_stops_at_the_first_missing_key(index: KeyIndex) -> None:
    keys = [secrets.token_bytes(16) for _ in range(5)]
    for key in keys[:3] + keys[4:]:
        index.set(key, 0, True)
    assert view(index).leading(keys, 1) == 3


def test_colliding_keys_probe_past_each_other_and_past_tombstones(index: KeyIndex) -> None:
    # The same first 8 bytes: one home slot, so each probes past the ones before it.
    keys = [bytes(8) + secrets.token_bytes(8) for _ in range(6)]
    for key in keys:
        index.set(key, 0, True)
    index.set(keys[1], 0, False)  # a tombstone in the middle of the run
    reader = view(index)
    assert [reader.holds(k, 1) for k in keys] == [True, False, True, True, True, True]
    index.set(keys[1], 0, True)  # back in (its tombstone reused)
    assert all(reader.holds(k, 1) for k in keys)


def test_many_removals_rebuild_without_losing_a_live_key(index: KeyIndex) -> None:
    live = [secrets.token_bytes(16) for _ in range(10)]
    for key in live:
        index.set(key, 0, True)
    for _ in range(4):  # far more tombstones than a quarter of the slots, over time
        gone = [secrets.token_bytes(16) for _ in range(30)]
        for key in gone:
            index.set(key, 0, True)
        for key in gone:
            index.set(key, 0, False)
    reader = view(index)
    assert all(reader.holds(key, 1) for key in live)
    assert index.left_out == 0 and reader.authoritative


def test_a_full_index_leaves_keys_out_and_stops_being_authoritative(index: KeyIndex) -> None:
    keys = [secrets.token_bytes(16) for _ in range(64)]
    for key in keys:
        index.set(key, 0, True)
    reader = view(index)
    held = sum(reader.holds(key, 1) for key in keys)
    assert held == 48 and index.left_out == 16  # 3/4 of 64 slots
    assert not reader.authoritative  # a miss may now be a key left out


def test_a_reader_never_sees_a_key_it_was_not_given(index: KeyIndex) -> None:
    """Slots rewritten while a reader probes (tombstones taken over by other keys):
    the seqlock makes every answer one the writer gave at some moment, or "cannot
    say" when a slot stays mid-write (a writer preempted there), never a wrong one."""
    stable = [secrets.token_bytes(16) for _ in range(8)]
    for key in stable:
        index.set(key, 0, True)
    stop = threading.Event()
    wrong: list[bytes] = []
    reader = view(index)
    never = [secrets.token_bytes(16) for _ in range(8)]

    def answer(key: bytes) -> bool | None:
        try:
            return reader.holds(key, 1)
        except IndexBusy:  # "cannot say": the connector then asks the server
            return None

    def read() -> None:
        while not stop.is_set():
            wrong.extend(k for k in stable if answer(k) is False)
            wrong.extend(k for k in never if answer(k))

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for _ in range(300):
            churn = [secrets.token_bytes(16) for _ in range(12)]
            for key in churn:
                index.set(key, 0, True)
            for key in churn:
                index.set(key, 0, False)
    finally:
        stop.set()
        thread.join()
    assert wrong == []


def test_a_reader_during_a_rebuild_cannot_say_rather_than_miss(
    index: KeyIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild clears every slot and puts the live keys back one by one: a probe
    then says it cannot answer (the connector asks the server), never that a key the
    server holds is missing, and answers again once the rebuild is done."""
    stable = [secrets.token_bytes(16) for _ in range(8)]
    for key in stable:
        index.set(key, 0, True)
    for key in [secrets.token_bytes(16) for _ in range(8)]:  # tombstones to drop
        index.set(key, 0, True)
        index.set(key, 0, False)
    reader = view(index)
    seen: list[object] = []
    real_find = index._find

    def probing_find(low: int, high: int) -> tuple[int | None, int | None]:
        for leading in (False, True):
            try:
                seen.append(reader.leading(stable, 1) if leading else reader.holds(stable[-1], 1))
            except IndexBusy:
                seen.append(None)
        return real_find(low, high)

    monkeypatch.setattr(index, "_find", probing_find)
    index._rebuild()  # puts each live key back through _find
    assert len(seen) == 2 * len(stable)
    assert set(seen) == {None}
    monkeypatch.undo()
    assert all(reader.holds(key, 1) for key in stable)
    assert reader.leading(stable, 1) == len(stable)


def test_a_slot_left_mid_write_is_cannot_say_not_a_miss(index: KeyIndex) -> None:
    """A writer preempted inside a slot's write leaves its sequence odd: a reader that
    needs that slot says it cannot answer, so the connector asks the server instead
    of losing a hit the server holds."""
    key = secrets.token_bytes(16)
    index.set(key, 0, True)
    buf = memoryview(index.segment.buffer)
    home = int.from_bytes(key[:8], "little") & 63
    offset = HEADER_BYTES + home * SLOT_BYTES
    seq = int.from_bytes(buf[offset : offset + 8], "little")
    buf[offset : offset + 8] = (seq + 1).to_bytes(8, "little")  # a write begun
    with pytest.raises(IndexBusy):
        view(index).holds(key, 1)
    with pytest.raises(IndexBusy):
        view(index).leading([key] * 8, 1)
    buf[offset : offset + 8] = (seq + 2).to_bytes(8, "little")  # and ended
    assert view(index).holds(key, 1)


def test_index_slots_scale_with_the_pool() -> None:
    assert index_slots(10) == 1024
    assert index_slots(16384) == 131072  # a 1 GiB pool of 64 KiB pages
    assert index_slots(10**9) == 1 << 22


def test_the_pool_keeps_the_index_in_step(index: KeyIndex) -> None:
    pool = Pool.create(segment_name("pool"), 4 * PAGE, PAGE)
    try:
        pool.attach_index(index)
        reader = view(index)
        entry = pool.begin_store(
            b"c" * 16, 0, nbytes=PAGE, layout=b"L", present=1, unit_keys=(b"u" * 16,)
        )
        assert isinstance(entry, Entry)
        assert not reader.holds(b"c" * 16, 1)  # pending: not visible, not indexed
        pool.commit(entry)
        assert reader.holds(b"c" * 16, 1) and reader.holds(b"u" * 16, 1)
        for n in range(4):  # four more one-page entries evict it
            other = pool.begin_store(bytes([n]) * 16, 0, nbytes=PAGE, layout=b"L", present=1)
            assert isinstance(other, Entry)
            pool.commit(other)
        assert not reader.holds(b"c" * 16, 1) and not reader.holds(b"u" * 16, 1)
        assert reader.holds(bytes([3]) * 16, 1)
    finally:
        pool.close()


def test_leading_of_many_keys_reads_past_collisions(index: KeyIndex) -> None:
    """Many keys are read at their home slots at once; one that probed past a
    collision, or a missing one, is still answered right."""
    # Four pairs share a home slot; key 13 is never set; the rest are all held.
    keys = [bytes([i % 4]) + bytes(7) + secrets.token_bytes(8) for i in range(8)]
    keys += [secrets.token_bytes(16) for _ in range(12)]
    for n, key in enumerate(keys):
        if n != 13:
            index.set(key, 0, True)
    reader = view(index)
    assert reader.leading(keys, 1) == 13
    assert reader.leading(keys[:13], 1) == 13
    assert reader.leading(keys[:13], 2) == 0  # rank 1 holds none of them


def test_a_rebuild_that_failed_keeps_readers_off_until_the_next_one_succeeds(
    index: KeyIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refill that raised may have left the table half filled: readers cannot say
    from then on, and the next rebuild, once whole, lets them answer again."""
    stable = [secrets.token_bytes(16) for _ in range(8)]
    for key in stable:
        index.set(key, 0, True)
    reader = view(index)

    def broken() -> None:
        raise MemoryError

    monkeypatch.setattr(index, "_refill", broken)
    with pytest.raises(MemoryError):
        index._rebuild()
    with pytest.raises(IndexBusy):
        reader.holds(stable[0], 1)
    monkeypatch.undo()
    seen: list[object] = []
    real_refill = index._refill

    def watched_refill() -> None:
        try:
            seen.append(reader.holds(stable[0], 1))
        except IndexBusy:
            seen.append(None)
        real_refill()

    monkeypatch.setattr(index, "_refill", watched_refill)
    index._rebuild()
    assert seen == [None]  # still cannot say while the second rebuild runs
    assert all(reader.holds(key, 1) for key in stable)
    assert reader.leading(stable, 1) == len(stable)
