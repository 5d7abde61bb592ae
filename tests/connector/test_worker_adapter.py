"""Worker adapter: memfd registration (CPU), batched loads/stores, degraded mode."""

from __future__ import annotations

import base64
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.errors import LayoutError, ServerUnreachable, StartupError
from connector.metadata import StepPlan, TransferOp
from connector.registration import block_view
from connector.worker import MAX_QUEUED_STORES, WorkerAdapter, server_budget_s
from contract.fdpass import F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, seals_of
from contract.schemas import RetrieveRequest
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, FakeServer, Group
from tests.support import wait_until

NUM_BLOCKS = 8
NS = "ns"


@pytest.fixture
def workers() -> Iterator[list[WorkerAdapter]]:
    made: list[WorkerAdapter] = []
    yield made
    for w in made:
        w.shutdown()


def make(
    made: list[WorkerAdapter],
    server: FakeServer,
    *,
    groups: list[Group] | None = None,
    heartbeat: bool = False,
    rank: int = 0,
    world_size: int = 1,
    urls: tuple[str, ...] | None = None,
) -> WorkerAdapter:
    groups = groups or [Group(AttnSpec(16), ["l0", "l1"])]
    config = ConnectorConfig(
        server_urls=urls or (server.url,),
        heartbeat_interval_s=0.03,
        heartbeat_timeout_s=0.5,
        request_timeout_s=0.5,
        startup_timeout_s=0.3,
    )
    worker = WorkerAdapter(
        config,
        layout_from_groups(groups),
        model="tiny",
        instance_id="eng",
        namespace=NS,
        rank=rank,
        world_size=world_size,
        num_blocks=NUM_BLOCKS,
        transport=lambda url: server.transport(),
        async_transport=lambda url: server.transport(),
        start_heartbeat=heartbeat,
    )
    made.append(worker)
    return worker


def _kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, 2, 16, 4, generator=g, dtype=torch.float32).to(torch.float16)


def _map_memfd(fd: int) -> mmap.mmap:
    """Map the worker's memfd through a descriptor of our own, as the server does."""
    dup = os.dup(fd)
    try:
        return mmap.mmap(dup, os.fstat(dup).st_size)
    finally:
        os.close(dup)


def registered(made: list[WorkerAdapter], server: FakeServer, **kwargs: Any) -> WorkerAdapter:
    """``make``'s worker with its two layers' KV caches registered."""
    worker = make(made, server, **kwargs)
    worker.register_kv_caches({"l0": _kv(0), "l1": _kv(1)})
    return worker


def save(worker: WorkerAdapter, plan: StepPlan) -> None:
    """A step's stores, and wait until its lane has sent them."""
    worker.save(plan)
    assert worker.flush(5.0)


def load(worker: WorkerAdapter, plan: StepPlan) -> None:
    """A step's loads, and wait until its lane has their outcome."""
    worker.start_load(plan)
    assert worker.flush(5.0)


def _op(rid: str, tokens: list[int], start: int, end: int, blocks: list[int]) -> TransferOp:
    return TransferOp(rid, start, end, encode_tokens(tokens[:end]), [blocks])


# ------------------------------------------------------------------- negotiation


def test_an_unreachable_server_is_a_startup_error_naming_rank_and_server(
    workers: list[WorkerAdapter],
) -> None:
    server = FakeServer()
    server.up = False
    with pytest.raises(StartupError, match=r"worker rank 0: chunk-size negotiation with ") as info:
        make(workers, server)
    assert server.url in str(info.value)
    assert isinstance(info.value.__cause__, ServerUnreachable)


# ------------------------------------------------------------------ registration


