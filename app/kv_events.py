"""KV events: what the pool gains and loses, told as vLLM's own publisher tells it.

Off the store path. The pool tells an ``EventRecorder`` (``dataplane.pool``'s
``EntryObserver``), under its lock, which whole chunks became visible or stopped
being visible; the recorder only appends to a bounded queue (``--kv-events-queue``
records) and never waits. One thread (``BlockPublisher``) drains it ``TICK_S`` after
something was recorded (an idle server's thread sleeps until then: nothing on the
host's cores while vLLM computes), and every ``TICK_S`` where a replay socket or the
Redis mirror needs it awake: the ``BlockLedger`` turns what was recorded into the
events of one batch, which the thread numbers, publishes (``contract.kv_events``:
vLLM's wire format, on a ZMQ PUB socket, ``--kv-events-endpoint``), keeps for replay
(``--kv-events-replay-endpoint``) and hands to the Redis mirror that
``POST /cluster/lookup`` reads (``app.cluster_lookup``). The ledger runs whether or
not events are published: it is also this server's own answer to
``/cluster/lookup``.

What is announced (block hashes: ``contract.chunk_keys.block_hashes``): a block is
held when every rank of its registration's world size has committed it; it is
announced ``BlockStored`` once when it becomes held (by any namespace of its model)
and ``BlockRemoved`` once when it stops being held (eviction, replacement, a rank's
entry gone); a replacement that keeps it held says nothing. ``AllBlocksCleared``
opens the stream (the pool is empty when the server starts) and closes it.

A full queue drops what did not fit: that batch is counted
(``mpcache_kv_event_batches_total{outcome="dropped"}``) and its sequence number is
skipped, so consumers see a gap; the ledger then starts over from the pool's
entries (``Pool.whole_entries``), and the next batch corrects what the lost records
would have said. A store never waits for any of this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from app.telemetry import Telemetry
from contract.chunk_keys import block_seed, chain_block_hashes
from contract.kv_events import (
    END_SEQ,
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    encode_batch,
    packed_token_ids,
    seq_bytes,
)
from dataplane.pool import Entry, Pool

__all__ = [
    "TICK_S",
    "BlockLedger",
    "BlockNote",
    "BlockPublisher",
    "Change",
    "EventRecorder",
    "StoredItem",
    "ZmqSink",
]

logger = logging.getLogger(__name__)

TICK_S = 0.02
"""How long after a record the publisher drains the recorder: events are at most
this late, and a burst of stores makes one batch."""


@dataclass(eq=False, slots=True)
class StoredItem:
    """What one store (or L2 promotion) of one item knows about its chunks: shared by
    their notes until the ledger has hashed them."""

    model: str
    """The namespace's model part (``contract.chunk_keys.model_of``)."""
    cache_salt: str | None
    chunk_size: int
    tokens: np.ndarray
    keys: Sequence[bytes]
    """The item's chunk keys (at least up to its last chunk stored)."""
    hashes: dict[int, int] = field(default_factory=dict)
    """Block hashes computed so far, by chunk."""


@dataclass(eq=False, slots=True)
class BlockNote:
    """An entry's ``Entry.note``: which block of which item it holds."""

    item: StoredItem | None
    """Dropped once the ledger has announced (or passed over) the entry."""
    chunk: int
    world_size: int
    block_hash: int | None = None


Record = tuple[bool, Entry]


