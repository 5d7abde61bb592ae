"""Packing a burst's prompts into int32: the connector's C kernel against struct.

The prompts are what the burst bench sends: ``--requests`` prompts of ``--tokens``
Python ints, each behind a read-only view as vLLM's ``Request.all_token_ids`` is (a
``ConstantList``: a slice is a new list). Each round packs all of them with
``struct.pack(*tokens[:end])`` (``contract.tokens.pack_range``, the fallback), with
the kernel reading the ids through the iterator protocol (what it does on other
CPython versions), and with the kernel as loaded here (``connector.tokenpack``:
direct on CPython 3.10/3.11), in turn, and checks the bytes agree; it prints the
median and min-max spread of ``--rounds`` rounds in ms per burst and each time as a
ratio to struct's within its round, with the machine load.

    .venv/bin/python bench/token_pack_bench.py [--rounds 9] [--requests 64] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, TokenView, load_line, results
from connector import tokenpack
from contract.tokens import pack_range

Pack = Callable[[Sequence[int], int, int], bytes]

FIGURES = ("kernel, as loaded / struct", "kernel, iterator / struct")
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""


def _burst_ms(pack: Pack, prompts: list[TokenView]) -> tuple[float, list[bytes]]:
    begin = time.perf_counter()
    out = [pack(p, 0, len(p) - 1) for p in prompts]  # the last token is never looked up
    return (time.perf_counter() - begin) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    print(load_line())
    packer = tokenpack.load()
    if packer.kernel is None:
        raise SystemExit(f"the token kernel is unavailable here: {packer.reason}")
    # Fresh int objects per prompt, as a tokenizer's output is (not cached small ints).
    prompts = [
        TokenView([(seed * 7919 + i * 131) % 150000 for i in range(args.tokens)])
        for seed in range(args.requests)
    ]
    iterated = dataclasses.replace(packer, direct=False)
    print(f"{args.requests} prompts of {args.tokens} tokens a burst; packing: {packer.mode}")
    rounds = Rounds()
    for r in range(-1, max(MIN_ROUNDS, args.rounds)):  # round -1 warms up
        base_ms, expected = _burst_ms(pack_range, prompts)
        iterated_ms, by_iterator = _burst_ms(iterated, prompts)
        kernel_ms, packed = _burst_ms(packer, prompts)
        assert packed == expected == by_iterator, "the kernel packed other bytes than struct"
        if r >= 0:
            rounds.add("struct", base_ms)
            rounds.add("kernel, iterator", iterated_ms)
            rounds.add("kernel, as loaded", kernel_ms)
    print(load_line())
    names = ["struct", "kernel, iterator", "kernel, as loaded"]
    print(rounds.table(names, "struct", unit="ms", ratio_label="/ struct"))
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
