"""The shared L2 tier on Redis/Valkey (``--l2-url``), behind every server's L1 pool.

Write-behind: a chunk committed to L1 is queued (``enqueue``, never blocking the
store) and one writer thread copies it out of the pool and ``SET``s it. Reads: a
lookup counts the chunks that L1 lacks and L2 holds (``count_leading``, one
pipelined round trip within a ``KeyBudget``, ``app.lookup``); a retrieve fetches
the chunks L1 lacks in one pipeline, checks them and promotes them into L1
(``app.l2_reads``, ``app.retrieve``). Eviction is Redis's own: run it with a
``maxmemory`` and ``maxmemory-policy allkeys-lru``. Keys: ``l2_key``; values:
``app.l2_values``; faults: ``L2Tier``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import redis

from app.l2_values import FORMAT_VERSION, encode_header, seal
from app.redis_io import RedisUnavailable, redacted, translated
from app.redis_wire import Wires
from app.telemetry import Telemetry
from dataplane.pool import Pool

__all__ = [
    "FORMAT_VERSION",
    "MAX_LOOKUP_KEYS",
    "KeyBudget",
    "L2State",
    "L2Tier",
    "WriteJob",
    "encode_header",
    "l2_key",
]

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
MAX_LOOKUP_KEYS = 16384
"""At most this many L2 keys (chunks x world size) one lookup call builds and asks
(``KeyBudget``): a 64k-token prompt in 256-token chunks, for up to 64 ranks a server.
Past it, a lookup counts fewer L2 chunks than L2 may hold (a miss, never a fault),
so its cost does not grow with the ``world_size`` a client registers."""

L2State = Literal["up", "down"]


def _short_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def l2_key(
    *,
    deployment: str,
    namespace: str,
    chunk_size: int,
    layout: bytes,
    world_size: int,
    rank: int,
    chunk_key: bytes,
) -> bytes:
    """The Redis key of one chunk of one rank: it names everything that makes the chunk
    valid::

        mpcache:l2:v1:<deployment>:<namespace hash>:<chunk size>:<layout hash>:
            <world size>:<rank>:<chunk key>          (one key, split here)

    The layout hash covers dtypes and tensor shapes; the chunk key, a keyed hash of
    the prefix, already covers namespace, cache salt and chunk size, and differs
    unless the servers share the hash seed, published by the first server as
    ``mpcache:{<deployment>}:hash-seed`` (``L2Tier.connect``).
    """
    return (
        f"mpcache:l2:v{FORMAT_VERSION}:{deployment}:{_short_hash(namespace.encode())}:"
        f"{chunk_size}:{_short_hash(layout)}:{world_size}:{rank}:{chunk_key.hex()}"
    ).encode()


@dataclass(frozen=True)
class WriteJob:
    """One committed L1 entry to copy to L2."""

    key: bytes
    """The L2 key."""
    chunk_key: bytes
    rank: int
    layout: bytes
    present: int
    nbytes: int


class KeyBudget:
    """The L2 keys one lookup call may still build and ask (``MAX_LOOKUP_KEYS``)."""

    def __init__(self, keys: int = MAX_LOOKUP_KEYS) -> None:
        self.left = keys

    def take(self, chunks: int, world_size: int) -> int:
        """How many of ``chunks`` (each a key per rank) may be asked; they are spent."""
        asked = max(0, min(chunks, self.left // world_size))
        self.left -= asked * world_size
        return asked


class L2Tier:
    """Write-behind and reads of one deployment's L2 (see the module docstring).

    Reads of values go over ``wires`` (``app.redis_wire``: replies read straight into
    the pool, ``app.l2_reads``) where the URL allows, else through redis-py.
    A full queue or an unreachable Redis drops a write, counted in
    ``mpcache_l2_writes_total``. Faults: any Redis error marks the tier ``down``
    (``mpcache_l2_up`` 0, ``/health``); while down, lookups and retrieves are L1-only
    and writes are dropped; the writer thread probes Redis every
    ``PROBE_INTERVAL_S`` and marks it ``up`` when it answers.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        url: str,
        deployment: str,
        pool: Pool,
        telemetry: Telemetry,
        queue_chunks: int,
        max_value_bytes: int,
        wires: Wires | None = None,
    ) -> None:
        self._client = client
        self.wires = wires
        self.url = redacted(url)
        self.deployment = deployment
        self._pool = pool
        self._telemetry = telemetry
        self.max_value_bytes = max_value_bytes
        self._queue: queue.Queue[WriteJob] = queue.Queue(maxsize=queue_chunks)
        self._state: L2State = "down"
        self._detail: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seed_key = f"mpcache:{{{deployment}}}:hash-seed"
        self._seed = 0
        telemetry.l2_queue_chunks.set_function(self._queue.qsize)
        telemetry.l2_up.set(0)

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> int:
        """Check that Redis answers, start the writer; return the deployment's hash seed.

        The first server of the deployment publishes a random seed; the others use it,
        so that equal prompts get equal chunk keys on every server.
        """
        with translated(f"L2 {self.url}"):
            self._client.set(self._seed_key, str(secrets.randbits(64)), nx=True)
            raw = self._client.get(self._seed_key)
        if raw is None:
            raise RedisUnavailable(f"L2 {self.url}: the hash seed vanished as it was set")
        self._seed = int(raw)
        self._set_state("up", None)
        self._thread = threading.Thread(target=self._run, name="mpcache-l2-writer", daemon=True)
        self._thread.start()
        return self._seed

    def close(self) -> None:
        """Stop the writer (queued chunks not yet written are dropped) and disconnect."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.wires is not None:
            self.wires.close()
        self._client.close()

    @property
    def client(self) -> redis.Redis:
        """redis-py's client (for the reads ``wires`` cannot make)."""
        return self._client

    @property
    def seed(self) -> int:
        """The deployment's hash seed (``connect`` fetched it)."""
        return self._seed

    @property
    def up(self) -> bool:
        return self._state == "up"

    @property
    def state(self) -> L2State:
        return self._state

    @property
    def detail(self) -> str | None:
        return self._detail

    def queued(self) -> int:
        return self._queue.qsize()

    def key(
        self,
        namespace: str,
        chunk_size: int,
        layout: bytes,
        world_size: int,
        rank: int,
        chunk_key: bytes,
    ) -> bytes:
        """``l2_key`` of one chunk of one rank in this tier's deployment."""
        return l2_key(
            deployment=self.deployment,
            namespace=namespace,
            chunk_size=chunk_size,
            layout=layout,
            world_size=world_size,
            rank=rank,
            chunk_key=chunk_key,
        )

    # ------------------------------------------------------------------ writes

    def enqueue(self, job: WriteJob) -> None:
        """Queue a committed chunk for L2; never blocks (a drop is counted)."""
        writes = self._telemetry.l2_writes
        if not self.up:
            writes.labels("unavailable").inc()
        elif job.nbytes > self.max_value_bytes:
            writes.labels("too_large").inc()
        else:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                writes.labels("queue_full").inc()

    def _write(self, job: WriteJob) -> None:
        writes = self._telemetry.l2_writes
        entry = self._pool.pin(job.chunk_key, job.rank, job.layout, job.present)
        if entry is None:
            writes.labels("evicted").inc()  # gone from L1 before its turn
            return
        try:
            header = encode_header(job.chunk_key, job.rank, job.layout, entry.present)
            buf = bytearray(len(header) + entry.nbytes)
            buf[: len(header)] = header
            np.frombuffer(buf, dtype=np.uint8, offset=len(header))[:] = self._pool.view(
                entry
            ).numpy()
        finally:
            self._pool.unpin(entry)
        seal(buf, len(header))
        with translated(f"L2 {self.url}"):
            self._client.set(job.key, bytes(buf))
        writes.labels("written").inc()
        self._telemetry.l2_bytes.labels("write").inc(len(buf))

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.up:
                self._probe()
                self._stop.wait(PROBE_INTERVAL_S)
                continue
            try:
                job = self._queue.get(timeout=PROBE_INTERVAL_S)
            except queue.Empty:
                continue
            try:
                self._write(job)
            except RedisUnavailable as exc:
                self._telemetry.l2_writes.labels("unavailable").inc()
                self.fault(exc)
            except Exception:
                self._telemetry.l2_writes.labels("error").inc()
                logger.exception("L2 write failed")

    def _probe(self) -> None:
        try:
            with translated(f"L2 {self.url}"):
                self._client.ping()
                # Redis may have restarted empty: give it the seed this server hashes with.
                self._client.set(self._seed_key, str(self._seed), nx=True)
        except RedisUnavailable as exc:
            self._detail = str(exc)
            return
        self._drain()
        self._set_state("up", None)

    def _drain(self) -> None:
        """Drop what was queued before Redis went down (counted)."""
        for _ in range(self._queue.maxsize):
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._telemetry.l2_writes.labels("unavailable").inc()

    # ------------------------------------------------------------------ reads

    def count_leading(
        self,
        namespace: str,
        chunk_size: int,
        layout: bytes,
        world_size: int,
        chunk_keys: Sequence[bytes],
        budget: KeyBudget,
    ) -> int:
        """How many leading ``chunk_keys`` L2 holds for every rank in
        ``range(world_size)``, asking no more keys than ``budget`` allows (one pipelined
        round trip). 0 when L2 is down or fails (it is then marked down)."""
        if not self.up or not chunk_keys:
            return 0
        asked = chunk_keys[: budget.take(len(chunk_keys), world_size)]
        if not asked:
            return 0
        try:
            with translated(f"L2 {self.url}"):
                pipe = self._client.pipeline(transaction=False)
                for chunk_key in asked:
                    pipe.exists(
                        *(
                            self.key(namespace, chunk_size, layout, world_size, rank, chunk_key)
                            for rank in range(world_size)
                        )
                    )
                counts = pipe.execute()
        except RedisUnavailable as exc:
            self.fault(exc)
            return 0
        hits = 0
        for count in counts:
            if int(count) != world_size:
                break
            hits += 1
        return hits

    def discard(self, key: bytes, reason: str) -> None:
        """Delete a value that failed its checks (counted ``corrupt``)."""
        self._telemetry.l2_reads.labels("corrupt").inc()
        logger.warning("L2 value %s refused and deleted: %s", key.decode(), reason)
        try:
            with translated(f"L2 {self.url}"):
                self._client.delete(key)
        except RedisUnavailable as exc:
            self.fault(exc)

    def served(self, nbytes: int) -> None:
        """A value read (``nbytes`` on the wire) was checked and promoted."""
        self._telemetry.l2_reads.labels("hit").inc()
        self._telemetry.l2_bytes.labels("read").inc(nbytes)

    def missed(self, outcome: Literal["miss", "unavailable"] = "miss") -> None:
        self._telemetry.l2_reads.labels(outcome).inc()

    # ------------------------------------------------------------------ state

    def fault(self, exc: Exception) -> None:
        """Redis failed a call: mark the tier down (the writer probes until it answers)."""
        if self.wires is not None:
            self.wires.reset()
        self._set_state("down", str(exc))

    def _set_state(self, state: L2State, detail: str | None) -> None:
        previous, self._state, self._detail = self._state, state, detail
        self._telemetry.l2_up.set(1 if state == "up" else 0)
        if previous == state:
            return
        if state == "down":
            logger.warning("L2 %s unreachable, serving from L1 only: %s", self.url, detail)
        elif self._thread is not None:
            logger.info("L2 %s reachable again: write-behind and L2 reads resume", self.url)
