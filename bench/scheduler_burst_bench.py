"""A burst of new requests through the real SchedulerAdapter: vLLM's scheduler thread.

Against one real server (started here), with every prompt's chunks cached, each
round:

- ``GET /health`` round trips (``--health-calls``; their median is the round's
  baseline), interleaved with the burst;
- a burst of ``--requests`` new requests of ``--tokens`` tokens (vLLM's own
  ``Request`` objects, built as its engine core builds them), driven as vLLM's
  scheduler drives the connector: each step calls ``get_num_new_matched_tokens``
  for every waiting request, then ``build_connector_meta`` (which ends vLLM's
  ``schedule()``); a request whose answer is ``None`` waits for a later step; between
  steps the thread sleeps 1 ms, as vLLM's engine loop does when a step ran no model.

Figures, each per round and as a ratio to that round's /health: the scheduler
thread's time in the first step (``get_num_new_matched_tokens`` for the whole burst
plus ``build_connector_meta``; target <= 2x), the longest later step (target <= 2x),
and the time from the first call until every request has its answer (target
<= 10x). Every answer is checked (the cached tokens, in whole chunks). At least 5
rounds; median and min-max spread, with the machine load.

The process freezes its startup heap before the rounds, as vLLM's engine core does
once its scheduler and connector are built (``vllm.utils.gc_utils.freeze_gc_heap``).
Garbage collection in this process during a burst, in any thread, is reported on its
own row: a young collection walks every new request's token list, in whichever
thread's allocation triggers it.

With one server on this host the connector writes the burst's token ids into a
lookup area shared with the server and sends a mark per request
(``connector/lookup_area.py``). Each round also runs the same burst through a
second connector that sends the ids in the body (as against a server on another
host), its order against the first alternating round by round; the last line is
their ratio within each round. ``--no-lookup-area`` runs only the body form.

    .venv/bin/python bench/scheduler_burst_bench.py [--rounds 7] [--requests 64]

With ``--no-lookup-area`` it runs against older adapters too (a synchronous lookup
answers in the first step).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.scheduler import SchedulerAdapter
from contract.tokens import encode_tokens
from tests.support import server_process

BLOCK_SIZE = 16
CHUNK = 256
NAMESPACE = "bench@burst/ws1"
POLL_S = 0.001
BODY_ROW = "every request answered, ids in the body"
FIGURES = (
    "first step / GET /health",
    "longest later step / GET /health",
    "every request answered / GET /health",
    "every request answered, ids in the body / GET /health",
    "every request answered / every request answered, ids in the body",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""
KV_SHAPE = (
    2,
    BLOCK_SIZE,
    1,
    8,
)  # per block: K and V of one head of 8: tiny, the copy is not measured


@dataclass(frozen=True)
class _Spec:
    block_size: int


@dataclass
class _Group:
    kv_cache_spec: Any
    layer_names: list[str]


@dataclass
class _Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class _Step:
    scheduled_new_reqs: list[Any] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_cached_reqs: _Cached = field(default_factory=_Cached)


def _request_factory() -> Callable[[str, list[int]], Any]:
    """vLLM's own ``Request``, built as its engine core builds one (with the block
    hasher of its prefix cache, sha256 by default): its token list, its allocations."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)

    def new_request(request_id: str, prompt: list[int]) -> Any:
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=block_hasher,
        )

    return new_request


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 50000 for i in range(n)]


