"""The L2 value format (pure): every value L2 holds is one chunk of one rank::

    header (``HEADER``: magic, version, present-mask length, rank, payload length,
            checksum, chunk key, layout hash) | present mask | payload

Versioned, sized and checksummed (xxh3-64 over everything but the checksum field);
a value that fails any check is deleted and counted ``corrupt``, never served.
``decode_value`` checks a whole value in memory; ``check_head`` and ``checksum_of``
check one read in pieces (``app.l2_reads``: the header first, then the payload
straight into its pool entry).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MAX_MASK_BYTES",
    "CorruptValue",
    "Decoded",
    "Head",
    "check_head",
    "checksum_of",
    "decode_value",
    "encode_header",
    "seal",
]

FORMAT_VERSION = 1
MAGIC = b"MPL2"
# magic, version, present-mask length, rank, payload length, checksum, chunk key, layout
HEADER = struct.Struct("<4sHHIQQ16s16s")
MAX_MASK_BYTES = 64
_CHECKSUM_AT = slice(20, 28)


class CorruptValue(ValueError):
    """An L2 value that is not a valid chunk for the key it was read under."""


def _present_bytes(present: int) -> bytes:
    return present.to_bytes(max(1, (present.bit_length() + 7) // 8), "little")


def encode_header(chunk_key: bytes, rank: int, layout: bytes, present: int) -> bytes:
    """The header of a value whose checksum and payload length are filled in later."""
    mask = _present_bytes(present)
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(mask), rank, 0, 0, chunk_key, layout) + mask


def seal(buf: bytearray, header_len: int) -> None:
    """Write the payload length and checksum into a value built on ``encode_header``."""
    payload_len = len(buf) - header_len
    struct.pack_into("<Q", buf, 12, payload_len)
    struct.pack_into("<Q", buf, 20, checksum_of(buf))


def checksum_of(head: bytes | bytearray | memoryview, *rest: bytes | bytearray | memoryview) -> int:
    """The checksum of a value given in pieces: ``head`` starts with the fixed header
    (its checksum field is skipped), ``rest`` follows it."""
    view = memoryview(head)
    h = xxhash.xxh3_64()
    h.update(view[: _CHECKSUM_AT.start])
    h.update(view[_CHECKSUM_AT.stop :])
    for part in rest:
        h.update(part)
    return h.intdigest()


@dataclass(frozen=True)
class Head:
    """A value's fixed header, checked against the key it was read under."""

    mask_len: int
    payload_len: int
    checksum: int

    @property
    def header_len(self) -> int:
        return HEADER.size + self.mask_len


def check_head(
    head: bytes | bytearray,
    total: int,
    *,
    chunk_key: bytes,
    rank: int,
    layout: bytes,
    max_bytes: int,
) -> Head:
    """Check the fixed header (``HEADER.size`` bytes) of a ``total``-byte value read under
    the key of (``chunk_key``, ``rank``, ``layout``); the checksum is checked later."""
    if total > max_bytes + HEADER.size + MAX_MASK_BYTES:
        raise CorruptValue(f"{total} bytes: over the {max_bytes}-byte bound")
    if total < HEADER.size or len(head) < HEADER.size:
        raise CorruptValue(f"{total} bytes: shorter than the header")
    magic, version, mask_len, v_rank, payload_len, checksum, v_key, v_layout = HEADER.unpack_from(
        head
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptValue(f"format {magic!r} v{version}, expected {MAGIC!r} v{FORMAT_VERSION}")
    if mask_len > MAX_MASK_BYTES or payload_len != total - HEADER.size - mask_len:
        raise CorruptValue(f"length {total} does not match its header")
    if v_key != chunk_key or v_rank != rank or v_layout != layout:
        raise CorruptValue("the value belongs to another chunk, rank or layout")
    return Head(mask_len, payload_len, checksum)


@dataclass(frozen=True)
class Decoded:
    present: int
    payload: memoryview


def decode_value(
    raw: bytes, *, chunk_key: bytes, rank: int, layout: bytes, max_bytes: int
) -> Decoded:
    """Check a whole value read under the key of (``chunk_key``, ``rank``, ``layout``)."""
    head = check_head(
        raw, len(raw), chunk_key=chunk_key, rank=rank, layout=layout, max_bytes=max_bytes
    )
    if head.checksum != checksum_of(raw):
        raise CorruptValue("checksum mismatch")
    present = int.from_bytes(raw[HEADER.size : head.header_len], "little")
    return Decoded(present, memoryview(raw)[head.header_len :])
