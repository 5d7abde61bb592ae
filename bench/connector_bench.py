"""Connector overhead on vLLM's scheduler path, against a bare /health round trip.

Measures, in one run against one real server (started here unless ``--url``):

- ``GET /health``: the floor, one HTTP round trip;
- ``get_num_new_matched_tokens`` for 1k- and 32k-token prompts whose chunks are
  cached (a fresh request each time, so nothing is memoised: token packing, one
  ``/cache/lookup`` and the server's prefix hashing are all included);
- ``build_connector_meta`` for a step of 64 new requests (1k-token prompts, each
  storing its whole chunks): pure planning, no HTTP on this path.

Prints p50/p99 in milliseconds and each p50 as a multiple of the /health p50.

    python bench/connector_bench.py [--url http://127.0.0.1:8733] [--iterations 200]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from connector.alignment import layout_from_groups  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.scheduler import SchedulerAdapter  # noqa: E402
from connector.worker import WorkerAdapter  # noqa: E402

BLOCK_SIZE = 16
CHUNK = 256
NAMESPACE = "bench@layout/ws1"


# ----------------------------------------------------------- vLLM-shaped doubles


@dataclass(frozen=True)
class _Spec:
    block_size: int


@dataclass
class _Group:
    kv_cache_spec: Any
    layer_names: list[str]


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None


@dataclass
class _Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class _NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class _Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class _Step:
    scheduled_new_reqs: list[_NewReq]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: _Cached = field(default_factory=_Cached)


# ----------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url:
        yield url.rstrip("/")
        return
    port = _free_port()
    env = {**os.environ, "MPCACHE_POOL_SIZE": os.environ.get("MPCACHE_POOL_SIZE", "256MiB")}
    cmd = [sys.executable, "-m", "app", "server", "--chunk-size", str(CHUNK)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("server did not become healthy")
            time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# ------------------------------------------------------------------- measuring


def _time(fn: Callable[[int], object], n: int, warmup: int = 5) -> list[float]:
    for i in range(warmup):
        fn(-1 - i)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 50000 for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server (chunk size must be 256)")
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    n = max(20, args.iterations)

    layout = layout_from_groups([_Group(_Spec(BLOCK_SIZE), ["l0"])])
    with _server(args.url) as url:
        config = ConnectorConfig(server_urls=(url,), request_timeout_s=10, lookup_timeout_s=10)
        common = {"model": "bench", "instance_id": "bench", "namespace": NAMESPACE}
        sched = SchedulerAdapter(config, layout, world_size=1, **common)  # type: ignore[arg-type]
        num_blocks = 32768 // BLOCK_SIZE + 1
        worker = WorkerAdapter(
            config,
            layout,
            rank=0,
            world_size=1,
            num_blocks=num_blocks,
            **common,  # type: ignore[arg-type]
        )
        try:
            if sched.chunk_size != CHUNK:
                raise SystemExit(f"server chunk size is {sched.chunk_size}, need {CHUNK}")
            worker.register_kv_caches({"l0": torch.zeros(num_blocks, 2, BLOCK_SIZE, 1, 8)})
            blocks = list(range(1, num_blocks))
            prompts = {1024: _prompt(1024 + 1, 1), 32768: _prompt(32768 + 1, 2)}
            for size, prompt in prompts.items():  # cache every whole chunk of both prompts
                seed = _Request(f"seed-{size}", prompt, len(prompt))
                sched.get_num_new_matched_tokens(seed, 0)
                sched.update_state_after_alloc(seed, _Blocks((blocks,)), 0)
                plan = sched.build_connector_meta(
                    _Step([_NewReq(seed.request_id, (blocks,), 0)], {seed.request_id: size + 1})
                )
                worker.save(plan)
                sched.request_finished(seed)

            client = httpx.Client(base_url=url)
            health = _time(lambda i: client.get("/health").raise_for_status(), n)
            results = {"GET /health round trip": health}
            for size, prompt in prompts.items():

                def lookup(i: int, size: int = size, prompt: list[int] = prompt) -> None:
                    req = _Request(f"l{size}-{i}", prompt, len(prompt))
                    hit, _ = sched.get_num_new_matched_tokens(req, 0)
                    assert hit == size, (hit, size)
                    sched.request_finished(req)

                label = f"get_num_new_matched_tokens {size // 1024}k (hit)"
                results[label] = _time(lookup, n if size <= 1024 else max(20, n // 4))

            def build(i: int) -> None:
                step = _Step([], {})
                for r in range(64):
                    req = _Request(f"b{i}-{r}", _prompt(1024, 1000 * i + r), 1024)
                    ids = list(range(1 + r * 64, 1 + (r + 1) * 64))
                    sched.update_state_after_alloc(req, _Blocks((ids,)), 0)
                    step.scheduled_new_reqs.append(_NewReq(req.request_id, (ids,), 0))
                    step.num_scheduled_tokens[req.request_id] = 1024
                t0 = time.perf_counter()
                plan = sched.build_connector_meta(step)
                build.elapsed_ms = (time.perf_counter() - t0) * 1e3  # type: ignore[attr-defined]
                assert len(plan.stores) == 64
                for rid in step.num_scheduled_tokens:
                    sched.request_finished(_Request(rid, [], 0))

            build_times = []
            for i in range(max(20, n // 4) + 3):
                build(i)
                if i >= 3:
                    build_times.append(build.elapsed_ms)  # type: ignore[attr-defined]
            results["build_connector_meta 64 req x 1k"] = build_times
            client.close()
        finally:
            worker.shutdown()
            sched.shutdown()

    floor = _p(health, 50)
    print(f"{'operation':42s} {'p50 ms':>9s} {'p99 ms':>9s} {'p50 / health':>13s}")
    for label, values in results.items():
        p50, p99 = _p(values, 50), _p(values, 99)
        print(f"{label:42s} {p50:9.3f} {p99:9.3f} {p50 / floor:12.2f}x")


if __name__ == "__main__":
    main()
