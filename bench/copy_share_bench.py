"""One chunk's copy by one thread against several, by chunk size: where helpers pay.

The server splits a chunk's copy across its copy threads (``dataplane.transfer.
CopyPool``), but waking a helper and waiting for it costs time of its own, so a
chunk smaller than twice ``--copy-share`` (the setting, 2 MiB by default) is copied
by the calling thread alone. This bench measures where that pays: chunks of vLLM's
KV layout (8 layers, K and V, bfloat16, block 32, head 64, chunk 256, with 4 to 64
KV heads: 2 to 32 MiB a chunk), stored (``gather_chunk``) and retrieved
(``scatter_chunk``) in blocks that run in order, as vLLM hands out fresh ones, by
three copy pools taking turns, each copying the chunks one after another as a call
does (six turns a round, one in each order of the pools: the chunks' bytes are in the
cache for the pools after the first, and a split pool's helpers are still winding
down for the pool after it):

- ``1 thread``: the baseline;
- ``N threads``: every chunk split across ``--threads`` threads (``--copy-share 0``);
- ``default``: ``--threads`` threads with the server's default ``--copy-share``.

A turn copies ``--chunks`` distinct chunks each way per pool and size; the figure
is a pool's median over a round's turns of its time per chunk, and its ratio to one
thread within the round,
printed as the median and min-max spread over ``--rounds`` rounds (at least 5),
with the machine load.

    .venv/bin/python bench/copy_share_bench.py [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings
from bench.common import MIN_ROUNDS, Rounds, load_line, results
from dataplane.plans import TensorPlan
from dataplane.transfer import CopyPool, gather_chunk, scatter_chunk
from tests.dataplane.support import attention_plans

LAYERS, BLOCK, HEAD, CHUNK = 8, 32, 64, 256
HEADS = (4, 8, 16, 32, 64)
"""KV heads per size: 2, 4, 8, 16 and 32 MiB a chunk."""
PER_CHUNK = CHUNK // BLOCK
FIGURES = (
    "2 MiB retrieve, default / 2 MiB retrieve, 1 thread",
    "2 MiB retrieve, 2 threads / 2 MiB retrieve, 1 thread",
    "4 MiB retrieve, 2 threads / 4 MiB retrieve, 1 thread",
    "8 MiB retrieve, 2 threads / 8 MiB retrieve, 1 thread",
    "32 MiB retrieve, default / 32 MiB retrieve, 1 thread",
    "32 MiB retrieve, 2 threads / 32 MiB retrieve, 1 thread",
    "2 MiB store, default / 2 MiB store, 1 thread",
    "2 MiB store, 2 threads / 2 MiB store, 1 thread",
    "4 MiB store, 2 threads / 4 MiB store, 1 thread",
    "8 MiB store, 2 threads / 8 MiB store, 1 thread",
    "32 MiB store, default / 32 MiB store, 1 thread",
    "32 MiB store, 2 threads / 32 MiB store, 1 thread",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``), for ``--threads 2``."""


def _ms_per_chunk(
    copy: Callable[..., int],
    plans: Sequence[TensorPlan],
    entries: Sequence[torch.Tensor],
    pool: CopyPool,
) -> float:
    """One call's worth: every chunk copied one after another with ``pool``."""
    begin = time.perf_counter()
    for c, entry in enumerate(entries):
        copy(plans, _ids(c), entry, pool)
    return (time.perf_counter() - begin) * 1e3 / len(entries)


def _ids(c: int) -> list[np.ndarray]:
    """Chunk ``c``'s block ids: a run, as vLLM hands out fresh blocks."""
    return [np.arange(1 + c * PER_CHUNK, 1 + (c + 1) * PER_CHUNK)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="copy threads of the split pools")
    parser.add_argument("--chunks", type=int, default=8, help="chunks each way a round")
    args = parser.parse_args()
    share = int(Settings().copy_share)
    many = f"{args.threads} threads"
    pools = {
        "1 thread": CopyPool(1),
        many: CopyPool(args.threads),
        "default": CopyPool(args.threads, share_bytes=share),
    }
    print(load_line())
    print(f"default --copy-share: {share} bytes; split pools: {args.threads} threads")
    rounds = Rounds()
    blocks = args.chunks * PER_CHUNK + 1
    try:
        for heads in HEADS:
            # Written through (random bytes): a block never written reads as the
            # kernel's one zero page, which no real KV cache is.
            tensors = [torch.randn(2, blocks, BLOCK, heads, HEAD).bfloat16() for _ in range(LAYERS)]
            plans, chunk_bytes = attention_plans(tensors, CHUNK, BLOCK)
            entries = [torch.ones(chunk_bytes, dtype=torch.uint8) for _ in range(args.chunks)]
            size = f"{chunk_bytes >> 20} MiB"

            for r in range(max(MIN_ROUNDS, args.rounds) + 1):  # round 0 warms up
                times: dict[str, list[float]] = {}
                # Every order once a round: each pool goes first, and follows each
                # other pool (a split pool's helpers still hold a core), equally often.
                for order in itertools.permutations(pools.items()):
                    for name, pool in order:
                        for way, copy in (("store", gather_chunk), ("retrieve", scatter_chunk)):
                            ms = _ms_per_chunk(copy, plans, entries, pool)
                            times.setdefault(f"{size} {way}, {name}", []).append(ms)
                if r == 0:
                    continue
                for name, samples in times.items():
                    rounds.add(name, sorted(samples)[len(samples) // 2])
            for way in ("retrieve", "store"):
                names = [f"{size} {way}, {name}" for name in pools]
                print(rounds.table(names, names[0], unit="ms per chunk", ratio_label="/ 1 thread"))
    finally:
        for pool in pools.values():
            pool.close()
    print(load_line())
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
