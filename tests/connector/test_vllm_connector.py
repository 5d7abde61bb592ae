"""The connector inside real vLLM 0.33: factory, real Scheduler, real server."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from connector.errors import StartupError
from tests.connector.conftest import require_vllm
from tests.connector.fakes import FakeServer
from tests.support import ROOT, server_process, wait_until

# --------------------------------------------------------------- import hygiene


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_has_no_side_effects() -> None:
    proc = _run(
        "import sys, threading\n"
        "import connector\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert connector.resolve_chunk_size(96, 256) == 288\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_pure_parts_work_without_vllm() -> None:
    proc = _run(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import connector\n"
        "from connector import parse_extra_config, required_alignment\n"
        "assert required_alignment([32, 48]) == 96\n"
        "assert parse_extra_config({}).heartbeat_interval_s == 10.0\n"
        "try:\n"
        "    connector.MPCacheConnector\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('needs', exc.name)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "needs vllm"


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server_64() -> Iterator[str]:
    with server_process("--chunk-size", "64") as (url, _proc):
        yield url


def _factory(config: Any, role: str, kv_cache_config: Any) -> Any:
    from tests.connector.vllm_support import make_connector

    return make_connector(config, role, kv_cache_config)


# -------------------------------------------------------------------- factory


@pytest.mark.vllm
@pytest.mark.slow
def test_factory_builds_both_roles(tiny_model_dir: Path, server_64: str, built: list[Any]) -> None:
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from connector import MPCacheConnector
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    extra = {"mpcache.server_urls": server_64, "lmcache.mp.heartbeat_interval": "30"}
    config = make_vllm_config(tiny_model_dir, extra)
    # SupportsHMA keeps vLLM's hybrid allocator on.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kvcc = make_kv_cache_config(num_blocks=32)
    for role in ("scheduler", "worker"):
        conn = _factory(config, role, kvcc)
        built.append(conn)
        assert type(conn) is MPCacheConnector
        assert isinstance(conn, KVConnectorBase_V1) and isinstance(conn, SupportsHMA)
        assert conn.chunk_size == 64
        assert conn.requires_kv_delivery is False
        assert conn.mp_config.heartbeat_interval_s == 30.0
    sched, worker = built
    assert sched.scheduler_adapter is not None and sched.worker_adapter is None
    assert worker.worker_adapter is not None and worker.scheduler_adapter is None
    assert sched.scheduler_adapter.namespace == worker.worker_adapter.namespace


@pytest.mark.vllm
def test_bad_extra_config_fails_startup_naming_the_key(tiny_model_dir: Path) -> None:
    require_vllm()
    from connector.errors import ConfigError
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    config = make_vllm_config(tiny_model_dir, {"lmcache.mp.heartbeat_interval": "often"})
    with pytest.raises(ConfigError, match=r"lmcache\.mp\.heartbeat_interval"):
        _factory(config, "scheduler", make_kv_cache_config(num_blocks=8))


@pytest.mark.vllm
@pytest.mark.slow
def test_multi_server_agree_and_disagree(tiny_model_dir: Path, built: list[Any]) -> None:
    require_vllm()
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    kvcc = make_kv_cache_config(num_blocks=8)
    with (
        server_process("--chunk-size", "64") as (a, _),
        server_process("--chunk-size", "50") as (b, _),
        server_process("--chunk-size", "100") as (c, _),
    ):
        agree = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": [a, b]})
        conn = _factory(agree, "scheduler", kvcc)
        built.append(conn)
        assert conn.chunk_size == 64  # 50 rounds up to 64 for alignment 16

        disagree = make_vllm_config(
            tiny_model_dir, {"mpcache.server_urls": f"{a},{c}", "mpcache.startup_timeout": 2}
        )
        with pytest.raises(StartupError) as info:
            _factory(disagree, "scheduler", kvcc)
    text = str(info.value)
    assert f"{a} -> chunk size 64" in text
    assert f"{c} -> chunk size 112" in text


# ---------------------------------------------------------- scheduler in the loop


def _run_two_requests(
    tiny_model_dir: Path, extra: dict[str, Any], built: list[Any], *, key_index: bool
) -> Any:
    """Request A computes a 150-token prompt; B repeats it. Returns the driver.
    ``key_index``: the server publishes one, so B's load is planned in the step vLLM
    first asks about B; without, B's lookup is asked of the server, and answered in a
    later step."""
    from tests.connector.vllm_support import (
        LAYERS,
        CpuWorker,
        kv_value,
        make_kv_cache_config,
        make_request,
        make_scheduler,
        make_vllm_config,
    )

    num_blocks = 64
    config = make_vllm_config(tiny_model_dir, extra, max_num_batched_tokens=96)
    kvcc = make_kv_cache_config(num_blocks)
    scheduler = make_scheduler(config, kvcc)
    built.append(scheduler.connector)
    worker_conn = _factory(config, "worker", kvcc)
    built.append(worker_conn)
    worker = CpuWorker(worker_conn, scheduler, num_blocks)

    prompt = [(i * 37 + 11) % 997 for i in range(150)]
    scheduler.add_request(make_request("A", prompt))

    # A's lookup (a miss), then chunked prefill of 96 tokens per step.
    def a_finished() -> bool:
        worker.step()
        return not scheduler.requests

    wait_until(a_finished, what="A finished", poll_s=0.001)
    for t in worker.kv.values():  # forget everything A left in vLLM's blocks
        t.zero_()

    scheduler.add_request(make_request("B", prompt))
    out, _ = worker.step()
    if key_index:  # answered at once: blocks allocated, the load runs in this step...
        assert [op.request_id for op in _loads(out)] == ["B"]
    else:  # B's lookup starts: vLLM skips B while it is in flight
        assert out.scheduled_new_reqs == [] and "B" not in out.num_scheduled_tokens
        # Later steps: the answer lands, blocks are allocated and the load runs...
        out = step_until(
            worker, lambda out: any(op.request_id == "B" for op in _loads(out)), "load"
        )
    assert out.scheduled_new_reqs == []

    # The load runs off the step: vLLM keeps B waiting until it is reported done.
    def b_loaded() -> bool:
        out, _ = worker.step()
        assert "B" not in out.num_scheduled_tokens
        return "B" in scheduler.finished_recving_kv_req_ids

    wait_until(b_loaded, what="B's load reported", poll_s=0.001)
    blocks_b = worker.blocks_of("B")
    loaded = {
        layer: [worker.slot(layer, blocks_b, p).clone() for p in range(len(blocks_b) * 16)]
        for layer in LAYERS
    }
    # ...then B is scheduled with the loaded tokens computed.
    out, _ = worker.step()
    (new,) = out.scheduled_new_reqs
    assert worker_conn.worker_adapter.flush(10.0)  # B's store has been sent
    return worker, new, prompt, loaded, kv_value


def _loads(out: Any) -> tuple[Any, ...]:
    return tuple(out.kv_connector_metadata.plan.loads)


def step_until(worker: Any, done: Callable[[Any], bool], what: str) -> Any:
    """Step the engine until ``done(scheduler_output)`` holds; that output."""
    found: list[Any] = []

    def step() -> bool:
        out, _ = worker.step()
        if done(out):
            found.append(out)
        return bool(found)

    wait_until(step, what=what, poll_s=0.001)
    return found[0]


@pytest.mark.vllm
def test_scheduler_in_the_loop_fake_server(
    tiny_model_dir: Path, built: list[Any], fake_server: FakeServer
) -> None:
    """Control flow with vLLM's real Scheduler against the in-memory server."""
    fake = fake_server
    _worker, new, _prompt, _loaded, _ = _run_two_requests(
        tiny_model_dir, {"mpcache.server_urls": fake.url}, built, key_index=False
    )
    assert new.req_id == "B"
    assert new.num_computed_tokens == 128  # two whole chunks came from the cache
    paths = fake.paths()
    assert paths.count("POST /cache/retrieve") == 1
    stores = [
        [(r["request_id"], r["start_token"], r["end_token"]) for r in body["requests"]]
        for _, path, body in fake.calls
        if path == "/cache/store"
    ]
    # One batched call per step with work: A's two prefill steps (whole chunks, then the
    # last chunk and the prompt's tail), and B's tail, which this fake (whole chunks
    # only) did not keep.
    assert stores == [[("A", 0, 64)], [("A", 64, 144)], [("B", 128, 144)]]
    wait_until(lambda: fake.ended == ["A"])  # A's session ended off vLLM's thread


