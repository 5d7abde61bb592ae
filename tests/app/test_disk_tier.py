"""The disk tier's parts: its file format, its LRU index, and the tier on a real pool
and a real directory (pytest's tmp_path: a real filesystem; a few KiB a file)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from app.disk_codec import (
    HEADER_BYTES,
    CorruptFile,
    decode_header,
    encode_header,
    file_bytes,
    file_name,
    parse_name,
    seal,
    verify,
)
from app.disk_dir import DiskRefused
from app.disk_index import DiskIndex, DiskRecord
from app.disk_tier import DiskChunkSizeMismatch, DiskTier
from app.telemetry import Telemetry
from contract.shm_naming import segment_name
from dataplane.pool import Entry, Pool
from tests.support import wait_until

KEY, LAYOUT, CHUNK = bytes(range(16)), bytes(range(16, 32)), 64
PAGE = 4096
NBYTES = 3 * PAGE + 100  # a partial last block goes through the scratch block


def _payload(seed: int, nbytes: int = NBYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# ------------------------------------------------------------------ codec


def _sealed(payload: np.ndarray, *, present: int = 0b1011) -> bytearray:
    header = encode_header(KEY, 2, LAYOUT, present, CHUNK, len(payload))
    seal(header, payload.data)
    return header


def test_a_sealed_header_decodes_and_its_payload_verifies() -> None:
    payload = _payload(1)
    block = _sealed(payload)
    header = decode_header(block, name=(KEY, 2, LAYOUT), chunk_size=CHUNK)
    assert (header.present, header.payload_bytes, header.chunk_size) == (0b1011, NBYTES, CHUNK)
    verify(header, block, payload.data)


@pytest.mark.parametrize(
    ("name", "chunk_size", "why"),
    [
        pytest.param((bytes(16), 2, LAYOUT), CHUNK, "another chunk", id="other-key"),
        pytest.param((KEY, 3, LAYOUT), CHUNK, "another chunk", id="other-rank"),
        pytest.param((KEY, 2, bytes(16)), CHUNK, "another chunk", id="other-layout"),
        pytest.param((KEY, 2, LAYOUT), 128, "64 tokens", id="other-chunk-size"),
    ],
)
def test_a_foreign_header_is_refused(
    name: tuple[bytes, int, bytes], chunk_size: int, why: str
) -> None:
    with pytest.raises(CorruptFile, match=why):
        decode_header(_sealed(_payload(1)), name=name, chunk_size=chunk_size)


def test_a_torn_header_or_payload_is_refused() -> None:
    payload = _payload(2)
    block = _sealed(payload)
    with pytest.raises(CorruptFile, match="shorter"):
        decode_header(block[:100], name=(KEY, 2, LAYOUT), chunk_size=CHUNK)
    bad = bytearray(block)
    bad[:4] = b"XXXX"
    with pytest.raises(CorruptFile, match="format"):
        decode_header(bad, name=(KEY, 2, LAYOUT), chunk_size=CHUNK)
    header = decode_header(block, name=(KEY, 2, LAYOUT), chunk_size=CHUNK)
    altered = payload.copy()
    altered[-1] ^= 1
    with pytest.raises(CorruptFile, match="checksum"):
        verify(header, block, altered.data)
    with pytest.raises(CorruptFile, match="payload bytes"):
        verify(header, block, payload[:-1].data)
    flipped = bytearray(block)
    flipped[HEADER_BYTES - 1] ^= 1  # the padding is covered too
    with pytest.raises(CorruptFile, match="checksum"):
        verify(header, flipped, payload.data)


def test_file_names_round_trip_and_junk_is_refused() -> None:
    name = file_name(KEY, 5, LAYOUT)
    assert name.startswith(KEY.hex()[:2] + "/")
    assert parse_name(name.split("/")[1]) == (KEY, 5, LAYOUT)
    for junk in ("meta.json", "zz-1-aa.chunk", f"{KEY.hex()}-x-{LAYOUT.hex()}.chunk"):
        with pytest.raises(CorruptFile):
            parse_name(junk)


# ------------------------------------------------------------------ index


def _record(n: int, size: int = 10) -> DiskRecord:
    return DiskRecord(f"f{n}", 1, size, size)


def test_the_index_evicts_least_recently_used_and_a_hit_refreshes() -> None:
    index = DiskIndex(30)
    for n in range(3):
        assert index.add((bytes([n]), 0, LAYOUT), _record(n)) == []
    assert index.get((bytes([0]), 0, LAYOUT)) == _record(0)  # 0 is now the most recent
    assert index.make_room(10, keep=(bytes([3]), 0, LAYOUT)) == [_record(1)]
    assert index.add((bytes([3]), 0, LAYOUT), _record(3)) == []
    assert index.used_bytes == 30
    assert index.make_room(31, keep=(bytes([4]), 0, LAYOUT)) is None  # can never fit
    # Replacing a file counts its own bytes as freed: nothing else goes.
    assert index.make_room(10, keep=(bytes([3]), 0, LAYOUT)) == []


def test_count_leading_needs_every_rank_and_stops_at_the_first_miss() -> None:
    index = DiskIndex(1 << 20)
    for key in (b"a", b"b", b"d"):
        for rank in range(2):
            index.add((key, rank, LAYOUT), _record(0))
    index.add((b"c", 0, LAYOUT), _record(0))
    assert index.count_leading([b"a", b"b", b"c", b"d"], 2, LAYOUT) == 2
    assert index.count_leading([b"a", b"b", b"c", b"d"], 1, LAYOUT) == 4
    assert index.count_leading([b"a"], 1, bytes(16)) == 0


# ------------------------------------------------------------------ the tier


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool.create(segment_name("disktest"), 16 * PAGE, PAGE)
    try:
        yield p
    finally:
        p.close()


def _open(directory: Path, pool: Pool, telemetry: Telemetry, **kwargs: object) -> DiskTier:
    options: dict[str, object] = {
        "size_bytes": 1 << 20,
        "l2_seed": None,
        "min_chunk_size": 16,
        "max_chunk_size": 1024,
        **kwargs,
    }
    return DiskTier.open(directory, pool=pool, telemetry=telemetry, **options)  # type: ignore[arg-type]


def _commit(pool: Pool, key: bytes, payload: np.ndarray, present: int = 1) -> Entry:
    entry = pool.begin_store(key, 0, nbytes=len(payload), layout=LAYOUT, present=present)
    assert isinstance(entry, Entry)
    pool.view(entry).numpy()[:] = payload
    pool.commit(entry)
    return entry


def _written(telemetry: Telemetry, outcome: str = "written") -> float:
    return telemetry.disk_writes.labels(outcome)._value.get()


def _flush(tier: DiskTier) -> None:
    tier.close(30.0)


def test_a_queued_chunk_stays_pinned_in_the_pool_until_its_file_is_written(
    tmp_path: Path, pool: Pool
) -> None:
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    tier.bind(CHUNK)
    entry = _commit(pool, KEY, _payload(3))  # 4 of the pool's 16 pages
    tier.enqueue(entry)  # the writer is not started: it stays queued
    assert tier.health().queued_bytes == NBYTES
    # A chunk larger than the free space would have to evict it: it cannot.
    other = pool.begin_store(b"x" * 16, 0, nbytes=13 * PAGE, layout=LAYOUT, present=1)
    assert other is None
    tier.start()
    _flush(tier)
    assert _written(telemetry) == 1
    assert (tmp_path / file_name(KEY, 0, LAYOUT)).stat().st_size == file_bytes(NBYTES)
    other = pool.begin_store(b"x" * 16, 0, nbytes=13 * PAGE, layout=LAYOUT, present=1)
    assert isinstance(other, Entry)  # unpinned once written: now it may be evicted
    pool.abort(other)


def test_the_writer_holds_back_while_a_store_copies_but_never_for_long(
    tmp_path: Path, pool: Pool
) -> None:
    """The write-behind yields the CPU to a store call in flight (so the reply is not
    slowed), and still writes when stores never stop (the hold is bounded)."""
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    tier.bind(CHUNK)
    tier.start()
    try:
        with tier.copying():  # a store call that never ends
            tier.enqueue(_commit(pool, KEY, _payload(4)))
            assert _written(telemetry) == 0  # held: nothing was written inside the call
            wait_until(lambda: _written(telemetry) == 1, timeout_s=10.0, what="the held write")
    finally:
        _flush(tier)


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path, pool: Pool) -> None:
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    tier.bind(CHUNK)
    assert tier.queue_bytes == 4 * PAGE  # a quarter of the pool
    tier.enqueue(_commit(pool, KEY, _payload(4, 2 * PAGE)))
    tier.enqueue(_commit(pool, b"k" * 16, _payload(5, 3 * PAGE)))
    assert _written(telemetry, "queue_full") == 1
    tier.start()
    _flush(tier)
    assert _written(telemetry) == 1


def test_a_restarted_tier_keeps_its_seed_and_serves_its_files(tmp_path: Path, pool: Pool) -> None:
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    seed = tier.seed
    tier.bind(CHUNK)
    tier.start()
    payload = _payload(6)
    entry = _commit(pool, KEY, payload, present=0b11)
    tier.enqueue(entry)
    _flush(tier)
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / ".torn.tmp").write_bytes(b"half")  # a write a crash cut short
    fresh = Pool.create(segment_name("disktest"), 16 * PAGE, PAGE)  # a restarted server's
    try:
        again = _open(tmp_path, fresh, Telemetry())
        assert again.seed == seed and again.health().chunks == 1
        assert not (tmp_path / "ab" / ".torn.tmp").exists()
        again.bind(CHUNK)
        with pytest.raises(DiskChunkSizeMismatch, match="64 tokens, not 128"):
            again.bind(128)
        assert again.promote(b"z" * 16, 0, LAYOUT, chunk_bytes=NBYTES, needed=1) is None
        # A slot the file lacks is a miss.
        assert again.promote(KEY, 0, LAYOUT, chunk_bytes=NBYTES, needed=0b100) is None
        got = again.promote(KEY, 0, LAYOUT, chunk_bytes=NBYTES, needed=0b11)
        assert got is not None and got.present == 0b11
        assert np.array_equal(fresh.view(got).numpy(), payload)
        fresh.unpin(got)
        again.close(0)
    finally:
        fresh.close()


def test_a_torn_file_is_refused_deleted_and_counted_when_read(tmp_path: Path, pool: Pool) -> None:
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    tier.bind(CHUNK)
    tier.start()
    tier.enqueue(_commit(pool, KEY, _payload(7)))
    _flush(tier)
    path = tmp_path / file_name(KEY, 0, LAYOUT)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 5)
        f.write(b"\0\1\2")
    fresh = Pool.create(segment_name("disktest"), 16 * PAGE, PAGE)
    try:
        again = _open(tmp_path, fresh, telemetry)
        assert again.promote(KEY, 0, LAYOUT, chunk_bytes=NBYTES, needed=1) is None
        assert telemetry.disk_reads.labels("corrupt")._value.get() == 1
        assert not path.exists() and again.health().chunks == 0
        assert fresh.stats().pending == 0 and fresh.stats().entries == 0
        again.close(0)
    finally:
        fresh.close()


def test_a_file_whose_size_disagrees_is_deleted_at_start(tmp_path: Path, pool: Pool) -> None:
    telemetry = Telemetry()
    tier = _open(tmp_path, pool, telemetry)
    tier.bind(CHUNK)
    tier.start()
    tier.enqueue(_commit(pool, KEY, _payload(8)))
    _flush(tier)
    path = tmp_path / file_name(KEY, 0, LAYOUT)
    os.truncate(path, path.stat().st_size - 1)
    again = _open(tmp_path, pool, telemetry)
    assert again.health().chunks == 0 and not path.exists()
    assert telemetry.disk_reads.labels("corrupt")._value.get() == 1
    again.close(0)


def test_the_l2_seed_wins_and_empties_a_directory_keyed_by_another(
    tmp_path: Path, pool: Pool
) -> None:
    tier = _open(tmp_path, pool, Telemetry())
    tier.bind(CHUNK)
    tier.start()
    tier.enqueue(_commit(pool, KEY, _payload(9)))
    _flush(tier)
    other = (tier.seed + 1) % 2**64
    again = _open(tmp_path, pool, Telemetry(), l2_seed=other)
    assert again.seed == other and again.health().chunks == 0
    assert json.loads((tmp_path / "meta.json").read_text())["seed"] == other
    assert not list(tmp_path.glob("*/*.chunk"))
    again.close(0)


def test_refusals_at_start_name_the_setting(tmp_path: Path, pool: Pool) -> None:
    with pytest.raises(DiskRefused, match="MPCACHE_DISK_SIZE"):
        _open(tmp_path, pool, Telemetry(), size_bytes=1 << 62)
    tier = _open(tmp_path, pool, Telemetry())
    with pytest.raises(DiskRefused, match="in use by another server"):
        _open(tmp_path, pool, Telemetry())
    tier.bind(CHUNK)
    tier.close(0)
    with pytest.raises(DiskRefused, match=r"chunks of 64 tokens.*128 to 1024"):
        _open(tmp_path, pool, Telemetry(), min_chunk_size=128)
    (tmp_path / "meta.json").write_text('{"format": "other", "version": 9}')
    with pytest.raises(DiskRefused, match="MPCACHE_DISK_PATH"):
        _open(tmp_path, pool, Telemetry())
