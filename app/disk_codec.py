"""The local-disk tier's file format (``app.disk_tier``): pure, no I/O.

One file per (chunk key, rank, layout), named ``file_name``::

    <2 hex of the key>/<key hex>-<rank>-<layout hex>.chunk

Its first ``HEADER_BYTES`` (one aligned block) are the header, the payload follows
from that offset, padded with zeros to a multiple of ``BLOCK_BYTES`` so that every
read and write of the file is block-aligned (``O_DIRECT``)::

    magic "MPD1" | version u16 | mask length u16 | rank u32 | chunk size u32 (tokens)
    | payload length u64 | checksum u64 | chunk key 16 B | layout 16 B | present mask
    | zeros to HEADER_BYTES

What an L2 value carries (``app.l2``), plus the chunk size. The checksum (xxh3-64,
as L2's) covers the whole header block but its own field, then the payload's
``payload length`` bytes (not the padding). A file whose header, name, size or
checksum does not agree is ``CorruptFile``: refused, deleted and counted, never
served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "BLOCK_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "CorruptFile",
    "DiskHeader",
    "checksum",
    "decode_header",
    "encode_header",
    "file_bytes",
    "file_name",
    "parse_name",
    "round_up",
    "verify",
]

FORMAT_VERSION = 1
MAGIC = b"MPD1"
BLOCK_BYTES = 4096
"""The alignment of every offset, length and buffer of a file's I/O."""
HEADER_BYTES = BLOCK_BYTES
_FIXED = struct.Struct("<4sHHIIQQ16s16s")
_CHECKSUM_AT = 24  # offset of the checksum field (u64)
MAX_MASK_BYTES = HEADER_BYTES - _FIXED.size
KEY_BYTES = 16
SUFFIX = ".chunk"


class CorruptFile(ValueError):
    """A chunk file that is not a valid chunk for the name it was found under."""


@dataclass(frozen=True)
class DiskHeader:
    chunk_key: bytes
    rank: int
    layout: bytes
    present: int
    chunk_size: int
    """Tokens per chunk of the server that wrote it."""
    payload_bytes: int
    checksum: int


def round_up(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def file_bytes(payload_bytes: int) -> int:
    """The size of the file of a chunk of ``payload_bytes`` (header and padding)."""
    return HEADER_BYTES + round_up(payload_bytes)


def file_name(chunk_key: bytes, rank: int, layout: bytes) -> str:
    """The file's path relative to the tier's directory."""
    key = chunk_key.hex()
    return f"{key[:2]}/{key}-{rank}-{layout.hex()}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int, bytes]:
    """(chunk key, rank, layout) of a ``file_name``'s last part; ``CorruptFile`` if it
    is not one."""
    if not name.endswith(SUFFIX):
        raise CorruptFile(f"{name}: not a chunk file")
    try:
        key, rank, layout = name[: -len(SUFFIX)].split("-")
        parsed = bytes.fromhex(key), int(rank), bytes.fromhex(layout)
    except ValueError as exc:
        raise CorruptFile(f"{name}: not a chunk file name") from exc
    if len(parsed[0]) != KEY_BYTES or len(parsed[2]) != KEY_BYTES or parsed[1] < 0:
        raise CorruptFile(f"{name}: not a chunk file name")
    return parsed


def _mask_bytes(present: int) -> bytes:
    return present.to_bytes(max(1, (present.bit_length() + 7) // 8), "little")


def encode_header(
    chunk_key: bytes, rank: int, layout: bytes, present: int, chunk_size: int, payload_bytes: int
) -> bytearray:
    """The header block, checksum 0 (``checksum`` then ``seal`` it with the payload)."""
    if len(chunk_key) != KEY_BYTES or len(layout) != KEY_BYTES:
        raise ValueError("chunk keys and layouts are 16 bytes")
    mask = _mask_bytes(present)
    if len(mask) > MAX_MASK_BYTES:
        raise ValueError(f"a present mask of {len(mask)} bytes does not fit the header")
    block = bytearray(HEADER_BYTES)
    _FIXED.pack_into(
        block, 0, MAGIC, FORMAT_VERSION, len(mask), rank, chunk_size, payload_bytes, 0,
        chunk_key, layout,
    )  # fmt: skip
    block[_FIXED.size : _FIXED.size + len(mask)] = mask
    return block


def checksum(header: bytes | bytearray | memoryview, payload: memoryview) -> int:
    """xxh3-64 of the header block but its checksum field, then of the payload."""
    view = memoryview(header)
    h = xxhash.xxh3_64()
    h.update(view[:_CHECKSUM_AT])
    h.update(view[_CHECKSUM_AT + 8 : HEADER_BYTES])
    h.update(payload)
    return h.intdigest()


def seal(header: bytearray, payload: memoryview) -> None:
    """Write the checksum of ``header`` and ``payload`` into ``header``."""
    struct.pack_into("<Q", header, _CHECKSUM_AT, checksum(header, payload))


def decode_header(
    block: bytes | bytearray | memoryview, *, name: tuple[bytes, int, bytes], chunk_size: int
) -> DiskHeader:
    """The header of a file found under ``name`` (``parse_name``) by a tier of
    ``chunk_size`` tokens; ``CorruptFile`` if it is torn or belongs to another chunk."""
    if len(block) < HEADER_BYTES:
        raise CorruptFile(f"{len(block)} bytes: shorter than the header")
    magic, version, mask_len, rank, size, payload_bytes, check, key, layout = _FIXED.unpack_from(
        block
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptFile(f"format {magic!r} v{version}, expected {MAGIC!r} v{FORMAT_VERSION}")
    if not 1 <= mask_len <= MAX_MASK_BYTES:
        raise CorruptFile(f"a present mask of {mask_len} bytes")
    if (key, rank, layout) != name:
        raise CorruptFile("the file belongs to another chunk, rank or layout")
    if size != chunk_size:
        raise CorruptFile(f"a chunk of {size} tokens, this tier's are {chunk_size}")
    present = int.from_bytes(bytes(block[_FIXED.size : _FIXED.size + mask_len]), "little")
    return DiskHeader(key, rank, layout, present, size, payload_bytes, check)


def verify(header: DiskHeader, block: bytes | bytearray | memoryview, payload: memoryview) -> None:
    """Check the payload read under ``header`` (``CorruptFile`` on a mismatch)."""
    if len(payload) != header.payload_bytes:
        raise CorruptFile(f"{len(payload)} payload bytes, the header says {header.payload_bytes}")
    if checksum(block, payload) != header.checksum:
        raise CorruptFile("checksum mismatch")
