"""A worker's store and retrieve calls: over the server's ops socket against HTTP.

Starts a real server process on 127.0.0.1 (chunk size 256) and registers a worker's
CPU KV cache with it (8 layers, 4 KV heads of 64, bfloat16, block 32: 2 MiB per
chunk, as bench/ttft_bench.py's model), then stores one 1984-token prompt (seven
chunks and a tail, 14.7 MB). Each round makes ``--calls`` calls of each kind both
ways, interleaved call by call, through the worker's own ``TransferCalls``: one with
the socket, one with ``mpcache.ops_socket`` off (HTTP).

- retrieve: the prompt's 1984 tokens copied into other blocks (the copy plus the
  call around it, as a load pays it);
- store again: the same prompt, whose chunks the cache holds (``present_chunks``):
  no copy, so the call is all the transport and the server's bookkeeping.

The figure is the median wall time per call, and its ratio to HTTP within each
round; prints the median and min-max spread over ``--rounds`` rounds (at least 5),
and the machine load.

    .venv/bin/python bench/transfer_call_bench.py [--rounds 7] [--calls 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results, timed_ms
from connector.alignment import layout_from_groups
from connector.metadata import TransferOp
from connector.worker import WorkerAdapter
from contract.schemas import RetrieveRequest, StoreRequest
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, Group
from tests.support import quick_connector_config, server_process

BLOCK, LAYERS, BLOCKS, CHUNK, TOKENS = 32, 8, 160, 256, 1984
NAMES = (
    "retrieve over HTTP",
    "retrieve over the ops socket",
    "store (present) over HTTP",
    "store (present) over the ops socket",
)
FIGURES = (
    "retrieve over the ops socket / retrieve over HTTP",
    "store (present) over the ops socket / store (present) over HTTP",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""


def _worker(url: str, name: str, *, ops_socket: bool) -> WorkerAdapter:
    layout = layout_from_groups([Group(AttnSpec(BLOCK), [f"l{i}" for i in range(LAYERS)])])
    config = quick_connector_config(url, heartbeat_interval_s=30.0, ops_socket=ops_socket)
    common: dict[str, Any] = {"model": "bench", "instance_id": name, "namespace": "bench@ops"}
    return WorkerAdapter(config, layout, rank=0, world_size=1, num_blocks=BLOCKS, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=40, help="calls of each kind per round")
    args = parser.parse_args()
    print(load_line())
    rounds = Rounds()
    with server_process("--chunk-size", str(CHUNK), "--pool-size", "256MiB") as (url, _):
        workers = {
            "ops socket": _worker(url, "ops", ops_socket=True),
            "HTTP": _worker(url, "http", ops_socket=False),
        }
        try:
            calls = {}
            prompt = [(i * 37) % 997 + 3 for i in range(TOKENS)]
            blocks = -(-TOKENS // BLOCK)
            for way, worker in workers.items():
                kv = torch.randn(BLOCKS, 2, BLOCK, 4, 64).to(torch.bfloat16)
                worker.register_kv_caches({f"l{i}": kv.clone() for i in range(LAYERS)})
                assert worker.registered, way
                store = TransferOp(
                    "s", 0, TOKENS, encode_tokens(prompt), [list(range(1, 1 + blocks))], None, 32
                )
                load = TransferOp(
                    "r", 0, TOKENS, store.tokens_b64, [list(range(80, 80 + blocks))], None, 32
                )
                stored = StoreRequest(**worker._body([store], None))
                loaded = RetrieveRequest(**worker._body([load], None))
                token = worker.registration_token
                transfers = worker._transfers
                transfers.store(stored, timeout_s=10.0, registration_token=token)
                calls[way] = (
                    lambda t=transfers, b=loaded, k=token: t.retrieve(
                        b, timeout_s=10.0, registration_token=k
                    ),
                    lambda t=transfers, b=stored, k=token: t.store(
                        b, timeout_s=10.0, registration_token=k
                    ),
                )
                reply = calls[way][0]()
                assert reply.results[0].loaded_tokens == TOKENS, (way, reply)
            for _ in range(5):  # warm up both ways
                for retrieve, store_again in calls.values():
                    retrieve()
                    store_again()
            for _ in range(max(MIN_ROUNDS, args.rounds)):
                times: dict[str, list[float]] = {name: [] for name in NAMES}
                for _ in range(args.calls):
                    for way, (retrieve, store_again) in calls.items():
                        suffix = "HTTP" if way == "HTTP" else "the ops socket"
                        times[f"retrieve over {suffix}"].append(timed_ms(retrieve, 1))
                        times[f"store (present) over {suffix}"].append(timed_ms(store_again, 1))
                for name, samples in times.items():
                    rounds.add(name, sorted(samples)[len(samples) // 2])
        finally:
            for worker in workers.values():
                worker.shutdown()
    print(load_line())
    print(
        rounds.table(list(NAMES[:2]), NAMES[0], unit="ms per call", ratio_label="/ HTTP", digits=3)
    )
    print(
        rounds.table(list(NAMES[2:]), NAMES[2], unit="ms per call", ratio_label="/ HTTP", digits=3)
    )
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
