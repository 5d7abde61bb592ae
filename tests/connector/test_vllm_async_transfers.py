"""Loads and stores off vLLM's step, with vLLM's real Scheduler (docs/design.md s.6).

The in-memory server holds a path's calls at a gate, so a transfer is still running
while the scheduler steps on: vLLM must keep a finished request's blocks until its
store is done, and a preempted request's blocks must not be rewritten by a forward
while a store still reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.connector.fakes import FakeServer
from tests.support import wait_until

pytestmark = pytest.mark.vllm


def _engine(
    tiny_model_dir: Path,
    built: list[Any],
    fake: FakeServer,
    *,
    num_blocks: int,
    max_batched: int = 256,
) -> tuple[Any, Any]:
    """(scheduler, CPU worker) with the connector talking to ``fake``."""
    from tests.connector.vllm_support import (
        CpuWorker,
        make_connector,
        make_kv_cache_config,
        make_scheduler,
        make_vllm_config,
    )

    config = make_vllm_config(
        tiny_model_dir, {"mpcache.server_urls": fake.url}, max_num_batched_tokens=max_batched
    )
    kvcc = make_kv_cache_config(num_blocks)
    scheduler = make_scheduler(config, kvcc)
    built.append(scheduler.connector)
    worker_conn = make_connector(config, "worker", kvcc)
    built.append(worker_conn)
    return scheduler, CpuWorker(worker_conn, scheduler, num_blocks)


def _steps_until(worker: Any, done: Callable[[], bool], what: str) -> None:
    def step() -> bool:
        worker.step()
        return done()

    wait_until(step, what=what, poll_s=0.001)


def _free_blocks(scheduler: Any) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_finished_and_aborted_requests_keep_their_blocks_until_their_store_is_done(
    tiny_model_dir: Path, built: list[Any], fake_server: FakeServer
) -> None:
    """A finishes and B is aborted while the store reading their blocks is held: vLLM
    must not hand those blocks to C, and frees them once the store has returned."""
    from vllm.v1.request import RequestStatus

    from tests.connector.vllm_support import make_request

    fake = fake_server
    scheduler, worker = _engine(tiny_model_dir, built, fake, num_blocks=32)
    idle = _free_blocks(scheduler)
    gate = fake.hold("/cache/store")
    scheduler.add_request(make_request("A", [(i * 37 + 11) % 997 for i in range(150)]))
    scheduler.add_request(make_request("B", [(i * 37 + 503) % 997 for i in range(64)], 32))
    _steps_until(worker, lambda: fake.arrived.get("/cache/store", 0) >= 1, "the store")
    _steps_until(worker, lambda: scheduler.requests["A"].is_finished(), "A finished")
    held = set(worker.blocks_of("A")) | set(worker.blocks_of("B"))
    scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("C", [(i * 37 + 7) % 997 for i in range(200)], 8))
    for _ in range(5):  # steps go on while the store is held
        worker.step()
    assert {"A", "B"} <= set(scheduler.requests)  # vLLM still holds A and B ...
    assert not held & set(worker.blocks_of("C"))  # ... and gave none of their blocks to C
    assert fake.ended == []  # their sessions outlive their blocks' reads

    gate.set()
    _steps_until(worker, lambda: not {"A", "B"} & set(scheduler.requests), "A and B freed")
    _steps_until(worker, lambda: not scheduler.requests, "C finished")
    assert _free_blocks(scheduler) == idle
    wait_until(lambda: sorted(fake.ended) == ["A", "B", "C"], what="the sessions ended")


def test_a_preempted_request_is_not_rewritten_while_its_store_runs(
    tiny_model_dir: Path,
    built: list[Any],
    fake_server: FakeServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two prompts fill the cache and a decode step preempts B. B's blocks go back to
    vLLM in that step's schedule, so the step's forward may write them: it must run
    only once the store reading them has returned, and B's store not yet sent is
    dropped.

    Step 1 computes A's prompt and B's first chunk (one store call, held at the
    server's gate); step 2 B's last 32 tokens (a second call, queued behind it) and
    A's first decode; step 3 finds no block for B's decode and preempts B.
    """
    from tests.connector.vllm_support import make_request

    fake = fake_server
    # 13 usable blocks: the prompts take 12, A's first decode the 13th.
    scheduler, worker = _engine(tiny_model_dir, built, fake, num_blocks=14, max_batched=160)
    gate = fake.hold("/cache/store")
    for rid, seed in (("A", 11), ("B", 503)):
        prompt = [(i * 37 + seed) % 997 for i in range(96)]
        scheduler.add_request(make_request(rid, prompt, max_tokens=64))

    adapter = worker.connector.worker_adapter
    handle = adapter.handle_preemptions

    def handle_then_open(plan: Any) -> None:
        threading.Timer(0.2, gate.set).start()  # the held call returns while we wait
        handle(plan)

    monkeypatch.setattr(adapter, "handle_preemptions", handle_then_open)
    stores_done: list[int] = []  # per forward: store calls the server had answered
    forward = worker._forward

    def recording_forward(request_id: str, start: int, count: int) -> None:
        stores_done.append(fake.paths().count("POST /cache/store"))
        forward(request_id, start, count)

    monkeypatch.setattr(worker, "_forward", recording_forward)
    preempted: list[tuple[str, ...]] = []

    def step() -> bool:
        before = len(stores_done)
        out, _ = worker.step()
        if out.kv_connector_metadata.plan.preempted:
            preempted.append(out.kv_connector_metadata.plan.preempted)
            assert min(stores_done[before:]) == 1  # the forward waited for the call
        return bool(preempted)

    wait_until(step, what="a preemption", poll_s=0.001)
    assert preempted == [("B",)]
    assert adapter.flush(5.0)
    sent = [
        (r["request_id"], r["start_token"], r["end_token"])
        for _, path, body in fake.calls
        if path == "/cache/store"
        for r in body["requests"]
    ]
    # Step 1's call, whole; step 2's (B's blocks, after the preemption) never sent.
    assert sent == [("A", 0, 96), ("B", 0, 64)]