def _cache_prompts(http: httpx.Client, prompts: list[list[int]], tokens: int) -> None:
    """Store every whole chunk of every prompt through a tiny registered KV cache."""
    import mmap
    import os

    import torch

    from contract.schemas import REGISTRATION_TOKEN_HEADER
    from tests.dataplane.support import register_over, sealed_memfd

    blocks = tokens // BLOCK_SIZE
    per_layer = (blocks + 1) * 2 * BLOCK_SIZE * 8 * 4
    fd = sealed_memfd(per_layer, "mpcache-bench-burst")
    mm = mmap.mmap(fd, per_layer)
    try:
        view = torch.frombuffer(mm, dtype=torch.float32)
        view.fill_(1.0)
        shape = [blocks + 1, *KV_SHAPE]
        stride = [2 * BLOCK_SIZE * 8, BLOCK_SIZE * 8, 8, 8, 1]
        tensor = {
            "transport": "memfd",
            "ticket": f"fd:{fd}",
            "offset_bytes": 0,
            "shape": shape,
            "stride": stride,
            "dtype": "float32",
            "block_dim": 0,
        }
        body = {
            "instance_id": "burst",
            "rank": 0,
            "chunk_size": CHUNK,
            "namespace": NAMESPACE,
            "groups": [{"group_id": 0, "kind": "attention", "token_span": BLOCK_SIZE}],
            "layers": [{"name": "l0", "group_id": 0, "tensors": [tensor]}],
        }
        token, sock = register_over(http, body)
        owner = {REGISTRATION_TOKEN_HEADER: token}
        ids = list(range(1, blocks + 1))
        for i, prompt in enumerate(prompts):
            end = (len(prompt) - 1) // CHUNK * CHUNK
            item = {
                "request_id": f"seed{i}",
                "namespace": NAMESPACE,
                "tokens_b64": encode_tokens(prompt[:end]),
                "start_token": 0,
                "end_token": end,
                "block_ids": [ids],
            }
            reply = http.post(
                "/cache/store",
                json={"instance_id": "burst", "rank": 0, "requests": [item]},
                headers=owner,
            )
            reply.raise_for_status()
            assert reply.json()["results"][0]["stored_chunks"] == end // CHUNK, reply.text
        http.post("/cache/end", json={"request_ids": [f"seed{i}" for i in range(len(prompts))]})
        http.delete("/register/burst/0", headers=owner).raise_for_status()
        sock.close()
        del view
    finally:
        mm.close()
        os.close(fd)


class _Collections:
    """Time the garbage collector spends in this process, in any thread (ms)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._start) * 1e3

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def burst(sched: SchedulerAdapter, requests: list[Any], expect: int) -> dict[str, float]:
    """Drive one burst as vLLM's scheduler would; times in ms."""
    with _Collections() as collections:
        return _burst(sched, requests, expect, collections)


