"""Data-plane throughput and lookup latency, through a real server over HTTP.

Registers a Llama-3-8B-like KV cache (32 layers, 8 KV heads, head 128, bf16,
block 16, vLLM's CPU layout ``[2, num_blocks, 16, 8, 128]``, chunk 256 = 32 MiB) in
POSIX shm. Each round, interleaved so machine noise hits every figure alike:

- store: ``/cache/store`` of a fresh ``--tokens`` prompt, in engine-step-sized
  calls of ``--step-tokens``, every chunk copied; block ids in ascending runs (as
  vLLM hands out fresh blocks) and, separately, in random order (the worst case);
- retrieve: ``/cache/retrieve`` of that prompt into other blocks (same two orders);
- baseline: a numpy copy of the same number of bytes between two shm segments
  (like for like: the pool and the KV cache are both shm), in this process.

and prints GB/s and the per-round ratio to the baseline (target >= 0.8). Then, per
round, 32k-token ``/cache/lookup`` calls (every chunk cached) in the binary form,
as ``tokens_b64`` and as a JSON list, interleaved call by call with bare
``GET /health`` calls: the median of each per round and the ratio to /health
(target for the form the connector sends <= 1.5). At least 5 rounds; the median
and min-max spread over the rounds are printed, with the machine load.

    .venv/bin/python bench/dataplane_bench.py            # ~1 min
    .venv/bin/python bench/dataplane_bench.py --tokens 2048 --rounds 5   # smaller

/dev/shm: the KV segment, the pool and the baseline's target hold ``--tokens`` x
128 KiB each (1.5 GiB at the default 4096 tokens); all are removed on exit, also
on failure.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from contract.schemas import REGISTRATION_TOKEN_HEADER
from contract.shm_naming import segment_name
from dataplane.segments import Segment
from tests.dataplane.support import WorkerSocket, register_over, sealed_memfd
from tests.support import server_process

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16
CHUNK = 256
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 128 KiB
NAMESPACE = "bench/llama-3-8b-like"
TINY_NAMESPACE = "bench/tiny"
FIGURES = (
    "store (runs) / numpy copy shm -> shm",
    "retrieve (runs) / numpy copy shm -> shm",
    "store (random) / numpy copy shm -> shm",
    "retrieve (random) / numpy copy shm -> shm",
    "lookup 32k, binary form / GET /health",
    "lookup 32k, tokens_b64 / GET /health",
    "lookup 32k, JSON list / GET /health",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""
TOKENS: dict[str, str] = {}
"""Registration token of each instance (``POST /register`` returned it)."""


def b64(tokens: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).decode()


class KVCache:
    """A worker's KV cache in one sealed memfd: one ``[2, NB, 16, H, 128]`` bf16 tensor a layer."""

    def __init__(self, num_blocks: int, layers: int = LAYERS, heads: int = KV_HEADS) -> None:
        self.shape = (2, num_blocks, BLOCK, heads, HEAD_DIM)
        self.layer_bytes = 2 * num_blocks * BLOCK * heads * HEAD_DIM * 2
        self.layers = layers
        self.fd = sealed_memfd(self.layer_bytes * layers, "mpcache-bench-kv")
        self.mm = mmap.mmap(self.fd, self.layer_bytes * layers)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        for i in range(layers):  # touch every page, a different pattern per layer
            self.array[i * self.layer_bytes : (i + 1) * self.layer_bytes] = i + 1

    def block(self, layer: int, kv: int, block: int) -> np.ndarray:
        flat = self.array[layer * self.layer_bytes : (layer + 1) * self.layer_bytes]
        return flat.view(np.int16).reshape(self.shape)[kv, block]

    def register_body(self, instance: str, namespace: str) -> dict[str, Any]:
        elems = [1]
        for n in reversed(self.shape[1:]):
            elems.insert(0, elems[0] * n)
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
                            "transport": "memfd",
                            "ticket": f"fd:{self.fd}",
                            "offset_bytes": i * self.layer_bytes,
                            "shape": list(self.shape),
                            "stride": elems,
                            "dtype": "bfloat16",
                            "block_dim": 1,
                        }
                    ],
                }
                for i in range(self.layers)
            ],
        }

    def close(self) -> None:
        del self.array
        self.mm.close()
        os.close(self.fd)


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
    reply = http.post(path, json=body, headers={REGISTRATION_TOKEN_HEADER: TOKENS[instance]})
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()["results"][0]
    return result


