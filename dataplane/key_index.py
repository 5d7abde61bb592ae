"""The writer of the key index (layout and readers: ``contract.key_index``).

``KeyIndex`` owns one shared-memory segment: ``create`` makes it (mode 0600),
``close`` unlinks it. The pool tells it, under the pool's own lock, when a
``(key, rank)`` becomes visible and when its last entry goes (``Pool`` calls
``set``); readers in other processes see each slot change as a whole (seqlock).

Stores are plain aligned 8-byte writes through numpy, which x86-64 makes visible in
program order (TSO): ``supported`` says whether this machine is one; elsewhere the
server publishes no index and connectors ask by HTTP, as before.
"""

from __future__ import annotations

import logging
import platform
import struct

import numpy as np

from contract.key_index import (
    EPOCH_OFFSET,
    FLAG_AUTHORITATIVE,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_RANKS,
    SLOT_BYTES,
    VERSION,
)
from contract.shm_naming import segment_name
from dataplane.segments import Segment

__all__ = ["KeyIndex", "index_slots", "supported"]

logger = logging.getLogger(__name__)

_MAX_LOAD = 0.75
"""Slots in use (live or tombstone) past which new keys are left out, until a rebuild."""
_MAX_SLOTS = 1 << 22


def supported() -> bool:
    """True where the index's lock-free publication is sound (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def index_slots(pool_pages: int) -> int:
    """Slots for a pool of ``pool_pages`` pages: room for each page's entry and several
    unit keys per entry, a power of two, at most ``_MAX_SLOTS`` (128 MiB)."""
    want = max(1024, 8 * pool_pages)
    return min(_MAX_SLOTS, 1 << (want - 1).bit_length())


class KeyIndex:
    """The server's key index; not thread-safe by itself (the pool's lock guards it)."""

    def __init__(self, segment: Segment, slots: int, *, authoritative: bool) -> None:
        self.segment = segment
        self.slots = slots
        self._mask = slots - 1
        self._words = np.frombuffer(
            segment.buffer, dtype="<u8", count=slots * SLOT_BYTES // 8, offset=HEADER_BYTES
        ).reshape(slots, SLOT_BYTES // 8)
        self._used = 0  # slots holding a key, live or tombstone
        self._tombstones = 0
        self._authoritative = authoritative
        self._epoch = 0  # odd while the table is rebuilt (contract.key_index)
        self.left_out = 0
        """Keys not indexed because the table was full (readers then ask by HTTP)."""

    @classmethod
    def create(cls, slots: int, *, secret: int, boot_id: str, authoritative: bool) -> KeyIndex:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        segment = Segment.create(segment_name("index"), HEADER_BYTES + slots * SLOT_BYTES)
        index = cls(segment, slots, authoritative=authoritative)
        flags = FLAG_AUTHORITATIVE if authoritative else 0
        header = HEADER.pack(b"\0" * 4, VERSION, slots, flags, secret, bytes.fromhex(boot_id), 0)
        segment.buffer[4:HEADER_BYTES] = header[4:]
        segment.buffer[0:4] = MAGIC  # last: a reader sees a whole header or none
        return index

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        self.segment.close()

    def set(self, key: bytes, rank: int, held: bool) -> None:
        """Record whether ``rank`` holds ``key`` (an entry of it is visible)."""
        if rank >= MAX_RANKS:
            return
        low, high = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
        slot, free = self._find(low, high)
        if slot is not None:
            before = int(self._words[slot, 1])
            ranks = before | (1 << rank) if held else before & ~(1 << rank)
            self._tombstones += (ranks == 0) - (before == 0)
            self._write(slot, ranks, low, high)
            if self._tombstones > self.slots // 4:
                self._rebuild()
            return
        if not held:
            return
        if free is not None and int(self._words[free, 0]) == 0 and self._full():
            if self._tombstones:
                self._rebuild()
                _, free = self._find(low, high)
            if free is None or self._full():
                free = None
        if free is None:
            self._leave_out()
            return
        if int(self._words[free, 0]) == 0:
            self._used += 1  # a slot never used before
        else:
            self._tombstones -= 1  # a tombstone taken over
        self._write(free, 1 << rank, low, high)

    def _find(self, low: int, high: int) -> tuple[int | None, int | None]:
        """(the slot holding the key, the first slot a new key could take)."""
        words, mask = self._words, self._mask
        pos = low & mask
        free: int | None = None
        for _ in range(self.slots):
            if int(words[pos, 2]) == low and int(words[pos, 3]) == high:
                return pos, free
            if int(words[pos, 1]) == 0:
                if free is None:
                    free = pos
                if int(words[pos, 0]) == 0:  # never used: the key is nowhere further
                    return None, free
            pos = (pos + 1) & mask
        return None, free

    def _write(self, slot: int, ranks: int, low: int, high: int) -> None:
        words = self._words
        seq = int(words[slot, 0])
        words[slot, 0] = seq + 1  # odd: readers retry
        words[slot, 2] = low
        words[slot, 3] = high
        words[slot, 1] = ranks
        words[slot, 0] = seq + 2

    def _full(self) -> bool:
        return self._used + 1 > self.slots * _MAX_LOAD

    def _leave_out(self) -> None:
        if not self.left_out:
            logger.warning(
                "key index full (%d slots): keys left out are looked up by HTTP", self.slots
            )
        self.left_out += 1
        if self._authoritative:
            self._authoritative = False
            struct.pack_into("<I", self.segment.buffer, 12, 0)  # a miss here may be a hit

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        struct.pack_into("<Q", self.segment.buffer, EPOCH_OFFSET, epoch)

    def _rebuild(self) -> None:
        """Drop the tombstones: clear the table and put the live keys back. The epoch
        is odd meanwhile, so a reader cannot say (a lookup by HTTP then) rather than
        miss a key not yet put back."""
        # Odd from here, whatever it was: a refill that raised left it odd (readers
        # went to HTTP since), and this one must still end on an even epoch.
        self._set_epoch((self._epoch + 1) | 1)
        self._refill()
        self._set_epoch(self._epoch + 1)

    def _refill(self) -> None:
        words = self._words
        live = words[words[:, 1] != 0][:, 1:].copy()
        for slot in range(self.slots):
            if int(words[slot, 2]) or int(words[slot, 3]):
                self._write(slot, 0, 0, 0)
        words[:, 0] = 0  # even: every slot now reads as never used
        self._used = self._tombstones = 0
        for ranks, low, high in live.tolist():
            _, free = self._find(low, high)
            assert free is not None
            self._used += 1
            self._write(free, ranks, low, high)