def _burst(
    sched: SchedulerAdapter, requests: list[Any], expect: int, collections: _Collections
) -> dict[str, float]:
    waiting = list(requests)
    answered: dict[str, int] = {}
    steps: list[float] = []
    begin = time.perf_counter()
    while waiting:
        step_start = time.perf_counter()
        still = []
        for request in waiting:
            need, _ = sched.get_num_new_matched_tokens(request, 0)
            if need is None:
                still.append(request)
            else:
                answered[request.request_id] = need
        sched.build_connector_meta(_Step())
        steps.append((time.perf_counter() - step_start) * 1e3)
        waiting = still
        if waiting:
            if time.perf_counter() - begin > 30:
                raise SystemExit(f"{len(waiting)} requests still unanswered after 30 s")
            time.sleep(POLL_S)  # vLLM's engine loop after a step that ran no model
    total = (time.perf_counter() - begin) * 1e3
    collected = collections.ms
    wrong = {rid: n for rid, n in answered.items() if n != expect}
    assert not wrong, f"answers other than {expect}: {wrong}"
    for request in requests:
        sched.request_finished(request)
        sched.transfers_finished({request.request_id})  # vLLM's finished_sending
    sched.build_connector_meta(_Step())  # ends their sessions
    return {
        "first step": steps[0],
        "longest later step": max(steps[1:], default=0.0),
        "every request answered": total,
        "garbage collection in the burst": collected,
        "steps": float(len(steps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--health-calls", type=int, default=20)
    parser.add_argument(
        "--lookup-area",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the connector's mpcache.lookup_area (--no-lookup-area: ids in the body)",
    )
    args = parser.parse_args()
    rounds_n = max(MIN_ROUNDS, args.rounds)
    print(load_line())
    print(
        f"{args.requests} new requests of {args.tokens} tokens a burst (all chunks cached), "
        f"chunk {CHUNK}; {rounds_n} rounds; token ids "
        + ("through a lookup area" if args.lookup_area else "in the body")
    )
    layout = layout_from_groups([_Group(_Spec(BLOCK_SIZE), ["l0"])])
    prompts = [_prompt(args.tokens, seed) for seed in range(args.requests)]
    expect = (args.tokens - 1) // CHUNK * CHUNK
    new_request = _request_factory()
    rounds = Rounds()
    steps: list[float] = []
    with (
        server_process("--chunk-size", str(CHUNK), "--pool-size", "64MiB") as (url, _),
        httpx.Client(base_url=url) as http,
    ):
        http.post("/negotiate", json={"required_alignment": BLOCK_SIZE}).raise_for_status()
        _cache_prompts(http, prompts, args.tokens)

        def connector(instance_id: str, **config: Any) -> SchedulerAdapter:
            return SchedulerAdapter(
                ConnectorConfig(
                    server_urls=(url,), request_timeout_s=10, lookup_timeout_s=10, **config
                ),
                layout,
                model="bench",
                instance_id=instance_id,
                namespace=NAMESPACE,
                world_size=1,
            )

        # (lookup_area named only when off: older connectors take the default form)
        sched = connector("bench", **({} if args.lookup_area else {"lookup_area": False}))
        # With the lookup area on, a second connector sends the ids in the body: its
        # burst runs in the same rounds (the two alternate which goes first).
        plain = connector("bench-body", lookup_area=False) if args.lookup_area else None
        # As vLLM's engine core does once its scheduler (and so this connector) is
        # built (vllm.utils.gc_utils.freeze_gc_heap): the startup heap is frozen, so a
        # full collection does not walk torch's and vLLM's objects.
        gc.collect()
        gc.freeze()
        try:
            for r in range(-1, rounds_n):  # round -1 warms up
                health = []
                order = [(sched, "r"), (plain, "b")][:: 1 if r % 2 else -1]
                at = {args.health_calls * (k + 1) // 3: pair for k, pair in enumerate(order)}
                for i in range(args.health_calls):
                    begin = time.perf_counter()
                    http.get("/health").raise_for_status()
                    health.append((time.perf_counter() - begin) * 1e3)
                    adapter, tag = at.get(i, (None, ""))
                    if adapter is not None:  # each burst sits between /health calls
                        requests = [new_request(f"{tag}{r}-{j}", p) for j, p in enumerate(prompts)]
                        if tag == "r":
                            figures = burst(adapter, requests, expect)
                        else:
                            body = burst(adapter, requests, expect)["every request answered"]
                if r < 0:
                    continue
                rounds.add("GET /health", statistics.median(health))
                for name, value in figures.items():
                    if name == "steps":
                        steps.append(value)
                    else:
                        rounds.add(name, value)
                if plain is not None:
                    rounds.add(BODY_ROW, body)
        finally:
            sched.shutdown()
            if plain is not None:
                plain.shutdown()
    print(load_line())
    print(
        rounds.table(
            [
                "GET /health",
                "first step",
                "longest later step",
                "every request answered",
                *([BODY_ROW] if args.lookup_area else []),
                "garbage collection in the burst",
            ],
            "GET /health",
            unit="ms",
            ratio_label="/ GET /health",
            target="targets: steps <= 2, answered <= 10",
        )
    )
    print(f"steps until every request was answered: {statistics.median(steps):.0f} (median)")
    print(results([f for f in FIGURES if args.lookup_area or BODY_ROW not in f], rounds))


if __name__ == "__main__":
    main()