@pytest.mark.vllm
@pytest.mark.slow
def test_scheduler_in_the_loop_real_server(
    tiny_model_dir: Path, server_64: str, built: list[Any]
) -> None:
    """A real Scheduler, a CPU worker and a real server: B loads A's exact bytes."""
    require_vllm()
    _worker, new, prompt, loaded, kv_value = _run_two_requests(
        tiny_model_dir, {"mpcache.server_urls": server_64}, built, key_index=True
    )
    assert new.req_id == "B"
    assert new.num_computed_tokens == 144  # two chunks and the tail's one block
    for li, layer in enumerate(loaded):
        for p in range(144):
            expected = kv_value(prompt[p], p, li)
            assert bool((loaded[layer][p] == expected).all()), (layer, p)


# ------------------------------------------------------------ failure contract


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("policy", "warnings"),
    [pytest.param(None, 1, id="vllm-default-fail"), pytest.param("recompute", 0, id="recompute")],
)
def test_scheduler_recomputes_failed_loads(
    tiny_model_dir: Path,
    fake_server: FakeServer,
    built: list[Any],
    caplog: pytest.LogCaptureFixture,
    policy: str | None,
    warnings: int,
) -> None:
    """A best-effort cache must never fail a request for a load: vLLM's default
    policy "fail" is switched to "recompute" before the real Scheduler reads it."""
    from tests.connector.vllm_support import (
        make_kv_cache_config,
        make_scheduler,
        make_vllm_config,
    )

    config = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": fake_server.url})
    transfer = config.kv_transfer_config
    if policy is not None:
        transfer.kv_load_failure_policy = policy
    assert transfer.kv_load_failure_policy == (policy or "fail")
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        scheduler = make_scheduler(config, make_kv_cache_config(num_blocks=32))
    built.append(scheduler.connector)
    assert scheduler.recompute_kv_load_failures is True
    assert transfer.kv_load_failure_policy == "recompute"
    notes = [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert len(notes) == warnings
    assert all(r.levelno == logging.WARNING for r in notes)
    if notes:
        text = notes[0].getMessage()
        assert "best-effort" in text and '"kv_load_failure_policy": "recompute"' in text


def _worker_connector(
    tiny_model_dir: Path, fake: FakeServer, built: list[Any], kvcc: Any, layers: dict[str, Any]
) -> Any:
    from tests.connector.vllm_support import make_vllm_config

    config = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": fake.url})
    conn = _factory(config, "worker", kvcc)
    built.append(conn)
    conn.register_kv_caches(layers)
    assert conn.worker_adapter.available
    return conn


def _bind(conn: Any, *ops: Any) -> None:
    from connector import MPCacheConnectorMetadata
    from connector.metadata import StepPlan

    conn.bind_connector_metadata(MPCacheConnectorMetadata(StepPlan(loads=ops)))


def _kv_layers(num_blocks: int, names: Sequence[str]) -> dict[str, Any]:
    import torch

    return {name: torch.zeros(num_blocks, 2, 16, 2, 8) for name in names}


@pytest.mark.vllm
def test_load_error_escaping_the_adapter_is_reported_failed(
    tiny_model_dir: Path,
    fake_server: FakeServer,
    built: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """start_load_kv swallows the error; vLLM must still learn the blocks are bad."""
    from connector.metadata import TransferOp
    from contract.tokens import encode_tokens
    from tests.connector.vllm_support import LAYERS, make_kv_cache_config

    conn = _worker_connector(
        tiny_model_dir, fake_server, built, make_kv_cache_config(16), _kv_layers(16, LAYERS)
    )

    def cuda_error() -> None:
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(conn.worker_adapter, "_device_event", cuda_error)
    _bind(conn, TransferOp("B", 0, 64, encode_tokens(range(64)), [[0, 3, 4, 5]]))
    with caplog.at_level(logging.ERROR, logger="mpcache.connector"):
        conn.start_load_kv(None)  # never raises into vLLM
    assert any("start_load_kv failed" in r.getMessage() for r in caplog.records)
    results = conn.get_transfer_results(set())
    assert results.finished_recving == {"B"}  # released from the wait...
    assert conn.get_block_ids_with_load_errors() == {3, 4, 5}  # ...and recomputed


@pytest.mark.vllm
@pytest.mark.parametrize("multi_group", [False, True], ids=["single-group", "multi-group"])
def test_get_finished_does_not_lose_failed_loads(
    tiny_model_dir: Path, fake_server: FakeServer, built: list[Any], multi_group: bool
) -> None:
    """vLLM's older get_finished() has no failure channel. Block-level failures go
    through get_block_ids_with_load_errors(); request-level ones (multi-group) stay
    queued for get_transfer_results() instead of being reported as loaded."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from connector.metadata import TransferOp
    from contract.tokens import encode_tokens
    from tests.connector.vllm_support import HEAD_SIZE, LAYERS, NUM_KV_HEADS, make_kv_cache_config

    if multi_group:
        groups = [
            KVCacheGroupSpec(
                layer_names=[name],
                kv_cache_spec=FullAttentionSpec(
                    block_size=bs,
                    num_kv_heads=NUM_KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=torch.float32,
                ),
            )
            for name, bs in zip(LAYERS, (16, 32), strict=True)
        ]
        kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
        blocks = [[3, 4, 5, 6], [7, 8]]
    else:
        kvcc = make_kv_cache_config(16)
        blocks = [[3, 4, 5, 6]]
    conn = _worker_connector(tiny_model_dir, fake_server, built, kvcc, _kv_layers(16, LAYERS))
    _bind(conn, TransferOp("MISS", 0, 64, encode_tokens(range(64)), blocks))  # nothing cached
    conn.start_load_kv(None)
    assert conn.worker_adapter.flush(5.0)  # the load's call has returned

    sending, recving = conn.get_finished(set())
    assert sending is None
    if multi_group:
        assert recving is None  # not reported as loaded...
        assert conn.get_block_ids_with_load_errors() == set()  # (vLLM refuses these here)
        results = conn.get_transfer_results(set())
        assert results.finished_recving == {"MISS"}  # ...but as finished and failed
        assert results.failed_recving == {"MISS"}
    else:
        assert recving == {"MISS"}
        assert conn.get_block_ids_with_load_errors() == {3, 4, 5, 6}
    assert conn.get_transfer_results(set()).finished_recving == set()


@pytest.mark.vllm
def test_real_scheduler_async_lookups_lose_nothing(
    tiny_model_dir: Path, fake_server: FakeServer, built: list[Any]
) -> None:
    """vLLM's real Scheduler with lookups in flight: the requests first seen in a step
    are skipped (None) and looked up in one call; each is admitted later with its own
    answer (hits load 128 tokens, misses none); an abort while the lookup is in
    flight leaves no session behind; every request finishes."""
    from vllm.v1.request import RequestStatus

    from tests.connector.vllm_support import (
        CpuWorker,
        make_kv_cache_config,
        make_request,
        make_scheduler,
        make_vllm_config,
    )

    num_blocks = 128
    extra = {"mpcache.server_urls": fake_server.url}
    config = make_vllm_config(tiny_model_dir, extra, max_num_batched_tokens=2048)
    kvcc = make_kv_cache_config(num_blocks)
    scheduler = make_scheduler(config, kvcc)
    built.append(scheduler.connector)
    worker_conn = _factory(config, "worker", kvcc)
    built.append(worker_conn)
    worker = CpuWorker(worker_conn, scheduler, num_blocks)

    cached = [(i * 37 + 11) % 997 for i in range(150)]
    scheduler.add_request(make_request("seed", cached))
    step_until(worker, lambda out: not scheduler.requests, "seed finished")

    fake_server.lookup_gate.clear()
    hits = [f"hit{i}" for i in range(3)]
    misses = [f"miss{i}" for i in range(3)]
    for rid in hits:
        scheduler.add_request(make_request(rid, cached))
    for i, rid in enumerate(misses):
        scheduler.add_request(make_request(rid, [(t * 7 + i) % 991 for t in range(150)]))
    scheduler.add_request(make_request("aborted", cached))
    before = len(fake_server.lookups())
    for _ in range(3):  # lookups in flight: nothing is admitted, nothing blocks
        out, _ = worker.step()
        assert out.scheduled_new_reqs == [] and not _loads(out)
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    fake_server.lookup_gate.set()

    admitted: dict[str, int] = {}

    def all_done(out: Any) -> bool:
        for new in out.scheduled_new_reqs:
            admitted[new.req_id] = new.num_computed_tokens
        return not scheduler.requests

    step_until(worker, all_done, "every request finished")
    assert fake_server.lookups()[before] == [*hits, *misses, "aborted"]  # one batch
    assert admitted == {**dict.fromkeys(hits, 128), **dict.fromkeys(misses, 0)}
    wait_until(lambda: fake_server.ended.count("aborted") == 2)
    calls = [(p, b) for _, p, b in fake_server.calls if p in ("/cache/lookup", "/cache/end")]
    last = max(i for i, (_, b) in enumerate(calls) if "aborted" in str(b))
    assert calls[last][0] == "/cache/end"  # its session ended after its lookup
