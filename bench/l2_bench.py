"""Two nodes sharing an L2 tier: L2 retrieve GB/s against raw GETs of the same values.

One ``redis-server`` (a temporary one on a free 127.0.0.1 port, ``--save ''``,
``maxmemory-policy allkeys-lru``) and two ``mpcache server`` processes, A and B, using
it as coordinator and L2 tier, each with its own KV cache registered (the layout of
``bench/dataplane_bench.py``, fewer layers: ``--layers`` x ``[2, NB, 16, 8, 128]``
bf16, chunk 256). Each round, interleaved so machine noise hits every figure alike:

1. store a fresh ``--tokens`` prompt through A, wait until A has written it behind;
2. look it up through B (every chunk an L2 hit: the round's L2 hit ratio), then
   retrieve it through B into B's KV cache: every chunk fetched from L2, checked
   and promoted into B's L1 (the "L2 -> B" figure);
3. baseline: the same values (the round's new L2 keys) read by a bare raw-socket
   ``GET`` loop over the same loopback into one reused buffer, no check, no copy
   (the "raw GET" figure; before step 2 in odd rounds, after it in even ones);
4. retrieve it through B again, now from B's L1 (the "L1 -> B" figure).

Prints GB/s median (min-max) over at least 5 rounds, each ratio to the raw GET
within its round, and the machine load. /dev/shm: two KV caches and two pools,
about 4 x ``--tokens`` x 32 KiB (160 MiB at the default 1024 tokens, 8 layers);
Redis holds at most ``--redis-maxmemory``. Everything is removed on exit, also on
failure.

    .venv/bin/python bench/l2_bench.py               # ~1 min
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import redis as redis_py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results, summary
from bench.dataplane_bench import BLOCK, CHUNK, HEAD_DIM, KV_HEADS, TOKENS, KVCache, b64, transfer
from tests.dataplane.support import register_over
from tests.support import RedisServer, server_process, wait_until

NAMESPACE = "bench/l2"
RAW = "raw GET (same values)"
FIGURES = (
    "L2 hit ratio",
    "retrieve L2 -> B",
    "raw GET (same values)",
    "retrieve L2 -> B / raw GET (same values)",
    "retrieve L1 -> B",
)
"""What docs/benchmarks.md quotes, the retrieves in GB/s (bench/common.py ``results``)."""


def _metric(http: httpx.Client, name: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            total += float(match.group(2))
    return total


def _raw_gets(port: int, keys: list[bytes], buf: bytearray) -> int:
    """GET ``keys`` one by one over a fresh raw socket, each value into ``buf``: the
    bytes read. The least a client can do: no parser, no check, no copy."""
    view = memoryview(buf)
    total = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for key in keys:
            sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
            line = b""
            while not line.endswith(b"\r\n"):
                line += sock.recv(1)  # "$<n>\r\n": a few bytes
            n = int(line[1:-2]) + 2  # and the value's CRLF
            assert line.startswith(b"$") and 2 < n <= len(buf), line
            got = 0
            while got < n:
                got += sock.recv_into(view[got:n])
            total += n - 2
    return total


def _l2_keys(client: redis_py.Redis) -> set[bytes]:
    return set(client.scan_iter(match="mpcache:l2:*", count=1000))


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
        client = redis_py.Redis.from_url(redis.url)
        stack.callback(client.close)
        raw_buf = bytearray(CHUNK * per_token + (1 << 20))  # one value and its header
        flags = ["--chunk-size", str(CHUNK), "--pool-size", str(nbytes + (16 << 20))]
        flags += ["--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "bench"]
        urls = [stack.enter_context(server_process(*flags))[0] for _ in "ab"]
        a, b = (stack.enter_context(httpx.Client(base_url=u, timeout=120.0)) for u in urls)
        for http, kv, name in ((a, kv_a, "a"), (b, kv_b, "b")):
            http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
            TOKENS[name], sock = register_over(http, kv.register_body(name, NAMESPACE))
            stack.callback(sock.close)  # the registration lives while its socket is open
        written = "mpcache_l2_writes_total"
        for r in range(-1, rounds_n):  # round -1 warms up (and checks the bytes)
            tokens = np.random.default_rng(r + 100).integers(0, 128000, args.tokens, np.int32)
            before = _metric(a, f'{written}{{outcome="written"}}')
            old_keys = _l2_keys(client)
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
            keys = sorted(_l2_keys(client) - old_keys)
            assert len(keys) == chunks, (len(keys), chunks)
            item = {"request_id": f"l{r}", "namespace": NAMESPACE, "tokens_b64": b64(tokens)}
            reply = b.post("/cache/lookup", json={"requests": [item]}).json()
            hit_ratio = reply["results"][0]["hit_tokens"] / args.tokens
            # The raw GETs go first in odd rounds, after the L2 retrieve in even ones.
            order = ["raw", "L2 -> B"] if r % 2 else ["L2 -> B", "raw"]
            for source in [*order, "L1 -> B"]:
                begin = time.perf_counter()
                if source == "raw":
                    moved = _raw_gets(redis.port, keys, raw_buf)
                    figure = RAW
                else:
                    args_b = (f"l{r}", tokens, blocks, 0, args.tokens, "b", NAMESPACE)
                    got = transfer(b, "/cache/retrieve", *args_b)
                    assert got["loaded_tokens"] == args.tokens, (source, got)
                    moved, figure = nbytes, f"retrieve {source}"
                if r >= 0:
                    rounds.add(figure, moved / (time.perf_counter() - begin) / 1e9)
            b.post("/cache/end", json={"request_ids": [f"l{r}"]})
            # Redis's LRU is sampled: well below maxmemory, no round's value is evicted.
            client.delete(*keys)
            if r < 0:
                for layer in (0, args.layers - 1):
                    assert np.array_equal(kv_a.block(layer, 1, 1), kv_b.block(layer, 1, 1))
                continue
            hit_ratios.append(hit_ratio)
            rounds.add("L2 hit ratio", hit_ratio)
        l2_hits = _metric(b, "mpcache_chunks_l2_hit_total")
        reads = _metric(b, 'mpcache_l2_reads_total{outcome="hit"}')
        drops = sum(
            _metric(a, f'{written}{{outcome="{o}"}}') for o in ("queue_full", "unavailable")
        )

    print(load_line())
    print(
        f"B's lookups: L2 hit ratio {summary(hit_ratios)} (chunks found in L2 / chunks stored "
        f"through A); B counted {l2_hits:.0f} L2 hit chunks, promoted {reads:.0f}; A dropped "
        f"{drops:.0f} write-behind chunks"
    )
    print()
    print(
        rounds.table(
            ["retrieve L2 -> B", RAW, "retrieve L1 -> B"],
            RAW,
            unit="GB/s",
            ratio_label=f"/ {RAW}",
            target="target: L2 -> B >= 0.8x",
            digits=2,
        )
    )
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
