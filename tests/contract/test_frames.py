"""The binary lookup form: what the connector frames, the server reads back."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from contract.frames import (
    LOOKUP_FRAME_MAGIC,
    LookupFrameReader,
    decode_lookup_frame,
    encode_lookup_frame,
)
from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import TokenEncoder, pack_tokens


def _header(*sizes: int, salt: str | None = None) -> LookupFrameHeader:
    return LookupFrameHeader(
        requests=[
            LookupFrameItem(
                request_id=f"r{i}", namespace="ns", cache_salt=salt, world_size=2, num_tokens=n
            )
            for i, n in enumerate(sizes)
        ]
    )


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param((), id="empty"),
        pytest.param((0,), id="no-tokens"),
        pytest.param((5, 0, 3), id="mixed"),
        pytest.param((4096,) * 3, id="long"),
    ],
)
def test_round_trip(sizes: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(sizes))
    tokens = [rng.integers(0, 2**31 - 1, n, dtype=np.int64).tolist() for n in sizes]
    header = _header(*sizes, salt="tenant")
    raw = encode_lookup_frame(header, [pack_tokens(t) for t in tokens])
    assert raw[:4] == LOOKUP_FRAME_MAGIC
    head_len = struct.unpack_from("<I", raw, 4)[0]
    start = 8 + head_len + (-head_len % 4)
    assert start % 4 == 0 and len(raw) == start + 4 * sum(sizes)
    decoded = decode_lookup_frame(raw)
    assert [item for item, _ in decoded] == list(header.requests)
    assert [arr.tolist() for _, arr in decoded] == tokens
    assert all(arr.dtype == np.dtype("<i4") for _, arr in decoded)


def test_encoder_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="2 token blobs for 1 items"):
        encode_lookup_frame(_header(2), [b"", b""])
    with pytest.raises(ValueError, match="4 token bytes for num_tokens 2"):
        encode_lookup_frame(_header(2), [pack_tokens([1])])


def test_token_encoder_packs_once_and_agrees_with_pack_tokens() -> None:
    tokens = list(range(100))
    enc = TokenEncoder()
    assert enc.packed(tokens, 10) == pack_tokens(tokens[:10])
    tokens.extend(range(100, 120))
    assert enc.packed(tokens, 120) == pack_tokens(tokens)
    assert enc.packed(tokens, 64) == pack_tokens(tokens[:64])
    assert np.frombuffer(enc.packed(tokens, 3), dtype="<i4").tolist() == [0, 1, 2]


def test_reader_gives_each_item_as_soon_as_its_bytes_are_in() -> None:
    """The server serves item i while item i + 1 is still on the wire."""
    from contract.frames import LookupFrameReader, lookup_frame_parts

    tokens = [list(range(5)), list(range(100, 103)), list(range(7))]
    parts = list(lookup_frame_parts(_header(5, 3, 7), [pack_tokens(t) for t in tokens]))
    reader = LookupFrameReader()
    raw = b"".join(parts)
    seen: list[list[int]] = []
    for i in range(0, len(raw), 3):  # three bytes at a time
        seen += [arr.tolist() for _, arr in reader.feed(raw[i : i + 3])]
        if i >= len(parts[0]) + 20:  # the first item (20 bytes) is out by now
            assert seen[:1] == tokens[:1]
    reader.close()
    assert seen == tokens


def test_reader_refuses_a_fault_where_it_is_found() -> None:
    from contract.frames import LookupFrameReader

    good = pack_tokens([1, 2])
    raw = encode_lookup_frame(_header(2, 2), [good, good])
    bad = raw[:-4] + struct.pack("<i", -3)
    reader = LookupFrameReader()
    first = reader.feed(bad[:-8])
    assert [arr.tolist() for _, arr in first] == [[1, 2]]
    with pytest.raises(ValueError, match="negative token id"):
        reader.feed(bad[-8:])
    short = LookupFrameReader()
    short.feed(raw[:-1])
    with pytest.raises(ValueError, match="token section holds 15 bytes"):
        short.close()
    from contract.frames import lookup_frame_parts

    with pytest.raises(ValueError, match="more token blobs"):
        list(lookup_frame_parts(_header(2), [good, good]))
    with pytest.raises(ValueError, match="fewer token blobs"):
        list(lookup_frame_parts(_header(2, 2), [good]))


def test_parts_gathered_into_pieces_are_the_same_frame() -> None:
    """A sender writes few large pieces, not one per item; the bytes do not change,
    and each piece is written as soon as it is full (not after the next item)."""
    from contract.frames import lookup_frame_parts

    blobs = [pack_tokens(list(range(n))) for n in (5, 3, 7, 40)]
    header = _header(5, 3, 7, 40)
    whole = encode_lookup_frame(header, blobs)
    produced: list[int] = []

    def packing() -> Iterator[bytes]:
        for i, blob in enumerate(blobs):
            produced.append(i)
            yield blob

    head = len(whole) - sum(map(len, blobs))
    sent = 0
    pieces = []
    for piece in lookup_frame_parts(header, packing(), piece_bytes=64):
        sent += len(piece)
        # Everything packed so far is in the pieces written: none is held back.
        assert sent == head + sum(len(blobs[i]) for i in produced)
        pieces.append(piece)
    assert b"".join(pieces) == whole
    assert all(len(p) >= 64 for p in pieces[:-1]) and len(pieces) < 1 + len(blobs)
    one_by_one = list(lookup_frame_parts(header, blobs))
    assert len(one_by_one) == 1 + len(blobs) and b"".join(one_by_one) == whole


@pytest.mark.parametrize("seed", range(5))
def test_reader_gives_the_same_items_however_the_body_is_cut(seed: int) -> None:
    """Pieces cut anywhere (mid-header, mid-item, between items, empty) give the
    items a whole read gives, in order; items that span pieces come out whole."""
    from contract.frames import LookupFrameReader

    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(0, 40, 12)]
    tokens = [rng.integers(0, 2**31 - 1, n).tolist() for n in sizes]
    raw = encode_lookup_frame(_header(*sizes), [pack_tokens(t) for t in tokens])
    cuts = sorted({int(c) for c in rng.integers(0, len(raw), 20)} | {0, len(raw)})
    reader = LookupFrameReader()
    seen: list[list[int]] = []
    for a, b in itertools.pairwise(cuts):
        seen += [arr.tolist() for _, arr in reader.feed(raw[a:b])]
        seen += [arr.tolist() for _, arr in reader.feed(b"")]
    reader.close()
    assert seen == tokens
    extra = LookupFrameReader()
    with pytest.raises(ValueError, match="token section holds"):
        extra.feed(raw + b"\0\0\0\0")


class _Area:
    """A lookup area in a bytearray: what the client writes, what the server fetches."""

    def __init__(self, nbytes: int) -> None:
        self.mem = bytearray(nbytes)
        self.fetches: list[tuple[str, int, int]] = []

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset : offset + len(data)] = data

    def fetch(self, area: str, offset: int, num_tokens: int) -> np.ndarray:
        self.fetches.append((area, offset, num_tokens))
        return np.frombuffer(self.mem, dtype="<i4", count=num_tokens, offset=offset).copy()


def _area_header(*sizes: int) -> LookupFrameHeader:
    return _header(*sizes).model_copy(update={"area": "a1"})


@pytest.mark.parametrize("seed", range(3))
def test_a_frame_of_marks_gives_the_items_the_area_holds(seed: int) -> None:
    """With an area, the body carries a 4-byte mark per item; the reader gives each
    item's ids from the area as its mark arrives, however the body is cut."""
    from contract.frames import LookupFrameReader, lookup_frame_marks

    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(0, 40, 10)]
    tokens = [rng.integers(0, 2**31 - 1, n).tolist() for n in sizes]
    area = _Area(4 * sum(sizes))
    header = _area_header(*sizes)
    parts = list(lookup_frame_marks(header, [pack_tokens(t) for t in tokens], area.write))
    raw = b"".join(parts)
    head = len(raw) - 4 * len(sizes)
    assert raw[head:] == struct.pack(f"<{len(sizes)}I", *range(len(sizes)))
    assert bytes(area.mem) == b"".join(pack_tokens(t) for t in tokens)
    reader = LookupFrameReader(area.fetch)
    seen: list[list[int]] = []
    cuts = sorted({int(c) for c in rng.integers(0, len(raw), 15)} | {0, len(raw)})
    for a, b in itertools.pairwise(cuts):
        seen += [arr.tolist() for _, arr in reader.feed(raw[a:b])]
    reader.close()
    assert seen == tokens
    # One fetch per piece that completed items, together covering the ids in order.
    ends = [offset + 4 * n for _, offset, n in area.fetches]
    assert [offset for _, offset, _ in area.fetches] == [0, *ends[:-1]]
    assert ends[-1] == 4 * sum(sizes) and {name for name, _, _ in area.fetches} == {"a1"}