def _metric(lines: list[str], name: str) -> list[str]:
    """The value of the unlabelled metric ``name`` in ``/metrics`` lines ([] if absent)."""
    return [line.split()[-1] for line in lines if line.startswith(f"{name} ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per store (128 KiB each)")
    parser.add_argument("--step-tokens", type=int, default=2048, help="tokens per store call")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lookup-tokens", type=int, default=32768)
    parser.add_argument("--lookup-calls", type=int, default=40, help="lookups of each form a round")
    args = parser.parse_args()
    if args.tokens % args.step_tokens or args.step_tokens % CHUNK:
        parser.error(f"--step-tokens must divide --tokens and be a multiple of {CHUNK}")
    rounds_n = max(MIN_ROUNDS, args.rounds)
    nbytes = args.tokens * BYTES_PER_TOKEN
    num_blocks = args.tokens // BLOCK + 1  # block 0 is vLLM's null block
    tiny_blocks = args.lookup_tokens // BLOCK + 1
    print(load_line())
    print(
        f"layout: {LAYERS} layers x [2, {num_blocks}, {BLOCK}, {KV_HEADS}, {HEAD_DIM}] bf16, "
        f"chunk {CHUNK} tokens = {CHUNK * BYTES_PER_TOKEN >> 20} MiB; {args.tokens} tokens "
        f"a store = {nbytes / 2**30:.2f} GiB; {rounds_n} rounds"
    )
    rng = np.random.default_rng(7)
    orders = {
        "runs": (list(range(1, num_blocks)), list(range(1, num_blocks))),
        "random": (
            (rng.permutation(num_blocks - 1) + 1).tolist(),
            (rng.permutation(num_blocks - 1) + 1).tolist(),
        ),
    }
    copies = Rounds()
    threads: list[str] = []
    alone: list[str] = []
    lat = Rounds()
    kv = tiny = dst_segment = None
    try:
        kv = KVCache(num_blocks)
        tiny = KVCache(tiny_blocks, layers=1, heads=1)
        dst_segment = Segment.create(segment_name("w"), nbytes)
        dst = np.frombuffer(dst_segment.buffer, dtype=np.uint8)
        dst[:] = 0
        src = kv.array[:nbytes]
        pool_bytes = nbytes + (64 << 20)
        server_args = ["--chunk-size", str(CHUNK), "--pool-size", str(pool_bytes)]
        with (
            server_process(*server_args, "--log-level", "warning") as (url, _),
            httpx.Client(base_url=url, timeout=120.0) as http,
        ):
            http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
            sockets: list[WorkerSocket] = []
            for owner, instance, ns in ((kv, "bench", NAMESPACE), (tiny, "tiny", TINY_NAMESPACE)):
                TOKENS[instance], sock = register_over(http, owner.register_body(instance, ns))
                sockets.append(sock)

            def store(seed: int, blocks: list[int]) -> tuple[np.ndarray, float]:
                tokens = np.random.default_rng(seed).integers(0, 128000, args.tokens, np.int32)
                begin = time.perf_counter()
                for start in range(0, args.tokens, args.step_tokens):
                    end = start + args.step_tokens
                    got = transfer(http, "/cache/store", f"s{seed}", tokens, blocks, start, end)
                    assert got["stored_chunks"] == args.step_tokens // CHUNK, got
                elapsed = time.perf_counter() - begin
                http.post("/cache/end", json={"request_ids": [f"s{seed}"]})
                return tokens, elapsed

            def retrieve(tokens: np.ndarray, rid: str, blocks: list[int]) -> float:
                begin = time.perf_counter()
                got = transfer(http, "/cache/retrieve", rid, tokens, blocks, 0, args.tokens)
                elapsed = time.perf_counter() - begin
                assert got["loaded_tokens"] == args.tokens, got
                http.post("/cache/end", json={"request_ids": [rid]})
                return elapsed

            # Warm-up (faults the pool's pages in) and a check that bytes arrive intact.
            for name, (stored, loaded) in orders.items():
                tokens, _ = store(10**6 + len(name), stored)
                before = [kv.block(3, 1, stored[j]).copy() for j in (0, len(stored) - 1)]
                retrieve(tokens, f"check-{name}", loaded)
                after = [kv.block(3, 1, loaded[j]).copy() for j in (0, len(loaded) - 1)]
                assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
            np.copyto(dst, src)

            for r in range(rounds_n):
                for name, (stored, loaded) in orders.items():
                    tokens, elapsed = store(r * 10 + len(name), stored)
                    copies.add(f"store ({name})", nbytes / elapsed / 1e9)
                    elapsed = retrieve(tokens, f"r{r}-{name}", loaded)
                    copies.add(f"retrieve ({name})", nbytes / elapsed / 1e9)
                begin = time.perf_counter()
                np.copyto(dst, src)
                copies.add("numpy copy shm -> shm", nbytes / (time.perf_counter() - begin) / 1e9)

            lookup_rounds(http, args, rounds_n, tiny_blocks, lat)
            metrics = http.get("/metrics").text.splitlines()
            threads = _metric(metrics, "mpcache_copy_threads")
            alone = _metric(metrics, "mpcache_copies_alone_total")
            for sock in sockets:
                sock.close()
        del dst, src
    finally:
        # The shm segment first: it must go even if closing a KV cache fails.
        if dst_segment is not None:
            dst_segment.close()
        for owner in (kv, tiny):
            if owner is not None:
                owner.close()

    print(load_line())
    print(f"server copy threads: {threads[0] if threads else 'not reported'}")
    print(
        "chunks copied alone, threads waiting for a core (mpcache_copies_alone_total): "
        f"{alone[0] if alone else 'not reported'}"
    )
    names = [f"{op} ({order})" for order in orders for op in ("store", "retrieve")]
    print()
    print(
        copies.table(
            [*names, "numpy copy shm -> shm"],
            "numpy copy shm -> shm",
            unit="GB/s",
            ratio_label="/ numpy copy shm -> shm",
            target="target >= 0.8",
            digits=2,
        )
    )
    print()
    print(
        lat.table(
            list(lat.values),
            "GET /health",
            unit="ms",
            ratio_label="/ GET /health",
            target="target <= 1.5",
        )
    )
    print()
    print(results(FIGURES, copies, lat))


def lookup_rounds(
    http: httpx.Client, args: argparse.Namespace, rounds_n: int, tiny_blocks: int, lat: Rounds
) -> None:
    """Lookups of a 32k-token prompt (every chunk cached) in each form, against /health."""
    prompt = np.random.default_rng(99).integers(0, 128000, args.lookup_tokens, dtype=np.int32)
    got = transfer(
        http,
        "/cache/store",
        "tiny",
        prompt,
        list(range(1, tiny_blocks)),
        0,
        args.lookup_tokens,
        instance="tiny",
        namespace=TINY_NAMESPACE,
    )
    assert got["stored_chunks"] == args.lookup_tokens // CHUNK, got
    packed = prompt.astype("<i4").tobytes()
    try:
        from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, encode_lookup_frame
        from contract.schemas import LookupFrameHeader, LookupFrameItem
    except ImportError:  # a checkout from before the binary form: JSON forms only
        LOOKUP_FRAME_MEDIA_TYPE = ""

    def frame(rid: str) -> bytes:
        header = LookupFrameHeader(
            requests=[
                LookupFrameItem(request_id=rid, namespace=TINY_NAMESPACE, num_tokens=len(prompt))
            ]
        )
        return encode_lookup_frame(header, [packed])

    def json_body(rid: str, tokens: dict[str, Any]) -> bytes:
        item = {"request_id": rid, "namespace": TINY_NAMESPACE, **tokens}
        return json.dumps({"requests": [item]}).encode()

    b64_tokens = {"tokens_b64": b64(prompt)}
    list_tokens = {"tokens": prompt.tolist()}
    forms: dict[str, tuple[str, Any]] = {
        "lookup 32k, binary form": (LOOKUP_FRAME_MEDIA_TYPE, frame),
        "lookup 32k, tokens_b64": ("application/json", lambda rid: json_body(rid, b64_tokens)),
        "lookup 32k, JSON list": ("application/json", lambda rid: json_body(rid, list_tokens)),
    }
    if not LOOKUP_FRAME_MEDIA_TYPE:
        del forms["lookup 32k, binary form"]
    # Bodies are built before the clock starts: this measures the server and HTTP.
    for r in range(-1, rounds_n):  # round -1 warms up
        times: dict[str, list[float]] = {"GET /health": [], **{name: [] for name in forms}}
        ended = []
        for i in range(args.lookup_calls):
            begin = time.perf_counter()
            http.get("/health").raise_for_status()
            times["GET /health"].append((time.perf_counter() - begin) * 1e3)
            for name, (media, build) in forms.items():
                rid = f"l{r}-{i}-{len(ended)}"
                body = build(rid)
                begin = time.perf_counter()
                reply = http.post("/cache/lookup", content=body, headers={"content-type": media})
                times[name].append((time.perf_counter() - begin) * 1e3)
                assert reply.json()["results"][0]["hit_tokens"] == args.lookup_tokens, reply.text
                ended.append(rid)
        http.post("/cache/end", json={"request_ids": ended})
        if r >= 0:
            for name, samples in times.items():
                lat.add(name, statistics.median(samples))


if __name__ == "__main__":
    main()
