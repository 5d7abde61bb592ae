"""Store and lookup with KV events on against off: two real servers, interleaved.

Two ``mpcache server`` processes, alike but for ``--kv-events-endpoint`` (and its
replay endpoint) on one; a subscriber in this process drains its events, so every
batch is really encoded and sent. Each server has two registered KV caches:

- large: 8 layers x ``[2, NB, 16, 8, 128]`` bf16, chunk 256 = 8 MiB;
- small: 1 layer x ``[2, NB, 16, 1, 128]`` bf16, chunk 256 = 128 KiB (the most
  events per byte copied: the worst case for the event path).

Each round, call by call alternating between the servers (which goes first
alternates too): ``--stores`` ``/cache/store`` calls of a fresh prompt per cache
(``--tokens``, ``--small-tokens``: every chunk copied and committed, evicting older
ones once the pool is full, which the events announce too), then ``--lookup-calls``
``/cache/lookup`` calls (``tokens_b64``) of the last small prompt (every chunk a
hit); the median of each per server. Per round, each figure's ratio on
against off; target <= 1.03. At least 5 rounds; medians and min-max spread over the
rounds.

    .venv/bin/python bench/kv_events_bench.py             # ~1 min
    .venv/bin/python bench/kv_events_bench.py --rounds 5 --tokens 4096

/dev/shm: per server a pool of 96 MiB and KV caches of ``--tokens`` x 32 KiB and
``--small-tokens`` x 512 B (72 MiB at the defaults); all removed on exit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.kv_events import BlockLedger, BlockNote, EventRecorder, StoredItem
from bench.common import MIN_ROUNDS, Rounds, load_line, results
from bench.dataplane_bench import BLOCK, CHUNK, TOKENS, KVCache, b64, transfer
from contract.kv_events import KVEventBatch, encode_batch
from dataplane.pool import Entry
from tests.dataplane.support import register_over
from tests.support import free_port, server_process

FIGURES = (
    "store 8 MiB chunks, events on / store 8 MiB chunks, events off",
    "store 128 KiB chunks, events on / store 128 KiB chunks, events off",
    "lookup, events on / lookup, events off",
    "recorder per commit (us)",
    "ledger and encoding per chunk (us)",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""
START_S = 120.0
"""How long a server may take to start on a loaded machine."""

CACHES = {"large": (8, 8), "small": (1, 1)}
"""name -> (layers, KV heads)."""
SIZES = {"large": "8 MiB", "small": "128 KiB"}


class Drain:
    """A subscriber that reads every batch the events-on server publishes."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self._sub.recv_multipart()
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        self._ctx.term()


