"""The local-disk tier (``--disk-path``): under the pool, above L2, kept across restarts.

Write-behind: a chunk committed to the pool (``app.store``, or promoted from L2:
``app.retrieve``) is queued (``enqueue``: never blocks, never does I/O) with a pin
on its pool entry, so it cannot leave the pool before its file is complete; one
writer thread writes it (``app.disk_io``: temporary name, renamed) and unpins it.
The queue holds at most ``queue_bytes`` (a fraction of the pool, so pins never
starve the pool); a chunk that does not fit is dropped and counted
(``mpcache_disk_writes_total{outcome="queue_full"}``). Reads: a lookup counts the
chunks past L1's hits that the in-memory index holds for every rank
(``count_leading``, no I/O); a retrieve that misses L1 reads the file straight into
a pending pool entry, checks it (``app.disk_codec``: header, size, checksum) and
commits it (``promote``); a torn or foreign file is refused, deleted and counted.
Eviction: LRU within ``--disk-size`` (``app.disk_index``); a retrieve hit
refreshes a file. I/O runs on the writer thread and on ``READERS`` reader threads
(``promote_later``: a retrieve reads a few chunks ahead of the one it copies,
``app.disk_reads``), never on the event loop nor in vLLM's step. A restart with the
same directory serves what it held (``app.disk_dir``: the seed and chunk size in
``meta.json``, the index rebuilt from headers). SIGTERM lets the writer finish the
queue (within --shutdown-timeout-s); a SIGKILL loses what was still queued (the
last fraction of a second at the disk's speed); files are not fsynced, so a power
loss may tear the last ones, which the checksum then refuses.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from app.disk_codec import (
    CorruptFile,
    decode_header,
    encode_header,
    file_bytes,
    file_name,
    seal,
    verify,
)
from app.disk_dir import (
    PATH_KEY,
    DiskMeta,
    DiskRefused,
    check_chunk_size,
    check_fits,
    empty,
    lock_directory,
    read_meta,
    rebuild,
    scan,
    write_meta,
)
from app.disk_index import DiskIndex, DiskRecord, Ident
from app.disk_io import ChunkFiles, probe_direct
from app.telemetry import Telemetry
from contract.errors import Conflict
from contract.schemas import DiskHealth
from dataplane.pool import Entry, Pool

__all__ = ["QUEUE_POOL_FRACTION", "READERS", "DiskChunkSizeMismatch", "DiskRefused", "DiskTier"]

logger = logging.getLogger(__name__)

QUEUE_POOL_FRACTION = 4
"""The write-behind queue holds at most 1/4 of the pool (its entries are pinned)."""
STORE_HOLD_S = 0.05
"""How long after a chunk was queued the writer may hold it back while a store call
copies into the pool, so that the two do not compete for the CPU while the store's
caller waits; past it, the writer writes anyway. A chunk queued longer ago is not
held, so a steady stream of stores delays the disk by this much, not this much a
chunk."""
READERS = 4
"""Reader threads, shared by every retrieve (``promote_later``: ``app.disk_reads``)."""


class DiskChunkSizeMismatch(Conflict):
    title = "Chunk size differs from the disk tier's"
    slug = "disk-chunk-size-mismatch"


class DiskTier:
    """See the module docstring. Built by ``open``; ``start`` runs the writer once the
    server is up; ``bind`` is the ``disk_tier`` chunk-size binding; ``close`` flushes."""

    def __init__(
        self,
        *,
        files: ChunkFiles,
        index: DiskIndex,
        meta: DiskMeta,
        pool: Pool,
        telemetry: Telemetry,
        queue_bytes: int,
        lock_fd: int = -1,
    ) -> None:
        self._lock_fd = lock_fd
        self._files = files
        self._index = index
        self._meta = meta
        self._pool = pool
        self._telemetry = telemetry
        self.queue_bytes = queue_bytes
        self._queue: collections.deque[tuple[Entry, float]] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._closing = self._stopped = False
        self._copying = 0  # store calls copying into the pool now (``copying``)
        self._thread: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="mpcache-disk-reader")
        telemetry.disk_capacity_bytes.set(index.capacity_bytes)
        telemetry.disk_used_bytes.set_function(lambda: index.used_bytes)
        telemetry.disk_queue_bytes.set_function(lambda: self._queued)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        size_bytes: int,
        pool: Pool,
        telemetry: Telemetry,
        l2_seed: int | None,
        min_chunk_size: int,
        max_chunk_size: int,
    ) -> DiskTier:
        """Check and index ``directory`` (``DiskRefused`` naming the setting if it cannot
        serve); with L2, its seed wins (a directory keyed by another is emptied)."""
        began = time.monotonic()
        lock_fd = lock_directory(directory)
        try:
            meta = read_meta(directory)
            found = scan(directory)
            check_fits(directory, size_bytes, found.held_bytes)
            why_not = probe_direct(directory)
            files = ChunkFiles(directory, direct=why_not is None)
            for name in found.temps:
                files.remove(name)
            if meta is None or (l2_seed is not None and meta.seed != l2_seed):
                if found.chunks:
                    logger.warning(
                        "disk tier %s: %d chunk file(s) %s: deleted",
                        directory,
                        len(found.chunks),
                        "without meta.json"
                        if meta is None
                        else "keyed by another hash seed than the L2 tier's (the L2's wins)",
                    )
                empty(files, found)
                meta = DiskMeta.new(l2_seed)
                write_meta(directory, meta)
            check_chunk_size(directory, meta, min_chunk_size, max_chunk_size)
            index = DiskIndex(size_bytes)
            refused = rebuild(files, index, found, meta.chunk_size) if meta.chunk_size else []
        except BaseException as exc:
            os.close(lock_fd)
            if isinstance(exc, OSError):
                raise DiskRefused(f"{PATH_KEY} {directory}: {exc}") from exc
            raise
        for why in refused[:10]:
            logger.warning("disk tier: refused and deleted %s", why)
        telemetry.disk_reads.labels("corrupt").inc(len(refused))
        logger.info(
            "disk tier: %s, %d chunk file(s) (%d of %d bytes) indexed in %.2f s; I/O %s",
            directory,
            len(index),
            index.used_bytes,
            size_bytes,
            time.monotonic() - began,
            "O_DIRECT" if why_not is None else f"buffered ({why_not})",
        )
        queue_bytes = max(1, pool.capacity_bytes // QUEUE_POOL_FRACTION)
        return cls(
            files=files,
            index=index,
            meta=meta,
            pool=pool,
            telemetry=telemetry,
            queue_bytes=queue_bytes,
            lock_fd=lock_fd,
        )

    @property
    def seed(self) -> int:
        """The hash seed of the directory's chunk keys (``app.hashing.TokenHasher``)."""
        return self._meta.seed

    @property
    def directory(self) -> Path:
        return self._files.directory

    def bind(self, chunk_size: int) -> None:
        """The ``disk_tier`` binding: the directory takes the size, or refuses another."""
        held = self._meta.chunk_size
        if held is None:
            self._meta = replace(self._meta, chunk_size=chunk_size)
            write_meta(self.directory, self._meta)
        elif held != chunk_size:
            raise DiskChunkSizeMismatch(
                f"{PATH_KEY} {self.directory} holds chunks of {held} tokens, not {chunk_size}: "
                f"start with another --disk-path, or empty this one",
                disk_chunk_size=held,
                disk_path=str(self.directory),
            )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mpcache-disk-writer", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        """Write what is queued (for at most ``timeout_s``), then stop the writer; what
        is left is dropped (counted ``shutdown``)."""
        with self._cond:
            self._closing = True
            self._cond.wait_for(lambda: not self._queued, timeout=timeout_s)
            self._stopped = True
            left = [entry for entry, _ in self._queue]
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._readers.shutdown(wait=True, cancel_futures=True)
        for entry in left:
            self._pool.unpin(entry)
        with self._cond:
            self._queued -= sum(entry.nbytes for entry in left)
        self._telemetry.disk_writes.labels("shutdown").inc(len(left))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # another server may use the directory now
            self._lock_fd = -1
        if left:
            logger.warning("disk tier: %d queued chunk(s) not written at shutdown", len(left))

    # ------------------------------------------------------------------ writes

    def enqueue(self, entry: Entry) -> None:
        """Queue a whole chunk's entry just committed to the pool; never blocks."""
        writes = self._telemetry.disk_writes
        if self._index.holds((entry.key, entry.rank, entry.layout), entry.present):
            writes.labels("present").inc()
            return
        with self._cond:
            if self._closing:
                writes.labels("shutdown").inc()
                return
            if self._queued + entry.nbytes > self.queue_bytes:
                writes.labels("queue_full").inc()
                return
            pinned = self._pool.pin(entry.key, entry.rank, entry.layout, entry.present)
            if pinned is not entry:  # gone already, or replaced: queued in its turn
                if pinned is not None:
                    self._pool.unpin(pinned)
                writes.labels("evicted").inc()
                return
            self._queue.append((entry, time.monotonic()))
            self._queued += entry.nbytes
            self._cond.notify()

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Around a store call's copies: the writer holds back meanwhile (a chunk at
        most ``STORE_HOLD_S`` from its queueing), so the write-behind does not slow
        the reply."""
        with self._cond:
            self._copying += 1
        try:
            yield
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopped)
                hold = self._queue[0][1] + STORE_HOLD_S - time.monotonic() if self._queue else 0
                if hold > 0:
                    self._cond.wait_for(lambda: not self._copying or self._stopped, hold)
                if self._stopped:
                    return
                entry, _ = self._queue.popleft()
            try:
                self._write(entry)
            except Exception:
                self._telemetry.disk_writes.labels("error").inc()
                logger.exception("disk tier: write of a chunk failed")
            finally:
                self._pool.unpin(entry)
                with self._cond:
                    self._queued -= entry.nbytes
                    self._cond.notify_all()

    def _write(self, entry: Entry) -> None:
        writes = self._telemetry.disk_writes
        ident = (entry.key, entry.rank, entry.layout)
        if self._index.holds(ident, entry.present):
            writes.labels("present").inc()
            return
        size = file_bytes(entry.nbytes)
        evicted = self._index.make_room(size, keep=ident)
        if evicted is None:
            writes.labels("too_large").inc()
            return
        self._forget(evicted)
        chunk_size = self._meta.chunk_size
        assert chunk_size is not None, "chunks are stored once the chunk size is final"
        payload = self._pool.view(entry).numpy()
        header = encode_header(
            entry.key, entry.rank, entry.layout, entry.present, chunk_size, entry.nbytes
        )
        seal(header, payload.data)
        name = file_name(*ident)
        written = self._files.write(name, header, payload)
        self._forget(self._index.add(ident, DiskRecord(name, entry.present, entry.nbytes, size)))
        writes.labels("written").inc()
        self._telemetry.disk_bytes.labels("write").inc(written)

    def _forget(self, evicted: list[DiskRecord]) -> None:
        for record in evicted:
            self._files.remove(record.name)
        self._telemetry.disk_evicted.inc(len(evicted))

    # ------------------------------------------------------------------ reads

    def count_leading(self, keys: Sequence[bytes], world_size: int, layout: bytes) -> int:
        """How many leading chunk ``keys`` are on disk for every rank (no I/O)."""
        return self._index.count_leading(keys, world_size, layout)

    def promote(
        self,
        chunk_key: bytes,
        rank: int,
        layout: bytes,
        *,
        chunk_bytes: int,
        needed: int,
        note: object = None,
    ) -> Entry | None:
        """Read a chunk the pool lacks from its file into the pool, checked; return the
        pool entry pinned (None: not on disk with every ``needed`` slot, refused, or no
        room in the pool)."""
        ident = (chunk_key, rank, layout)
        record = self._index.get(ident)
        if record is None or needed & ~record.present:
            return None
        reads = self._telemetry.disk_reads
        expected = chunk_bytes if record.present else 1
        if record.payload_bytes != expected:
            self._refuse(ident, record, f"{record.payload_bytes} payload bytes, not {expected}")
            return None
        pool = self._pool
        entry = pool.begin_store(
            chunk_key, rank, nbytes=expected, layout=layout, present=record.present, note=note
        )
        if not isinstance(entry, Entry):
            if entry is None:
                reads.labels("miss").inc()  # no room in the pool
            return pool.pin(chunk_key, rank, layout, needed)
        try:
            self._read_into(ident, record, entry)
        except FileNotFoundError:
            pool.abort(entry)
            self._index.remove(ident, record)  # evicted meanwhile
            reads.labels("miss").inc()
            return None
        except (CorruptFile, OSError) as exc:
            pool.abort(entry)
            self._refuse(ident, record, str(exc))
            return None
        except BaseException:
            pool.abort(entry)
            raise
        pool.commit(entry)
        reads.labels("hit").inc()
        self._telemetry.disk_bytes.labels("read").inc(record.file_bytes)
        return pool.pin(chunk_key, rank, layout, needed)

    def promote_later(
        self,
        chunk_key: bytes,
        rank: int,
        layout: bytes,
        *,
        chunk_bytes: int,
        needed: int,
        note: object = None,
    ) -> Future[Entry | None]:
        """``promote`` on a reader thread (a closed tier reads no more: None)."""
        try:
            return self._readers.submit(
                self.promote,
                chunk_key,
                rank,
                layout,
                chunk_bytes=chunk_bytes,
                needed=needed,
                note=note,
            )
        except RuntimeError:  # shut down
            done: Future[Entry | None] = Future()
            done.set_result(None)
            return done

    def _read_into(self, ident: Ident, record: DiskRecord, entry: Entry) -> None:
        chunk_size = self._meta.chunk_size
        assert chunk_size is not None
        payload = self._pool.view(entry).numpy()
        block, got = self._files.read(record.name, payload)
        header = decode_header(block, name=ident, chunk_size=chunk_size)
        if header.payload_bytes != entry.nbytes or got != entry.nbytes:
            raise CorruptFile(f"{got} of {header.payload_bytes} payload bytes, {entry.nbytes} due")
        if record.present & ~header.present:
            raise CorruptFile("the file lacks slots its index entry has")
        verify(header, block, payload.data)

    def _refuse(self, ident: Ident, record: DiskRecord, why: str) -> None:
        self._telemetry.disk_reads.labels("corrupt").inc()
        logger.warning("disk tier: %s refused and deleted: %s", record.name, why)
        if self._index.remove(ident, record):
            self._files.remove(record.name)

    # ------------------------------------------------------------------ state

    def health(self) -> DiskHealth:
        return DiskHealth(
            path=str(self.directory),
            io="direct" if self._files.direct else "buffered",
            chunk_size=self._meta.chunk_size,
            capacity_bytes=self._index.capacity_bytes,
            used_bytes=self._index.used_bytes,
            chunks=len(self._index),
            queued_bytes=self._queued,
        )