def test_cpu_tensors_move_into_sealed_memfds_zero_copy(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)
    l0, l1 = _kv(0), _kv(1)
    before0, before1 = l0.clone(), l1.clone()
    view_of_l0 = l0[3]  # a view vLLM might hold elsewhere
    worker.register_kv_caches({"l0": l0, "l1": l1})

    assert worker.registered
    assert torch.equal(l0, before0) and torch.equal(l1, before1)
    reg = server.registrations[("eng", 0)]
    assert [layer.name for layer in reg.layers] == ["l0", "l1"]
    d0 = reg.layers[0].tensors[0]
    assert d0.transport == "memfd"
    assert server.redeemed == [2]  # both memfds passed over the socket, tickets redeemed
    assert (d0.shape, d0.stride, d0.dtype, d0.block_dim, d0.offset_bytes) == (
        [NUM_BLOCKS, 2, 16, 4],
        [128, 64, 4, 1],
        "float16",
        0,
        0,
    )
    assert reg.chunk_size == 64 and reg.namespace == NS
    assert [g.model_dump() for g in reg.groups] == [
        {"group_id": 0, "kind": "attention", "token_span": 16}
    ]
    assert len(worker.segments) == 2
    for seg in worker.segments:  # no size change can ever SIGBUS the server
        assert seals_of(seg.fd) & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == (
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
        )
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)

    # Same pages: a write through the server's mapping shows up in vLLM's tensors.
    mapping = _map_memfd(worker.segments[0].fd)
    server_view = torch.frombuffer(mapping, dtype=torch.float16).view(NUM_BLOCKS, 2, 16, 4)
    server_view[3].fill_(7.0)
    assert torch.all(l0[3] == 7.0) and torch.all(view_of_l0 == 7.0)
    l0[5].fill_(-1.0)
    assert torch.all(server_view[5] == -1.0)
    del server_view
    mapping.close()


def test_shared_storage_is_one_segment(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)
    raw = torch.zeros(2 * NUM_BLOCKS * 128, dtype=torch.float16)
    l0 = raw[: NUM_BLOCKS * 128].view(NUM_BLOCKS, 2, 16, 4)
    l1 = raw[NUM_BLOCKS * 128 :].view(NUM_BLOCKS, 2, 16, 4)
    worker.register_kv_caches({"l0": l0, "l1": l1})
    d0, d1 = (layer.tensors[0] for layer in server.registrations[("eng", 0)].layers)
    assert d0.transport == d1.transport == "memfd"
    assert d0.ticket == d1.ticket
    assert (d0.offset_bytes, d1.offset_bytes) == (0, NUM_BLOCKS * 128 * 2)
    assert len(worker.segments) == 1
    raw[-1] = 3.0
    assert l1[-1, -1, -1, -1] == 3.0


def test_scratch_layers_are_not_registered(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    groups = [
        Group(AttnSpec(16), ["l0"]),
        Group(AttnSpec(8, prefix_cacheable=False), ["ring"]),
    ]
    worker = make(workers, server, groups=groups)
    worker.register_kv_caches({"l0": _kv(0), "ring": _kv(1)})
    assert [layer.name for layer in server.registrations[("eng", 0)].layers] == ["l0"]
    assert len(worker.segments) == 1


@pytest.mark.parametrize(
    ("shape", "num_blocks", "dim", "view_shape"),
    [
        pytest.param((NUM_BLOCKS, 2, 16, 4), NUM_BLOCKS, 0, None, id="blocks-first"),
        pytest.param((2, NUM_BLOCKS, 16, 4), NUM_BLOCKS, 1, None, id="kv-first"),
        pytest.param(
            (2 * NUM_BLOCKS, 3, 4), NUM_BLOCKS, 0, (NUM_BLOCKS, 2, 3, 4), id="kernel-split"
        ),
        # Two blocks: a size match alone cannot tell the K/V dim from the block dim.
        pytest.param((2, 2, 16, 4, 8), 2, 1, None, id="kv-first-5d-two-blocks"),
        pytest.param((2, 2, 16, 4), 2, 0, None, id="blocks-first-4d-two-blocks"),
        pytest.param((NUM_BLOCKS, 2, 16, 4, 8), NUM_BLOCKS, 0, None, id="blocks-first-5d"),
        pytest.param((2, NUM_BLOCKS, 16, 4, 8), NUM_BLOCKS, 1, None, id="kv-first-5d"),
        # Kernel blocks whose head count equals num_blocks: dim 0 still indexes blocks.
        pytest.param(
            (2 * NUM_BLOCKS, NUM_BLOCKS, 16, 4),
            NUM_BLOCKS,
            0,
            (NUM_BLOCKS, 2, NUM_BLOCKS, 16, 4),
            id="kernel-split-heads-equal-blocks",
        ),
        pytest.param((NUM_BLOCKS, 16, 64), NUM_BLOCKS, 0, None, id="mla"),
    ],
)
def test_block_dim(
    shape: tuple[int, ...], num_blocks: int, dim: int, view_shape: tuple[int, ...] | None
) -> None:
    tensor = torch.zeros(shape)
    view, block_dim = block_view(tensor, num_blocks)
    assert (block_dim, tuple(view.shape)) == (dim, view_shape or shape)
    assert view.data_ptr() == tensor.data_ptr()  # a view, never a copy


def test_block_dim_missing() -> None:
    with pytest.raises(LayoutError, match="indexes the 8 KV cache blocks"):
        block_view(torch.zeros(3, 5), NUM_BLOCKS)


def test_refused_registration_degrades(workers: list[WorkerAdapter]) -> None:
    import httpx

    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)
    server.fail_next["/register"] = httpx.Response(422, json={"detail": "bad descriptor"})
    worker.register_kv_caches({"l0": _kv(0), "l1": _kv(1)})  # does not raise
    assert not worker.registered and not worker.available


