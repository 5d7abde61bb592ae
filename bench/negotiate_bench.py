"""Control-plane latency: /negotiate and /chunk-size against a bare /health.

Starts a real server process on 127.0.0.1. Each round makes ``--calls`` calls of
each route, interleaved call by call, and keeps each route's median; ratios to
/health are taken within the round. Prints the median and min-max spread over
``--rounds`` rounds (at least 5), and the machine load.

    .venv/bin/python bench/negotiate_bench.py [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from tests.support import server_process

FIGURES = ("POST /negotiate (confirm) / GET /health", "GET /chunk-size / GET /health")
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls of each route per round")
    args = parser.parse_args()
    calls = {
        "GET /health": ("GET", "/health", None),
        "GET /chunk-size": ("GET", "/chunk-size", None),
        "POST /negotiate (confirm)": ("POST", "/negotiate", {"required_alignment": 96}),
    }
    print(load_line())
    rounds = Rounds()
    with server_process() as (url, _), httpx.Client(base_url=url) as http:
        http.post("/negotiate", json={"required_alignment": 96}).raise_for_status()
        for _ in range(100):  # warm up
            http.get("/health")
        for _ in range(max(MIN_ROUNDS, args.rounds)):
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.calls):
                for name, (method, path, body) in calls.items():
                    start = time.perf_counter()
                    http.request(method, path, json=body).raise_for_status()
                    times[name].append((time.perf_counter() - start) * 1e3)
            for name, samples in times.items():
                rounds.add(name, statistics.median(samples))
    print(load_line())
    print(rounds.table(list(calls), "GET /health", unit="ms", ratio_label="/ GET /health"))
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
