"""The local-disk tier: retrieve from disk and write-behind against raw pread/pwrite.

Two ``mpcache server`` processes with the same pool, one with ``--disk-path`` (a new
directory under ``--dir``, a real filesystem; tmpfs would measure memory) and one
without, each with its own KV cache (``bench/dataplane_bench.py``'s layout, fewer
layers: ``--layers`` x ``[2, NB, 16, 8, 128]`` bf16, chunk 256). The pool holds four
prompts, the write-behind queue a quarter of that: one prompt. Each round,
interleaved so machine noise hits every figure alike:

1. store a fresh ``--tokens`` prompt through both servers, in alternating order:
   the store-reply latency with the disk tier on and off (write-behind: on must
   not be slower); then the time until the disk server has written it behind, as
   writer GB/s; baseline: a raw ``os.pwrite`` of the same bytes (the same files'
   sizes, the same open flags: O_DIRECT where the tier uses it) into the same
   filesystem;
2. store four filler prompts (each written behind before the next), which evict
   the round's prompt from the pool;
3. drop the prompt's files from the page cache (fsync, ``POSIX_FADV_DONTNEED``),
   then retrieve it: every chunk read from disk, checked and promoted into the
   pool, then copied into the KV cache (disk retrieve GB/s); baseline: drop them
   again, then a raw ``os.pread`` of the same files (same flags), in alternating
   order with the retrieve; then the same retrieve again, from the pool (what the
   copy into the KV cache costs by itself: a retrieve from disk does both, one
   after the other).

Prints GB/s and ms median (min-max) over at least 5 rounds, each ratio within its
round, and the machine load. Disk: about 6 x ``--tokens`` x 32 KiB a round, all
removed on exit; /dev/shm: two KV caches and two pools (~10 x that).

    .venv/bin/python bench/disk_bench.py            # ~1 min
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.disk_codec import HEADER_BYTES
from bench.common import MIN_ROUNDS, Rounds, load_line, results
from bench.dataplane_bench import BLOCK, CHUNK, HEAD_DIM, KV_HEADS, TOKENS, KVCache, transfer
from tests.dataplane.support import register_over
from tests.support import server_process, wait_until

NAMESPACE = "bench/disk"
FIGURES = (
    "retrieve from disk",
    "raw pread",
    "retrieve from disk / raw pread",
    "retrieve from L1",
    "disk writer",
    "raw pwrite",
    "disk writer / raw pwrite",
    "store reply, disk on",
    "store reply, disk on / store reply, disk off",
)
"""What docs/benchmarks.md quotes: GB/s, store replies in ms (``results``)."""
WRITTEN = 'mpcache_disk_writes_total{outcome="written"}'
DIRECT = getattr(os, "O_DIRECT", 0)


def _metric(http: httpx.Client, sample: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        match = re.fullmatch(rf"{re.escape(sample)} (\S+)", line)
        if match:
            return float(match.group(1))
    return 0.0


def _chunk_files(directory: Path) -> set[Path]:
    return set(directory.glob("*/*.chunk"))


def _uncache(paths: list[Path]) -> None:
    """Make the next read of ``paths`` come from the device, not the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_pread(paths: list[Path], buf: mmap.mmap, flags: int) -> int:
    """Read each file whole into ``buf``; the bytes read."""
    view, total = memoryview(buf), 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            size = os.fstat(fd).st_size
            total += os.preadv(fd, [view[:size]], 0)
        finally:
            os.close(fd)
    return total


def _raw_pwrite(directory: Path, src: np.ndarray, chunk_bytes: int, flags: int) -> int:
    """Write ``src`` as files of a header block and one chunk each; the bytes written."""
    header = mmap.mmap(-1, HEADER_BYTES)
    total = 0
    for n, start in enumerate(range(0, len(src), chunk_bytes)):
        path = directory / f"raw-{n}.chunk"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            total += os.pwritev(fd, [memoryview(header), src[start : start + chunk_bytes].data], 0)
        finally:
            os.close(fd)
    header.close()
    return total