class EventRecorder:
    """The pool's observer: records, never waits (called under the pool's lock).

    ``lost`` only grows (one writer: the pool's lock holder), so the publisher reads
    how many records were lost since it last looked without resetting it."""

    def __init__(self, capacity: int) -> None:
        self._records: deque[Record] = deque()
        self._capacity = capacity
        self.lost = 0
        self.recorded = threading.Event()
        """Set when a record arrives or is lost: wakes the publisher, which clears it
        before it takes what was recorded."""

    def added(self, entry: Entry) -> None:
        self._put(True, entry)

    def removed(self, entry: Entry) -> None:
        self._put(False, entry)

    def _put(self, present: bool, entry: Entry) -> None:
        if not isinstance(entry.note, BlockNote):
            return
        if len(self._records) >= self._capacity:
            self.lost += 1
        else:
            self._records.append((present, entry))
        if not self.recorded.is_set():  # the lock only when the publisher may sleep
            self.recorded.set()

    def take(self) -> list[Record]:
        """What was recorded so far, oldest first (the publisher's thread)."""
        records = self._records
        pop = records.popleft
        return [pop() for _ in range(len(records))]

    def reset(self) -> None:
        """Forget what was recorded (under the pool's lock: ``Pool.whole_entries``)."""
        self._records.clear()


@dataclass(frozen=True)
class Change:
    """One batch's worth: its events and the block hashes it announced each way."""

    events: list[Event]
    stored: list[int]
    removed: list[int]


