"""A retrieve's L2 reads: the chunks L1 lacks, fetched in one pipeline and promoted
into the pool (``Promoter.promote``).

Over a raw connection (``app.redis_wire``) the ``GET``s of one retrieve go out
pipelined, at most ``PIPELINE_BYTES`` of values outstanding, so Redis writes the next
value while this one is read; each value's header is read and checked first
(``app.l2_values.check_head``), then its payload is read straight into the pending
pool entry (``Pool.begin_store``) and checksummed there, once. A value that fails a
check is never committed: the entry is aborted, the value deleted and counted
``corrupt``. Without a raw connection (``rediss://``) the same pipeline goes through
redis-py, each value copied into the pool after ``decode_value``.

Faults: a connection error or timeout (each socket call bounded by
``--redis-timeout-s``) marks the tier down; what was promoted before it is served,
the rest is a miss. Past the retrieve's deadline no more ``GET`` is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from app.l2 import L2Tier
from app.l2_values import HEADER, CorruptValue, Head, check_head, checksum_of, decode_value
from app.redis_io import RedisUnavailable, translated
from app.redis_wire import Wire
from app.resp import encode
from dataplane.pool import Entry, Pool
from dataplane.registry import Registration

__all__ = ["PIPELINE_BYTES", "Owner", "Promoter", "Want"]

logger = logging.getLogger(__name__)

PIPELINE_BYTES = 64 << 20
"""Values outstanding on one connection at most (at least 2 ``GET``s, at most 64):
what Redis buffers for this reader, and what it may read and drop on a fault."""


@dataclass(frozen=True)
class Owner:
    """Whose chunks are read: what a registration names of them."""

    namespace: str
    world_size: int
    rank: int
    layout: bytes
    """The layout signature."""
    chunk_bytes: int

    @classmethod
    def of(cls, reg: Registration) -> Owner:
        sig, size = reg.layout.signature, reg.chunk_bytes
        return cls(reg.namespace, reg.world_size, reg.rank, sig, size)


@dataclass(frozen=True)
class Want:
    """One chunk L1 lacks: its chunk key, the slots the caller needs, its note."""

    chunk_key: bytes
    needed: int
    note: object


def _depth(chunk_bytes: int) -> int:
    return max(2, min(64, PIPELINE_BYTES // max(1, chunk_bytes)))


class _Chunk:
    """What one value must be: checks and the pool entry it lands in."""

    def __init__(self, promoter: Promoter, owner: Owner, want: Want, key: bytes) -> None:
        self.pool = promoter.pool
        self.l2 = promoter.l2
        self.reg = owner
        self.want = want
        self.key = key
        self.layout = owner.layout

    def head(self, raw: bytes | bytearray, total: int) -> Head:
        """The checked fixed header of a ``total``-byte value that starts with ``raw``."""
        return check_head(
            raw,
            total,
            chunk_key=self.want.chunk_key,
            rank=self.reg.rank,
            layout=self.layout,
            max_bytes=self.l2.max_value_bytes,
        )

    def check_payload(self, present: int, payload_len: int) -> None:
        expected = self.reg.chunk_bytes if present else 1
        if payload_len != expected:
            raise CorruptValue(f"{payload_len} payload bytes, expected {expected}")

    def begin(self, present: int, nbytes: int) -> Entry | None:
        """A pending entry to read the payload into (None: not wanted, or no room)."""
        if self.want.needed & ~present:
            return None  # L2's copy lacks a block the caller needs: a miss
        entry = self.pool.begin_store(
            self.want.chunk_key,
            self.reg.rank,
            nbytes=nbytes,
            layout=self.layout,
            present=present,
            note=self.want.note,
        )
        return entry if isinstance(entry, Entry) else None

    def pinned(self) -> Entry | None:
        return self.pool.pin(self.want.chunk_key, self.reg.rank, self.layout, self.want.needed)


class Promoter:
    """Promotes chunks from L2 into the pool, a retrieve's at once (module docstring)."""

    def __init__(self, l2: L2Tier, pool: Pool) -> None:
        self.l2 = l2
        self.pool = pool

    def promote(
        self,
        reg: Owner,
        chunk_size: int,
        wants: Sequence[Want],
        passed: Callable[[], bool],
    ) -> list[Entry | None]:
        """Per want, its entry promoted from L2 and pinned, or None (a miss, a corrupt
        value, L2 down, no room); ``passed``: whether the deadline has passed."""
        l2 = self.l2
        if not wants or not l2.up:
            return [None] * len(wants)
        layout = reg.layout
        chunks = [
            _Chunk(
                self,
                reg,
                want,
                l2.key(reg.namespace, chunk_size, layout, reg.world_size, reg.rank, want.chunk_key),
            )
            for want in wants
        ]
        depth = _depth(reg.chunk_bytes)
        out: list[Entry | None] = [None] * len(wants)
        try:
            if l2.wires is None:
                self._through_redis_py(chunks, depth, passed, out)
            else:
                self._over_wire(chunks, depth, passed, out)
        except RedisUnavailable as exc:
            # What was promoted before the fault is served; the rest is a miss.
            l2.missed("unavailable")
            l2.fault(exc)
        except BaseException:
            for entry in out:
                if entry is not None:
                    self.pool.unpin(entry)
            raise
        return out

    # ------------------------------------------------------------------ raw wire

    def _over_wire(
        self,
        chunks: list[_Chunk],
        depth: int,
        passed: Callable[[], bool],
        out: list[Entry | None],
    ) -> None:
        wires = self.l2.wires
        assert wires is not None
        wire = wires.take()
        sent = read = 0
        clean = False
        try:
            for i, chunk in enumerate(chunks):
                while sent < len(chunks) and sent < i + depth and not passed():
                    wire.send(encode("GET", chunks[sent].key))
                    sent += 1
                if i >= sent:
                    break  # the deadline passed: nothing more was asked
                out[i] = self._read_value(wire, chunk)
                read += 1
            clean = True
        finally:
            # Reused only with every reply read; else its unread replies die with it.
            if clean and read == sent:
                wires.give(wire)
            else:
                wire.close()

    def _read_value(self, wire: Wire, chunk: _Chunk) -> Entry | None:
        """Read the next reply (``chunk``'s value) off ``wire``: its entry, pinned."""
        reply = wire.header()
        if reply.kind == "nil":
            self.l2.missed()
            return None
        if reply.kind == "error":
            logger.warning("L2 GET %s: %s", chunk.key.decode(), reply.text)
            self.l2.missed()
            return None
        if reply.kind != "bulk":
            wire.close()
            raise RedisUnavailable(f"L2 GET answered with a {reply.kind}, not a value")
        total = reply.number
        try:
            return self._read_checked(wire, chunk, total)
        except CorruptValue as exc:
            self.l2.discard(chunk.key, str(exc))
            return None

    def _read_checked(self, wire: Wire, chunk: _Chunk, total: int) -> Entry | None:
        """Read a ``total``-byte value: checked header, payload into a pending entry,
        checksum, commit. Raises ``CorruptValue`` with every byte of it read."""
        fixed = bytearray(min(total, HEADER.size))
        wire.read_into(memoryview(fixed))
        consumed = len(fixed)
        try:
            head = chunk.head(fixed, total)
            mask = bytearray(head.mask_len)
            wire.read_into(memoryview(mask))
            consumed += len(mask)
            present = int.from_bytes(mask, "little")
            chunk.check_payload(present, head.payload_len)
        except CorruptValue:
            wire.skip(total - consumed)
            wire.end_of_bulk()
            raise
        entry = chunk.begin(present, head.payload_len)
        if entry is None:
            wire.skip(head.payload_len)
            wire.end_of_bulk()
            return chunk.pinned()  # present in L1 already (or no room, or not wanted)
        try:
            target = self.pool.view(entry).numpy().data
            wire.read_into(target)
            wire.end_of_bulk()
            if checksum_of(fixed, mask, target) != head.checksum:
                raise CorruptValue("checksum mismatch")
        except BaseException:
            self.pool.abort(entry)
            raise
        self.pool.commit(entry)
        self.l2.served(total)
        return chunk.pinned()

    # ------------------------------------------------------------------ redis-py

    def _through_redis_py(
        self,
        chunks: list[_Chunk],
        depth: int,
        passed: Callable[[], bool],
        out: list[Entry | None],
    ) -> None:
        for start in range(0, len(chunks), depth):
            if passed():
                break
            window = chunks[start : start + depth]
            with translated(f"L2 {self.l2.url}"):
                pipe = self.l2.client.pipeline(transaction=False)
                for chunk in window:
                    pipe.get(chunk.key)
                # An error reply (WRONGTYPE, ...) is one value's miss, as on the raw path.
                values = pipe.execute(raise_on_error=False)
            for n, (chunk, raw) in enumerate(zip(window, values, strict=True)):
                out[start + n] = self._copied(chunk, raw)

    def _copied(self, chunk: _Chunk, raw: object) -> Entry | None:
        """Check a value redis-py read, copy it into a pending entry, commit it."""
        if not isinstance(raw, bytes):
            self.l2.missed()
            return None
        try:
            value = decode_value(
                raw,
                chunk_key=chunk.want.chunk_key,
                rank=chunk.reg.rank,
                layout=chunk.layout,
                max_bytes=self.l2.max_value_bytes,
            )
            chunk.check_payload(value.present, len(value.payload))
        except CorruptValue as exc:
            self.l2.discard(chunk.key, str(exc))
            return None
        entry = chunk.begin(value.present, len(value.payload))
        if entry is None:
            return chunk.pinned()
        try:
            self.pool.view(entry).numpy()[:] = np.frombuffer(value.payload, dtype=np.uint8)
        except BaseException:
            self.pool.abort(entry)
            raise
        self.pool.commit(entry)
        self.l2.served(len(raw))
        return chunk.pinned()
