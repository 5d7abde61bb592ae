"""The GPU path on a real GPU (``cuda`` marker; skipped without one): the pool pinned
for DMA, store and retrieve on the server's own stream, ordered after the worker's
event, and the pageable fallback. ``make gpu-check`` runs these.

The worker is a real second process (tests/dataplane/gpu_worker.py) whose KV cache
the in-process server opens by CUDA IPC, as it opens vLLM's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from contract.shm_naming import segment_name
from dataplane import device_path, transfer
from dataplane.pool import Pool
from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    random_tokens,
    transfer_item,
)
from tests.support import ROOT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHUNK = 64
"""Four 16-token blocks a chunk."""
CHUNKS = 3
"""Chunks a call moves: the server waits for each while the next one's copy is queued."""
STORED = list(range(1, 13))
LOADED = list(range(13, 25))

ClientFactory = Callable[..., CacheClient]


@dataclass
class Worker:
    """The worker process and its line protocol (see gpu_worker.py)."""

    proc: subprocess.Popen[str]
    layers: list[dict[str, Any]]

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def event(self, reply: str) -> str | None:
        assert reply, "the worker exited"
        return None if reply == "none" else reply


@pytest.fixture
def worker() -> Iterator[Worker]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dataplane.gpu_worker"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield Worker(proc, json.loads(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait(timeout=60)


def _register(client: CacheClient, worker: Worker) -> None:
    body = {
        "instance_id": "gpu-engine",
        "rank": 0,
        "world_size": 1,
        "chunk_size": CHUNK,
        "namespace": NAMESPACE,
        "groups": [{"group_id": 0, "kind": "attention", "token_span": 16}],
        "layers": worker.layers,
    }
    reply = client.post("/register", json=body)
    assert reply.status_code == 200, reply.text


def _call(client: CacheClient, path: str, ids: list[int], event: str | None) -> dict[str, Any]:
    item = transfer_item("req", random_tokens(CHUNKS * CHUNK, seed=3), [ids])
    body: dict[str, Any] = {"instance_id": "gpu-engine", "rank": 0, "requests": [item]}
    if event is not None:
        body["event_ipc_b64"] = event
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()["results"][0]
    return result


def _pinning(client: CacheClient) -> device_path.PoolPinning:
    pinning = client.app.state.runtime.device.pinning  # type: ignore[attr-defined]
    assert isinstance(pinning, device_path.PoolPinning)
    return pinning


def test_pool_pinning_round_trip() -> None:
    pool = Pool.create(segment_name("pool"), 8 << 20, 4096)
    try:
        entry = pool.begin_store(b"k" * 32, 0, nbytes=4096, layout=b"l", present=1)
        assert not isinstance(entry, str) and entry is not None
        view = pool.view(entry)
        assert not view.is_pinned()
        pinning = device_path.PoolPinning(pool.address, pool.capacity_bytes)
        pinning.start()
        assert pinning.wait(timeout_s=120) == "pinned", pinning.reason
        assert view.is_pinned()  # CUDA sees the pool's pages as page-locked
        pinning.close()
        assert pinning.state == "off"
        assert not view.is_pinned()
        pool.abort(entry)
        del view
    finally:
        pool.close()


def test_store_and_retrieve_through_the_pinned_pool_on_the_servers_stream(
    make_client: ClientFactory, worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(chunk_size=CHUNK, pool_size="16MiB")
    _register(client, worker)
    assert _pinning(client).wait(timeout_s=120) == "pinned", _pinning(client).reason
    server_stream = client.app.state.runtime.device.stream(0)  # type: ignore[attr-defined]
    streams: list[torch.cuda.Stream] = []  # the stream each chunk's copies ran on
    record = device_path._record_marker

    def spy(device: int) -> Any:
        streams.append(torch.cuda.current_stream(device))
        return record(device)

    monkeypatch.setattr(device_path, "_record_marker", spy)
    monkeypatch.setattr(transfer, "_sync_current_stream", lambda _d: pytest.fail("a chunk sync"))
    stored = _call(client, "/cache/store", STORED, worker.event(worker.ask("write 1 12 3")))
    assert stored["stored_chunks"] == CHUNKS, stored
    loaded = _call(client, "/cache/retrieve", LOADED, worker.event(worker.ask("event")))
    assert loaded["loaded_tokens"] == CHUNKS * CHUNK, loaded
    assert worker.ask("same 1 13 12") == "ok"  # every byte came back
    assert worker.ask("check 25 4 1.0") == "ok"  # and nothing else was written
    assert len(streams) == 2 * CHUNKS and all(s == server_stream for s in streams)
    assert server_stream != torch.cuda.default_stream(0)


def test_a_store_waits_for_the_workers_writes_without_a_device_sync(
    make_client: ClientFactory, worker: Worker
) -> None:
    client = make_client(chunk_size=CHUNK, pool_size="16MiB")
    _register(client, worker)
    # The worker's fill runs behind a long GPU sleep and nothing synchronises it: only
    # the event orders the server's copy after it.
    event = worker.event(worker.ask("write 1 12 7"))
    assert event is not None
    assert _call(client, "/cache/store", STORED, event)["stored_chunks"] == CHUNKS
    loaded = _call(client, "/cache/retrieve", LOADED, worker.event(worker.ask("event")))
    assert loaded["loaded_tokens"] == CHUNKS * CHUNK
    assert worker.ask("same 1 13 12") == "ok"  # the new bytes were stored, not the old


class _FailingCudart:
    """libcudart whose ``cudaHostRegister`` fails as on a host out of lockable memory."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 2

    def cudaHostUnregister(self, ptr: int) -> int:
        raise AssertionError("a pool that was never pinned is not unregistered")

    def cudaGetErrorString(self, error: Any) -> str:
        return "out of memory"


def test_when_pinning_fails_copies_go_through_pageable_memory(
    make_client: ClientFactory,
    worker: Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(device_path, "_torch_cudart", _FailingCudart)
    client = make_client(chunk_size=CHUNK, pool_size="16MiB")
    with caplog.at_level(logging.WARNING, logger="dataplane.device_path"):
        _register(client, worker)
        assert _pinning(client).wait(timeout_s=120) == "failed"
    assert any("pool not pinned" in r.getMessage() for r in caplog.records)
    assert "out of memory (cudaError 2)" in (_pinning(client).reason or "")
    event = worker.event(worker.ask("write 1 12 5"))
    assert _call(client, "/cache/store", STORED, event)["stored_chunks"] == CHUNKS
    loaded = _call(client, "/cache/retrieve", LOADED, worker.event(worker.ask("event")))
    assert loaded["loaded_tokens"] == CHUNKS * CHUNK
    assert worker.ask("same 1 13 12") == "ok"
    assert worker.ask("check 25 4 1.0") == "ok"
