"""``timeout_s``: once the client's deadline has passed, nothing more is committed or written.

The copies are made slow by wrapping the copy kernels the service calls; a slow
copy sleeps longer than ``timeout_s`` after it starts, so it always ends past the
deadline (which counts from the request's receipt, earlier still).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import app.retrieve
import app.store
from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    ShmKV,
    lookup,
    metric,
    post_ok,
    random_tokens,
    register_body,
    retrieve,
    store,
    transfer_item,
    vllm_layer,
)

CHUNK = 64
GROUPS = [(0, "attention", 16)]
LAYERS = [vllm_layer(f"l{i}", 0, 40) for i in range(2)]

ClientFactory = Callable[..., CacheClient]


class SlowCopy:
    """Wraps a copy kernel: the calls numbered in ``slow`` sleep ``delay_s`` first."""

    def __init__(self, real: Callable[..., int], slow: set[int], delay_s: float) -> None:
        self.real = real
        self.slow = slow
        self.delay_s = delay_s
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> int:
        call = self.calls
        self.calls += 1
        if call in self.slow:
            time.sleep(self.delay_s)
        return self.real(*args, **kwargs)


def _slow(monkeypatch: pytest.MonkeyPatch, name: str, slow: set[int], delay_s: float) -> SlowCopy:
    path = app.store if name == "gather_chunk" else app.retrieve  # the path that copies so
    wrapper = SlowCopy(getattr(path, name), slow, delay_s)
    monkeypatch.setattr(path, name, wrapper)
    return wrapper


def _setup(make_client: ClientFactory, shm_kv: KVFactory) -> tuple[TestClient, ShmKV, ShmKV]:
    client = make_client()
    a, b = shm_kv(LAYERS), shm_kv(LAYERS)
    a.fill_random(seed=5)
    for name, kv in (("a", a), ("b", b)):
        post_ok(client, "/register", register_body(kv, name, GROUPS, chunk_size=CHUNK))
    return client, a, b


def _blocks(first: int, n_chunks: int) -> list[int]:
    return list(range(first, first + 4 * n_chunks))


def _body(instance: str, *items: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    return {"instance_id": instance, "rank": 0, "requests": list(items), "timeout_s": timeout_s}


def _pool_stats(client: TestClient) -> Any:
    return client.app.state.runtime.pool.stats()  # type: ignore[attr-defined]


def test_store_copy_ending_past_the_deadline_is_never_committed(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = _setup(make_client, shm_kv)
    p1, p2 = random_tokens(3 * CHUNK, seed=1), random_tokens(2 * CHUNK, seed=2)
    gather = _slow(monkeypatch, "gather_chunk", {0}, delay_s=0.6)
    body = _body(
        "a",
        transfer_item("p1", p1, [_blocks(1, 3)]),
        transfer_item("p2", p2, [_blocks(20, 2)]),
        timeout_s=0.5,
    )
    results = post_ok(client, "/cache/store", body)["results"]
    assert [(r["stored_chunks"], r["failed_chunks"]) for r in results] == [(0, 3), (0, 2)]
    assert gather.calls == 1  # nothing more was copied once the deadline had passed
    assert lookup(client, p1, "q1") == 0 and lookup(client, p2, "q2") == 0
    stats = _pool_stats(client)
    assert (stats.entries, stats.pending, stats.used_bytes) == (0, 0, 0)
    assert metric(client, "mpcache_transfer_timeouts_total", op="store") == 1
    assert metric(client, "mpcache_chunks_stored_total") == 0


def test_store_commits_the_chunks_copied_before_the_deadline(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = _setup(make_client, shm_kv)
    tokens = random_tokens(3 * CHUNK, seed=3)
    gather = _slow(monkeypatch, "gather_chunk", {1}, delay_s=1.1)
    body = _body("a", transfer_item("p", tokens, [_blocks(1, 3)]), timeout_s=1.0)
    (result,) = post_ok(client, "/cache/store", body)["results"]
    assert (result["stored_chunks"], result["failed_chunks"]) == (1, 2)
    assert gather.calls == 2
    assert lookup(client, tokens, "q") == CHUNK
    assert _pool_stats(client).pending == 0
    # With the copy fast again and no deadline, the rest is stored on a retry.
    gather.slow.clear()
    (retry,) = store(client, "a", transfer_item("p", tokens, [_blocks(1, 3)]))
    assert (retry["present_chunks"], retry["stored_chunks"]) == (1, 2)


def test_retrieve_writes_no_chunk_once_the_deadline_has_passed(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, a, b = _setup(make_client, shm_kv)
    tokens = random_tokens(3 * CHUNK, seed=4)
    assert store(client, "a", transfer_item("s", tokens, [_blocks(1, 3)]))[0]["stored_chunks"] == 3
    # Chunk 1's copy starts in time but ends late; chunk 2's must not start.
    scatter = _slow(monkeypatch, "scatter_chunk", {1}, delay_s=1.1)
    dst = _blocks(20, 3)
    body = _body("b", transfer_item("r", tokens, [dst]), timeout_s=1.0)
    (result,) = post_ok(client, "/cache/retrieve", body)["results"]
    assert result == {"request_id": "r", "loaded_tokens": 2 * CHUNK, "failed_block_ids": dst[8:]}
    assert scatter.calls == 2
    for layer in LAYERS:
        for src_block, dst_block in zip(_blocks(1, 2), dst[:8], strict=True):
            src = a.block(layer.name, 0, src_block).view(torch.uint8)
            assert torch.equal(src, b.block(layer.name, 0, dst_block).view(torch.uint8))
        for dst_block in dst[8:]:
            assert not b.block(layer.name, 0, dst_block).view(torch.uint8).any()
    assert metric(client, "mpcache_transfer_timeouts_total", op="retrieve") == 1
    # Every pin was released: the entries can still be replaced or evicted.
    assert _pool_stats(client).entries == 3


def test_retrieve_past_the_deadline_reports_every_later_item_failed(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, b = _setup(make_client, shm_kv)
    t1, t2 = random_tokens(CHUNK, seed=6), random_tokens(2 * CHUNK, seed=7)
    store(client, "a", transfer_item("s1", t1, [_blocks(1, 1)]))
    store(client, "a", transfer_item("s2", t2, [_blocks(5, 2)]))
    scatter = _slow(monkeypatch, "scatter_chunk", {0}, delay_s=0.6)
    body = _body(
        "b",
        transfer_item("r1", t1, [_blocks(20, 1)]),
        transfer_item("r2", t2, [[0, *_blocks(25, 2)[1:]]]),
        timeout_s=0.5,
    )
    r1, r2 = post_ok(client, "/cache/retrieve", body)["results"]
    assert r1["loaded_tokens"] == CHUNK  # started in time
    assert r2 == {"request_id": "r2", "loaded_tokens": 0, "failed_block_ids": _blocks(26, 2)[:7]}
    assert scatter.calls == 1
    for layer in LAYERS:
        for block in _blocks(25, 2):
            assert not b.block(layer.name, 0, block).view(torch.uint8).any()


def test_without_timeout_a_slow_copy_still_completes(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = _setup(make_client, shm_kv)
    tokens = random_tokens(2 * CHUNK, seed=8)
    _slow(monkeypatch, "gather_chunk", {0}, delay_s=0.2)
    body = _body("a", transfer_item("p", tokens, [_blocks(1, 2)]), timeout_s=None)
    (result,) = post_ok(client, "/cache/store", body)["results"]
    assert (result["stored_chunks"], result["failed_chunks"]) == (2, 0)
    (late,) = retrieve(client, "b", transfer_item("r", tokens, [_blocks(20, 2)]))
    assert late["loaded_tokens"] == 2 * CHUNK


def test_the_deadline_counts_from_receipt(
    make_client: ClientFactory, shm_kv: KVFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = _setup(make_client, shm_kv)
    cache = client.app.state.runtime.cache  # type: ignore[attr-defined]
    seen: list[float | None] = []
    real_store = cache.store

    def spy(req: Any, *, received_at: float | None = None, token: str | None = None) -> Any:
        seen.append(received_at)
        seen.append(time.monotonic())
        return real_store(req, received_at=received_at, token=token)

    monkeypatch.setattr(cache, "store", spy)
    before = time.monotonic()
    tokens = random_tokens(CHUNK, seed=9)
    store(client, "a", transfer_item("p", tokens, [_blocks(1, 1)]))
    received, handled = seen
    assert received is not None and before <= received <= handled
