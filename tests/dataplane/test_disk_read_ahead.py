"""A retrieve from the disk tier reads ahead of its copies (``app.disk_reads``): a chunk
that turns out not to be servable, or the deadline, ends the item there, and what was
read ahead past it is unpinned (the pool can evict every entry afterwards).

In-process servers with ``--disk-path`` under pytest's tmp_path (a real directory); the
chunks are written behind, then evicted from the pool, so the retrieve reads each one
from its file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import app.retrieve
from dataplane.pool import Entry, Pool
from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    ShmKV,
    metric,
    post_ok,
    random_tokens,
    register_body,
    retrieve,
    store,
    transfer_item,
    vllm_layer,
)
from tests.support import wait_until

CHUNK = 64
GROUPS = [(0, "attention", 16)]
LAYERS = [vllm_layer(f"l{i}", 0, 40) for i in range(2)]
CHUNKS = 4

ClientFactory = Callable[..., CacheClient]


def _pool(client: CacheClient) -> Pool:
    pool: Pool = client.app.state.runtime.pool  # type: ignore[attr-defined]
    return pool


def _blocks(first: int, n_chunks: int) -> list[int]:
    return list(range(first, first + 4 * n_chunks))


def _written(client: CacheClient) -> float:
    return metric(client, "mpcache_disk_writes_total", outcome="written")


def _nothing_pinned(pool: Pool) -> None:
    """No entry pinned nor pending: a store of the whole pool evicts every entry."""
    assert pool.stats().pending == 0
    assert all(entry.pins == 0 for entry in pool.whole_entries(lambda: None))
    whole = pool.begin_store(b"w" * 16, 0, nbytes=pool.capacity_bytes, layout=b"l" * 16, present=1)
    assert isinstance(whole, Entry)
    pool.abort(whole)
    assert pool.stats().entries == 0


def _on_disk(
    make_client: ClientFactory, shm_kv: KVFactory, disk: Path
) -> tuple[CacheClient, ShmKV, ShmKV, Any, list[Path]]:
    """A server whose pool lacks an item's ``CHUNKS`` chunks and whose disk holds them:
    the client, the source and destination caches, the tokens, each chunk's file."""
    client = make_client(disk_path=str(disk), disk_size="64MiB")
    a, b = shm_kv(LAYERS), shm_kv(LAYERS)
    a.fill_random(seed=7)
    for name, kv in (("a", a), ("b", b)):
        post_ok(client, "/register", register_body(kv, name, GROUPS, chunk_size=CHUNK))
    tokens = random_tokens(CHUNKS * CHUNK, seed=8)
    files: list[Path] = []
    for n in range(1, CHUNKS + 1):  # one more chunk a time: each store writes one file
        before = set(disk.glob("*/*.chunk"))
        item = transfer_item(f"s{n}", tokens[: n * CHUNK], [_blocks(1, n)])
        assert store(client, "a", item)[0]["stored_chunks"] == 1
        wait_until(lambda n=n: _written(client) >= n)
        (new,) = set(disk.glob("*/*.chunk")) - before
        files.append(new)
    _nothing_pinned(_pool(client))  # written, unpinned: and now evicted from the pool
    return client, a, b, tokens, files


def _same(a: ShmKV, b: ShmKV, src: list[int], dst: list[int]) -> bool:
    return all(
        torch.equal(
            a.block(layer.name, 0, s).view(torch.uint8), b.block(layer.name, 0, d).view(torch.uint8)
        )
        for layer in LAYERS
        for s, d in zip(src, dst, strict=True)
    )


def _untouched(b: ShmKV, dst: list[int]) -> bool:
    return not any(
        b.block(layer.name, 0, d).view(torch.uint8).any() for layer in LAYERS for d in dst
    )


def test_every_chunk_read_ahead_from_disk_is_served_and_unpinned(
    make_client: ClientFactory, shm_kv: KVFactory, tmp_path: Path
) -> None:
    client, a, b, tokens, _ = _on_disk(make_client, shm_kv, tmp_path / "disk")
    dst = _blocks(20, CHUNKS)
    (result,) = retrieve(client, "b", transfer_item("r", tokens, [dst]))
    assert result == {"request_id": "r", "loaded_tokens": CHUNKS * CHUNK, "failed_block_ids": []}
    assert _same(a, b, _blocks(1, CHUNKS), dst)
    assert metric(client, "mpcache_disk_reads_total", outcome="hit") == CHUNKS
    _nothing_pinned(_pool(client))


@pytest.mark.parametrize("fault", ["deleted", "altered"])
def test_a_chunk_missing_or_refused_mid_item_ends_it_there_and_unpins_the_rest(
    make_client: ClientFactory, shm_kv: KVFactory, tmp_path: Path, fault: str
) -> None:
    client, a, b, tokens, files = _on_disk(make_client, shm_kv, tmp_path / "disk")
    if fault == "deleted":  # the index still lists it: the read misses
        files[1].unlink()
    else:  # one payload byte flipped: the checksum refuses it
        with files[1].open("r+b") as f:
            f.seek(8192)
            byte = f.read(1)
            f.seek(8192)
            f.write(bytes([byte[0] ^ 0xFF]))
    dst = _blocks(20, CHUNKS)
    (result,) = retrieve(client, "b", transfer_item("r", tokens, [dst]))
    assert result == {"request_id": "r", "loaded_tokens": CHUNK, "failed_block_ids": dst[4:]}
    assert _same(a, b, _blocks(1, 1), dst[:4])
    assert _untouched(b, dst[4:])  # chunks 2 and 3 (read ahead) were not written
    outcome = "miss" if fault == "deleted" else "corrupt"
    assert metric(client, "mpcache_disk_reads_total", outcome=outcome) == 1
    _nothing_pinned(_pool(client))
    # The chunks after the fault are still served: from the pool now, or from disk.
    (after,) = retrieve(client, "b", transfer_item("r2", tokens, [dst]))
    assert after["loaded_tokens"] == CHUNK  # still stops at chunk 1, which is gone
    _nothing_pinned(_pool(client))


def test_the_deadline_passing_mid_item_writes_no_more_and_unpins_what_was_read_ahead(
    make_client: ClientFactory,
    shm_kv: KVFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, a, b, tokens, _ = _on_disk(make_client, shm_kv, tmp_path / "disk")
    real = app.retrieve.scatter_chunk

    def slow_first(*args: Any, **kwargs: Any) -> int:  # chunk 0's copy ends past the deadline
        time.sleep(1.1)
        monkeypatch.setattr(app.retrieve, "scatter_chunk", real)
        return real(*args, **kwargs)

    monkeypatch.setattr(app.retrieve, "scatter_chunk", slow_first)
    dst = _blocks(20, CHUNKS)
    body = {
        "instance_id": "b",
        "rank": 0,
        "requests": [transfer_item("r", tokens, [dst])],
        "timeout_s": 1.0,
    }
    (result,) = post_ok(client, "/cache/retrieve", body)["results"]
    assert result == {"request_id": "r", "loaded_tokens": CHUNK, "failed_block_ids": dst[4:]}
    assert _same(a, b, _blocks(1, 1), dst[:4])
    assert _untouched(b, dst[4:])
    assert metric(client, "mpcache_transfer_timeouts_total", op="retrieve") == 1
    _nothing_pinned(_pool(client))