def _rid(server: str, name: str, r: int) -> str:
    return f"{server}-{name}-{r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens a large store")
    parser.add_argument("--small-tokens", type=int, default=16384, help="tokens a small store")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stores", type=int, default=6, help="stores a cache a server a round")
    parser.add_argument("--lookup-calls", type=int, default=40, help="lookups a server a round")
    args = parser.parse_args()
    if args.tokens % CHUNK or args.small_tokens % CHUNK:
        parser.error(f"--tokens and --small-tokens must be multiples of {CHUNK}")
    rounds_n = max(MIN_ROUNDS, args.rounds)
    lengths = {"large": args.tokens, "small": args.small_tokens}
    print(load_line())
    print(
        f"stores of {args.tokens} tokens (8 MiB chunks) and {args.small_tokens} tokens "
        f"(128 KiB chunks), chunk {CHUNK}; {rounds_n} rounds"
    )
    events = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    common = ["--chunk-size", str(CHUNK), "--pool-size", "96MiB", "--log-level", "warning"]
    common += ["--copy-threads", "2"]  # alike on both, and no measuring at start
    flags = {"off": common, "on": [*common, "--kv-events-endpoint", events]}
    flags["on"] += ["--kv-events-replay-endpoint", replay]
    caches: dict[tuple[str, str], KVCache] = {}
    rounds = Rounds()
    drain: Drain | None = None
    try:
        with (
            server_process(*flags["off"], start_timeout_s=START_S) as (off_url, _),
            server_process(*flags["on"], start_timeout_s=START_S) as (on_url, _),
        ):
            clients = {
                "off": httpx.Client(base_url=off_url, timeout=120.0),
                "on": httpx.Client(base_url=on_url, timeout=120.0),
            }
            sockets = []
            for server, http in clients.items():
                http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
                for name, (layers, heads) in CACHES.items():
                    num_blocks = lengths[name] // BLOCK + 1
                    kv = caches[(server, name)] = KVCache(num_blocks, layers=layers, heads=heads)
                    instance = f"{server}-{name}"
                    body = kv.register_body(instance, f"bench/{name}")
                    TOKENS[instance], sock = register_over(http, body)
                    sockets.append(sock)
            drain = Drain(events)

            def store(server: str, name: str, rid: str, seed: int) -> float:
                """One store of a fresh prompt: ms."""
                n = lengths[name]
                tokens = np.random.default_rng(seed).integers(0, 128000, n, np.int32)
                begin = time.perf_counter()
                got = transfer(
                    clients[server],
                    "/cache/store",
                    rid,
                    tokens,
                    list(range(1, n // BLOCK + 1)),
                    0,
                    n,
                    instance=f"{server}-{name}",
                    namespace=f"bench/{name}",
                )
                elapsed = (time.perf_counter() - begin) * 1e3
                assert got["stored_chunks"] == n // CHUNK, got
                clients[server].post("/cache/end", json={"request_ids": [rid]})
                return elapsed

            def lookup(server: str, body: dict[str, Any]) -> float:
                begin = time.perf_counter()
                reply = clients[server].post("/cache/lookup", json=body)
                elapsed = (time.perf_counter() - begin) * 1e3
                assert reply.json()["results"][0]["hit_tokens"] == args.small_tokens, reply.text
                return elapsed

            def one_round(r: int) -> None:
                """Stores, then lookups, each call alternating between the servers."""
                times: dict[str, list[float]] = {}
                for i in range(args.stores):
                    for name in CACHES:
                        order = ("off", "on") if (i + r) % 2 == 0 else ("on", "off")
                        for server in order:
                            rid = f"{server}-{name}-{r}-{i}"
                            key = f"store {SIZES[name]} chunks, events {server}"
                            times.setdefault(key, []).append(
                                store(server, name, rid, (r + 2) * 100 + i)
                            )
                # The last small prompt (the same on both servers) is looked up.
                item = {
                    "namespace": "bench/small",
                    "tokens_b64": b64(
                        np.random.default_rng((r + 2) * 100 + args.stores - 1).integers(
                            0, 128000, lengths["small"], np.int32
                        )
                    ),
                }
                ids = []
                for i in range(args.lookup_calls):
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    for server in order:
                        rid = f"l{r}-{i}"
                        ids.append(rid)
                        body = {"requests": [{"request_id": rid, **item}]}
                        key = f"lookup, events {server}"
                        times.setdefault(key, []).append(lookup(server, body))
                for http in clients.values():
                    http.post("/cache/end", json={"request_ids": ids})
                for key, samples in times.items():
                    rounds.add(key, statistics.median(samples))

            one_round(-1)  # warm-up (pages faulted in, code paths hot)
            rounds.values.clear()
            for r in range(rounds_n):
                one_round(r)
            published = drain.batches
            for sock in sockets:
                sock.close()
            for http in clients.values():
                http.close()
    finally:
        if drain is not None:
            drain.close()
        for kv in caches.values():
            kv.close()

    print(load_line())
    print(f"batches received from the events-on server: {published}")
    for figure in ("store 8 MiB chunks", "store 128 KiB chunks", "lookup"):
        print()
        print(
            rounds.table(
                [f"{figure}, events on", f"{figure}, events off"],
                f"{figure}, events off",
                unit="ms",
                ratio_label="/ events off",
                target="target <= 1.03",
            )
        )
    work = Rounds()
    for _ in range(rounds_n):
        ledger_round(work)
    print()
    print(
        "in this process, per chunk: the store path's part (the pool's observer, under "
        "its lock) and the publisher thread's (hash, ledger, events, msgpack)"
    )
    for name, values in work.values.items():
        print(f"  {name}: {statistics.median(values):.2f} (min {min(values):.2f})")
    print()
    print(results(FIGURES, rounds, work))


def ledger_round(work: Rounds, chunks: int = 1024) -> None:
    """The event path's own work for ``chunks`` committed chunks of one prompt."""
    tokens = np.random.default_rng(len(work.values)).integers(0, 128000, chunks * CHUNK, np.int32)
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    item = StoredItem("bench", None, CHUNK, tokens, keys)
    entries = [
        Entry(keys[c], 0, b"L", 1, None, 0, 1, 1, 0, note=BlockNote(item, c, 1))
        for c in range(chunks)
    ]
    recorder = EventRecorder(chunks)
    begin = time.perf_counter()
    for entry in entries:
        recorder.added(entry)
    work.add("recorder per commit (us)", (time.perf_counter() - begin) * 1e6 / chunks)
    begin = time.perf_counter()
    change = BlockLedger().apply(recorder.take())
    encode_batch(KVEventBatch(ts=time.time(), events=change.events))
    work.add("ledger and encoding per chunk (us)", (time.perf_counter() - begin) * 1e6 / chunks)
    assert len(change.stored) == chunks


if __name__ == "__main__":
    main()
