"""Two nodes sharing an L2 tier: L2 retrieve GB/s next to L1, in one run.

One ``redis-server`` (a temporary one on a free 127.0.0.1 port, ``--save ''``,
``maxmemory-policy allkeys-lru``) and two ``mpcache server`` processes, A and B, using
it as coordinator and L2 tier, each with its own KV cache registered (the layout of
``bench/dataplane_bench.py``, fewer layers: ``--layers`` x ``[2, NB, 16, 8, 128]``
bf16, chunk 256). Each round, interleaved so machine noise hits every figure alike:

1. store a fresh ``--tokens`` prompt through A, wait until A has written it behind;
2. look it up through B (every chunk an L2 hit: the round's L2 hit ratio), then
   retrieve it through B into B's KV cache: every chunk fetched from L2, checked
   and promoted into B's L1 (the "L2 -> B" figure);
3. retrieve it through B again, now from B's L1 (the "L1 -> B" figure);
4. baseline: a numpy copy of the same bytes between two shm segments.

Prints GB/s median (min-max) over at least 5 rounds, each ratio within its round,
and the machine load. /dev/shm: two KV caches, two pools and the baseline's target,
about 5 x ``--tokens`` x 32 KiB (160 MiB at the default 1024 tokens, 8 layers);
Redis holds at most ``--redis-maxmemory``. Everything is removed on exit, also on
failure.

    .venv/bin/python bench/l2_bench.py               # ~1 min
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results, summary
from bench.dataplane_bench import BLOCK, CHUNK, HEAD_DIM, KV_HEADS, TOKENS, KVCache, b64, transfer
from contract.shm_naming import segment_name
from dataplane.segments import Segment
from tests.dataplane.support import register_over
from tests.support import RedisServer, server_process, wait_until

NAMESPACE = "bench/l2"
FIGURES = ("L2 hit ratio", "retrieve L2 -> B", "retrieve L1 -> B", "numpy copy shm -> shm")
"""What docs/benchmarks.md quotes, the retrieves in GB/s (bench/common.py ``results``)."""


def _metric(http: httpx.Client, name: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            total += float(match.group(2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a round (x 32 KiB)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis-maxmemory", default="160mb")
    args = parser.parse_args()
    if args.tokens % CHUNK:
        parser.error(f"--tokens must be a multiple of {CHUNK}")
    rounds_n = max(MIN_ROUNDS, args.rounds)
    per_token = args.layers * 2 * KV_HEADS * HEAD_DIM * 2
    nbytes = args.tokens * per_token
    num_blocks = args.tokens // BLOCK + 1
    chunks = args.tokens // CHUNK
    print(load_line())
    print(
        f"layout: {args.layers} layers x [2, {num_blocks}, {BLOCK}, {KV_HEADS}, {HEAD_DIM}] "
        f"bf16, chunk {CHUNK} tokens = {CHUNK * per_token >> 20} MiB; {args.tokens} tokens "
        f"a round = {nbytes >> 20} MiB; {rounds_n} rounds; redis-server maxmemory "
        f"{args.redis_maxmemory}, allkeys-lru"
    )
    rounds = Rounds()
    hit_ratios: list[float] = []
    blocks = list(range(1, num_blocks))
    with ExitStack() as stack, tempfile.TemporaryDirectory() as workdir:
        redis = RedisServer(Path(workdir), maxmemory=args.redis_maxmemory)
        stack.callback(redis.stop)
        redis.start()
        kv_a = KVCache(num_blocks, layers=args.layers)
        stack.callback(kv_a.close)
        kv_b = KVCache(num_blocks, layers=args.layers)
        stack.callback(kv_b.close)
        # A's KV cache holds random bytes, B's zeros: the warm-up checks what arrives.
        kv_a.array[:] = np.random.default_rng(1).integers(0, 256, kv_a.array.size, np.uint8)
        kv_b.array[:] = 0
        dst_segment = Segment.create(segment_name("w"), nbytes)
        stack.callback(dst_segment.close)
        flags = ["--chunk-size", str(CHUNK), "--pool-size", str(nbytes + (16 << 20))]
        flags += ["--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "bench"]
        urls = [stack.enter_context(server_process(*flags))[0] for _ in "ab"]
        a, b = (stack.enter_context(httpx.Client(base_url=u, timeout=120.0)) for u in urls)
        for http, kv, name in ((a, kv_a, "a"), (b, kv_b, "b")):
            http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
            TOKENS[name], sock = register_over(http, kv.register_body(name, NAMESPACE))
            stack.callback(sock.close)  # the registration lives while its socket is open
        dst = np.frombuffer(dst_segment.buffer, dtype=np.uint8)
        src = kv_a.array[:nbytes]
        np.copyto(dst, src)
        written = "mpcache_l2_writes_total"
        for r in range(-1, rounds_n):  # round -1 warms up (and checks the bytes)
            tokens = np.random.default_rng(r + 100).integers(0, 128000, args.tokens, np.int32)
            before = _metric(a, f'{written}{{outcome="written"}}')
            got = transfer(
                a, "/cache/store", f"s{r}", tokens, blocks, 0, args.tokens, "a", NAMESPACE
            )
            assert got["stored_chunks"] == chunks, got
            wait_until(
                lambda before=before: (
                    _metric(a, f'{written}{{outcome="written"}}') >= before + chunks
                ),
                what="A's write-behind",
                poll_s=0.005,
            )
            item = {"request_id": f"l{r}", "namespace": NAMESPACE, "tokens_b64": b64(tokens)}
            reply = b.post("/cache/lookup", json={"requests": [item]}).json()
            hit_ratio = reply["results"][0]["hit_tokens"] / args.tokens
            for source in ("L2 -> B", "L1 -> B"):
                begin = time.perf_counter()
                got = transfer(
                    b, "/cache/retrieve", f"l{r}", tokens, blocks, 0, args.tokens, "b", NAMESPACE
                )
                elapsed = time.perf_counter() - begin
                assert got["loaded_tokens"] == args.tokens, (source, got)
                if r >= 0:
                    rounds.add(f"retrieve {source}", nbytes / elapsed / 1e9)
            b.post("/cache/end", json={"request_ids": [f"l{r}"]})
            if r < 0:
                for layer in (0, args.layers - 1):
                    assert np.array_equal(kv_a.block(layer, 1, 1), kv_b.block(layer, 1, 1))
                continue
            hit_ratios.append(hit_ratio)
            rounds.add("L2 hit ratio", hit_ratio)
            begin = time.perf_counter()
            np.copyto(dst, src)
            rounds.add("numpy copy shm -> shm", nbytes / (time.perf_counter() - begin) / 1e9)
        l2_hits = _metric(b, "mpcache_chunks_l2_hit_total")
        reads = _metric(b, 'mpcache_l2_reads_total{outcome="hit"}')
        drops = sum(
            _metric(a, f'{written}{{outcome="{o}"}}') for o in ("queue_full", "unavailable")
        )
        del dst, src

    print(load_line())
    print(
        f"B's lookups: L2 hit ratio {summary(hit_ratios)} (chunks found in L2 / chunks stored "
        f"through A); B counted {l2_hits:.0f} L2 hit chunks, promoted {reads:.0f}; A dropped "
        f"{drops:.0f} write-behind chunks"
    )
    print()
    print(
        rounds.table(
            ["retrieve L2 -> B", "retrieve L1 -> B", "numpy copy shm -> shm"],
            "retrieve L1 -> B",
            unit="GB/s",
            ratio_label="/ retrieve L1 -> B",
            digits=2,
        )
    )
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