# ---------------------------------------------------------------- loads, stores


def test_store_then_load_and_failures(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    tokens = list(range(200))
    save(worker, StepPlan(stores=(_op("A", tokens, 0, 128, [1, 2, 3, 4, 5, 6, 7, 7]),)))
    (store_call,) = [c for c in server.calls if c[1] == "/cache/store"]
    assert store_call[2]["rank"] == 0 and store_call[2]["instance_id"] == "eng"
    assert store_call[2]["requests"][0]["namespace"] == NS
    tokens_sent = np.frombuffer(
        base64.b64decode(store_call[2]["requests"][0]["tokens_b64"]), dtype="<i4"
    )
    assert tokens_sent.tolist() == tokens[:128]
    assert store_call[2].get("event_ipc_b64") is None  # CPU caches: no CUDA event

    # B loads both chunks; C asks for a chunk that is not cached.
    other = [t + 1000 for t in tokens]
    load(
        worker,
        StepPlan(
            loads=(
                _op("B", tokens, 0, 128, [0, 0, 3, 4, 5, 6, 7, 1]),
                _op("C", other, 0, 128, [0, 0, 3, 4, 5, 6, 7, 1]),
            )
        ),
    )
    finished, failed = worker.take_transfer_results()
    assert finished == {"B", "C"}
    (load_call,) = [c for c in server.calls if c[1] == "/cache/retrieve"]
    assert load_call[2].get("event_ipc_b64") is None
    assert failed == set()  # single group: failures are reported per block
    assert worker.take_load_errors() == {1, 3, 4, 5, 6, 7}
    assert worker.take_load_errors() == set()
    assert [c[1] for c in server.calls].count("/cache/retrieve") == 1  # one batched call


def test_transfer_calls_carry_a_server_budget_below_the_client_timeout(
    workers: list[WorkerAdapter],
) -> None:
    """The server must have stopped touching the blocks before the client gives up."""
    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)  # request_timeout_s = 0.5
    worker.register_kv_caches({"l0": _kv(0), "l1": _kv(1)})
    tokens = list(range(128))
    save(worker, StepPlan(stores=(_op("A", tokens, 0, 128, [1, 2, 3, 4, 5, 6, 7, 1]),)))
    load(worker, StepPlan(loads=(_op("B", tokens, 0, 64, [0, 2, 3, 4]),)))

    bodies = {path: body for _, path, body in server.calls}
    timeouts = dict(server.client_timeouts)
    for path in ("/cache/store", "/cache/retrieve"):
        budget = bodies[path]["timeout_s"]
        client = timeouts[path]
        assert client["read"] == worker.config.request_timeout_s
        # httpx gives up after `read` seconds without a reply, counted from the send.
        assert 0 < budget <= 0.75 * client["read"] < client["read"], path


@pytest.mark.parametrize("client_timeout_s", [0.01, 2.0, 30.0, 1e6])
def test_server_budget_is_a_fraction_of_the_client_timeout(client_timeout_s: float) -> None:
    budget = server_budget_s(client_timeout_s)
    assert 0 < budget < client_timeout_s
    assert budget == min(0.75 * client_timeout_s, 3600.0)
    # Always inside the schema's bounds, however long the configured timeout.
    RetrieveRequest(instance_id="eng", rank=0, requests=[], timeout_s=budget)


