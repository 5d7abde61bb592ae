"""Chunk-key hash candidates on the same bytes: the prefix chain of app/hashing.py.

Each candidate computes the chain ``key_i = H(key_{i-1}, 1 KiB of chunk i tokens)``
(256 int32 tokens per chunk, 16-byte keys) over the same random ``--tokens``-token
prompt, exactly the call pattern of a lookup. Candidates run interleaved, round by
round, so machine noise hits them alike; it prints the median and the min-max spread
of ``--rounds`` rounds in microseconds per prompt and in GB/s of token bytes, with
the machine load. Packages that are not installed (``xxhash``, ``blake3``) are
reported as missing, not measured. "xxh3-128, C loop" is the chain the server runs
(``contract/keychain.py``: the same XXH3 calls without the interpreter's work per chunk),
checked to give the Python loop's keys first.

    .venv/bin/python bench/hash_bench.py [--tokens 32768] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results, spread
from contract import keychain

CHUNK_TOKENS = 256
KEY = 16
FIGURES = ("xxh3-128, C loop", "xxh3-128", "sha-256/128", "blake3-128", "blake2b-128")
"""What docs/benchmarks.md quotes, in us per prompt (bench/common.py ``results``)."""

Chain = Callable[[bytes, bytes], bytes]


def _blake2b(seed: bytes, raw: bytes) -> bytes:
    prev = seed
    step = CHUNK_TOKENS * 4
    for i in range(0, len(raw), step):
        h = hashlib.blake2b(prev, digest_size=KEY)
        h.update(raw[i : i + step])
        prev = h.digest()
    return prev


def _sha256(seed: bytes, raw: bytes) -> bytes:
    prev = seed
    step = CHUNK_TOKENS * 4
    view = memoryview(raw)
    for i in range(0, len(raw), step):
        h = hashlib.sha256(prev)
        h.update(view[i : i + step])
        prev = h.digest()[:KEY]
    return prev


def _candidates() -> tuple[dict[str, Chain], list[str]]:
    found: dict[str, Chain] = {"blake2b-128": _blake2b, "sha-256/128": _sha256}
    missing = []
    try:
        import blake3
    except ImportError:
        missing.append("blake3 (pip install blake3)")
    else:

        def _blake3(seed: bytes, raw: bytes) -> bytes:
            prev = seed
            step = CHUNK_TOKENS * 4
            view = memoryview(raw)
            for i in range(0, len(raw), step):
                h = blake3.blake3(prev)
                h.update(view[i : i + step])
                prev = h.digest(KEY)
            return prev

        found["blake3-128"] = _blake3
    try:
        import xxhash
    except ImportError:
        missing.append("xxh3-128 (pip install xxhash)")
    else:
        digest = xxhash.xxh3_128_digest

        def _xxh3(seed: bytes, raw: bytes) -> bytes:
            prev = seed
            step = CHUNK_TOKENS * 4
            for i in range(0, len(raw), step):
                prev = digest(prev + raw[i : i + step])
            return prev

        found["xxh3-128"] = _xxh3
        try:
            chain = keychain.load()
        except keychain.KernelUnavailable as exc:
            missing.append(f"xxh3-128 in the server's C loop ({exc})")
        else:

            def _xxh3_c_loop(seed: bytes, raw: bytes) -> bytes:
                tokens = np.frombuffer(raw, "<i4")
                step = CHUNK_TOKENS * 4
                return chain.keys(seed, tokens, step, 0, len(raw) // step, 0)[-1]

            found["xxh3-128, C loop"] = _xxh3_c_loop
    return found, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=20, help="prompts hashed per round")
    args = parser.parse_args()
    rounds = max(MIN_ROUNDS, args.rounds)
    raw = np.random.default_rng(1).integers(0, 128000, args.tokens, dtype="<i4").tobytes()
    seed = bytes(range(KEY))
    candidates, missing = _candidates()
    print(load_line())
    print(
        f"chain over {args.tokens} tokens ({len(raw) >> 10} KiB, "
        f"{args.tokens // CHUNK_TOKENS} chunks of {CHUNK_TOKENS}); {rounds} rounds x "
        f"{args.repeat} prompts, interleaved"
    )
    for chain in candidates.values():  # warm up
        chain(seed, raw)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, chain in candidates.items():
            begin = time.perf_counter()
            for _ in range(args.repeat):
                chain(seed, raw)
            times[name].append((time.perf_counter() - begin) / args.repeat)
    if "xxh3-128, C loop" in candidates:  # the server's loop: the Python loop's keys
        assert candidates["xxh3-128, C loop"](seed, raw) == candidates["xxh3-128"](seed, raw)
    print(f"\n{'hash':<18}{'us / prompt':>14}{'spread (min-max)':>20}{'GB/s':>8}")
    for name, samples in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(samples)
        lo, hi = spread(samples)
        print(
            f"{name:<18}{med * 1e6:>14.0f}{f'{lo * 1e6:.0f}-{hi * 1e6:.0f}':>20}"
            f"{len(raw) / med / 1e9:>8.2f}"
        )
    for name in missing:
        print(f"not measured: {name}")
    print(f"(cpu: {os.cpu_count()} cores)")
    per_prompt_us = Rounds()
    for name, samples in times.items():
        for seconds in samples:
            per_prompt_us.add(name, seconds * 1e6)
    print(results(FIGURES, per_prompt_us, digits=0))


if __name__ == "__main__":
    main()
