"""Control-plane latency: /negotiate and /chunk-size against a bare /health.

Starts a real server process on 127.0.0.1, interleaves the calls (so machine noise
hits all of them alike) and prints p50/p99 and the ratio to /health.

    .venv/bin/python bench/negotiate_bench.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import server_process


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100)[q - 1] if q < 100 else max(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    calls = {
        "health": ("GET", "/health", None),
        "chunk-size": ("GET", "/chunk-size", None),
        "negotiate (confirm)": ("POST", "/negotiate", {"required_alignment": 96}),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    with server_process() as (url, _), httpx.Client(base_url=url) as http:
        http.post("/negotiate", json={"required_alignment": 96}).raise_for_status()
        for _ in range(100):  # warm up
            http.get("/health")
        for _ in range(args.rounds):
            for name, (method, path, body) in calls.items():
                start = time.perf_counter()
                http.request(method, path, json=body).raise_for_status()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["health"])
    print(f"{'call':<22}{'p50 ms':>10}{'p99 ms':>10}{'p50 / health':>14}")
    for name, samples in times.items():
        p50, p99 = statistics.median(samples), pct(samples, 99)
        print(f"{name:<22}{p50 * 1e3:>10.3f}{p99 * 1e3:>10.3f}{p50 / base:>14.2f}")


if __name__ == "__main__":
    main()
