"""Adapters against a real mpcache server process (uvicorn subprocess, real shm)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
import torch

from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.metadata import StepPlan, TransferOp
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from contract.tokens import encode_tokens
from tests.connector.fakes import (
    AttnSpec,
    CachedReqs,
    FakeBlocks,
    FakeRequest,
    Group,
    NewReq,
    StepOutput,
    ask,
)
from tests.support import free_port, server_process, wait_until

pytestmark = pytest.mark.slow

NUM_BLOCKS = 32
BS = 16
NS = "tiny@test/ws1"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with server_process("--chunk-size", "64") as (url, _proc):
        yield url


def _config(
    url: str, *, interval: float = 10.0, lookup_area: bool = True, key_index: bool = True
) -> ConnectorConfig:
    return ConnectorConfig(
        server_urls=(url,),
        lookup_area=lookup_area,
        key_index=key_index,
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=1.0,
        request_timeout_s=5.0,
        lookup_timeout_s=2.0,
        startup_timeout_s=10.0,
    )


def _pair(
    url: str, instance: str, *, interval: float = 10.0, key_index: bool = True
) -> tuple[SchedulerAdapter, WorkerAdapter]:
    layout = layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])
    common = {"model": "tiny", "instance_id": instance, "namespace": NS}
    config = _config(url, interval=interval, key_index=key_index)
    sched = SchedulerAdapter(config, layout, world_size=1, **common)  # type: ignore[arg-type]
    worker = WorkerAdapter(
        _config(url, interval=interval),
        layout,
        rank=0,
        world_size=1,
        num_blocks=NUM_BLOCKS,
        **common,  # type: ignore[arg-type]
    )
    return sched, worker


def test_round_trip_same_bytes(server: str) -> None:
    sched, worker = _pair(server, "rt")
    try:
        assert sched.chunk_size == worker.chunk_size == 64
        kv = {name: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for name in ("l0", "l1")}
        worker.register_kv_caches(kv)
        assert worker.registered

        prompt = [(i * 37) % 997 for i in range(150)]
        a = FakeRequest("A", list(prompt))
        assert ask(sched, a, 0) == (0, False)
        blocks_a = list(range(1, 11))
        sched.update_state_after_alloc(a, FakeBlocks((blocks_a,)), 0)
        for j, b in enumerate(blocks_a):  # "forward": block j gets a recognisable pattern
            for name in kv:
                kv[name][b].fill_(float(j + 1) + (0.5 if name == "l1" else 0.0))
        plan = sched.build_connector_meta(
            StepOutput([NewReq("A", (blocks_a,), 0)], num_scheduled_tokens={"A": 150})
        )
        # Two whole chunks, then the prompt's tail: its last whole block (one unit).
        assert [(op.start_token, op.end_token) for op in plan.stores] == [(0, 144)]
        worker.save(plan)
        assert worker.flush(10.0)  # its lane has sent it
        sched.request_finished(a)
        sched.transfers_finished({a.request_id})  # vLLM's finished_sending

        b_req = FakeRequest("B", list(prompt))
        assert ask(sched, b_req, 16) == (128, True)  # all but the last partial block
        blocks_b = list(range(20, 30))
        sched.update_state_after_alloc(b_req, FakeBlocks((blocks_b,)), 128)
        plan = sched.build_connector_meta(StepOutput())
        assert len(plan.loads) == 1
        worker.start_load(plan)
        assert worker.flush(10.0)  # its lane has sent it
        assert worker.take_transfer_results() == ({"B"}, set())
        assert worker.take_load_errors() == set()
        for j in range(1, 9):  # blocks 1..8 hold tokens 16..143, loaded from the cache
            for name in kv:
                assert torch.equal(kv[name][blocks_b[j]], kv[name][blocks_a[j]]), (name, j)
        assert torch.all(kv["l0"][blocks_b[0]] == 0)  # vLLM's local block left alone
        assert torch.all(kv["l0"][blocks_b[9]] == 0)  # beyond the hit: not written

        # A cached request continues: the next chunk is stored when computed.
        plan = sched.build_connector_meta(
            StepOutput(
                scheduled_cached_reqs=CachedReqs(["B"], set(), [None], [128]),
                num_scheduled_tokens={"B": 22},
            )
        )
        assert plan.stores == ()  # 150 tokens: no further whole chunk, the tail is cached
    finally:
        worker.shutdown()
        sched.shutdown()


def test_degraded_never_raises(server: str) -> None:
    sched, worker = _pair(server, "deg")
    try:
        worker.register_kv_caches({n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")})
        worker.link.mark_unhealthy("test")
        sched.links[server].mark_unhealthy("test")
        assert sched.get_num_new_matched_tokens(FakeRequest("X", list(range(300))), 0) == (
            0,
            False,
        )
        worker.save(StepPlan())
        worker.start_load(StepPlan())
    finally:
        worker.shutdown()
        sched.shutdown()


def _stored_chunks(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith("mpcache_chunks_stored_total "):
            return float(line.split()[1])
    return 0.0


class _LosesFirstReply:
    """Forwards every call to the real server, but the reply of the first ``POST``
    to ``path`` through it is lost (the call was served server-side)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lost = 0

    def _lose(self, request: httpx.Request) -> bool:
        if request.method == "POST" and request.url.path == self.path and not self.lost:
            self.lost += 1
            return True
        return False

    def sync(self) -> httpx.BaseTransport:
        outer = self

        class Sync(httpx.HTTPTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                reply = super().handle_request(request)
                if outer._lose(request):
                    reply.close()
                    raise httpx.ReadTimeout("reply lost", request=request)
                return reply

        return Sync()

    def asynchronous(self) -> httpx.AsyncBaseTransport:
        outer = self

        class Async(httpx.AsyncHTTPTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                reply = await super().handle_async_request(request)
                if outer._lose(request):
                    await reply.aclose()
                    raise httpx.ReadTimeout("reply lost", request=request)
                return reply

        return Async()


def test_a_registration_whose_reply_was_lost_is_retried_to_success(server: str) -> None:
    """A slow server can register a KV cache after the worker gave up waiting: the
    heartbeat's retry must then refresh that registration, not be refused as
    another client's (it would stay degraded for the rest of vLLM's life)."""
    lossy = _LosesFirstReply("/register")
    layout = layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])
    worker = WorkerAdapter(
        _config(server, interval=0.05),
        layout,
        model="tiny",
        instance_id="lost-reply",
        namespace=NS,
        rank=0,
        world_size=1,
        num_blocks=NUM_BLOCKS,
        transport=lambda url: lossy.sync(),
        async_transport=lambda url: lossy.asynchronous(),
    )
    try:
        worker.register_kv_caches({n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")})
        assert lossy.lost == 1
        assert not worker.available  # the lost reply made the worker suspect the server
        wait_until(lambda: worker.available, timeout_s=10, what="the worker registered again")
        # The token the worker holds is its registration's: a store with it is served.
        before = _stored_chunks(server)
        op = TransferOp("A", 0, 64, encode_tokens(list(range(64))), [[0, 1, 2, 3]])
        worker.save(StepPlan(stores=(op,)))
        assert worker.flush(10.0)  # its lane has sent it
        assert _stored_chunks(server) == before + 1
    finally:
        worker.shutdown()


def _lookup_areas(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=5.0).json()["lookup_areas"])


def _store_prefix(worker: WorkerAdapter, request_id: str, prompt: list[int], n: int) -> None:
    """Store the first ``n`` tokens of ``prompt`` (whole chunks of 64) from blocks 0..."""
    op = TransferOp(request_id, 0, n, encode_tokens(prompt[:n]), [list(range(n // BS))])
    worker.save(StepPlan(stores=(op,)))
    assert worker.flush(10.0)  # its lane has sent it


def test_lookups_through_the_lookup_area_answer_as_ids_in_the_body(server: str) -> None:
    """The scheduler writes its lookups' ids into a lookup area shared with the
    server (one mark per request on the wire); its answers are those of a scheduler
    that sends the ids, and the area goes when the scheduler shuts down."""
    before = _lookup_areas(server)
    sched, worker = _pair(server, "area", key_index=False)  # every lookup asks the server
    layout = layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])
    plain = SchedulerAdapter(
        _config(server, lookup_area=False, key_index=False),
        layout,
        world_size=1,
        model="tiny",
        instance_id="area-plain",
        namespace=NS,
    )
    try:
        worker.register_kv_caches({n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")})
        prompt = [(i * 53) % 991 for i in range(150)]
        _store_prefix(worker, "S", prompt, 128)
        asks = {"full": prompt, "part": prompt[:100], "more": prompt + [7] * 80, "new": [3] * 150}
        for adapter, tag in ((sched, "a"), (plain, "p")):
            # One batch: every request is asked before the step ends.
            requests = {k: FakeRequest(f"{tag}-{k}", list(v)) for k, v in asks.items()}
            for r in requests.values():
                assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
            got = {k: ask(adapter, r) for k, r in requests.items()}
            assert got == {
                "full": (128, True),
                "part": (64, True),
                "more": (128, True),
                "new": (0, False),
            }, tag
        assert _lookup_areas(server) == before + 1  # the area scheduler's, not the plain one
    finally:
        worker.shutdown()
        sched.shutdown()
        plain.shutdown()
    assert _lookup_areas(server) == before


def test_after_a_server_restart_lookups_send_ids_then_register_a_new_area() -> None:
    """A restarted server has forgotten the area: the lookup naming it is refused,
    sent again with its ids in the body (the answer is still right), and the next
    batch goes through a new area."""
    port = free_port()
    with server_process("--chunk-size", "64", port=port) as (url, proc):
        sched, worker = _pair(url, "area-restart", interval=0.2, key_index=False)
        assert ask(sched, FakeRequest("before", list(range(150)))) == (0, False)
        assert _lookup_areas(url) == 1
        proc.kill()
        proc.wait(timeout=10)
    try:
        with server_process("--chunk-size", "64", port=port) as (url, _):
            kv = {n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")}
            worker.register_kv_caches(kv)
            wait_until(lambda: worker.available and sched.links[url].healthy, timeout_s=20)
            assert _lookup_areas(url) == 0
            prompt = [(i * 31) % 977 for i in range(150)]
            _store_prefix(worker, "S", prompt, 128)
            assert ask(sched, FakeRequest("after", list(prompt))) == (128, True)
            assert ask(sched, FakeRequest("again", list(prompt))) == (128, True)
            assert _lookup_areas(url) == 1
    finally:
        worker.shutdown()
        sched.shutdown()


def test_after_a_failed_lookup_through_the_area_the_next_batch_uses_a_new_one(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup whose reply was lost may still be read by the server: the area it
    used is never written again; once the server is healthy, a new area serves."""
    caplog.set_level(logging.INFO, logger="mpcache.connector")
    lossy = _LosesFirstReply("/cache/lookup")
    layout = layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])
    sched = SchedulerAdapter(
        _config(server, interval=0.05, key_index=False),
        layout,
        model="tiny",
        instance_id="area-lossy",
        namespace=NS,
        world_size=1,
        transport=lambda url: lossy.sync(),
        async_transport=lambda url: lossy.asynchronous(),
    )
    try:
        prompt = [(i * 71 + 5) % 983 for i in range(150)]  # stored by no other test
        assert ask(sched, FakeRequest("A", prompt)) == (0, False)
        assert lossy.lost == 1
        wait_until(lambda: sched.links[server].healthy, timeout_s=10, what="recovery")
        assert ask(sched, FakeRequest("B", list(prompt))) == (0, False)
        registered = caplog.text.count("lookups write token ids into lookup area")
        assert registered == 2, caplog.text
    finally:
        sched.shutdown()


@pytest.mark.parametrize("key_index", [False, True], ids=["server-lookup", "key-index"])
def test_ids_and_salts_past_256_characters_store_hit_and_stay_apart(
    server: str, key_index: bool
) -> None:
    """vLLM passes its users' request ids and cache salts unchanged: longer ones than a
    server field takes still store and hit, and two salts equal in their first 256
    characters still isolate their requests."""
    sched, worker = _pair(server, f"long-{key_index}", key_index=key_index)
    salt = "s" * 300
    try:
        worker.register_kv_caches(
            {name: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for name in ("l0", "l1")}
        )
        prompt = [(i * 41 + int(key_index)) % 997 for i in range(150)]
        a = FakeRequest("a" * 400, list(prompt), cache_salt=salt)
        assert ask(sched, a, 0) == (0, False)
        blocks_a = list(range(1, 11))
        sched.update_state_after_alloc(a, FakeBlocks((blocks_a,)), 0)
        plan = sched.build_connector_meta(
            StepOutput(
                [NewReq(a.request_id, (blocks_a,), 0)], num_scheduled_tokens={a.request_id: 150}
            )
        )
        worker.save(plan)
        assert worker.flush(10.0)
        sched.request_finished(a)
        sched.transfers_finished({a.request_id})

        other_salt = FakeRequest("c" * 300, list(prompt), cache_salt=salt + "-other")
        assert ask(sched, other_salt, 0) == (0, False)
        b = FakeRequest("b" * 300, list(prompt), cache_salt=salt)
        assert ask(sched, b, 0) == (144, True)
        blocks_b = list(range(20, 30))
        sched.update_state_after_alloc(b, FakeBlocks((blocks_b,)), 144)
        plan = sched.build_connector_meta(StepOutput())
        worker.start_load(plan)
        assert worker.flush(10.0)
        assert worker.take_transfer_results() == ({b.request_id}, set())
        assert worker.take_load_errors() == set()
    finally:
        worker.shutdown()
        sched.shutdown()
