"""Data-plane throughput and lookup latency, through a real server over HTTP.

Registers a Llama-3-8B-like KV cache (32 layers, 8 KV heads, head 128, bf16,
block 16, vLLM's CPU layout ``[2, num_blocks, 16, 8, 128]``) in POSIX shm, then,
interleaved so machine noise hits every figure alike:

- store: ``/cache/store`` of a fresh ``--tokens`` prompt per round, sent in
  engine-step-sized calls of ``--step-tokens``; every chunk is copied;
- retrieve: ``/cache/retrieve`` of the last stored prompt into other blocks;
- memcpy: a plain numpy copy of the same number of bytes (contiguous), from the
  KV segment into another shm segment (like for like: the pool is shm too) and
  into anonymous memory (which may get transparent huge pages; tmpfs gets them
  only where ``shmem_enabled`` allows);

and prints GB/s and each ratio to memcpy (target >= 0.7), plus the cost of one
store call that copies nothing (every chunk already cached). Then a 32k-token
``/cache/lookup`` (every chunk cached; tokens as ``tokens_b64`` and as a JSON list)
against a bare ``/health`` round trip: p50/p99 and the ratio (target <= 5).

    .venv/bin/python bench/dataplane_bench.py            # ~1 min, ~4.5 GiB of RAM
    .venv/bin/python bench/dataplane_bench.py --tokens 4096 --rounds 3   # smaller

``--block-order`` picks the block ids stored from and retrieved into: ``random``
(default; two independent permutations, the worst case), ``runs`` (ascending
ids, as vLLM hands out fresh blocks), or ``reversed``.

Memory: the KV segment, the pool and each memcpy target hold ``--tokens`` x 128 KiB.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contract.shm_naming import segment_name
from dataplane.segments import Segment
from tests.support import server_process

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16
CHUNK = 256
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 128 KiB
NAMESPACE = "bench/llama-3-8b-like"
TINY_NAMESPACE = "bench/tiny"


def pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100)[q - 1]


def b64(tokens: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).decode()


class KVCache:
    """A worker's KV cache in one shm segment: one ``[2, NB, 16, 8, 128]`` tensor per layer."""

    def __init__(self, num_blocks: int, layers: int = LAYERS, heads: int = KV_HEADS) -> None:
        self.shape = (2, num_blocks, BLOCK, heads, HEAD_DIM)
        self.layer_bytes = 2 * num_blocks * BLOCK * heads * HEAD_DIM * 2
        self.layers = layers
        self.segment = Segment.create(segment_name("w"), self.layer_bytes * layers)
        self.base = torch.frombuffer(self.segment.buffer, dtype=torch.uint8)
        # Touch every page, with a different pattern per layer.
        for i in range(layers):
            self.base[i * self.layer_bytes : (i + 1) * self.layer_bytes].fill_(i + 1)

    def layer(self, i: int) -> torch.Tensor:
        raw = self.base[i * self.layer_bytes : (i + 1) * self.layer_bytes]
        return raw.view(torch.bfloat16).view(self.shape)

    def register_body(self, instance: str, namespace: str) -> dict[str, Any]:
        stride = list(self.layer(0).stride())
        return {
            "instance_id": instance,
            "rank": 0,
            "chunk_size": CHUNK,
            "namespace": namespace,
            "groups": [{"group_id": 0, "kind": "attention", "token_span": BLOCK}],
            "layers": [
                {
                    "name": f"model.layers.{i}.self_attn",
                    "group_id": 0,
                    "tensors": [
                        {
                            "transport": "shm",
                            "segment": self.segment.name,
                            "offset_bytes": i * self.layer_bytes,
                            "shape": list(self.shape),
                            "stride": stride,
                            "dtype": "bfloat16",
                            "block_dim": 1,
                        }
                    ],
                }
                for i in range(self.layers)
            ],
        }

    def close(self) -> None:
        del self.base
        self.segment.close()