class BlockLedger:
    """Which blocks this server holds, from the recorder's records (one thread).

    Per chunk key: the ranks that hold it and its block hash; a key is complete when
    every rank of its world size holds it. Per block hash: how many complete keys
    have it (several namespaces of one model share block hashes). ``announced`` is
    what the events have said is held; ``apply`` and ``resync`` return what changed.
    """

    def __init__(self, medium: str = MEDIUM_CPU, *, events: bool = True) -> None:
        self._medium = medium
        self._events = events
        """False: changes carry hashes only (nobody publishes them as events)."""
        self._ranks: dict[bytes, set[int]] = {}
        self._hash_of: dict[bytes, int] = {}
        self._complete: dict[bytes, int] = {}
        self._refs: Counter[int] = Counter()
        self.announced: set[int] = set()
        """Read by other threads (``in``: atomic under the GIL)."""

    def leading(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are announced as held."""
        announced = self.announced
        for n, h in enumerate(hashes):
            if h not in announced:
                return n
        return len(hashes)

    def apply(self, records: Sequence[Record]) -> Change:
        """Take in records, in order; the net change against what was announced."""
        touched = self._accumulate(records)
        return self._announce(touched, records)

    def resync(self, entries: Iterable[Entry]) -> Change:
        """Start over from the pool's visible whole entries (after lost records)."""
        self._ranks.clear()
        self._hash_of.clear()
        self._complete.clear()
        self._refs.clear()
        records = [(True, e) for e in entries if isinstance(e.note, BlockNote)]
        touched: dict[int, BlockNote | None] = dict.fromkeys(self.announced)
        touched.update(self._accumulate(records))
        return self._announce(touched, records)

    # ------------------------------------------------------------------ internals

    def _accumulate(self, records: Sequence[Record]) -> dict[int, BlockNote | None]:
        """Update the per-key state; the block hashes whose holding may have changed,
        each with the note that made it held (None: it may have stopped)."""
        touched: dict[int, BlockNote | None] = {}
        for present, entry in records:
            note = entry.note
            assert isinstance(note, BlockNote)
            if present:
                self._add(entry, note, touched)
            else:
                self._remove(entry, note, touched)
        return touched

    def _add(self, entry: Entry, note: BlockNote, touched: dict[int, BlockNote | None]) -> None:
        key = entry.key
        h = self._hash(note, self._hash_of.get(key))
        if h is None:
            return
        ranks = self._ranks.get(key)
        if ranks is None:
            ranks = self._ranks[key] = set()
            self._hash_of[key] = h
        ranks.add(entry.rank)
        if len(ranks) >= note.world_size and key not in self._complete:
            self._complete[key] = h
            self._refs[h] += 1
            touched[h] = note

    def _remove(self, entry: Entry, note: BlockNote, touched: dict[int, BlockNote | None]) -> None:
        key = entry.key
        ranks = self._ranks.get(key)
        if ranks is None:
            return
        ranks.discard(entry.rank)
        if not ranks:
            del self._ranks[key]
            del self._hash_of[key]
        h = self._complete.get(key)
        if h is not None and len(ranks) < note.world_size:
            del self._complete[key]
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
            touched.setdefault(h, None)

    def _hash(self, note: BlockNote, known: int | None) -> int | None:
        """The note's block hash (computed once; the chain goes on from the nearest
        chunk before it whose hash is known)."""
        if note.block_hash is None:
            note.block_hash = known if known is not None else self._chain(note)
        return note.block_hash

    def _chain(self, note: BlockNote) -> int | None:
        item = note.item
        if item is None:
            return None
        size, chunk = item.chunk_size, note.chunk
        if chunk in item.hashes:
            return item.hashes[chunk]
        start, prev = chunk, None
        while start > 0 and prev is None:
            start -= 1
            prev = item.hashes.get(start)
            if prev is None and start < len(item.keys):
                prev = self._hash_of.get(item.keys[start])
                if prev is not None:
                    item.hashes[start] = prev  # the parent a BlockStored names
        if prev is None:
            prev, start = block_seed(item.model, item.cache_salt, size), -1
        # On to the item's last chunk: its other notes ask next, and one call for the
        # run costs far less than one a chunk.
        end = max(chunk, min(len(item.tokens) // size, len(item.keys)) - 1)
        raw = np.ascontiguousarray(item.tokens[(start + 1) * size : (end + 1) * size], "<i4")
        hashes = chain_block_hashes(prev, raw.data.cast("B"), size * 4, end - start)
        for offset, h in enumerate(hashes):
            item.hashes[start + 1 + offset] = h
        return item.hashes.get(chunk)

    def _announce(self, touched: dict[int, BlockNote | None], records: Sequence[Record]) -> Change:
        announced, refs = self.announced, self._refs
        stored: list[tuple[int, BlockNote | None]] = []
        removed: list[int] = []
        for h, note in touched.items():
            if h in refs and h not in announced:
                announced.add(h)
                stored.append((h, note))
            elif h not in refs and h in announced:
                announced.discard(h)
                removed.append(h)
        events: list[Event] = []
        if removed and self._events:
            events.append(BlockRemoved(block_hashes=removed, medium=self._medium))
        if self._events:
            events += self._stored_events(stored)
        for _, entry in records:
            assert isinstance(entry.note, BlockNote)
            entry.note.item = None  # hashed and announced: its tokens are no longer needed
        return Change(events, [h for h, _ in stored], removed)

    def _stored_events(self, stored: list[tuple[int, BlockNote | None]]) -> list[Event]:
        """One ``BlockStored`` per run of consecutive chunks of one item."""
        events: list[Event] = []
        run: list[tuple[int, BlockNote | None]] = []
        for h, note in stored:
            last = run[-1][1] if run else None
            follows = (
                note is not None
                and last is not None
                and note.item is last.item
                and note.chunk == last.chunk + 1
            )
            if run and not follows:
                events.append(self._block_stored(run))
                run = []
            run.append((h, note))
        if run:
            events.append(self._block_stored(run))
        return events

    def _block_stored(self, run: list[tuple[int, BlockNote | None]]) -> BlockStored:
        first = run[0][1]
        item = first.item if first is not None else None
        parent: int | None = None
        tokens: list[int] | msgspec.Raw = []
        size = 0
        if first is not None and item is not None:
            size = item.chunk_size
            parent = item.hashes.get(first.chunk - 1) if first.chunk else None
            end = (first.chunk + len(run)) * size
            tokens = packed_token_ids(item.tokens[first.chunk * size : end])
        return BlockStored(
            block_hashes=[h for h, _ in run],
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=size,
            lora_id=None,
            medium=self._medium,
            lora_name=None,
        )


class ZmqSink:
    """The PUB socket and, optionally, the replay ROUTER (used by one thread once
    bound: ``BlockPublisher``'s)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str, buffer_batches: int
    ) -> None:
        self._ctx = zmq.Context()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole replay and its end marker are queued for a slow client.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot bind the KV events sockets: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )

    def send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)
        self._buffer.append((seq, payload))

    def serve_replay(self, timeout_s: float) -> None:
        """Answer the replay requests that arrive within ``timeout_s`` (none without a
        replay socket)."""
        if self._replay is None:
            return
        if not self._replay.poll(int(timeout_s * 1000)):
            return
        for _ in range(64):  # requests waiting now, bounded
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a replay request of %d frame(s) ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(linger=1000)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


Mirror = Callable[[Change, bool], None]
"""Told each change, and whether the ledger started over (``app.cluster_lookup``)."""


class BlockPublisher:
    """The thread that drains the recorder, keeps the ledger and publishes each
    change as one numbered batch (``sink``: None when events are off), then hands
    it to ``mirror``. ``start`` publishes ``AllBlocksCleared`` first; ``close`` last."""

    def __init__(
        self,
        *,
        pool: Pool,
        recorder: EventRecorder,
        ledger: BlockLedger,
        telemetry: Telemetry,
        sink: ZmqSink | None = None,
        mirror: Mirror | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._recorder = recorder
        self.ledger = ledger
        self._telemetry = telemetry
        self._sink = sink
        self.mirror = mirror
        self._clock = clock
        self._seq = 0
        self._seen_lost = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def describe(self) -> str:
        """For the startup log: where the events go (the bound addresses), or off."""
        sink = self._sink
        if sink is None:
            return "KV events off"
        replay = f", replay {sink.replay_endpoint}" if sink.replay_endpoint else ""
        return f"KV events on {sink.endpoint}{replay}"

    def start(self) -> None:
        self._publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="mpcache-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Publish what is left and ``AllBlocksCleared`` (the pool is closed), then stop."""
        self._stop.set()
        self._recorder.recorded.set()  # wake a thread waiting for a record
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._publish([AllBlocksCleared()])
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def tick(self) -> None:
        """Drain the recorder once (the thread's step; tests call it directly)."""
        records = self._recorder.take()
        lost = self._recorder.lost - self._seen_lost
        resynced = lost > 0
        if resynced:
            self._seen_lost += lost
            self._seq += 1  # the dropped batch's number: a gap consumers see
            if self._sink is not None:
                self._telemetry.kv_event_batches.labels("dropped").inc()
            self._telemetry.kv_event_records_lost.inc(lost)
            logger.warning("KV events: %d record(s) dropped (queue full); resyncing", lost)
            change = self.ledger.resync(self._pool.whole_entries(then=self._recorder.reset))
        else:
            change = self.ledger.apply(records)
        if change.events:
            self._publish(change.events)
        if self.mirror is not None:
            self.mirror(change, resynced)

    def _publish(self, events: list[Event]) -> None:
        seq, self._seq = self._seq, self._seq + 1
        if self._sink is not None:
            self._telemetry.kv_event_batches.labels("published").inc()
            try:
                self._sink.send(seq, encode_batch(KVEventBatch(ts=self._clock(), events=events)))
            except zmq.ZMQError:
                logger.exception("KV events: batch %d not sent", seq)

    def _wait(self) -> None:
        """Until the next tick: ``TICK_S`` answering replay requests where there is a
        replay socket; else until something is recorded and ``TICK_S`` more (what the
        moment's stores record joins the batch), at most ``TICK_S`` with a mirror to
        renew."""
        sink = self._sink
        if sink is not None and sink.replay_endpoint is not None:
            sink.serve_replay(TICK_S)
            return
        if self._recorder.recorded.wait(None if self.mirror is None else TICK_S):
            self._stop.wait(TICK_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._wait()
                self._recorder.recorded.clear()
                self.tick()
            except Exception:  # the publisher must outlive any surprise
                logger.exception("KV events: publisher step failed")
                self._stop.wait(TICK_S)
        try:
            self.tick()
        except Exception:
            logger.exception("KV events: last publisher step failed")
