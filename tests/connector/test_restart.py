"""Restart recovery (docs/design.md s.3) with real server processes killed by SIGKILL.

The connectors are built by vLLM's factory; every vLLM-facing call made while the
server is gone or incompatible must answer in degraded mode, never raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from connector.metadata import StepPlan, TransferOp
from contract.tokens import encode_tokens
from tests.connector.conftest import require_vllm
from tests.support import free_port, returns_promptly, server_process, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_BLOCKS = 32


def _health(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/health", timeout=2).json()
    return body


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[Callable[[str, float], tuple[Any, Any]]]:
    """Build (scheduler, worker) connectors for a URL and heartbeat interval."""
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from tests.connector.vllm_support import (
        BLOCK_SIZE,
        HEAD_SIZE,
        LAYERS,
        NUM_KV_HEADS,
        make_kv_cache_config,
        make_vllm_config,
    )

    made: list[Any] = []

    def build(url: str, interval: float) -> tuple[Any, Any]:
        extra = {
            "mpcache.server_urls": url,
            "lmcache.mp.heartbeat_interval": interval,
            "mpcache.heartbeat_timeout": 0.5,
            "mpcache.request_timeout": 1.0,
            "mpcache.lookup_timeout": 0.5,
        }
        config = make_vllm_config(tiny_model_dir, extra)
        kvcc = make_kv_cache_config(NUM_BLOCKS)
        sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kvcc)
        made.append(sched)
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kvcc)
        made.append(worker)
        shape = (NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
        worker.register_kv_caches({name: torch.zeros(shape) for name in LAYERS})
        return sched, worker

    yield build
    for c in made:
        c.shutdown()


def _links(sched: Any, worker: Any) -> list[Any]:
    return [*sched.scheduler_adapter.links.values(), worker.worker_adapter.link]


def _vllm_calls_degrade(sched: Any, worker: Any) -> None:
    """Drive every step-time entry point vLLM uses; none may raise or block long."""
    from connector.mp_connector import MPCacheConnectorMetadata
    from tests.connector.vllm_support import make_request

    request = make_request("degraded", list(range(300)))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    op = TransferOp("degraded", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4]])
    worker.bind_connector_metadata(MPCacheConnectorMetadata(StepPlan(loads=(op,), stores=(op,))))
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"degraded"}
    assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 4}  # vLLM recomputes
    worker.clear_connector_metadata()
    assert sched.request_finished_all_groups(request, ([],)) == (False, None)


def test_sigkill_and_restart_with_same_size_recovers(
    pair: Callable[[str, float], tuple[Any, Any]],
) -> None:
    port = free_port()
    with server_process("--chunk-size", "64", port=port) as (url, proc):
        sched, worker = pair(url, 0.2)
        first = _health(url)
        assert (first["chunk_size"], first["registrations"]) == (64, 1)
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: not any(link.healthy for link in _links(sched, worker)))
        returns_promptly(lambda: _vllm_calls_degrade(sched, worker))
    # The same server, started the other documented way: uvicorn + MPCACHE_* env.
    with server_process(port=port, uvicorn=True, env={"MPCACHE_CHUNK_SIZE": "64"}) as (url, _):
        wait_until(lambda: all(link.healthy for link in _links(sched, worker)))
        second = _health(url)
        assert second["boot_id"] != first["boot_id"]
        assert second["chunk_size"] == 64  # re-negotiated with the original alignment
        assert second["registrations"] == 1  # the worker re-registered
        assert worker.worker_adapter.available
        assert sched.chunk_size == worker.chunk_size == 64


def test_restart_with_other_size_stays_degraded(
    pair: Callable[[str, float], tuple[Any, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    with server_process("--chunk-size", "64", port=port) as (url, proc):
        sched, worker = pair(url, 0.2)
        proc.kill()
        proc.wait(timeout=10)
    with (
        caplog.at_level(logging.WARNING, logger="mpcache.connector"),
        server_process("--chunk-size", "100", port=port) as (url, _),
    ):
        beats = [sched.scheduler_adapter.heartbeat, worker.worker_adapter.heartbeat]
        wait_until(lambda: _health(url)["chunk_size"] == 112)
        rounds = [hb.rounds for hb in beats]
        # Each adapter has pinged (and failed to re-join) several times since.
        wait_until(lambda: all(hb.rounds >= r + 5 for hb, r in zip(beats, rounds, strict=True)))
        assert not any(link.healthy for link in _links(sched, worker))
        returns_promptly(lambda: _vllm_calls_degrade(sched, worker))
        assert _health(url)["registrations"] == 0
    refusals = [
        r.message for r in caplog.records if "cannot re-join" in r.message and "112" in r.message
    ]
    assert len(refusals) == 2  # once per adapter, not once per heartbeat
    assert all("64" in m for m in refusals)


def test_restart_between_two_pings_is_detected_by_boot_id(
    pair: Callable[[str, float], tuple[Any, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    interval = 3600.0  # no ping of its own while the server restarts: rounds come from wake()
    beats: list[Any] = []
    with server_process("--chunk-size", "64", port=port) as (url, proc):
        sched, worker = pair(url, interval)
        beats = [sched.scheduler_adapter.heartbeat, worker.worker_adapter.heartbeat]
        wait_until(lambda: all(hb.rounds >= 1 for hb in beats), what="first ping")
        boot = _health(url)["boot_id"]
        proc.kill()
        proc.wait(timeout=10)
    with (
        caplog.at_level(logging.WARNING, logger="mpcache.connector"),
        server_process("--chunk-size", "64", port=port) as (url, _),
    ):
        new_boot = _health(url)["boot_id"]
        assert new_boot != boot
        # Both adapters still believe the old process is healthy: nothing pinged since.
        assert all(link.healthy and link.boot_id == boot for link in _links(sched, worker))
        for hb in beats:
            hb.wake()  # the next ping finds a healthy server with another boot_id
        wait_until(
            lambda: all(
                link.boot_id == new_boot and link.healthy for link in _links(sched, worker)
            ),
            what="recovery after a restart between two pings",
        )
        assert _health(url)["registrations"] == 1
    messages = [r.message for r in caplog.records]
    assert any("restarted: boot_id" in m for m in messages)
    assert not any("health check failed" in m for m in messages)  # never seen down
