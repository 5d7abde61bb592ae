"""Several clients store, look up and retrieve at once: no 5xx, no torn chunk.

A real server process with a pool far smaller than the working set, so entries
are evicted and their pages reused while other clients read. Every block of
chunk ``k`` of prompt ``p`` holds one known value in every byte pair, so a block
or chunk mixed from two sources (a torn read) is detected.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from contract.schemas import REGISTRATION_TOKEN_HEADER
from tests.dataplane.support import (
    NAMESPACE,
    KVFactory,
    ShmKV,
    WorkerSocket,
    random_tokens,
    register_body,
    token_field,
    transfer_item,
    vllm_layer,
    with_tickets,
)
from tests.support import server_process

CHUNK = 64
CHUNKS_PER_PROMPT = 3
BLOCKS = 4 * CHUNKS_PER_PROMPT
GROUPS = [(0, "attention", 16)]
LAYERS = [vllm_layer(f"l{i}", 0, BLOCKS + 1) for i in range(4)]
NUM_CLIENTS = 4
ITERATIONS = 25
PROMPTS = [random_tokens(CHUNKS_PER_PROMPT * CHUNK, seed=500 + i) for i in range(6)]
BLOCK_IDS = list(range(1, BLOCKS + 1))


def _value(prompt: int, block: int, layer: int) -> int:
    return 1 + (prompt * BLOCKS + block) * len(LAYERS) + layer


def _fill(kv: ShmKV, prompt: int) -> None:
    for li, layer in enumerate(LAYERS):
        for j, block in enumerate(BLOCK_IDS):
            kv.block(layer.name, 0, block).view(torch.int16).fill_(_value(prompt, j, li))


def _check(kv: ShmKV, prompt: int, loaded_blocks: int) -> None:
    for li, layer in enumerate(LAYERS):
        for j, block in enumerate(BLOCK_IDS):
            data = kv.block(layer.name, 0, block).view(torch.int16)
            want = _value(prompt, j, li) if j < loaded_blocks else 0
            assert bool((data == want).all()), (
                prompt,
                j,
                layer.name,
                sorted(set(data.flatten().tolist())),
            )


class Client(threading.Thread):
    def __init__(self, index: int, url: str, kv: ShmKV, token: str) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.index = index
        self.url = url
        self.kv = kv
        self.token = token
        self.errors: list[BaseException] = []
        self.statuses: list[int] = []
        self.loaded_chunks = 0

    def post(self, http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = http.post(path, json=body, headers={REGISTRATION_TOKEN_HEADER: self.token})
        self.statuses.append(reply.status_code)
        assert reply.status_code == 200, f"{path}: {reply.status_code} {reply.text}"
        result: dict[str, Any] = reply.json()["results"][0]
        return result

    def run(self) -> None:
        rng = np.random.default_rng(self.index)
        instance = f"client-{self.index}"
        try:
            with httpx.Client(base_url=self.url, timeout=30.0) as http:
                for step in range(ITERATIONS):
                    p = int(rng.integers(len(PROMPTS)))
                    _fill(self.kv, p)
                    rid = f"{instance}-s{step}"
                    item = transfer_item(rid, PROMPTS[p], [BLOCK_IDS])
                    self.post(
                        http,
                        "/cache/store",
                        {"instance_id": instance, "rank": 0, "requests": [item]},
                    )

                    q = int(rng.integers(len(PROMPTS)))
                    rid = f"{instance}-r{step}"
                    self.kv.zero()
                    look = {"request_id": rid, "namespace": NAMESPACE, **token_field(PROMPTS[q])}
                    hit = self.post(http, "/cache/lookup", {"requests": [look]})["hit_tokens"]
                    item = transfer_item(rid, PROMPTS[q], [BLOCK_IDS])
                    got = self.post(
                        http,
                        "/cache/retrieve",
                        {"instance_id": instance, "rank": 0, "requests": [item]},
                    )
                    loaded = got["loaded_tokens"]
                    # The lookup leased its hits, so the retrieve finds at least those.
                    assert loaded >= hit and loaded % CHUNK == 0, (hit, loaded)
                    _check(self.kv, q, loaded // 16)
                    self.loaded_chunks += loaded // CHUNK
                    http.post("/cache/end", json={"request_ids": [rid, f"{instance}-s{step}"]})
        except BaseException as exc:
            self.errors.append(exc)


@pytest.mark.slow
def test_concurrent_clients_never_see_a_torn_chunk(shm_kv: KVFactory) -> None:
    # 16 KiB per chunk, 18 distinct chunks, room for 8: constant eviction.
    with (
        server_process(
            "--chunk-size", "64", "--pool-size", "128KiB", "--pool-page-size", "4KiB"
        ) as (
            url,
            _,
        ),
        httpx.Client(base_url=url, timeout=30.0) as http,
    ):
        assert http.post("/negotiate", json={"required_alignment": 16}).status_code == 200
        kvs = [shm_kv(LAYERS) for _ in range(NUM_CLIENTS)]
        worker = WorkerSocket(http.get("/register").json()["socket_path"])
        tokens = []
        for i, kv in enumerate(kvs):
            body = with_tickets(register_body(kv, f"client-{i}", GROUPS, chunk_size=CHUNK), worker)
            reply = http.post("/register", json=body)
            assert reply.status_code == 200, reply.text
            tokens.append(reply.json()["registration_token"])
        clients = [Client(i, url, kv, tokens[i]) for i, kv in enumerate(kvs)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=120)
        assert not any(c.is_alive() for c in clients), "a client hung"
        for client in clients:
            if client.errors:
                raise client.errors[0]
            assert all(s < 500 for s in client.statuses)
        assert sum(c.loaded_chunks for c in clients) > 0
        metrics = http.get("/metrics").text
        evicted = [
            line for line in metrics.splitlines() if line.startswith("mpcache_chunks_evicted_total")
        ]
        assert evicted and float(evicted[0].split()[1]) > 0
        worker.close()