@pytest.mark.parametrize(
    ("groups", "errors", "failed"),
    [
        pytest.param(
            [Group(AttnSpec(16), ["l0", "l1"])], {2, 3, 4, 5}, set(), id="single-group-blocks"
        ),
        pytest.param(
            [Group(AttnSpec(16), ["l0"]), Group(AttnSpec(32), ["l1"])],
            set(),
            {"B"},
            id="multi-group-request",
        ),
    ],
)
def test_unexpected_error_fails_every_load_of_the_step(
    workers: list[WorkerAdapter],
    monkeypatch: pytest.MonkeyPatch,
    groups: list[Group],
    errors: set[int],
    failed: set[str],
) -> None:
    """A CUDA sync error (or any escape) must not leave loads reported as done."""
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server, groups=groups)
    assert worker.available

    def cuda_error() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker, "_device_event", cuda_error)
    blocks = [[0, 2, 3, 4], [0, 5]] if len(groups) == 2 else [[0, 2, 3, 4, 5]]
    op = TransferOp("B", 0, 64, encode_tokens(range(64)), blocks)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        load(worker, StepPlan(loads=(op,)))
    assert worker.take_transfer_results() == ({"B"}, failed)
    assert worker.take_load_errors() == errors


def test_unplanned_loads_are_reported_failed(workers: list[WorkerAdapter]) -> None:
    worker = make(workers, FakeServer(min_chunk_size=64))
    load(worker, StepPlan(failed_loads=("C",)))
    assert worker.take_transfer_results() == ({"C"}, {"C"})


def test_finished_loads_for_get_finished_keep_request_failures(
    workers: list[WorkerAdapter],
) -> None:
    """vLLM's older get_finished has no failure channel: a request-level failure is
    kept for take_transfer_results instead of being reported as a success."""
    server = FakeServer(min_chunk_size=64)
    groups = [Group(AttnSpec(16), ["l0"]), Group(AttnSpec(32), ["l1"])]
    worker = registered(workers, server, groups=groups)
    ok = TransferOp("OK", 0, 64, encode_tokens(range(64)), [[0, 0, 0, 0], [0, 0]])
    bad = TransferOp("BAD", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4], [5, 6]])
    load(worker, StepPlan(loads=(ok, bad)))
    assert worker.take_finished_loads() == {"OK"}
    assert worker.take_finished_loads() == set()
    assert worker.take_transfer_results() == ({"BAD"}, {"BAD"})
    assert worker.take_transfer_results() == (set(), set())


def test_multi_group_failures_are_request_level(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    groups = [Group(AttnSpec(16), ["l0"]), Group(AttnSpec(32), ["l1"])]
    worker = registered(workers, server, groups=groups)
    op = TransferOp("A", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4], [5, 6]])
    load(worker, StepPlan(loads=(op,)))
    assert worker.take_transfer_results() == ({"A"}, {"A"})
    assert worker.take_load_errors() == set()


def test_degraded_worker_skips_stores_and_fails_loads(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    server.up = False
    tokens = list(range(128))
    save(worker, StepPlan(stores=(_op("A", tokens, 0, 128, [1, 2, 3, 4, 5, 6, 7, 1]),)))
    assert not worker.available  # the failed store marked the server suspect
    save(worker, StepPlan(stores=(_op("A", tokens, 0, 128, [1, 2, 3, 4, 5, 6, 7, 1]),)))
    load(worker, StepPlan(loads=(_op("B", tokens, 0, 64, [0, 2, 3, 4]),)))
    assert worker.take_transfer_results() == ({"B"}, set())
    assert worker.take_load_errors() == {2, 3, 4}
    assert [c[1] for c in server.calls].count("/cache/store") == 0  # refused connection


def test_restart_reregisters(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server, heartbeat=True)
    server.restart()
    assert server.registrations == {}
    wait_until(lambda: worker.link.healthy and worker.link.boot_id == server.boot_id)
    assert ("eng", 0) in server.registrations
    assert server.chunk_size == 64
    assert worker.available


def test_heartbeat_calls_wait_the_configured_timeout_not_the_interval(
    workers: list[WorkerAdapter],
) -> None:
    """Was: pings were cut to the interval (0.03 s here, 0.5 s in the e2e engine,
    whose 10 s timeout never applied): a loaded server answering /health in 0.6 s
    put vLLM in degraded mode, and a registration reply cut short locked the worker
    out (its retry was refused as another client's)."""
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server, heartbeat=True)
    assert worker.config.heartbeat_interval_s < worker.config.heartbeat_timeout_s
    calls_before = len(server.client_timeouts)
    server.restart()
    wait_until(lambda: worker.link.healthy and worker.link.boot_id == server.boot_id)
    # Every ping, and the recovery's negotiate and register, waited the timeout.
    heartbeat_calls = server.client_timeouts[calls_before:]
    paths = {path for path, _ in heartbeat_calls}
    assert {"/health", "/negotiate", "/register"} <= paths
    assert {t["read"] for _, t in heartbeat_calls} == {worker.config.heartbeat_timeout_s}


