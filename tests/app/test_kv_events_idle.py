"""The KV-events publisher's thread on an idle server: asleep until the pool records
something (no wake-ups on cores vLLM computes on), awake on time for what it serves.

Real pool, real thread; no sockets (events off, the default), as ``mpcache server``
runs it unless KV events or a Redis coordinator are configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from app.kv_events import (
    TICK_S,
    BlockLedger,
    BlockNote,
    BlockPublisher,
    Change,
    EventRecorder,
    Mirror,
    StoredItem,
)
from app.telemetry import Telemetry
from contract.shm_naming import segment_name
from dataplane.pool import Entry, Pool

PAGE = 4096
CHUNK = 4


class CountingPublisher(BlockPublisher):
    """Counts its thread's ticks."""

    ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        super().tick()


class Rig:
    def __init__(self, mirror: Mirror | None = None) -> None:
        self.pool = Pool.create(segment_name("pool"), 4 * PAGE, PAGE)
        self.recorder = EventRecorder(100)
        self.pool.attach_index(observer=self.recorder)
        self.ledger = BlockLedger(events=False)
        self.publisher = CountingPublisher(
            pool=self.pool,
            recorder=self.recorder,
            ledger=self.ledger,
            telemetry=Telemetry(),
            mirror=mirror,
        )

    def store_chunk(self) -> None:
        """Commit one chunk as the store path does."""
        tokens = list(range(1, CHUNK + 1))
        key = f"a:{tokens}".encode()
        item = StoredItem("tiny", None, CHUNK, np.asarray(tokens, dtype=np.int32), [key])
        entry = self.pool.begin_store(
            key, 0, nbytes=PAGE, layout=b"L", present=1, note=BlockNote(item, 0, 1)
        )
        assert isinstance(entry, Entry)
        self.pool.commit(entry)

    def close_within(self, timeout_s: float) -> bool:
        """Close the publisher from another thread; True if it returned in time."""
        closer = threading.Thread(target=self.publisher.close, daemon=True)
        closer.start()
        closer.join(timeout_s)
        return not closer.is_alive()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close_within(5.0)  # bounded: a publisher that never wakes fails its test, not hangs
        r.pool.close()


def _until(condition: Callable[[], object], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def test_an_idle_publisher_does_not_wake_until_a_store_then_announces_it(rig: Rig) -> None:
    rig.publisher.start()
    time.sleep(10 * TICK_S)
    assert rig.publisher.ticks == 0  # ten ticks' time idle: not one wake-up
    rig.store_chunk()
    assert _until(lambda: rig.ledger.announced)
    assert rig.publisher.ticks >= 1
    ticks = rig.publisher.ticks
    time.sleep(10 * TICK_S)
    assert rig.publisher.ticks == ticks  # asleep again once the record is drained


def test_close_wakes_an_idle_publisher(rig: Rig) -> None:
    rig.publisher.start()
    time.sleep(2 * TICK_S)
    assert rig.close_within(5.0)


def test_close_right_after_a_store_still_announces_it(rig: Rig) -> None:
    rig.publisher.start()
    rig.store_chunk()
    assert rig.close_within(5.0)
    assert rig.ledger.announced  # the last tick took the store


def test_with_a_mirror_the_publisher_ticks_while_idle() -> None:
    """The Redis mirror renews its set's expiry from the publisher's ticks, so an idle
    server keeps it alive (``app.cluster_lookup.HeldMirror``)."""
    calls: list[Change] = []
    rig = Rig(mirror=lambda change, resynced: calls.append(change))
    try:
        rig.publisher.start()
        assert _until(lambda: len(calls) >= 3)
        assert not any(c.stored or c.removed for c in calls)
    finally:
        assert rig.close_within(5.0)
        rig.pool.close()