def test_a_mark_is_written_only_after_its_ids_are_in_the_area() -> None:
    """The server reads an item's ids when its mark arrives: every mark the sender
    has yielded must follow the write of its item's ids."""
    from contract.frames import lookup_frame_marks

    blobs = [pack_tokens(list(range(n))) for n in (5, 3, 7, 40)]
    written: list[int] = []

    def write(offset: int, data: bytes) -> None:
        written.append(offset)

    marks_sent = 0
    for i, piece in enumerate(lookup_frame_marks(_area_header(5, 3, 7, 40), blobs, write)):
        if i:  # after the head: marks only for items already written
            marks_sent += len(piece) // 4
            assert marks_sent <= len(written)
    assert marks_sent == 4 and written == [0, 20, 32, 60]
    gathered = list(lookup_frame_marks(_area_header(5, 3, 7, 40), blobs, write, piece_bytes=10**6))
    assert len(gathered) == 2  # the head, then every mark in one piece


def test_a_frame_of_marks_refuses_what_does_not_add_up() -> None:
    from contract.frames import LookupFrameReader, lookup_frame_marks

    area = _Area(64)
    blobs = [pack_tokens([1, 2]), pack_tokens([3])]
    raw = b"".join(lookup_frame_marks(_area_header(2, 1), blobs, area.write))
    head = raw[: len(raw) - 8]
    with pytest.raises(ValueError, match="mark 1 where the mark of item 0 was due"):
        LookupFrameReader(area.fetch).feed(head + struct.pack("<2I", 1, 0))
    with pytest.raises(
        ValueError, match=r"2 items \(8 bytes of marks\) but its mark section holds 12"
    ):
        LookupFrameReader(area.fetch).feed(raw + b"\0\0\0\0")
    short = LookupFrameReader(area.fetch)
    short.feed(raw[:-1])
    with pytest.raises(ValueError, match="mark section holds 7 bytes"):
        short.close()
    with pytest.raises(ValueError, match="takes no lookup area"):
        LookupFrameReader().feed(raw)
    area.write(4, struct.pack("<i", -1))  # the client wrote a negative id after all
    with pytest.raises(ValueError, match="negative token id"):
        LookupFrameReader(area.fetch).feed(raw)
    with pytest.raises(ValueError, match="names its lookup area"):
        list(lookup_frame_marks(_header(2, 1), blobs, area.write))
    with pytest.raises(ValueError, match="fewer token blobs"):
        list(lookup_frame_marks(_area_header(2, 1), blobs[:1], area.write))


def test_a_long_header_is_left_to_the_caller() -> None:
    """``inline_header_bytes``: the reader hands the header's JSON out (a server
    parses it off its event loop) and goes on once given it back parsed."""
    header = _header(3, 2)
    packed = [pack_tokens([1, 2, 3]), pack_tokens([4, 5])]
    frame = encode_lookup_frame(header, packed)
    reader = LookupFrameReader(inline_header_bytes=16)
    assert reader.feed(frame[:-4]) == []
    assert reader.raw_header is not None
    assert reader.feed(frame[-4:]) == []  # buffered until the header is given back
    items = reader.set_header(LookupFrameHeader.model_validate_json(reader.raw_header))
    assert [list(tokens) for _, tokens in items] == [[1, 2, 3], [4, 5]]
    assert reader.raw_header is None
    reader.close()