def test_restart_with_other_size_keeps_worker_degraded(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server, heartbeat=True)
    server.restart(min_chunk_size=65)  # -> 80
    wait_until(lambda: not worker.link.healthy)
    rounds = worker.heartbeat.rounds
    wait_until(lambda: worker.heartbeat.rounds >= rounds + 3)
    assert not worker.available
    assert server.registrations == {}
    save(worker, StepPlan(stores=(_op("A", list(range(64)), 0, 64, [1, 2, 3, 4]),)))
    assert "/cache/store" not in [c[1] for c in server.calls]


def test_second_server_gets_its_ranks_from_zero(workers: list[WorkerAdapter]) -> None:
    server = FakeServer("http://b:2", min_chunk_size=64)
    worker = make(workers, server, rank=3, world_size=4, urls=("http://a:1", "http://b:2"))
    assert (worker.server_rank, worker.ranks_on_server) == (1, 2)
    worker.register_kv_caches({"l0": _kv(0), "l1": _kv(1)})
    reg = server.registrations[("eng", 1)]
    assert (reg.rank, reg.world_size) == (1, 2)


def test_shutdown_unregisters_and_closes(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)
    l0 = _kv(0)
    expected = l0.clone()
    worker.register_kv_caches({"l0": l0, "l1": _kv(1)})
    fds = [s.fd for s in worker.segments]
    worker.shutdown()
    workers.clear()
    assert server.registrations == {}
    assert "DELETE /register/eng/0" in server.paths()
    assert all(s.fd == -1 for s in worker.segments)
    for fd in fds:
        assert not os.path.exists(f"/proc/self/fd/{fd}") or "memfd:mpcache-kv" not in (
            os.readlink(f"/proc/self/fd/{fd}")
        )
    assert torch.equal(l0, expected)  # vLLM's tensors stay valid after the close


# ------------------------------------------------------- off vLLM's step (lanes)


@dataclass(frozen=True)
class SlidingWindowSpec:  # named like vLLM's: the classifier reads the class name
    block_size: int
    dcp_sharded: bool = True
    prefix_cacheable: bool = True


