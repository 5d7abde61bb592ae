"""GPU copy bandwidth: mpcache's store and retrieve copy path against a plain copy.

Needs a CUDA GPU (``make gpu-check`` runs it; without one it exits with one line).
A KV cache in vLLM's GPU layout (``--layers`` tensors ``[2, blocks, 16, kv_heads,
head_dim]`` bf16) and a pool of shared memory (``MAP_SHARED`` shmem, the kind the
server's pool is), pinned as the server pins it (``dataplane.device_path``). Each
round moves ``--chunks`` chunks each way, interleaved:

- ``store D2H``: ``gather_chunk`` per chunk on the server's own stream, as a store
  runs (blocks gathered on the GPU, one copy a chunk to its pool entry, each chunk
  waited for, as before its commit, once the next one's copy is queued:
  ``CopyWindow``);
- ``cudaMemcpy D2H``: the same bytes, one ``tensor.copy_`` a chunk from a contiguous
  GPU buffer into the same pinned pool memory, synchronised once;
- ``retrieve H2D`` / ``cudaMemcpy H2D``: the same, the other way (``scatter_chunk``);
- ``... pool not pinned``: the store and retrieve path into a second, unpinned pool
  (the fallback when pinning fails), for the record.

GB/s per row, and the store and retrieve ratios to the plain copy taken within each
round and printed round by round; the target is >= 0.9. Medians (min-max) over
``--rounds`` rounds (at least 5).

    .venv/bin/python bench/gpu_bench.py [--rounds 7] [--chunks 16] [--layers 32]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import MIN_ROUNDS, Rounds, load_line, results
from dataplane.device_path import CopyWindow, DevicePath, PoolPinning
from dataplane.transfer import gather_chunk, scatter_chunk
from tests.dataplane.support import attention_plans

FIGURES = (
    "store D2H / cudaMemcpy D2H",
    "retrieve H2D / cudaMemcpy H2D",
    "store D2H",
    "retrieve H2D",
    "cudaMemcpy D2H",
    "cudaMemcpy H2D",
    "store D2H, pool not pinned",
    "retrieve H2D, pool not pinned",
)
"""What docs/benchmarks.md may quote (bench/common.py ``results``)."""

DEVICE = "cuda"
"""This bench needs a CUDA GPU (tests/test_docs.py: its rows wait for one)."""

BLOCK_TOKENS = 16
TARGET = 0.9
ENTRY_ALIGN = 64 << 10
"""Entries start on pool pages (64 KiB by default)."""


class Pool:
    """Shared memory cut into ``chunks`` entries of ``entry_bytes``, as the pool is."""

    def __init__(self, chunks: int, entry_bytes: int, *, pin: bool) -> None:
        self.stride = -(-entry_bytes // ENTRY_ALIGN) * ENTRY_ALIGN
        self.buf = mmap.mmap(-1, chunks * self.stride)  # MAP_SHARED | MAP_ANONYMOUS: shmem
        self.bytes = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.bytes.fill_(1)  # fault every page in, as the server's prefault does
        self.entries = [
            self.bytes[k * self.stride : k * self.stride + entry_bytes] for k in range(chunks)
        ]
        self.pinning = PoolPinning(self.bytes.data_ptr(), chunks * self.stride, enabled=pin)
        self.pinning.start()
        state = self.pinning.wait()
        if pin and state != "pinned":
            raise SystemExit(f"gpu_bench: the pool could not be pinned: {self.pinning.reason}")

    def close(self) -> None:
        self.pinning.close()
        self.entries = []
        del self.bytes
        self.buf.close()


def _seconds(run: Callable[[], None], stream: torch.cuda.Stream) -> float:
    stream.synchronize()
    begin = time.perf_counter()
    run()
    stream.synchronize()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=16, help="chunks each way per round")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA GPU visible (torch.cuda.is_available() is False); nothing measured"
        )
        sys.exit(2)
    print(load_line())
    device = torch.device("cuda", 0)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    per_chunk = args.chunk_tokens // BLOCK_TOKENS
    num_blocks = 2 * args.chunks * per_chunk + 1  # block 0 is vLLM's null block
    shape = (2, num_blocks, BLOCK_TOKENS, args.kv_heads, args.head_dim)
    kv = [torch.randn(shape, device=device).bfloat16() for _ in range(args.layers)]
    plans, chunk_bytes = attention_plans(kv, args.chunk_tokens, BLOCK_TOKENS)
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, num_blocks))  # vLLM's free list, shuffled
    stored = [order[k * per_chunk : (k + 1) * per_chunk] for k in range(args.chunks)]
    loaded = [order[(args.chunks + k) * per_chunk :][:per_chunk] for k in range(args.chunks)]
    total = args.chunks * chunk_bytes
    print(
        f"{args.layers} layers of {list(shape)} bf16; {args.chunks} chunks of "
        f"{chunk_bytes / 2**20:.1f} MiB ({args.chunk_tokens} tokens) each way, scattered blocks"
    )
    stream = DevicePath().stream(0)  # the server's own stream
    pinned = Pool(args.chunks, chunk_bytes, pin=True)
    pageable = Pool(args.chunks, chunk_bytes, pin=False)
    plain = torch.empty(args.chunks, chunk_bytes, dtype=torch.uint8, device=device)

    def store(pool: Pool) -> Callable[[], None]:
        def run() -> None:  # as app/store.py runs a GPU registration's chunks
            with torch.cuda.stream(stream):
                window = CopyWindow(0)
                for ids, entry in zip(stored, pool.entries, strict=True):
                    gather_chunk(plans, [ids], entry, wait=False)
                    window.add(lambda: None)  # the commit
                window.drain()

        return run

    def retrieve(pool: Pool) -> Callable[[], None]:
        def run() -> None:  # as app/retrieve.py does
            with torch.cuda.stream(stream):
                window = CopyWindow(0)
                for ids, entry in zip(loaded, pool.entries, strict=True):
                    scatter_chunk(plans, [ids], entry, wait=False)
                    window.add(lambda: None)
                window.drain()

        return run

    def memcpy_d2h() -> None:
        with torch.cuda.stream(stream):
            for k, entry in enumerate(pinned.entries):
                entry.copy_(plain[k], non_blocking=True)

    def memcpy_h2d() -> None:
        with torch.cuda.stream(stream):
            for k, entry in enumerate(pinned.entries):
                plain[k].copy_(entry, non_blocking=True)

    # Check once that the path moves the bytes, then warm up.
    store(pinned)()
    retrieve(pinned)()
    torch.cuda.synchronize()
    for src, dst in zip(stored, loaded, strict=True):
        for t in kv:
            assert torch.equal(t[:, src.tolist()], t[:, dst.tolist()]), "bytes differ"
    runs = {
        "cudaMemcpy D2H": memcpy_d2h,
        "store D2H": store(pinned),
        "cudaMemcpy H2D": memcpy_h2d,
        "retrieve H2D": retrieve(pinned),
        "store D2H, pool not pinned": store(pageable),
        "retrieve H2D, pool not pinned": retrieve(pageable),
    }
    for run in runs.values():
        run()
    rounds = Rounds()
    for r in range(max(MIN_ROUNDS, args.rounds)):
        for name, run in runs.items():
            rounds.add(name, total / _seconds(run, stream) / 1e9)
        v = rounds.values
        print(
            f"round {r + 1}: store {v['store D2H'][-1]:.1f} / memcpy {v['cudaMemcpy D2H'][-1]:.1f}"
            f" GB/s = {v['store D2H'][-1] / v['cudaMemcpy D2H'][-1]:.3f}; retrieve "
            f"{v['retrieve H2D'][-1]:.1f} / memcpy {v['cudaMemcpy H2D'][-1]:.1f} GB/s = "
            f"{v['retrieve H2D'][-1] / v['cudaMemcpy H2D'][-1]:.3f}",
            flush=True,
        )
    pinned.close()
    pageable.close()
    print(load_line())
    print(rounds.table(list(runs), "cudaMemcpy D2H", unit="GB/s", ratio_label="/ cudaMemcpy D2H"))
    for name, base in (("store D2H", "cudaMemcpy D2H"), ("retrieve H2D", "cudaMemcpy H2D")):
        median = statistics.median(rounds.ratios(name, base))
        verdict = "met" if median >= TARGET else "NOT met"
        print(f"target {name} / {base} >= {TARGET}: {verdict} (median {median:.3f})")
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
