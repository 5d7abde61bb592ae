"""Connector overhead on vLLM's scheduler thread, against a bare /health round trip.

Against one real server (started here), each round interleaves, call by call:

- ``GET /health``: the floor, one HTTP round trip;
- ``get_num_new_matched_tokens`` of a fresh 1k- and 32k-token request whose chunks
  are cached: the time of the first call on the scheduler thread (it starts the
  lookup and answers ``None``), and the time until the answer is there (the step
  ends with ``build_connector_meta``, then the scheduler asks again every 0.2 ms);
- ``build_connector_meta`` for a step of 64 new requests (1k tokens each, storing
  their whole chunks): planning only, no HTTP on this path.

Per round the median of ``--calls`` calls of each; printed: the median over the
rounds with the min-max spread, and the per-round ratio to /health. At least 5
rounds, with the machine load.

    .venv/bin/python bench/connector_bench.py [--rounds 7] [--calls 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from tests.support import server_process

BLOCK_SIZE = 16
CHUNK = 256
NAMESPACE = "bench@layout/ws1"
FIGURES = (
    "lookup 1k: first call (thread)",
    "lookup 1k: until answered / GET /health",
    "lookup 32k: until answered / GET /health",
    "build_connector_meta 64 x 1k / GET /health",
)
"""What docs/benchmarks.md quotes, the first call in ms (bench/common.py ``results``)."""


@dataclass(frozen=True)
class _Spec:
    block_size: int


@dataclass
class _Group:
    kv_cache_spec: Any
    layer_names: list[str]


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None


@dataclass
class _Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class _NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class _Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class _Step:
    scheduled_new_reqs: list[_NewReq] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_cached_reqs: _Cached = field(default_factory=_Cached)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 50000 for i in range(n)]


def _ask(sched: SchedulerAdapter, request: _Request) -> tuple[float, float, int]:
    """(first call ms, ms until answered, the answer), as vLLM's scheduler asks."""
    begin = time.perf_counter()
    need, _ = sched.get_num_new_matched_tokens(request, 0)
    first = (time.perf_counter() - begin) * 1e3
    while need is None:
        sched.build_connector_meta(_Step())
        time.sleep(0.0002)
        need, _ = sched.get_num_new_matched_tokens(request, 0)
    answered = (time.perf_counter() - begin) * 1e3
    sched.request_finished(request)
    sched.transfers_finished({request.request_id})  # vLLM's finished_sending
    return first, answered, need


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="calls of each figure a round")
    args = parser.parse_args()
    rounds_n = max(MIN_ROUNDS, args.rounds)
    print(load_line())
    layout = layout_from_groups([_Group(_Spec(BLOCK_SIZE), ["l0"])])
    rounds = Rounds()
    with (
        server_process("--chunk-size", str(CHUNK), "--pool-size", "256MiB") as (url, _),
        httpx.Client(base_url=url) as client,
    ):
        config = ConnectorConfig(server_urls=(url,), request_timeout_s=10, lookup_timeout_s=10)
        common: dict[str, Any] = {"model": "bench", "instance_id": "bench", "namespace": NAMESPACE}
        sched = SchedulerAdapter(config, layout, world_size=1, **common)  # type: ignore[arg-type]
        num_blocks = 32768 // BLOCK_SIZE + 1
        worker = WorkerAdapter(
            config,
            layout,  # type: ignore[arg-type]
            rank=0,
            world_size=1,
            num_blocks=num_blocks,
            **common,
        )
        try:
            assert sched.chunk_size == CHUNK, sched.chunk_size
            worker.register_kv_caches({"l0": torch.zeros(num_blocks, 2, BLOCK_SIZE, 1, 8)})
            blocks = list(range(1, num_blocks))
            prompts = {1024: _prompt(1024 + 1, 1), 32768: _prompt(32768 + 1, 2)}
            for size, prompt in prompts.items():  # cache every whole chunk of both prompts
                st = _Request(f"store-{size}", prompt, len(prompt))
                while sched.get_num_new_matched_tokens(st, 0)[0] is None:
                    sched.build_connector_meta(_Step())
                    time.sleep(0.001)
                sched.update_state_after_alloc(st, _Blocks((blocks,)), 0)
                plan = sched.build_connector_meta(
                    _Step([_NewReq(st.request_id, (blocks,), 0)], {st.request_id: size + 1})
                )
                worker.save(plan)
                assert worker.flush(10.0)  # its lane has sent it
                sched.request_finished(st)
                sched.transfers_finished({st.request_id})  # vLLM's finished_sending

            def build(i: int) -> float:
                step = _Step()
                for r in range(64):
                    req = _Request(f"b{i}-{r}", _prompt(1024, 1000 * i + r), 1024)
                    ids = list(range(1 + r * 64, 1 + (r + 1) * 64))
                    sched.update_state_after_alloc(req, _Blocks((ids,)), 0)
                    step.scheduled_new_reqs.append(_NewReq(req.request_id, (ids,), 0))
                    step.num_scheduled_tokens[req.request_id] = 1024
                begin = time.perf_counter()
                plan = sched.build_connector_meta(step)
                elapsed = (time.perf_counter() - begin) * 1e3
                assert len(plan.stores) == 64
                for rid in step.num_scheduled_tokens:
                    sched.request_finished(_Request(rid, [], 0))
                return elapsed

            for r in range(-1, rounds_n):  # round -1 warms up
                samples: dict[str, list[float]] = {}
                for i in range(args.calls):
                    begin = time.perf_counter()
                    client.get("/health").raise_for_status()
                    samples.setdefault("GET /health", []).append(
                        (time.perf_counter() - begin) * 1e3
                    )
                    for size, prompt in prompts.items():
                        req = _Request(f"l{size}-{r}-{i}", prompt, len(prompt))
                        first, answered, need = _ask(sched, req)
                        assert need == size, (need, size)
                        k = f"{size // 1024}k"
                        samples.setdefault(f"lookup {k}: first call (thread)", []).append(first)
                        samples.setdefault(f"lookup {k}: until answered", []).append(answered)
                    if i % 3 == 0:
                        samples.setdefault("build_connector_meta 64 x 1k", []).append(
                            build(r * 1000 + i)
                        )
                if r >= 0:
                    for name, values in samples.items():
                        rounds.add(name, statistics.median(values))
        finally:
            worker.shutdown()
            sched.shutdown()
    print(load_line())
    print(rounds.table(list(rounds.values), "GET /health", unit="ms", ratio_label="/ GET /health"))
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
