"""The local-disk tier in real server processes (issue 24): what a restart serves.

Each test starts ``mpcache server --disk-path DIR`` (DIR under pytest's tmp_path,
on a real filesystem), registers a KV cache over shm as a worker does, stores
prompts, and checks what a server on the same directory serves after SIGTERM or
SIGKILL: identical bytes, never a torn file's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from contract.schemas import REGISTRATION_TOKEN_HEADER
from tests.dataplane.support import (
    ShmKV,
    build_kv,
    random_tokens,
    register_body,
    register_over,
    token_field,
    transfer_item,
    vllm_layer,
)
from tests.support import server_process, wait_until

pytestmark = pytest.mark.slow

CHUNK = 64
NUM_BLOCKS = 72
BLOCK = 16
LAYERS = ("l0", "l1")
WRITTEN = 'mpcache_disk_writes_total{outcome="written"}'
CORRUPT = 'mpcache_disk_reads_total{outcome="corrupt"}'
DISK_HITS = 'mpcache_disk_reads_total{outcome="hit"}'


def _metric(http: httpx.Client, sample: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    raise AssertionError(f"no sample {sample} on /metrics")


@contextlib.contextmanager
def _kv() -> Iterator[ShmKV]:
    kv = build_kv([vllm_layer(name, 0, NUM_BLOCKS) for name in LAYERS])
    try:
        yield kv
    finally:
        kv.close()


class Node:
    """One server process on ``disk``, negotiated, with ``kv`` registered."""

    def __init__(self, url: str, kv: ShmKV) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        reply = self.http.post("/negotiate", json={"required_alignment": CHUNK})
        reply.raise_for_status()
        body = register_body(kv, "w", [(0, "attention", BLOCK)], chunk_size=CHUNK)
        token, self.worker = register_over(self.http, body)
        self.http.headers[REGISTRATION_TOKEN_HEADER] = token

    def transfer(self, op: str, tokens: np.ndarray, blocks: list[int]) -> dict[str, Any]:
        item = transfer_item(f"{op}-{len(tokens)}", tokens, [blocks])
        reply = self.http.post(
            f"/cache/{op}", json={"instance_id": "w", "rank": 0, "requests": [item]}
        )
        assert reply.status_code == 200, reply.text
        result: dict[str, Any] = reply.json()["results"][0]
        return result

    def lookup(self, tokens: np.ndarray) -> int:
        item = {"request_id": "look", "namespace": "test-model|layout-v1|ws1"}
        item.update(token_field(tokens))
        reply = self.http.post("/cache/lookup", json={"requests": [item]})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["results"][0]["hit_tokens"])

    def wait_written(self, chunks: int) -> None:
        wait_until(lambda: _metric(self.http, WRITTEN) >= chunks, what="the write-behind")

    def close(self) -> None:
        self.worker.close()
        self.http.close()


def _flags(disk: Path, *extra: str) -> list[str]:
    return ["--chunk-size", str(CHUNK), "--disk-path", str(disk), "--disk-size", "64MiB", *extra]


def _blocks(chunks: int, first: int = 1) -> list[int]:
    return list(range(first, first + chunks * CHUNK // BLOCK))


def _data(kv: ShmKV, blocks: list[int]) -> list[bytes]:
    return [
        kv.block(layer, 0, b).contiguous().view(torch.uint8).numpy().tobytes()
        for layer in LAYERS
        for b in blocks
    ]


@contextlib.contextmanager
def _node(disk: Path, kv: ShmKV, *extra: str) -> Iterator[tuple[Node, subprocess.Popen[bytes]]]:
    with server_process(*_flags(disk, *extra)) as (url, proc):
        node = Node(url, kv)
        try:
            yield node, proc
        finally:
            node.close()


def _stop(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_restart_on_the_same_directory_serves_every_chunk_it_held(
    tmp_path: Path, sig: signal.Signals
) -> None:
    disk = tmp_path / "disk"
    chunks = 4
    tokens = random_tokens(chunks * CHUNK, seed=1)
    src, dst = _blocks(chunks), _blocks(chunks, first=1 + chunks * CHUNK // BLOCK)
    with _kv() as kv:
        kv.fill_random(7)
        stored = _data(kv, src)
        with _node(disk, kv) as (node, proc):
            assert node.transfer("store", tokens, src)["stored_chunks"] == chunks
            if sig == signal.SIGKILL:
                node.wait_written(chunks)  # SIGKILL loses only what was still queued
            _stop(proc, sig)
        health_meta = json.loads((disk / "meta.json").read_text())
        assert health_meta["chunk_size"] == CHUNK
        with _node(disk, kv) as (node, _):
            health = node.http.get("/health").json()["disk"]
            assert health["chunks"] == chunks and health["chunk_size"] == CHUNK
            assert node.lookup(tokens) == len(tokens)  # counted from the disk index
            got = node.transfer("retrieve", tokens, dst)
            assert got["loaded_tokens"] == len(tokens), got
            assert _data(kv, dst) == stored
            assert _metric(node.http, DISK_HITS) == chunks


def test_a_torn_or_altered_file_is_refused_deleted_and_counted(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    chunks = 3
    tokens = random_tokens(chunks * CHUNK, seed=2)
    src, dst = _blocks(chunks), _blocks(chunks, first=20)
    with _kv() as kv:
        kv.fill_random(8)
        files: list[Path] = []  # in chunk order: each store adds the next chunk
        with _node(disk, kv) as (node, _):
            for n in range(1, chunks + 1):
                node.transfer("store", tokens[: n * CHUNK], src[: n * CHUNK // BLOCK])
                node.wait_written(n)
                (new,) = set(disk.glob("*/*.chunk")) - set(files)
                files.append(new)
        # Truncate the last chunk's file, alter the second's payload.
        with open(files[2], "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) - 100)
        with open(files[1], "r+b") as f:
            f.seek(4096 + 10)
            byte = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        with _node(disk, kv) as (node, _):
            assert _metric(node.http, CORRUPT) == 1  # the truncated one, at start
            assert not files[2].exists()
            got = node.transfer("retrieve", tokens, dst)
            assert got["loaded_tokens"] == CHUNK, got  # the first only
            assert _metric(node.http, CORRUPT) == 2  # the altered one, when read
            assert not files[1].exists()
            assert files[0].exists()


def test_a_directory_in_use_or_of_another_chunk_size_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    # One server per directory: a second one is refused at start.
    with (
        _kv() as kv,
        _node(disk, kv),
        pytest.raises(RuntimeError, match="in use by another server"),
        server_process(*_flags(disk)),
    ):
        pass
    # Below the minimum: a size this server can never select, refused at start.
    cmd = ["--chunk-size", "128", "--disk-path", str(disk), "--disk-size", "64MiB"]
    with pytest.raises(RuntimeError) as refused, server_process(*cmd):
        pass
    message = str(refused.value)
    assert "64 tokens" in message and "128" in message and "MPCACHE_DISK_PATH" in message
    # Selectable, but not what the negotiation selects: the negotiation is refused.
    cmd = ["--chunk-size", "32", "--disk-path", str(disk), "--disk-size", "64MiB"]
    with server_process(*cmd) as (url, _):
        reply = httpx.post(f"{url}/negotiate", json={"required_alignment": 32}, timeout=60)
        assert reply.status_code == 503, reply.text
        problem = reply.json()
        assert problem["binding"] == "disk_tier"
        assert problem["chunk_size"] == 32 and problem["disk_chunk_size"] == CHUNK
        assert "64 tokens, not 32" in problem["detail"]


def test_a_chunk_evicted_from_a_small_pool_is_served_from_disk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    small = ["--pool-size", "64KiB", "--pool-page-size", "4KiB"]  # 8 chunks of 8 KiB
    prompts = [random_tokens(2 * CHUNK, seed=10 + n) for n in range(6)]
    with _kv() as kv:
        kv.fill_random(9)
        with _node(disk, kv, *small) as (node, _):
            for n, tokens in enumerate(prompts):  # 12 chunks through a pool of 8
                assert node.transfer("store", tokens, _blocks(2, 1 + 8 * n))["stored_chunks"] == 2
                node.wait_written(2 * (n + 1))
            first = _data(kv, _blocks(2, 1))
            kv.zero()
            got = node.transfer("retrieve", prompts[0], _blocks(2, 1))
            assert got["loaded_tokens"] == 2 * CHUNK, got
            assert _data(kv, _blocks(2, 1)) == first
            assert _metric(node.http, DISK_HITS) == 2
