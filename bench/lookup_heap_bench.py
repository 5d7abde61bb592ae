"""A burst-sized binary lookup against two servers: one keeps freed memory
(``--keep-freed-memory``, the default; ``app/heap.py``), one hands it back.

Both real servers hold every chunk of ``--requests`` prompts of ``--tokens``
tokens. Each round, for each server in turn: ``GET /health`` round trips (their
median is that server's baseline for the round), then one binary lookup of every
prompt under new request ids (ended after), timed, with the minor page faults the
server process took during it (``/proc/<pid>/stat``). At least 5 rounds; median
and min-max spread, with the machine load.

    .venv/bin/python bench/lookup_heap_bench.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results, timed_ms
from bench.scheduler_burst_bench import BLOCK_SIZE, CHUNK, NAMESPACE, _cache_prompts, _prompt
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, encode_lookup_frame
from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import pack_tokens
from tests.support import server_process

SERVERS = {"keeps freed memory": (), "hands it back": ("--no-keep-freed-memory",)}
FIGURES = (
    "lookup (keeps freed memory) / lookup (hands it back)",
    "minor page faults (keeps freed memory)",
    "minor page faults (hands it back)",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""


def _health(http: httpx.Client) -> None:
    http.get("/health").raise_for_status()


def _minor_faults(pid: int) -> int:
    """The process's minor page faults so far (``minflt``, the 10th field of stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--health-calls", type=int, default=9)
    args = parser.parse_args()
    rounds_n = max(MIN_ROUNDS, args.rounds)
    print(load_line())
    end = (args.tokens - 1) // CHUNK * CHUNK
    print(
        f"one binary lookup of {args.requests} requests x {end} tokens (all cached), "
        f"chunk {CHUNK}; {rounds_n} rounds"
    )
    prompts = [_prompt(args.tokens, seed) for seed in range(args.requests)]
    packed = [pack_tokens(p[:end]) for p in prompts]
    rounds = Rounds()
    with (
        server_process("--chunk-size", str(CHUNK), *SERVERS["keeps freed memory"]) as kept,
        server_process("--chunk-size", str(CHUNK), *SERVERS["hands it back"]) as handed,
    ):
        servers = {"keeps freed memory": kept, "hands it back": handed}
        clients = {name: httpx.Client(base_url=url) for name, (url, _) in servers.items()}
        try:
            for http in clients.values():
                http.post("/negotiate", json={"required_alignment": BLOCK_SIZE}).raise_for_status()
                _cache_prompts(http, prompts, args.tokens)
            for r in range(-1, rounds_n):  # round -1 warms up
                for name, (_, proc) in servers.items():
                    http = clients[name]
                    health = timed_ms(functools.partial(_health, http), args.health_calls)
                    ids = [f"{r}-{i}" for i in range(args.requests)]
                    header = LookupFrameHeader(
                        requests=[
                            LookupFrameItem(
                                request_id=rid, namespace=NAMESPACE, world_size=1, num_tokens=end
                            )
                            for rid in ids
                        ]
                    )
                    body = encode_lookup_frame(header, packed)
                    before = _minor_faults(proc.pid)
                    begin = time.perf_counter()
                    reply = http.post(
                        "/cache/lookup",
                        content=body,
                        headers={"content-type": LOOKUP_FRAME_MEDIA_TYPE},
                    )
                    took = (time.perf_counter() - begin) * 1e3
                    taken = _minor_faults(proc.pid) - before
                    reply.raise_for_status()
                    hits = {item["hit_tokens"] for item in reply.json()["results"]}
                    assert hits == {end}, f"{name}: hit tokens {hits}, expected {end}"
                    http.post("/cache/end", json={"request_ids": ids}).raise_for_status()
                    if r >= 0:
                        rounds.add(f"GET /health ({name})", health)
                        rounds.add(f"lookup ({name})", took)
                        rounds.add(f"minor page faults ({name})", taken)
        finally:
            for http in clients.values():
                http.close()
    print(load_line())
    for name in SERVERS:
        print(
            rounds.table(
                [f"GET /health ({name})", f"lookup ({name})"],
                f"GET /health ({name})",
                unit="ms",
                ratio_label="/ GET /health",
            )
        )
    print(results(FIGURES[:1], rounds))
    print(results(FIGURES[1:], rounds, digits=0))


if __name__ == "__main__":
    main()
