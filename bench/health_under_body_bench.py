"""/health latency while a large JSON body is posted (issue 8: overload).

Against a running server (``--url``; negotiate first is done here): for each body
size, posts a JSON lookup whose tokens are a list of that many bytes (the costliest
JSON to decode per byte) on one connection, and meanwhile pings ``GET /health``
back to back on another, until the big reply arrives. Prints the idle /health
median, and per size the big reply's status, its time, and the slowest /health
during it. One run each: a stall is seconds, far above the VM's noise.

    .venv/bin/python bench/health_under_body_bench.py --url http://127.0.0.1:8733 \\
        [--sizes-mb 20 80]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import result_line

FIGURES = (
    "slowest GET /health during a 20 MB body",
    "slowest GET /health during a 80 MB body",
)
"""What docs/benchmarks.md quotes, in ms, for the default ``--sizes-mb``."""


def _big(url: str, size_bytes: int, result: dict[str, float]) -> None:
    host, port = url.removeprefix("http://").split(":")
    head = b'{"requests": [{"request_id": "big", "namespace": "ns", "tokens": ['
    body = head + b"7," * ((size_bytes - len(head)) // 2) + b"7]}]}"
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(
            f"POST /cache/lookup HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        )
        with contextlib.suppress(OSError):  # refused before it was all sent (413)
            sock.sendall(body)
        status = sock.recv(64).split(b" ", 2)[1]
    result["status"] = float(status)
    result["seconds"] = time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 80])
    args = parser.parse_args()
    with httpx.Client(timeout=600) as client:
        client.post(f"{args.url}/negotiate", json={"required_alignment": 64})
        idle = []
        for _ in range(50):
            t = time.perf_counter()
            client.get(f"{args.url}/health")
            idle.append(time.perf_counter() - t)
        print(f"/health idle: median {statistics.median(idle) * 1e3:.1f} ms")
        for mb in args.sizes_mb:
            result: dict[str, float] = {}
            big = threading.Thread(target=_big, args=(args.url, mb * 1_000_000, result))
            big.start()
            worst = 0.0
            pings = 0
            while big.is_alive():
                t = time.perf_counter()
                client.get(f"{args.url}/health")
                worst = max(worst, time.perf_counter() - t)
                pings += 1
            big.join()
            client.post(f"{args.url}/cache/end", json={"request_ids": ["big"]})
            print(
                f"{mb} MB body: reply {result.get('status', 0):.0f} after "
                f"{result.get('seconds', 0):.2f} s; /health during it: {pings} pings, "
                f"slowest {worst * 1e3:.0f} ms"
            )
            print(result_line(f"slowest GET /health during a {mb} MB body", [worst * 1e3], 0))


if __name__ == "__main__":
    main()
