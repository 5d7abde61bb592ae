"""bench/timed_connector.py: every call vLLM makes on a step is timed, once per step.

bench/step_bench.py's figures are only as good as this wrapper's coverage: a call
vLLM makes on its step that the wrapper misses would hide a wait moved into it. The
calls are read from the installed vLLM (0.33 here; the bench's engine runs the e2e
venv's 0.32, whose step makes the same calls).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.connector.conftest import require_vllm
from tests.connector.fakes import FakeServer


def _called_on_the_step() -> set[str]:
    """The connector methods vLLM's step code calls, read from the installed vLLM."""
    import vllm

    root = Path(vllm.__file__).parent
    mixin = (root / "v1/worker/kv_connector_model_runner_mixin.py").read_text()
    layers = (root / "model_executor/layers/attention/kv_transfer_utils.py").read_text()
    runner = (root / "v1/worker/gpu_model_runner.py").read_text()
    names = set(re.findall(r"\bkv_connector\.([a-z_]+)\(", mixin))
    names |= set(re.findall(r"\bconnector\.([a-z_]+)\(", layers))
    # execute_model's own call; the runner's other calls are made at start-up.
    names |= set(re.findall(r"get_kv_transfer_group\(\)\.([a-z_]+)\(", runner))
    return names - {"register_kv_caches", "set_host_xfer_buffer_ops", "get_mem_pool_context"}


@pytest.mark.vllm
def test_every_connector_call_of_vllms_step_is_timed() -> None:
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from bench.timed_connector import STEP_CALLS

    called = _called_on_the_step()
    assert {"bind_connector_metadata", "wait_for_save", "handle_preemptions"} <= called
    assert called <= set(STEP_CALLS), called - set(STEP_CALLS)
    assert all(callable(getattr(KVConnectorBase_V1, name)) for name in STEP_CALLS)


def _timed_connector(tiny_model_dir: Path, fake: FakeServer, role: str) -> Any:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from tests.connector.vllm_support import LAYERS, make_kv_cache_config, make_vllm_config

    config = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": fake.url})
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector = "TimedMPCacheConnector"
    config.kv_transfer_config.kv_connector_module_path = "bench.timed_connector"
    conn = KVConnectorFactory.create_connector(
        config, KVConnectorRole[role.upper()], make_kv_cache_config(16)
    )
    if role == "worker":
        conn.register_kv_caches({name: torch.zeros(16, 2, 16, 2, 8) for name in LAYERS})
    return conn


@pytest.mark.vllm
def test_one_record_per_step_with_its_calls_and_plan(
    tiny_model_dir: Path, fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from connector import MPCacheConnectorMetadata
    from connector.metadata import StepPlan, TransferOp
    from contract.tokens import encode_tokens

    records = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MPCACHE_STEP_RECORDS", str(records))
    scheduler = _timed_connector(tiny_model_dir, fake_server, "scheduler")
    worker = _timed_connector(tiny_model_dir, fake_server, "worker")
    try:
        store = TransferOp("A", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4]])
        plan = MPCacheConnectorMetadata(StepPlan(stores=(store,)))
        worker.handle_preemptions(plan)  # vLLM calls it before the bind
        worker.bind_connector_metadata(plan)
        worker.start_load_kv(None)
        assert worker.has_connector_metadata()
        worker.wait_for_save()
        worker.get_transfer_results(set())
        worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        worker.bind_connector_metadata(MPCacheConnectorMetadata(StepPlan()))
        worker.clear_connector_metadata()
        scheduler.get_kv_connector_stats()  # the scheduler role records nothing
    finally:
        worker.shutdown()
        scheduler.shutdown()
    first, second = (json.loads(line) for line in records.read_text().splitlines())
    assert (first["loads"], first["stores"]) == (0, 1)
    assert fake_server.chunks  # the wrapped wait_for_save did store
    assert {name: n for name, (n, _) in first["calls"].items()} == {
        "handle_preemptions": 1,
        "bind_connector_metadata": 1,
        "start_load_kv": 1,
        "has_connector_metadata": 1,
        "wait_for_save": 1,
        "get_transfer_results": 1,
        "get_block_ids_with_load_errors": 1,
        "clear_connector_metadata": 1,
    }
    assert first["ms"] == pytest.approx(sum(ms for _, ms in first["calls"].values()))
    assert (second["loads"], second["stores"]) == (0, 0)
    assert set(second["calls"]) == {"bind_connector_metadata", "clear_connector_metadata"}
    assert "stalled_ms" not in first  # only with MPCACHE_STEP_CPU=1