def _store_ms(http: httpx.Client, name: str, rid: str, tokens: np.ndarray, chunks: int) -> float:
    blocks = list(range(1, len(tokens) // BLOCK + 1))
    begin = time.perf_counter()
    got = transfer(http, "/cache/store", rid, tokens, blocks, 0, len(tokens), name, NAMESPACE)
    elapsed = (time.perf_counter() - begin) * 1e3
    assert got["stored_chunks"] == chunks, got
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens a round (x 32 KiB)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="on the disk to measure")
    args = parser.parse_args()
    if args.tokens % CHUNK:
        parser.error(f"--tokens must be a multiple of {CHUNK}")
    rounds_n = max(MIN_ROUNDS, args.rounds)
    per_token = args.layers * 2 * KV_HEADS * HEAD_DIM * 2
    nbytes, chunk_bytes = args.tokens * per_token, CHUNK * per_token
    num_blocks = args.tokens // BLOCK + 1
    chunks = args.tokens // CHUNK
    print(load_line())
    rounds = Rounds()
    with ExitStack() as stack, tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        disk, raw = Path(workdir) / "disk", Path(workdir) / "raw"
        raw.mkdir()
        kvs = {}
        for name in ("on", "off"):
            kvs[name] = KVCache(num_blocks, layers=args.layers)
            stack.callback(kvs[name].close)
            kvs[name].array[:] = np.random.default_rng(1).integers(
                0, 256, kvs[name].array.size, np.uint8
            )
        pool = ["--chunk-size", str(CHUNK), "--pool-size", str(4 * nbytes + (4 << 20))]
        on_flags = [*pool, "--disk-path", str(disk), "--disk-size", str(64 * nbytes)]
        urls = {
            "on": stack.enter_context(server_process(*on_flags))[0],
            "off": stack.enter_context(server_process(*pool))[0],
        }
        http = {
            n: stack.enter_context(httpx.Client(base_url=u, timeout=120.0)) for n, u in urls.items()
        }
        for name, client in http.items():
            client.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
            TOKENS[name], sock = register_over(client, kvs[name].register_body(name, NAMESPACE))
            stack.callback(sock.close)
        io = http["on"].get("/health").json()["disk"]["io"]
        flags = DIRECT if io == "direct" else 0
        print(
            f"layout: {args.layers} layers x [2, {num_blocks}, {BLOCK}, {KV_HEADS}, {HEAD_DIM}] "
            f"bf16, chunk {CHUNK} tokens = {chunk_bytes >> 20} MiB; {args.tokens} tokens a "
            f"round = {nbytes >> 20} MiB; {rounds_n} rounds; disk tier on {disk} ({io} I/O)"
        )
        buf = mmap.mmap(-1, chunk_bytes + HEADER_BYTES)
        stack.callback(buf.close)
        src = kvs["on"].array[:nbytes]
        on, seq = http["on"], 0
        for r in range(-1, rounds_n):  # round -1 warms up
            seq += 1
            tokens = np.random.default_rng(seq).integers(0, 128000, args.tokens, np.int32)
            before = _chunk_files(disk)
            written = _metric(on, WRITTEN)
            order = ("on", "off") if r % 2 else ("off", "on")
            ms = {n: _store_ms(http[n], n, f"s{seq}", tokens, chunks) for n in order}
            begin = time.perf_counter()
            wait_until(lambda w=written: _metric(on, WRITTEN) >= w + chunks, poll_s=0.001)
            writer_gbps = nbytes / (time.perf_counter() - begin) / 1e9
            begin = time.perf_counter()
            _raw_pwrite(raw, src, chunk_bytes, flags)
            raw_write_gbps = nbytes / (time.perf_counter() - begin) / 1e9
            files = sorted(_chunk_files(disk) - before)
            assert len(files) == chunks, files
            for _ in range(4):  # fillers: evict the round's prompt from the pool
                seq += 1
                filler = np.random.default_rng(seq).integers(0, 128000, args.tokens, np.int32)
                written = _metric(on, WRITTEN)
                _store_ms(on, "on", f"f{seq}", filler, chunks)
                wait_until(lambda w=written: _metric(on, WRITTEN) >= w + chunks, poll_s=0.001)
            hits = _metric(on, 'mpcache_disk_reads_total{outcome="hit"}')
            gbps = {}
            for source in ("disk", "raw") if r % 2 else ("raw", "disk"):
                _uncache(files)
                begin = time.perf_counter()
                if source == "raw":
                    got = sum(_raw_pread([f], buf, flags) for f in files)
                    assert got == chunks * (chunk_bytes + HEADER_BYTES)
                else:
                    blocks = list(range(1, num_blocks))
                    got_r = transfer(
                        on, "/cache/retrieve", f"r{seq}", tokens, blocks, 0, args.tokens, "on",
                        NAMESPACE,
                    )  # fmt: skip
                    assert got_r["loaded_tokens"] == args.tokens, got_r
                gbps[source] = nbytes / (time.perf_counter() - begin) / 1e9
            assert _metric(on, 'mpcache_disk_reads_total{outcome="hit"}') == hits + chunks
            begin = time.perf_counter()  # the same prompt again, now from the pool
            blocks = list(range(1, num_blocks))
            got_r = transfer(
                on, "/cache/retrieve", f"r{seq}", tokens, blocks, 0, args.tokens, "on", NAMESPACE
            )
            assert got_r["loaded_tokens"] == args.tokens, got_r
            gbps["L1"] = nbytes / (time.perf_counter() - begin) / 1e9
            on.post("/cache/end", json={"request_ids": [f"r{seq}"]})
            if r < 0:
                continue
            rounds.add("retrieve from disk", gbps["disk"])
            rounds.add("raw pread", gbps["raw"])
            rounds.add("retrieve from L1", gbps["L1"])
            rounds.add("disk writer", writer_gbps)
            rounds.add("raw pwrite", raw_write_gbps)
            rounds.add("store reply, disk on", ms["on"])
            rounds.add("store reply, disk off", ms["off"])
        dropped = _metric(on, 'mpcache_disk_writes_total{outcome="queue_full"}')
        del src

    print(load_line())
    print(f"write-behind chunks dropped (queue full): {dropped:.0f}")
    print()
    print(
        rounds.table(
            ["retrieve from disk", "raw pread", "retrieve from L1"],
            "raw pread",
            unit="GB/s",
            ratio_label="/ raw pread",
            target="target >= 0.8",
            digits=2,
        )
    )
    print(
        rounds.table(
            ["disk writer", "raw pwrite"],
            "raw pwrite",
            unit="GB/s",
            ratio_label="/ raw pwrite",
            digits=2,
        )
    )
    print(
        rounds.table(
            ["store reply, disk on", "store reply, disk off"],
            "store reply, disk off",
            unit="ms",
            ratio_label="/ disk off",
            target="target <= ~1 (not delayed)",
            digits=1,
        )
    )
    print(results(FIGURES, rounds))


if __name__ == "__main__":
    main()
