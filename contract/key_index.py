"""The key index: which chunk and unit keys the server's pool holds, read in place.

The server publishes it (``dataplane.key_index.KeyIndex`` writes it, ``GET
/cache/key-index`` names it) as one POSIX shared-memory segment of mode 0600, so
only processes of its own user can map it; the connector maps it read-only and
answers a lookup on vLLM's thread by computing the prompt's keys itself
(``contract.chunk_keys``, with the secret in the header) and probing here, with no
call to the server. It is advisory: a key it shows may be evicted before the load
(the load then fails and vLLM recomputes), and one it lacks may still be in L2
(``FLAG_AUTHORITATIVE`` says when a miss here is a miss everywhere).

Layout (little-endian)::

    header (64 bytes): magic "MPKI" | version u32 | slots u32 | flags u32 |
                       secret u64 | boot_id 16 bytes | epoch u64 | 16 reserved
    slot i (32 bytes, at 64 + 32 i): seq u64 | ranks u64 | key 16 bytes

Open addressing with linear probing from ``key's first 8 bytes & (slots - 1)``. A
slot never used is all zeros and ends a probe; a key whose ranks fell to 0 stays as
a tombstone. ``ranks`` has bit r set when rank r holds the key. Each slot is a
seqlock: the writer makes ``seq`` odd, writes, makes it even again; a reader takes a
slot only if it read the same even ``seq`` before and after. ``epoch`` is the same
for the whole table: the writer makes it odd while it rebuilds (clears every slot and
puts the live keys back), and a probe that saw it odd, or changed, cannot say
(``IndexBusy``) rather than miss a key not yet put back. (A server older than the
field leaves it 0: never rebuilding, as its readers assumed.)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "EPOCH_OFFSET",
    "FLAG_AUTHORITATIVE",
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_RANKS",
    "SLOT",
    "SLOT_BYTES",
    "VERSION",
    "IndexBusy",
    "IndexHeader",
    "IndexView",
]


class IndexBusy(Exception):
    """A slot the answer depends on was being written for as long as a reader spins:
    the index cannot say (the caller asks the server), rather than answer "not held"."""


MAGIC = b"MPKI"
VERSION = 1
HEADER = struct.Struct("<4sIIIQ16sQ16x")
HEADER_BYTES = HEADER.size
SLOT = struct.Struct("<QQ16s")
SLOT_BYTES = SLOT.size
MAX_RANKS = 64
"""Ranks a slot's bitmask can name; a wider deployment does not use the index."""
FLAG_AUTHORITATIVE = 1
"""The index holds every key the server could serve (no L2 tier, nothing left out)."""

_SEQ = struct.Struct("<Q")
EPOCH_OFFSET = 40
"""Where the header's ``epoch`` is (odd while the writer rebuilds the table)."""
_EMPTY_KEY = bytes(16)
_SPINS = 64
"""Tries to read one slot the writer keeps changing before the probe gives up (a miss)."""

assert HEADER_BYTES == 64 and SLOT_BYTES == 32


@dataclass(frozen=True)
class IndexHeader:
    slots: int
    flags: int
    secret: int
    boot_id: str

    @classmethod
    def read(cls, buf: bytes | memoryview) -> IndexHeader:
        """The header of an index, or ``ValueError`` when ``buf`` is not one."""
        if len(buf) < HEADER_BYTES:
            raise ValueError("too short for a key index")
        magic, version, slots, flags, secret, boot, _epoch = HEADER.unpack_from(buf)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a key index of version {VERSION}: {magic!r} {version}")
        if slots < 1 or slots & (slots - 1) or len(buf) < HEADER_BYTES + slots * SLOT_BYTES:
            raise ValueError(f"a key index of {slots} slots does not fit {len(buf)} bytes")
        return cls(slots=slots, flags=flags, secret=secret, boot_id=boot.hex())