def transfer(
    http: httpx.Client,
    path: str,
    rid: str,
    tokens: np.ndarray,
    blocks: list[int],
    start: int,
    end: int,
    instance: str = "bench",
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    body = {
        "instance_id": instance,
        "rank": 0,
        "requests": [
            {
                "request_id": rid,
                "namespace": namespace,
                "tokens_b64": b64(tokens[:end]),
                "start_token": start,
                "end_token": end,
                "block_ids": [blocks[: end // BLOCK]],
            }
        ],
    }
    reply = http.post(path, json=body)
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()["results"][0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per round (8192 = 1 GiB)")
    parser.add_argument("--step-tokens", type=int, default=2048, help="tokens per store call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookup-tokens", type=int, default=32768)
    parser.add_argument("--lookup-rounds", type=int, default=300)
    parser.add_argument("--block-order", choices=("random", "runs", "reversed"), default="random")
    args = parser.parse_args()
    if args.tokens % CHUNK or args.step_tokens % CHUNK:
        parser.error(f"--tokens and --step-tokens must be multiples of {CHUNK}")

    nbytes = args.tokens * BYTES_PER_TOKEN
    num_blocks = args.tokens // BLOCK + 1  # block 0 is vLLM's null block
    tiny_blocks = args.lookup_tokens // BLOCK + 1
    pool_bytes = nbytes + (64 << 20)
    print(
        f"layout: {LAYERS} layers x [2, {num_blocks}, {BLOCK}, {KV_HEADS}, {HEAD_DIM}] bf16, "
        f"chunk {CHUNK} tokens = {CHUNK * BYTES_PER_TOKEN >> 20} MiB; "
        f"{args.tokens} tokens per round = {nbytes / 2**30:.2f} GiB; block order "
        f"{args.block_order}; server copy threads "
        f"{os.environ.get('MPCACHE_COPY_THREADS', '0')} (0: auto)"
    )
    kv = KVCache(num_blocks)
    tiny = KVCache(tiny_blocks, layers=1, heads=1)
    dst_anon = np.empty(nbytes, dtype=np.uint8)
    dst_anon.fill(0)
    dst_segment = Segment.create(segment_name("w"), nbytes)
    dst_shm = np.frombuffer(dst_segment.buffer, dtype=np.uint8)
    dst_shm.fill(0)
    src = np.frombuffer(kv.segment.buffer, dtype=np.uint8, count=nbytes)
    rng = np.random.default_rng(7)
    if args.block_order == "random":
        blocks = (rng.permutation(num_blocks - 1) + 1).tolist()
        other_blocks = (rng.permutation(num_blocks - 1) + 1).tolist()
    elif args.block_order == "runs":
        blocks = other_blocks = list(range(1, num_blocks))
    else:
        blocks, other_blocks = list(range(1, num_blocks)), list(range(num_blocks - 1, 0, -1))
    times: dict[str, list[float]] = {
        "store": [],
        "retrieve": [],
        "memcpy shm": [],
        "memcpy anon": [],
    }
    present: list[float] = []
    try:
        with (
            server_process(
                "--chunk-size", str(CHUNK), "--pool-size", str(pool_bytes), "--log-level", "warning"
            ) as (url, _),
            httpx.Client(base_url=url, timeout=120.0) as http,
        ):
            http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
            http.post("/register", json=kv.register_body("bench", NAMESPACE)).raise_for_status()
            http.post(
                "/register", json=tiny.register_body("tiny", TINY_NAMESPACE)
            ).raise_for_status()

            def store_round(seed: int) -> tuple[np.ndarray, float]:
                tokens = np.random.default_rng(seed).integers(
                    0, 128000, args.tokens, dtype=np.int32
                )
                begin = time.perf_counter()
                for start in range(0, args.tokens, args.step_tokens):
                    end = start + args.step_tokens
                    got = transfer(http, "/cache/store", f"s{seed}", tokens, blocks, start, end)
                    assert got["stored_chunks"] == args.step_tokens // CHUNK, got
                elapsed = time.perf_counter() - begin
                http.post("/cache/end", json={"request_ids": [f"s{seed}"]})
                return tokens, elapsed

            def retrieve_round(tokens: np.ndarray, rid: str) -> float:
                begin = time.perf_counter()
                got = transfer(http, "/cache/retrieve", rid, tokens, other_blocks, 0, args.tokens)
                elapsed = time.perf_counter() - begin
                assert got["loaded_tokens"] == args.tokens, got
                http.post("/cache/end", json={"request_ids": [rid]})
                return elapsed

            # Warm-up (faults the pool's pages in) and a correctness check.
            tokens, _ = store_round(0)
            layer0 = kv.layer(0).clone()
            retrieve_round(tokens, "check")
            for j in (0, len(blocks) // 2, len(blocks) - 1):
                a, b = layer0[:, blocks[j]], kv.layer(0)[:, other_blocks[j]]
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "bytes differ"
            np.copyto(dst_shm, src)
            np.copyto(dst_anon, src)

            for r in range(1, args.rounds + 1):
                tokens, elapsed = store_round(r)
                times["store"].append(elapsed)
                times["retrieve"].append(retrieve_round(tokens, f"r{r}"))
                for name, dst in (("memcpy shm", dst_shm), ("memcpy anon", dst_anon)):
                    begin = time.perf_counter()
                    np.copyto(dst, src)
                    times[name].append(time.perf_counter() - begin)
                for _ in range(10):  # calls that copy nothing: the per-call overhead
                    begin = time.perf_counter()
                    got = transfer(
                        http, "/cache/store", f"p{r}", tokens, blocks, 0, args.step_tokens
                    )
                    present.append(time.perf_counter() - begin)
                    assert got["present_chunks"] == args.step_tokens // CHUNK, got
                http.post("/cache/end", json={"request_ids": [f"p{r}"]})

            # Lookup latency: a 32k-token prompt, every chunk cached (stored through
            # the tiny registration: the lookup path does not depend on the layout).
            prompt = np.random.default_rng(99).integers(
                0, 128000, args.lookup_tokens, dtype=np.int32
            )
            tiny_ids = list(range(1, tiny_blocks))
            got = transfer(
                http,
                "/cache/store",
                "tiny",
                prompt,
                tiny_ids,
                0,
                args.lookup_tokens,
                instance="tiny",
                namespace=TINY_NAMESPACE,
            )
            assert got["stored_chunks"] == args.lookup_tokens // CHUNK, got
            encoded = {"b64": {"tokens_b64": b64(prompt)}, "json": {"tokens": prompt.tolist()}}
            lat: dict[str, list[float]] = {"health": [], "lookup b64": [], "lookup json": []}
            for i in range(-20, args.lookup_rounds):  # 20 warm-up rounds
                begin = time.perf_counter()
                http.get("/health").raise_for_status()
                health = time.perf_counter() - begin
                row = {"health": health}
                for enc, tokens_field in encoded.items():
                    body = {
                        "requests": [
                            {
                                "request_id": f"l{enc}{i}",
                                "namespace": TINY_NAMESPACE,
                                **tokens_field,
                            }
                        ]
                    }
                    begin = time.perf_counter()
                    reply = http.post("/cache/lookup", json=body)
                    row[f"lookup {enc}"] = time.perf_counter() - begin
                    reply.raise_for_status()
                    assert reply.json()["results"][0]["hit_tokens"] == args.lookup_tokens
                http.post("/cache/end", json={"request_ids": [f"lb64{i}", f"ljson{i}"]})
                if i >= 0:
                    for name, value in row.items():
                        lat[name].append(value)
    finally:
        del dst_shm
        dst_segment.close()
        kv.close()
        tiny.close()

    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    shm, anon = gbps["memcpy shm"], gbps["memcpy anon"]
    print(
        f"\n{'copy path':<14}{'GB/s (median)':>14}{'best':>8}{'/ memcpy shm':>14}"
        f"{'/ memcpy anon':>15}   target >= 0.70"
    )
    for name, rate in gbps.items():
        best = nbytes / min(times[name]) / 1e9
        print(f"{name:<14}{rate:>14.2f}{best:>8.2f}{rate / shm:>14.2f}{rate / anon:>15.2f}")
    print(
        f"store call with every chunk present ({args.step_tokens} tokens): "
        f"p50 {statistics.median(present) * 1e3:.2f} ms"
    )
    base = statistics.median(lat["health"])
    print(
        f"\n{'call (32k tokens)':<20}{'p50 ms':>10}{'p99 ms':>10}{'p50 / health':>14}   target <= 5"
    )
    for name, samples in lat.items():
        p50, p99 = statistics.median(samples), pct(samples, 99)
        print(f"{name:<20}{p50 * 1e3:>10.3f}{p99 * 1e3:>10.3f}{p50 / base:>14.2f}")


if __name__ == "__main__":
    main()
