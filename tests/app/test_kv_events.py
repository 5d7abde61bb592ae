"""The block ledger and its publisher over a real pool and real ZMQ sockets, decoded by
vLLM's own classes: what is announced, once; ranks; replacements; a full queue.

The publisher's thread is not started: each test calls ``tick`` itself, so what one
batch holds is exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from app.kv_events import BlockLedger, BlockNote, BlockPublisher, EventRecorder, StoredItem, ZmqSink
from app.telemetry import Telemetry
from contract.chunk_keys import block_hashes
from contract.shm_naming import segment_name
from dataplane.pool import Entry, Pool
from tests.events import Consumer, Received
from tests.support import free_port

pytestmark = pytest.mark.vllm

PAGE = 4096
CHUNK = 4
MODEL = "tiny"


class Rig:
    """A pool of ``pages`` one-page entries, observed; a publisher with real sockets and
    a consumer of them (the publisher's first batch, ``AllBlocksCleared``, read)."""

    def __init__(self, pages: int, queue: int = 1000) -> None:
        self.pool = Pool.create(segment_name("pool"), pages * PAGE, PAGE)
        self.recorder = EventRecorder(queue)
        self.pool.attach_index(observer=self.recorder)
        self.telemetry = Telemetry()
        endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        self.ledger = BlockLedger()
        self.publisher = BlockPublisher(
            pool=self.pool,
            recorder=self.recorder,
            ledger=self.ledger,
            telemetry=self.telemetry,
            sink=ZmqSink(endpoint, replay, "mpcache", 100),
        )
        self.publisher.start()
        self.consumer = Consumer(endpoint, replay)
        opening = self.consumer.next()
        assert (opening.seq, _kinds(opening)) == (0, ["AllBlocksCleared"])

    def store(
        self,
        tokens: Sequence[int],
        chunks: Sequence[int],
        *,
        rank: int = 0,
        world_size: int = 1,
        namespace: str = "a",
        present: int = 1,
    ) -> None:
        """Commit ``chunks`` of ``tokens`` as the store path does (a note each; the
        keys stand for the secret chunk keys of ``namespace``)."""
        arr = np.asarray(tokens, dtype=np.int32)
        keys = [
            f"{namespace}:{list(tokens[: (c + 1) * CHUNK])}".encode()
            for c in range(len(tokens) // CHUNK)
        ]
        item = StoredItem(MODEL, None, CHUNK, arr, keys)
        for c in chunks:
            entry = self.pool.begin_store(
                keys[c],
                rank,
                nbytes=PAGE,
                layout=b"L",
                present=present,
                note=BlockNote(item, c, world_size),
            )
            assert isinstance(entry, Entry)
            self.pool.commit(entry)

    def batch(self) -> Received:
        """Tick once and read the batch it published."""
        self.publisher.tick()
        return self.consumer.next()

    def silent(self) -> bool:
        """Tick once: True if nothing was published."""
        self.publisher.tick()
        return self.consumer.quiet()

    def metric(self, name: str, **labels: str) -> float | None:
        return self.telemetry.registry.get_sample_value(name, labels)

    def close(self) -> None:
        self.publisher.close()
        self.consumer.close()
        self.pool.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig(pages=4)
    try:
        yield r
    finally:
        r.close()


def _kinds(received: Received) -> list[str]:
    return [type(e).__name__ for e in received.batch.events]


def test_a_committed_chunk_is_announced_once_with_hashes_a_consumer_derives(rig: Rig) -> None:
    tokens = list(range(1, 2 * CHUNK + 1))
    rig.store(tokens, [0, 1])
    got = rig.batch()
    assert got.topic == b"mpcache" and got.seq == 1
    (stored,) = got.batch.events
    assert isinstance(stored, rig.consumer.kv.BlockStored)
    assert stored.block_hashes == block_hashes(MODEL, None, tokens, CHUNK)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens
    assert (stored.block_size, stored.medium, stored.lora_id) == (CHUNK, "CPU", None)
    # The same blocks committed by another namespace of the model: already announced.
    rig.store(tokens, [0, 1], namespace="b")
    assert rig.silent()


def test_a_later_chunk_names_its_parent_and_eviction_is_announced(rig: Rig) -> None:
    tokens = list(range(1, 4 * CHUNK + 1))
    hashes = block_hashes(MODEL, None, tokens, CHUNK)
    rig.store(tokens, [0])
    assert rig.batch().batch.events[0].block_hashes == hashes[:1]
    rig.store(tokens, [1, 2, 3])
    (stored,) = rig.batch().batch.events
    assert stored.block_hashes == hashes[1:]
    assert stored.parent_block_hash == hashes[0]
    assert stored.token_ids == tokens[CHUNK:]
    # A fifth entry in a pool of four evicts the least recently used: chunk 0.
    other = list(range(500, 500 + CHUNK))
    rig.store(other, [0])
    removed, stored = rig.batch().batch.events
    assert isinstance(removed, rig.consumer.kv.BlockRemoved)
    assert removed.block_hashes == [hashes[0]] and removed.medium == "CPU"
    assert stored.block_hashes == block_hashes(MODEL, None, other, CHUNK)


def test_a_block_is_held_once_every_rank_has_it_and_not_after_one_loses_it() -> None:
    rig = Rig(pages=3)
    try:
        tokens = list(range(1, CHUNK + 1))
        rig.store(tokens, [0], rank=0, world_size=2)
        assert rig.silent()
        rig.store(tokens, [0], rank=1, world_size=2)
        (stored,) = rig.batch().batch.events
        assert stored.block_hashes == block_hashes(MODEL, None, tokens, CHUNK)
        rig.store(list(range(50, 50 + CHUNK)), [0])  # fills the pool
        rig.batch()
        rig.store(list(range(90, 90 + CHUNK)), [0])  # evicts rank 0's entry only
        removed, _ = rig.batch().batch.events
        assert removed.block_hashes == stored.block_hashes
    finally:
        rig.close()


def test_a_replacement_that_keeps_the_block_says_nothing(rig: Rig) -> None:
    tokens = list(range(1, CHUNK + 1))
    rig.store(tokens, [0], present=0b01)
    rig.batch()
    rig.store(tokens, [0], present=0b11)  # a superset replaces the entry
    assert rig.silent()
    assert rig.pool.stats().entries == 1


def test_replay_serves_a_late_subscriber_every_batch_gapless(rig: Rig) -> None:
    for n in range(3):
        rig.store(list(range(10 * n + 1, 10 * n + 1 + CHUNK)), [0])
        rig.publisher.tick()
    got = rig.consumer.replay(0)
    assert [r.seq for r in got] == [0, 1, 2, 3]
    assert _kinds(got[0]) == ["AllBlocksCleared"]
    assert all(_kinds(r) == ["BlockStored"] for r in got[1:])
    assert [r.seq for r in rig.consumer.replay(2)] == [2, 3]


def test_a_full_queue_drops_a_counted_batch_leaves_a_gap_and_resyncs() -> None:
    rig = Rig(pages=8, queue=2)
    try:
        prompts = [list(range(10 * n + 1, 10 * n + 1 + CHUNK)) for n in range(3)]
        for p in prompts:
            rig.store(p, [0])  # the third finds the queue full: never waits for room
        assert rig.recorder.lost == 1
        got = rig.batch()
        assert got.seq == 2  # 1 was the dropped batch's: a gap
        announced = sorted(h for e in got.batch.events for h in e.block_hashes)
        assert announced == sorted(block_hashes(MODEL, None, p, CHUNK)[0] for p in prompts)
        assert rig.metric("mpcache_kv_event_batches_total", outcome="dropped") == 1
        assert rig.metric("mpcache_kv_event_batches_total", outcome="published") == 2
        assert rig.metric("mpcache_kv_event_records_lost_total") == 1
        rig.store(list(range(300, 300 + CHUNK)), [0])
        assert rig.batch().seq == 3  # gapless again
    finally:
        rig.close()
