"""``POST /cluster/lookup`` answer latency against prompt length and member count.

One real ``mpcache server`` with a real ``redis-server`` as its coordinator holds a
stored prompt; the deployment's other members are written into that Redis as a live
member writes itself (a member record and a set of held block hashes, every block of
the prompt: each member's SMISMEMBER answers in full), so 16 members cost no 16
processes on the machine. Each round, for each member count (1, 4, 16) and prompt
length (1k, 8k, 32k tokens, all cached), ``--calls`` cluster lookups interleaved call
by call with ``/cache/lookup`` of the same prompt on the same server (what a router
would otherwise ask each server), both with the tokens as a JSON list; the median of
each per round, and the ratio. At least 5 rounds; medians and min-max spread.

    .venv/bin/python bench/cluster_lookup_bench.py        # ~1 min
    .venv/bin/python bench/cluster_lookup_bench.py --rounds 5 --calls 20

Needs ``redis-server`` (scripts/ensure_redis.sh). /dev/shm: a 64 MiB pool and a
16 MiB KV cache, removed on exit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis as redis_py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.cluster_lookup import held_key
from app.coordinator import deployment_keys
from bench.common import MIN_ROUNDS, Rounds, load_line, results
from bench.dataplane_bench import BLOCK, CHUNK, TOKENS, KVCache, transfer
from contract.chunk_keys import block_hashes
from tests.dataplane.support import register_over
from tests.support import redis_server, require_redis_server, server_process

FIGURES = (
    "cluster lookup 1k, 1 member / cache lookup 1k",
    "cluster lookup 32k, 1 member / cache lookup 32k",
    "cluster lookup 1k, 16 members / cache lookup 1k",
    "cluster lookup 32k, 16 members / cache lookup 32k",
    "cluster lookup 32k, 16 members",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``)."""
START_S = 120.0
"""How long a server may take to start on a loaded machine."""

DEPLOYMENT = "bench"
NAMESPACE = "bench-model@layout/ws1"
MODEL = "bench-model"
LENGTHS = {"1k": 1024, "8k": 8192, "32k": 32768}
MEMBERS = (1, 4, 16)


def _fake_members(client: redis_py.Redis, prompt: np.ndarray, count: int) -> list[str]:
    """``count`` members as live ones publish themselves, each holding all of ``prompt``."""
    *_, info = deployment_keys(DEPLOYMENT)
    held = [h.to_bytes(8, "big") for h in block_hashes(MODEL, None, prompt, CHUNK)]
    ids = [f"fake{i:02d}" + "0" * 26 for i in range(count)]
    for n, member in enumerate(ids):
        record = {"host": "10.0.0.1", "port": 9000 + n, "chunk_size": CHUNK}
        client.hset(info, member, json.dumps(record))
        client.sadd(held_key(DEPLOYMENT, member), *held)
    return ids


def _live(client: redis_py.Redis, ids: list[str]) -> None:
    """Make exactly ``ids`` of the fake members live (the real server stays)."""
    _, members, _ = deployment_keys(DEPLOYMENT)
    for member in client.zrange(members, 0, -1):
        if member.decode().startswith("fake"):
            client.zrem(members, member)
    far = int(time.time() * 1000) + 10**9
    if ids:
        client.zadd(members, dict.fromkeys(ids, far))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="calls of each kind per figure")
    args = parser.parse_args()
    require_redis_server()
    rounds_n = max(MIN_ROUNDS, args.rounds)
    longest = max(LENGTHS.values())
    prompt = np.random.default_rng(5).integers(0, 128000, longest, dtype=np.int32)
    print(load_line())
    print(f"members {MEMBERS}, prompts {list(LENGTHS)} tokens, chunk {CHUNK}; {rounds_n} rounds")
    lat = Rounds()
    kv = None
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as redis:
        client = redis_py.Redis.from_url(redis.url)
        args_ = ["--coordinator-url", redis.url, "--deployment", DEPLOYMENT]
        args_ += ["--chunk-size", str(CHUNK), "--pool-size", "64MiB", "--log-level", "warning"]
        try:
            kv = KVCache(longest // BLOCK + 1, layers=1, heads=1)
            with (
                server_process(*args_, start_timeout_s=START_S) as (url, _),
                httpx.Client(base_url=url, timeout=60.0) as http,
            ):
                http.post("/negotiate", json={"required_alignment": BLOCK}).raise_for_status()
                TOKENS["tiny"], sock = register_over(http, kv.register_body("tiny", NAMESPACE))
                blocks = list(range(1, longest // BLOCK + 1))
                stored = transfer(
                    http, "/cache/store", "s", prompt, blocks, 0, longest, "tiny", NAMESPACE
                )
                assert stored["stored_chunks"] == longest // CHUNK, stored
                http.post("/cache/end", json={"request_ids": ["s"]})
                fakes = _fake_members(client, prompt, max(MEMBERS) - 1)
                bodies = {name: (json.dumps(prompt[:n].tolist()), n) for name, n in LENGTHS.items()}
                for r in range(-1, rounds_n):  # round -1 warms up
                    measure_round(http, client, fakes, bodies, args.calls, lat if r >= 0 else None)
                sock.close()
        finally:
            client.close()
            if kv is not None:
                kv.close()

    print(load_line())
    for members in MEMBERS:
        names = [f"cluster lookup {n}, {members} member{'s' * (members > 1)}" for n in LENGTHS]
        print()
        print(
            lat.table(
                [*names, *(f"cache lookup {n}" for n in LENGTHS)],
                "cache lookup 1k",
                unit="ms",
                ratio_label="/ cache lookup 1k",
            )
        )
    print()
    print(results(FIGURES, lat))


def measure_round(
    http: httpx.Client,
    client: redis_py.Redis,
    fakes: list[str],
    bodies: dict[str, tuple[str, int]],
    calls: int,
    lat: Rounds | None,
) -> None:
    cache_times: dict[str, list[float]] = {name: [] for name in bodies}
    for members in MEMBERS:
        _live(client, fakes[: members - 1])
        for name, (tokens, n) in bodies.items():
            cluster: list[float] = []
            body = f'{{"model": "{MODEL}", "tokens": {tokens}}}'.encode()
            for i in range(calls):
                rid = f"c{members}-{i}"
                lookup = (
                    f'{{"requests": [{{"request_id": "{rid}", "namespace": "{NAMESPACE}", '
                    f'"tokens": {tokens}}}]}}'
                ).encode()
                begin = time.perf_counter()
                reply = http.post(
                    "/cluster/lookup", content=body, headers={"content-type": "application/json"}
                )
                cluster.append((time.perf_counter() - begin) * 1e3)
                servers = reply.json()["servers"]
                assert len(servers) == members and all(s["l1_tokens"] == n for s in servers)
                begin = time.perf_counter()
                reply = http.post(
                    "/cache/lookup", content=lookup, headers={"content-type": "application/json"}
                )
                cache_times[name].append((time.perf_counter() - begin) * 1e3)
                assert reply.json()["results"][0]["hit_tokens"] == n, reply.text
            ids = [f"c{members}-{i}" for i in range(calls)]
            http.post("/cache/end", json={"request_ids": ids})
            if lat is not None:
                plural = "s" * (members > 1)
                lat.add(
                    f"cluster lookup {name}, {members} member{plural}", statistics.median(cluster)
                )
    if lat is not None:
        for name, samples in cache_times.items():
            lat.add(f"cache lookup {name}", statistics.median(samples))


if __name__ == "__main__":
    main()
