"""The binary lookup form: ``POST /cache/lookup`` with ``content-type: application/octet-stream``.

The JSON forms carry a lookup's tokens as a list or as base64 text
(``contract.tokens``); this form carries them raw, after a small JSON header, so
neither side parses a token list or base64 text and the body is 3/4 the size::

    offset    bytes   content
    0         4       magic b"MPL1" (mpcache lookup, version 1)
    4         4       H: the header's length, uint32 little-endian
    8         H       header: UTF-8 JSON of ``LookupFrameHeader``; each item says
                      how many tokens are its own (``num_tokens``)
    8+H       P       zero bytes, padding the header to a multiple of 4 (P = -H mod 4)
    8+H+P     4*T     token ids, little-endian int32: item 0's, then item 1's, ...

``T`` is the sum of the items' ``num_tokens``: the body is exactly
``8 + H + P + 4*T`` bytes. The reply is the JSON ``LookupResponse``, one result per
item, in order. With a lookup area (the header's ``area``) the ids are in shared
memory and the body carries a mark per item instead (``lookup_frame_marks``).
The connector sends a frame as it packs it (``lookup_frame_parts``); the server
reads it as it arrives (``LookupFrameReader``).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import TOKEN_DTYPE, check_tokens

__all__ = [
    "LOOKUP_FRAME_MAGIC",
    "LOOKUP_FRAME_MEDIA_TYPE",
    "SEND_PIECE_BYTES",
    "AreaFetch",
    "LookupFrameReader",
    "decode_lookup_frame",
    "encode_lookup_frame",
    "lookup_frame_marks",
    "lookup_frame_parts",
]

LOOKUP_FRAME_MEDIA_TYPE = "application/octet-stream"
LOOKUP_FRAME_MAGIC = b"MPL1"
_PREFIX = struct.Struct("<4sI")
_MARK = struct.Struct("<I")

AreaFetch = Callable[[str, int, int], np.ndarray]
"""``fetch(area, offset_bytes, num_tokens)``: a copy of those int32 ids of the
area (a reader with a lookup area calls it; it raises what the caller should)."""


def _head(header: LookupFrameHeader) -> bytes:
    head = header.model_dump_json(exclude_none=True).encode()
    return b"".join((_PREFIX.pack(LOOKUP_FRAME_MAGIC, len(head)), head, b"\0" * (-len(head) % 4)))


def encode_lookup_frame(header: LookupFrameHeader, packed: Sequence[bytes]) -> bytes:
    """The frame of ``header`` whose item ``i`` has the int32 bytes ``packed[i]``."""
    if len(packed) != len(header.requests):
        raise ValueError(f"{len(packed)} token blobs for {len(header.requests)} items")
    return b"".join(lookup_frame_parts(header, packed))


SEND_PIECE_BYTES = 64 << 10
"""What a sender gathers before it writes a piece of a frame. Item by item, a large
lookup (a burst's, as bench/scheduler_burst_bench.py --no-lookup-area sends) costs
more: each piece is a chunk to frame, a socket write and a wake-up of the server's
loop."""


def lookup_frame_parts(
    header: LookupFrameHeader, packed: Iterable[bytes], *, piece_bytes: int = 0
) -> Iterator[bytes]:
    """The frame in pieces, so a sender can pack item ``i + 1`` while item ``i`` is
    on the wire (and the server works on it: ``LookupFrameReader``): prefix and
    header, then the items' bytes as ``packed`` yields them, each item its own piece
    or, with ``piece_bytes``, gathered into pieces of at least that many bytes (the
    last may be shorter)."""
    gathered: list[bytes] = []
    size = 0
    for blob in itertools.chain((_head(header),), _checked(header, packed)):
        gathered.append(blob)
        size += len(blob)
        if size >= piece_bytes:
            yield b"".join(gathered) if len(gathered) > 1 else blob
            gathered, size = [], 0
    if gathered:
        yield b"".join(gathered)


def lookup_frame_marks(
    header: LookupFrameHeader,
    packed: Iterable[bytes],
    write: Callable[[int, bytes], None],
    *,
    piece_bytes: int = 0,
) -> Iterator[bytes]:
    """The frame of ``header`` (which names an area) in pieces: each item's ids are
    given to ``write(offset_bytes, ids)`` as ``packed`` yields them, and its mark
    follows, gathered into a piece once ``piece_bytes`` of ids were written since the
    last one (so the server works on item ``i`` while item ``i + 1`` is packed).

    With a lookup area the token ids are not in the body but in shared memory the
    client registered (``POST /cache/lookup-areas``), item after item from byte 0 as
    the token section would hold them, and the body carries one mark per item, its
    index as uint32 little-endian, written once the item's ids are in the area::

        8+H+P     4*N     the marks: 0, 1, ..., N-1 (N = the number of items)
    """
    if header.area is None:
        raise ValueError("a frame of marks needs a header that names its lookup area")
    yield _head(header)
    marks: list[bytes] = []
    offset = written = 0
    for index, blob in enumerate(_checked(header, packed)):
        write(offset, blob)
        offset += len(blob)
        written += len(blob)
        marks.append(_MARK.pack(index))
        if written >= piece_bytes:
            yield b"".join(marks)
            marks, written = [], 0
    if marks:
        yield b"".join(marks)


def _checked(header: LookupFrameHeader, packed: Iterable[bytes]) -> Iterator[bytes]:
    """``packed``, checked against the header's items one by one."""
    items = iter(header.requests)
    for blob in packed:
        item = next(items, None)
        if item is None:
            raise ValueError(f"more token blobs than the {len(header.requests)} items")
        if len(blob) != 4 * item.num_tokens:
            raise ValueError(
                f"request {item.request_id!r}: {len(blob)} token bytes for "
                f"num_tokens {item.num_tokens}"
            )
        yield blob
    if next(items, None) is not None:
        raise ValueError(f"fewer token blobs than the {len(header.requests)} items")


class LookupFrameReader:
    """``decode_lookup_frame`` for a body that arrives in pieces.

    ``feed`` takes the next bytes and returns the items completed by them, each with
    its token ids, so a server can hash item ``i`` while item ``i + 1`` is still
    arriving; ``close`` checks that the body ended exactly where the items say.
    Faults raise ``ValueError``, naming the fault, as soon as they are seen: a bad
    magic, a length that does not add up, a negative token id (a header that does
    not validate: pydantic's ``ValidationError``, itself a ``ValueError``). With a
    lookup area, the items' ids are copied out of the area (``fetch``) when their
    marks arrive, so what the server hashes is what it keeps.

    A header longer than ``inline_header_bytes`` is not parsed here: once it has
    arrived, ``raw_header`` holds its JSON for the caller to parse elsewhere (a
    server, off its event loop) and hand back with ``set_header``; until then
    ``feed`` only buffers.
    """

    def __init__(
        self, fetch: AreaFetch | None = None, *, inline_header_bytes: int | None = None
    ) -> None:
        self._fetch = fetch
        self._inline_header_bytes = inline_header_bytes
        self.raw_header: bytes | None = None
        """The header's JSON, when it is the caller's to parse (``set_header``)."""
        self._area_offset = 0  # where the next item's ids start in the area
        self._buf = bytearray()
        self._at = 0  # consumed bytes at the front of _buf
        self._received = 0
        self._header: LookupFrameHeader | None = None
        self._head_end = 0
        self._tokens_start = 0
        self._next = 0

    def feed(self, data: bytes) -> list[tuple[LookupFrameItem, np.ndarray]]:
        self._buf += data
        self._received += len(data)
        if self._header is None and (self.raw_header is not None or not self._read_header()):
            return []
        assert self._header is not None
        if self._header.area is not None:
            return self._feed_marks(self._header.area)
        items = self._header.requests
        # The items this call completes: one copy and one sign check for all of them,
        # not one per item.
        first, sizes, total = self._next, [], 0
        have = (len(self._buf) - self._at) // 4
        while self._next < len(items) and total + items[self._next].num_tokens <= have:
            sizes.append(items[self._next].num_tokens)
            total += sizes[-1]
            self._next += 1
        out: list[tuple[LookupFrameItem, np.ndarray]] = []
        if sizes:
            end = self._at + 4 * total
            with memoryview(self._buf) as view:  # one copy (a bytearray slice is another)
                raw = bytes(view[self._at : end])
            self._at = end
            out = self._split(first, sizes, check_tokens(np.frombuffer(raw, TOKEN_DTYPE)))
        self._settle()
        return out

    def _feed_marks(self, area: str) -> list[tuple[LookupFrameItem, np.ndarray]]:
        """The items whose marks this call completes, their ids copied out of the area
        in one piece (one fetch and one sign check for all of them, as for a body)."""
        assert self._header is not None
        if self._fetch is None:
            raise ValueError("this reader takes no lookup area (the header names one)")
        items = self._header.requests
        first = self._next
        count = min(len(items) - first, (len(self._buf) - self._at) // _MARK.size)
        out: list[tuple[LookupFrameItem, np.ndarray]] = []
        if count:
            marks = np.frombuffer(self._buf, "<u4", count, self._at)
            due = np.arange(first, first + count, dtype="<u4")
            if not np.array_equal(marks, due):
                at = int(np.flatnonzero(marks != due)[0])
                raise ValueError(f"mark {marks[at]} where the mark of item {first + at} was due")
            del marks  # the buffer is resized below: no view may be alive
            self._at += count * _MARK.size
            self._next += count
            sizes = [item.num_tokens for item in items[first : self._next]]
            tokens = check_tokens(self._fetch(area, self._area_offset, sum(sizes)))
            self._area_offset += 4 * len(tokens)
            out = self._split(first, sizes, tokens)
        self._settle()
        return out

    def _split(
        self, first: int, sizes: list[int], tokens: np.ndarray
    ) -> list[tuple[LookupFrameItem, np.ndarray]]:
        """Items ``first, first + 1, ...`` with their ``sizes[i]`` ids of ``tokens``."""
        assert self._header is not None
        items = self._header.requests[first : first + len(sizes)]
        out = []
        start = 0
        for item, size in zip(items, sizes, strict=True):
            out.append((item, tokens[start : start + size]))
            start += size
        return out

    def _settle(self) -> None:
        """After a feed: a fault if bytes follow the last item; the consumed front of
        the buffer dropped now and then, not per item."""
        assert self._header is not None
        if self._next == len(self._header.requests) and len(self._buf) > self._at:
            self._fail_length()
        if self._at > len(self._buf) // 2:
            del self._buf[: self._at]
            self._at = 0

    def close(self) -> None:
        """``ValueError`` unless the body held exactly the header and every item."""
        if self._header is None:
            if self._received < _PREFIX.size:
                raise ValueError(
                    f"a lookup frame starts with {_PREFIX.size} bytes; got {self._received}"
                )
            raise ValueError(
                f"header length {self._head_end - _PREFIX.size} runs past the "
                f"{self._received}-byte body"
            )
        if self._next < len(self._header.requests) or len(self._buf) > self._at:
            self._fail_length()

    def _read_header(self) -> bool:
        if len(self._buf) < _PREFIX.size:
            return False
        magic, head_len = _PREFIX.unpack_from(self._buf)
        if magic != LOOKUP_FRAME_MAGIC:
            raise ValueError(f"a lookup frame starts with {LOOKUP_FRAME_MAGIC!r}, not {magic!r}")
        self._head_end = _PREFIX.size + head_len
        if len(self._buf) < self._head_end + (-head_len % 4):
            return False
        raw = bytes(self._buf[_PREFIX.size : self._head_end])
        if self._inline_header_bytes is not None and head_len > self._inline_header_bytes:
            self.raw_header = raw
            return False
        self._start(LookupFrameHeader.model_validate_json(raw))
        return True

    def _start(self, header: LookupFrameHeader) -> None:
        self._header = header
        self._at = self._tokens_start = self._head_end + (-(self._head_end - _PREFIX.size) % 4)

    def set_header(self, header: LookupFrameHeader) -> list[tuple[LookupFrameItem, np.ndarray]]:
        """The header ``raw_header`` held, parsed: the reader goes on, and returns the
        items the bytes received so far complete."""
        if self.raw_header is None or self._header is not None:
            raise ValueError("this reader is not waiting for its header")
        self.raw_header = None
        self._start(header)
        return self.feed(b"")

    def _fail_length(self) -> None:
        assert self._header is not None
        if self._header.area is not None:
            n = len(self._header.requests)
            raise ValueError(
                f"the frame names {n} items ({4 * n} bytes of marks) but its mark "
                f"section holds {self._received - self._tokens_start} bytes"
            )
        total = sum(item.num_tokens for item in self._header.requests)
        raise ValueError(
            f"the items name {total} tokens ({4 * total} bytes) but the token section "
            f"holds {self._received - self._tokens_start} bytes"
        )


def decode_lookup_frame(raw: bytes) -> list[tuple[LookupFrameItem, np.ndarray]]:
    """Each item of the frame ``raw`` with its token ids."""
    reader = LookupFrameReader()
    items = reader.feed(raw)
    reader.close()
    return items
