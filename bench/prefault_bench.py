"""The first copy into a worker's memory through the server's mapping: fresh or populated.

The server maps each registered worker memfd (``dataplane.fdgate.map_sealed``) and,
since issue 22, populates the mapping's page tables in the background
(``dataplane.prefault``). This bench measures what that saves the first retrieve
into a worker's blocks: each round makes two sealed memfds of ``--mib`` MiB (pages
allocated, as a worker's are), maps both as the server does, populates one, and
times one scattered copy of ``--blocks`` blocks of ``--block-kib`` KiB into random
blocks of each (a retrieve's shape; the defaults move 14.7 MB, a 2000-token prompt
of the TTFT bench's model), in an order that alternates round by round. It prints
the time and the minor page faults of each copy, their ratio within each round,
and the time the background thread spent populating.

    .venv/bin/python bench/prefault_bench.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from contract.fdpass import F_ADD_SEALS, F_SEAL_SHRINK
from dataplane.fdgate import SealedMemory, map_sealed
from dataplane.prefault import populate

FIGURES = (
    "first copy, fresh mapping / first copy, populated mapping",
    "first copy, fresh mapping",
    "first copy, populated mapping",
    "minor faults, fresh mapping",
    "minor faults, populated mapping",
    "populate",
)
"""What docs/benchmarks.md quotes: the ratio, ms, faults per copy, ms to populate."""


def _mapped(nbytes: int) -> SealedMemory:
    """A sealed memfd of ``nbytes`` (pages allocated), mapped as the server maps one."""
    fd = os.memfd_create("mpcache-prefault-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)
        return map_sealed(fd)
    finally:
        os.close(fd)


def _copy(memory: SealedMemory, src: np.ndarray, slots: np.ndarray) -> tuple[float, int]:
    """(ms, minor faults) of one scattered copy of ``src``'s blocks into ``slots``."""
    dst = torch.frombuffer(memory.buffer, dtype=torch.uint8).numpy().reshape(-1, src.shape[1])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    begin = time.perf_counter()
    dst[slots] = src
    ms = (time.perf_counter() - begin) * 1e3
    return ms, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", type=int, default=16, help="each memfd's size")
    parser.add_argument("--blocks", type=int, default=896)
    parser.add_argument("--block-kib", type=int, default=16)
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        print(f"note: {args.rounds} rounds; figures want at least {MIN_ROUNDS}", file=sys.stderr)
    block = args.block_kib << 10
    nbytes = args.mib << 20
    if args.blocks * block > nbytes:
        raise SystemExit("--blocks x --block-kib must fit in --mib")
    print(load_line())
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, (args.blocks, block), dtype=np.uint8)
    table = Rounds()
    for index in range(args.rounds):
        slots = rng.permutation(nbytes // block)[: args.blocks]
        fresh, populated = _mapped(nbytes), _mapped(nbytes)
        try:
            begin = time.perf_counter()
            if not populate(ctypes.addressof(populated.buffer), nbytes):
                raise SystemExit("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
            table.add("populate", (time.perf_counter() - begin) * 1e3)
            order = [("fresh", fresh), ("populated", populated)]
            for kind, memory in order if index % 2 == 0 else order[::-1]:
                ms, faults = _copy(memory, src, slots)
                table.add(f"first copy, {kind} mapping", ms)
                table.add(f"minor faults, {kind} mapping", faults)
        finally:
            fresh.close()
            populated.close()
    copied = args.blocks * block / 1e6
    print(f"{args.blocks} blocks of {args.block_kib} KiB ({copied:.1f} MB) into {args.mib} MiB")
    print(
        table.table(
            ["first copy, populated mapping", "first copy, fresh mapping"],
            "first copy, populated mapping",
            unit="ms",
            ratio_label="/ populated",
        )
    )
    print(results(FIGURES, table))


if __name__ == "__main__":
    main()
