"""An idle server's CPU: what mpcache takes from the cores vLLM computes on while
nothing is stored or loaded, against a bare FastAPI app served by uvicorn.

vLLM's CPU engine keeps every core busy during a forward pass; a server thread that
wakes on a timer preempts one of its OpenMP threads, and the others wait for it at
the next barrier. So what an idle server burns is paid by every step beside it.

Each round runs both processes at once, a real ``mpcache server`` on its embedded
defaults (as deployed) and ``uvicorn`` serving ``bare_app`` (one route: what the
framework costs idle), and reads the CPU each spent over the same ``--window-s``
seconds (``/proc/PID/task/*/schedstat``: nanoseconds on a core, every thread), after
``--settle-s`` seconds of quiet following their start. Prints each one's CPU ms per
second idle and their ratio, per round, and the median and min-max over
``--rounds`` rounds.

    .venv/bin/python bench/idle_cpu_bench.py [--rounds 5] [--window-s 5]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, ROOT, Rounds, load_line, process_cpu_ns, results
from tests.support import free_port, server_process, wait_healthy

FIGURES = (
    "mpcache server idle CPU ms per s / bare uvicorn idle CPU ms per s",
    "mpcache server idle CPU ms per s",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""

bare_app = FastAPI()


@bare_app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@contextlib.contextmanager
def bare_uvicorn() -> Iterator[subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "bench.idle_cpu_bench:bare_app"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 30.0)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=5.0, help="seconds measured a round")
    parser.add_argument("--settle-s", type=float, default=2.0, help="quiet seconds before")
    args = parser.parse_args()
    print(load_line())
    rounds = Rounds()
    mpcache, bare = FIGURES[1], "bare uvicorn idle CPU ms per s"
    for index in range(max(MIN_ROUNDS, args.rounds)):
        with server_process() as (_, server), bare_uvicorn() as baseline:
            time.sleep(args.settle_s)
            pids = {mpcache: server.pid, bare: baseline.pid}
            before = {name: process_cpu_ns(pid) for name, pid in pids.items()}
            begin = time.monotonic()
            time.sleep(args.window_s)
            after = {name: process_cpu_ns(pid) for name, pid in pids.items()}
            seconds = time.monotonic() - begin
        for name in pids:
            rounds.add(name, (after[name] - before[name]) / 1e6 / seconds)
        print(
            f"round {index + 1}: mpcache {rounds.values[mpcache][-1]:.2f}, "
            f"bare uvicorn {rounds.values[bare][-1]:.2f} CPU ms per s",
            flush=True,
        )
    print(load_line())
    print(rounds.table([mpcache, bare], bare, unit="CPU ms per s", ratio_label="/ bare uvicorn"))
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