@pytest.mark.vllm
def test_with_cpu_reads_each_record_says_what_of_its_time_the_host_took(
    tiny_model_dir: Path, fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from connector import MPCacheConnectorMetadata
    from connector.metadata import StepPlan

    records = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MPCACHE_STEP_RECORDS", str(records))
    monkeypatch.setenv("MPCACHE_STEP_CPU", "1")
    worker = _timed_connector(tiny_model_dir, fake_server, "worker")
    try:
        for _ in range(3):
            worker.bind_connector_metadata(MPCacheConnectorMetadata(StepPlan()))
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
    finally:
        worker.shutdown()
    steps = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(steps) == 3
    for step in steps:
        assert 0.0 <= step["stalled_ms"] <= step["ms"]


@pytest.mark.vllm
def test_a_call_that_never_switched_lost_its_wall_time_past_its_cpu_time_to_the_host() -> None:
    require_vllm()
    from bench.timed_connector import ThreadClock, host_stall_ms

    before = ThreadClock(cpu_s=1.0, switches=7)
    held = ThreadClock(cpu_s=1.0005, switches=7)  # 0.5 ms of CPU, no switch
    assert host_stall_ms(0.003, before, held) == pytest.approx(2.5)
    # A thread that switched may have waited on the connector: nothing is the host's.
    assert host_stall_ms(0.003, before, ThreadClock(cpu_s=1.0005, switches=8)) == 0.0
    # The CPU reads span the wall clock's, so CPU time may exceed it: no stall.
    assert host_stall_ms(0.0004, before, held) == 0.0


@pytest.mark.vllm
def test_the_thread_clock_sees_a_wait_as_a_switch_and_work_as_cpu_time() -> None:
    require_vllm()
    import threading
    import time

    from bench.timed_connector import ThreadClock, host_stall_ms

    before = ThreadClock.read()
    threading.Event().wait(0.02)  # sleeps: a voluntary switch
    after = ThreadClock.read()
    assert after.switches > before.switches
    assert host_stall_ms(0.02, before, after) == 0.0

    before = ThreadClock.read()
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:  # bounded busy work
        pass
    after = ThreadClock.read()
    assert after.cpu_s - before.cpu_s > 0.005


def test_host_steal_is_read_from_proc_stat_in_ms(tmp_path: Path) -> None:
    import os

    from bench.step_bench import host_steal_ms

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 20 900 5 0 1 250 0 0\ncpu0 50 0 10 450 2 0 1 125 0 0\n")
    assert host_steal_ms(stat) == pytest.approx(250 * 1e3 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("intr 1 2 3\n")
    assert host_steal_ms(stat) is None
    assert host_steal_ms(tmp_path / "missing") is None


def test_a_step_past_the_bound_counts_as_the_connectors_only_past_the_hosts_stalls() -> None:
    from bench.step_bench import past_max

    steps = [
        {"ms": 4.4, "stalled_ms": 4.2},  # the host took it
        {"ms": 3.0, "stalled_ms": 0.5},  # 2.5 ms of the connector's own
        {"ms": 2.5},  # a plain run's record: not known, counted as the connector's
        {"ms": 0.3, "stalled_ms": 0.0},
    ]
    assert past_max(steps) == (3, 2)


def test_an_engines_decode_time_in_a_round_weighs_both_of_its_phases() -> None:
    import math

    from bench.step_bench import merged

    def phase(ms: float, alone: float, gap: float) -> dict[str, object]:
        return {
            "ms_per_token": ms,
            "ms_per_token_outside_prefills": ms - 1,
            "tokens": 50,
            "prefill_steps": 3,
            "max_gap_ms": gap,
            "alone_ms_per_token": alone,
            "outlived": True,
        }

    # The phases sit at both ends of the round (A B B A): a drift of the machine
    # over it moves one up and the other down, and their mean stays put.
    decode = merged([phase(20.0, math.nan, 900.0), phase(30.0, 24.0, 700.0)])
    assert decode["ms_per_token"] == 25.0
    assert decode["ms_per_token_outside_prefills"] == 24.0
    assert (decode["tokens"], decode["prefill_steps"], decode["max_gap_ms"]) == (100, 6, 900.0)
    assert decode["alone_ms_per_token"] == 24.0  # a phase R did not outlive is left out
    assert len(decode["phases"]) == 2
