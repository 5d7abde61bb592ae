"""The connector's CPU per control call: ``ControlClient`` against a plain
``httpx.Client.request`` call, both against one real server.

Starts a real server process on 127.0.0.1 (chunk size negotiated). Each round makes
``--calls`` binary lookups (a frame of one 4k-token item, sent in pieces as the
scheduler sends it) each way, interleaved call by call:

- baseline: ``httpx.Client.request`` with the base URL, headers and timeout merged
  on the call, then the reply validated into ``LookupResponse`` (what
  ``ControlClient`` did before it built its requests from parts made once);
- ``ControlClient.lookup``.

The figure is the calling thread's CPU time per call (``time.thread_time``: what
the call costs the thread that makes it, apart from the wait for the server); the
ratio is taken within each round. Prints the median and min-max spread over
``--rounds`` rounds (at least 5), and the machine load.

    .venv/bin/python bench/client_call_bench.py [--rounds 7] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from connector.client import ControlClient
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, SEND_PIECE_BYTES, lookup_frame_parts
from contract.schemas import LookupFrameHeader, LookupFrameItem, LookupResponse
from contract.tokens import pack_tokens
from tests.support import server_process

TOKENS = 4096
CLIENT = "ControlClient.lookup"
BASELINE = "httpx.Client.request + validation"
FIGURES = ("ControlClient.lookup / httpx.Client.request + validation",)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""


def _cpu_us(call: Callable[[], object]) -> float:
    start = time.thread_time()
    call()
    return (time.thread_time() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300, help="calls each way per round")
    args = parser.parse_args()
    header = LookupFrameHeader(
        requests=[LookupFrameItem(request_id="r", namespace="bench@client", num_tokens=TOKENS)]
    )
    packed = pack_tokens(list(range(TOKENS)))

    def frame() -> Iterator[bytes]:
        return lookup_frame_parts(header, [packed], piece_bytes=SEND_PIECE_BYTES)

    print(load_line())
    rounds = Rounds()
    with (
        server_process("--pool-size", "16MiB") as (url, _),
        httpx.Client(base_url=url, timeout=5, headers={"accept": "application/json"}) as http,
    ):
        http.post("/negotiate", json={"required_alignment": 16}).raise_for_status()
        client = ControlClient(url, timeout_s=5)

        def baseline() -> None:
            reply = http.request(
                "POST",
                "/cache/lookup",
                content=frame(),
                headers={"content-type": LOOKUP_FRAME_MEDIA_TYPE},
                timeout=5,
            )
            reply.raise_for_status()
            LookupResponse.model_validate_json(reply.content)

        def measured() -> None:
            client.lookup(frame())

        try:
            for _ in range(50):  # warm up both
                baseline()
                measured()
            for _ in range(max(MIN_ROUNDS, args.rounds)):
                times: dict[str, list[float]] = {BASELINE: [], CLIENT: []}
                for _ in range(args.calls):
                    times[BASELINE].append(_cpu_us(baseline))
                    times[CLIENT].append(_cpu_us(measured))
                for name, samples in times.items():
                    rounds.add(name, statistics.median(samples))
        finally:
            client.close()
    print(load_line())
    print(rounds.table([BASELINE, CLIENT], BASELINE, unit="us CPU", ratio_label="/ baseline"))
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
