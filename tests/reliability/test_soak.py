"""A bounded soak (issue 8, item 6): N worker adapters store and load through one real
server for a few seconds, with a pool small enough to evict; every block a load
reports loaded holds exactly the bytes stored for it.

Any client may store any of a small set of prompts, so chunks are shared, found
present, evicted and stored again; a prompt's bytes are a function of the prompt
alone, so whoever stored it, a load must return them. A load that cannot be
served reports its blocks failed (vLLM recomputes them): allowed, and counted.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.metadata import StepPlan, TransferOp
from connector.worker import WorkerAdapter
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, Group
from tests.support import server_process

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

CLIENTS = 4
SOAK_S = 10.0
MAX_ROUNDS = 5_000  # per client: the loop is bounded even if the clock misbehaves
PROMPTS = 24
NUM_BLOCKS = 32
BS = 16
CHUNK = 64
NS = "tiny@soak/ws1"
LAYERS = ("l0", "l1")
BLOCKS = 8  # 128 tokens per prompt: two chunks
SHAPE = (2, BS, 2, 8)


def _prompt(p: int) -> list[int]:
    return [(p * 7919 + i * 37) % 30000 for i in range(BLOCKS * BS)]


def _data(p: int, layer: int) -> torch.Tensor:
    """The bytes of prompt ``p``'s blocks in one layer (the same for every client)."""
    return torch.rand((BLOCKS, *SHAPE), generator=torch.Generator().manual_seed(p * 10 + layer))


def _worker(url: str, instance: str) -> tuple[WorkerAdapter, dict[str, torch.Tensor]]:
    config = ConnectorConfig(
        server_urls=(url,),
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
        request_timeout_s=10.0,
        lookup_timeout_s=5.0,
        startup_timeout_s=60.0,
    )
    layout = layout_from_groups([Group(AttnSpec(BS), list(LAYERS))])
    worker = WorkerAdapter(
        config,
        layout,
        rank=0,
        world_size=1,
        num_blocks=NUM_BLOCKS,
        model="tiny",
        instance_id=instance,
        namespace=NS,
    )
    kv = {name: torch.zeros(NUM_BLOCKS, *SHAPE) for name in LAYERS}
    worker.register_kv_caches(kv)
    return worker, kv


def test_soak_every_loaded_byte_is_the_stored_byte() -> None:
    # 2 chunks x 2 layers x 4 blocks x 2 KiB = 32 KiB per prompt: 512 KiB holds 16 of 24.
    with server_process("--chunk-size", str(CHUNK), env={"MPCACHE_POOL_SIZE": "512KiB"}) as (
        url,
        _,
    ):
        workers = [_worker(url, f"soak{c}") for c in range(CLIENTS)]
        totals = {"loads": 0, "full": 0, "failed_blocks": 0, "bytes_checked": 0}
        errors: list[BaseException] = []
        lock = threading.Lock()
        deadline = time.monotonic() + SOAK_S

        def client(c: int) -> None:
            worker, kv = workers[c]
            src, dst = list(range(1, 1 + BLOCKS)), list(range(1 + BLOCKS, 1 + 2 * BLOCKS))
            try:
                for r in range(MAX_ROUNDS):
                    if time.monotonic() > deadline:
                        return
                    p = (c * 5 + r * 7) % PROMPTS
                    tokens = encode_tokens(_prompt(p))
                    for i, name in enumerate(LAYERS):
                        kv[name][src] = _data(p, i)
                        kv[name][dst] = 0
                    end = BLOCKS * BS
                    worker.save(StepPlan(stores=(TransferOp(f"s{c}-{r}", 0, end, tokens, [src]),)))
                    assert worker.flush(10.0)  # its lane has sent it
                    rid = f"l{c}-{r}"
                    worker.start_load(StepPlan(loads=(TransferOp(rid, 0, end, tokens, [dst]),)))
                    assert worker.flush(10.0)  # its lane has sent it
                    finished, _ = worker.take_transfer_results()
                    assert rid in finished
                    failed = worker.take_load_errors()
                    checked = 0
                    for j, block in enumerate(dst):
                        if block in failed:
                            continue
                        for i, name in enumerate(LAYERS):
                            want = _data(p, i)[j]
                            assert torch.equal(kv[name][block], want), (c, r, p, j, name)
                            checked += want.numel() * want.element_size()
                    with lock:
                        totals["loads"] += 1
                        totals["full"] += not failed
                        totals["failed_blocks"] += len(failed)
                        totals["bytes_checked"] += checked
            except BaseException as exc:  # reported on the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_S + 120)
        for worker, _ in workers:
            worker.shutdown()
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)
    print(f"soak: {CLIENTS} clients x {SOAK_S:g} s: {totals}")
    assert totals["full"] > 0 and totals["bytes_checked"] > 0