class IndexView:
    """Reads an index in ``buf`` (a read-only mapping); never writes it."""

    def __init__(self, buf: memoryview) -> None:
        self.header = IndexHeader.read(buf)
        self._buf = buf
        self._mask = self.header.slots - 1
        self._words: np.ndarray | None = np.frombuffer(
            buf, dtype="<u8", count=self.header.slots * SLOT_BYTES // 8, offset=HEADER_BYTES
        ).reshape(-1, SLOT_BYTES // 8)

    def release(self) -> None:
        """Drop the views into ``buf`` (before its mapping is closed)."""
        self._words = None

    @property
    def authoritative(self) -> bool:
        """A miss here is a miss (flags are read afresh: the server may clear it)."""
        (flags,) = struct.unpack_from("<I", self._buf, 12)
        return bool(flags & FLAG_AUTHORITATIVE)

    def _epoch(self) -> int:
        """The table's epoch, even and unchanged through a probe, or ``IndexBusy``."""
        (epoch,) = _SEQ.unpack_from(self._buf, EPOCH_OFFSET)
        if epoch & 1:
            raise IndexBusy
        return int(epoch)

    def _settled(self, epoch: int) -> None:
        """Raise ``IndexBusy`` when a rebuild began since ``epoch`` was read."""
        if _SEQ.unpack_from(self._buf, EPOCH_OFFSET)[0] != epoch:
            raise IndexBusy

    def holds(self, key: bytes, ranks: int) -> bool:
        """True when every rank in the bitmask ``ranks`` holds ``key``; raises
        ``IndexBusy`` when a slot on its probe path would not settle, or the table
        was being rebuilt."""
        epoch = self._epoch()
        held = self._holds(key, ranks)
        self._settled(epoch)
        return held

    def _holds(self, key: bytes, ranks: int) -> bool:
        buf, mask = self._buf, self._mask
        pos = int.from_bytes(key[:8], "little") & mask
        for _ in range(mask + 1):
            offset = HEADER_BYTES + pos * SLOT_BYTES
            slot = _read_slot(buf, offset)
            if slot is None:
                raise IndexBusy
            seq, held, found = slot
            if found == key:
                return held & ranks == ranks
            if seq == 0 and found == _EMPTY_KEY:
                return False
            pos = (pos + 1) & mask
        return False

    def leading(self, keys: Sequence[bytes], world_size: int) -> int:
        """How many of ``keys``, in order, every rank in ``range(world_size)`` holds.

        Every key's home slot is read at once (numpy); a key not settled there (it
        probed on past a collision, or its slot was being written) is asked alone.
        ``IndexBusy`` as for ``holds``."""
        epoch = self._epoch()
        count = self._leading(keys, world_size)
        self._settled(epoch)
        return count

    def _leading(self, keys: Sequence[bytes], world_size: int) -> int:
        ranks = (1 << world_size) - 1
        words = self._words
        if words is None or len(keys) < 8:
            return self._leading_from(keys, 0, ranks)
        wanted = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
        home = wanted[:, 0] & np.uint64(self._mask)
        slots = words[home]
        settled = (slots[:, 0] & np.uint64(1) == 0) & (words[home, 0] == slots[:, 0])
        found = settled & (slots[:, 2] == wanted[:, 0]) & (slots[:, 3] == wanted[:, 1])
        held = found & (slots[:, 1] & np.uint64(ranks) == np.uint64(ranks))
        misses = np.flatnonzero(~held)
        if not len(misses):
            return len(keys)
        first = int(misses[0])
        if found[first] or (settled[first] and not slots[first, 1] and not slots[first, 0]):
            return first  # its own slot says no, or an empty home slot: not held
        return self._leading_from(keys, first, ranks)

    def _leading_from(self, keys: Sequence[bytes], start: int, ranks: int) -> int:
        for count in range(start, len(keys)):
            if not self._holds(keys[count], ranks):
                return count
        return len(keys)


def _read_slot(buf: memoryview, offset: int) -> tuple[int, int, bytes] | None:
    """The slot's ``(seq, ranks, key)`` as of one stable ``seq``, or None when the
    writer kept it changing."""
    for _ in range(_SPINS):
        seq, ranks, key = SLOT.unpack_from(buf, offset)
        if seq & 1:
            continue
        (again,) = _SEQ.unpack_from(buf, offset)
        if again == seq:
            return seq, ranks, key
    return None
