"""A full garbage collection in the server process: startup objects frozen or not.

Builds the server as ``uvicorn app.main:app`` does (its imports, the app, the
runtime its lifespan makes), then, each round, times ``gc.collect()`` with every
object scanned (the baseline: ``gc.unfreeze`` first) and again after
``app.heap.freeze_startup_objects`` (what the server does once started). Before
each collection ``--garbage`` lists in reference cycles are made (the collector
off meanwhile), so both have the same garbage to free besides the walk. Prints
the median and min-max spread of ``--rounds`` rounds in ms, and the frozen
collection's time as a ratio to the full one's within each round, with the
machine load.

    .venv/bin/python bench/gc_pause_bench.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.heap import freeze_startup_objects
from app.main import create_app
from app.settings import Settings
from app.state import build_runtime
from bench.common import MIN_ROUNDS, Rounds, load_line, results

FIGURES = ("full collection, nothing frozen", "full collection, startup frozen")
"""What docs/benchmarks.md quotes, in ms (bench/common.py ``results``)."""


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def _collect_ms(garbage: int) -> float:
    gc.disable()  # the cycles wait for the timed collection
    _cycles(garbage)
    gc.enable()
    begin = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - begin) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--garbage", type=int, default=10_000)
    args = parser.parse_args()
    print(load_line())
    create_app(Settings(port=0, pool_size="16MiB"))
    runtime = build_runtime(Settings(port=0, pool_size="16MiB", copy_threads=1))
    try:
        rounds = Rounds()
        frozen = 0
        for r in range(-1, max(MIN_ROUNDS, args.rounds)):  # round -1 warms up
            gc.unfreeze()
            full_ms = _collect_ms(args.garbage)
            frozen = freeze_startup_objects()
            frozen_ms = _collect_ms(args.garbage)
            if r >= 0:
                rounds.add("full collection, nothing frozen", full_ms)
                rounds.add("full collection, startup frozen", frozen_ms)
        gc.unfreeze()
    finally:
        runtime.close()
    print(f"objects frozen after startup: {frozen}; {args.garbage} cycles of garbage a collection")
    print(load_line())
    names = ["full collection, nothing frozen", "full collection, startup frozen"]
    print(rounds.table(names, names[0], unit="ms", ratio_label="/ nothing frozen"))
    print(results(FIGURES, rounds, digits=1))


if __name__ == "__main__":
    main()