def test_a_load_returns_before_its_call_and_lands_with_its_failed_blocks(
    workers: list[WorkerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    tokens = list(range(128))
    save(worker, StepPlan(stores=(_op("A", tokens, 0, 64, [1, 2, 3, 4]),)))
    gate = server.hold("/cache/retrieve")
    # B asks for two chunks; the server holds the first only.
    worker.start_load(StepPlan(loads=(_op("B", tokens, 0, 128, [0, 0, 5, 6, 7, 1, 2, 3]),)))
    wait_until(lambda: server.arrived.get("/cache/retrieve") == 1, what="the retrieve call")
    # The step is over while the call is held: nothing is reported yet.
    assert worker.take_transfer_results() == (set(), set())
    assert worker.take_load_errors() == set()
    gate.set()
    assert worker.flush(5.0)
    # The failed blocks are not handed out before their request is reported ...
    assert worker.take_load_errors() == set()
    # ... and come with it, in the same step.
    assert worker.take_transfer_results() == ({"B"}, set())
    assert worker.take_load_errors() == {7, 1, 2, 3}


def test_a_load_whose_server_dies_mid_call_is_reported_failed(
    workers: list[WorkerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    gate = server.hold("/cache/retrieve")
    worker.start_load(StepPlan(loads=(_op("B", list(range(64)), 0, 64, [0, 2, 3, 4]),)))
    wait_until(lambda: server.arrived.get("/cache/retrieve") == 1, what="the retrieve call")
    server.up = False  # the held call now fails: the connection is refused
    gate.set()
    assert worker.flush(5.0)
    assert worker.take_transfer_results() == ({"B"}, set())
    assert worker.take_load_errors() == {2, 3, 4}
    assert not worker.available  # the heartbeat takes it from here


def test_a_finished_request_is_freed_only_after_its_stores(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    gate = server.hold("/cache/store")
    worker.save(StepPlan(stores=(_op("A", list(range(64)), 0, 64, [1, 2, 3, 4]),)))
    wait_until(lambda: server.arrived.get("/cache/store") == 1, what="the store call")
    # vLLM says A finished, and C, which never stored anything.
    assert worker.take_finished_stores({"A", "C"}) == set()
    assert worker.take_finished_stores(set()) == set()
    gate.set()
    assert worker.flush(5.0)
    assert worker.take_finished_stores(set()) == {"A"}  # reported once
    assert worker.take_finished_stores({"A", "C"}) == set()
    assert [c[1] for c in server.calls].count("/cache/store") == 1


def test_a_degraded_worker_still_frees_the_requests_it_skipped(
    workers: list[WorkerAdapter],
) -> None:
    """The scheduler delayed the free of every request a plan stored: the worker must
    report each, whether or not its store ran."""
    server = FakeServer(min_chunk_size=64)
    worker = make(workers, server)  # not registered: not available
    worker.save(StepPlan(stores=(_op("A", list(range(64)), 0, 64, [1, 2, 3, 4]),)))
    assert worker.take_finished_stores({"A"}) == {"A"}
    assert "/cache/store" not in server.arrived


def test_preemption_revokes_queued_stores_and_waits_for_the_running_one(
    workers: list[WorkerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    tokens = list(range(128))
    gate = server.hold("/cache/store")
    worker.save(StepPlan(stores=(_op("A", tokens, 0, 64, [1, 2, 3, 4]),)))
    wait_until(lambda: server.arrived.get("/cache/store") == 1, what="the first store call")
    worker.save(
        StepPlan(
            stores=(
                _op("A", tokens, 64, 128, [1, 2, 3, 4, 5, 6, 7, 1]),
                _op("B", tokens, 0, 64, [5, 6, 7, 1]),
            )
        )
    )
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    try:
        # vLLM freed A's blocks: this returns only once the running call is over.
        worker.handle_preemptions(StepPlan(preempted=("A",)))
        assert [c[1] for c in server.calls].count("/cache/store") >= 1
    finally:
        opener.join()
    assert worker.flush(5.0)
    stores = [body for _, path, body in server.calls if path == "/cache/store"]
    assert [[r["request_id"] for r in body["requests"]] for body in stores] == [["A"], ["B"]]


def test_a_full_store_lane_drops_the_step(workers: list[WorkerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    worker = registered(workers, server)
    gate = server.hold("/cache/store")
    rids = [f"R{i}" for i in range(MAX_QUEUED_STORES + 2)]
    for i, rid in enumerate(rids):
        worker.save(StepPlan(stores=(_op(rid, list(range(i, i + 64)), 0, 64, [1, 2, 3, 4]),)))
        if i == 0:
            wait_until(lambda: server.arrived.get("/cache/store") == 1, what="the first store")
    gate.set()
    assert worker.flush(5.0)
    sent = [body["requests"][0]["request_id"] for _, p, body in server.calls if p == "/cache/store"]
    assert sent == rids[:-1]  # one running, MAX_QUEUED_STORES queued, the last dropped
    assert worker.take_finished_stores(set(rids)) == set(rids)


def test_windowed_layouts_wait_for_their_stores(workers: list[WorkerAdapter]) -> None:
    """vLLM frees a sliding window's old blocks while the request runs, so its store
    must be over before the next step's forward."""
    server = FakeServer(min_chunk_size=64)
    groups = [Group(AttnSpec(16), ["l0"]), Group(SlidingWindowSpec(16), ["l1"])]
    worker = registered(workers, server, groups=groups)
    assert worker.stores_wait
    op = TransferOp("A", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4], [5, 6, 7, 1]])
    worker.save(StepPlan(stores=(op,)))
    assert [c[1] for c in server.calls].count("/cache/store") == 1  # no flush needed
