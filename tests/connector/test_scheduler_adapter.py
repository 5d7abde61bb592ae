"""Scheduler adapter against the in-memory server double (no vLLM needed)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from connector.alignment import layout_from_groups
from connector.client import ControlClient
from connector.config import ConnectorConfig
from connector.errors import StartupError
from connector.metadata import StepPlan, TransferOp
from connector.scheduler import SchedulerAdapter
from contract.schemas import StoreRequest
from tests.connector.fakes import (
    AttnSpec,
    CachedReqs,
    FakeBlocks,
    FakeRequest,
    FakeServer,
    Group,
    NewReq,
    StepOutput,
    ask,
)
from tests.support import returns_promptly, wait_until

NS = "ns"


def _layout(*spans: int, scratch: int | None = None) -> object:
    groups = [Group(AttnSpec(s), [f"l{i}"]) for i, s in enumerate(spans)]
    if scratch is not None:
        groups.insert(1, Group(AttnSpec(scratch, prefix_cacheable=False), ["ring"]))
    return layout_from_groups(groups)


def _router(*servers: FakeServer) -> Callable[[str], object]:
    by_url = {s.url: s for s in servers}
    return lambda url: by_url[url].transport()


@pytest.fixture
def adapters() -> Iterator[list[SchedulerAdapter]]:
    made: list[SchedulerAdapter] = []
    yield made
    for a in made:
        a.shutdown()


def make(
    made: list[SchedulerAdapter],
    *servers: FakeServer,
    spans: tuple[int, ...] = (16,),
    scratch: int | None = None,
    heartbeat: bool = False,
    interval: float = 0.05,
    world_size: int = 1,
    **extra: Any,
) -> SchedulerAdapter:
    config = ConnectorConfig(
        server_urls=tuple(s.url for s in servers),
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=0.5,
        request_timeout_s=0.5,
        lookup_timeout_s=0.5,
        startup_timeout_s=0.3,
    )
    adapter = SchedulerAdapter(
        config,
        _layout(*spans, scratch=scratch),  # type: ignore[arg-type]
        model="tiny",
        instance_id="eng",
        namespace=NS,
        world_size=world_size,
        transport=_router(*servers),  # type: ignore[arg-type]
        async_transport=_router(*servers),  # type: ignore[arg-type]
        start_heartbeat=heartbeat,
        **extra,
    )
    made.append(adapter)
    return adapter


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def _decode(op: TransferOp) -> list[int]:
    return np.frombuffer(base64.b64decode(op.tokens_b64), dtype="<i4").tolist()


def _store(server: FakeServer, ops: tuple[TransferOp, ...], rank: int = 0) -> None:
    client = ControlClient(server.url, timeout_s=1, transport=server.transport())
    try:
        client.store(
            StoreRequest(instance_id="eng", rank=rank, requests=[o.to_item(NS) for o in ops])
        )
    finally:
        client.close()


# ------------------------------------------------------------------- negotiation


@pytest.mark.parametrize(
    ("spans", "minimum", "chunk"),
    [
        pytest.param((256,), 256, 256, id="256"),
        pytest.param((544,), 256, 544, id="544"),
        pytest.param((544,), 600, 1088, id="544-min600"),
        pytest.param((32, 48), 256, 288, id="32-48"),
    ],
)
def test_negotiates_seed_sizes(
    adapters: list[SchedulerAdapter], spans: tuple[int, ...], minimum: int, chunk: int
) -> None:
    server = FakeServer(min_chunk_size=minimum)
    adapter = make(adapters, server, spans=spans)
    assert adapter.chunk_size == chunk
    # Negotiation comes before anything (then, on the lookup thread, the lookup
    # area's try: this fake server refuses it).
    assert server.paths()[0] == "POST /negotiate"
    assert "POST /cache/lookup" not in server.paths()
    assert server.calls[0][2]["required_alignment"] == adapter.alignment
    assert server.calls[0][2]["role"] == "scheduler"


def test_a_server_that_refuses_lookup_areas_gets_the_ids_in_the_body(
    adapters: list[SchedulerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """The lookup area is tried once at startup; refused (this fake has no such
    route), lookups send the ids in the body, and it is not tried again per batch."""
    caplog.set_level(logging.INFO, logger="mpcache.connector")
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    assert ask(adapter, FakeRequest("A", list(range(200)))) == (0, False)
    assert ask(adapter, FakeRequest("B", list(range(300)))) == (0, False)
    paths = server.paths()
    assert paths.count("POST /cache/lookup-areas") == 1
    assert paths.count("POST /cache/lookup") == 2  # the fake reads ids from the body
    assert server.lookups() == [["A"], ["B"]]
    assert "lookups send token ids in the body" in caplog.text


def test_scratch_group_not_in_alignment(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, spans=(16,), scratch=24)
    assert adapter.alignment == 16
    assert adapter.chunk_size == 64


def test_two_servers_agree(adapters: list[SchedulerAdapter]) -> None:
    a, b = FakeServer("http://a:1", 256), FakeServer("http://b:2", 200)
    adapter = make(adapters, a, b, spans=(32, 48))
    assert adapter.chunk_size == 288
    assert all(link.healthy for link in adapter.links.values())


def test_two_servers_disagree_is_a_startup_error(adapters: list[SchedulerAdapter]) -> None:
    a, b = FakeServer("http://a:1", 256), FakeServer("http://b:2", 300)
    with pytest.raises(StartupError) as info:
        make(adapters, a, b, spans=(32, 48))
    text = str(info.value)
    assert "disagree" in text
    assert "http://a:1 -> chunk size 288" in text
    assert "http://b:2 -> chunk size 384" in text


def test_unreachable_server_is_a_startup_error(adapters: list[SchedulerAdapter]) -> None:
    a, b = FakeServer("http://a:1"), FakeServer("http://b:2")
    b.up = False
    with pytest.raises(StartupError) as info:
        returns_promptly(lambda: make(adapters, a, b))  # gives up after startup_timeout
    assert "http://a:1 -> chunk size 256" in str(info.value)
    assert "http://b:2 -> error:" in str(info.value)


def test_refusal_is_not_retried(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    make(adapters, server, spans=(16,))  # selects 64
    with pytest.raises(StartupError, match="not a multiple of 48"):
        make(adapters, server, spans=(48,))
    assert server.paths().count("POST /negotiate") == 2


# ------------------------------------------------------------- lookup and plans


def test_store_then_hit_then_load(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    prompt = _tokens(200)
    a = FakeRequest("A", list(prompt))
    assert ask(adapter, a, 0) == (0, False)
    blocks_a = [list(range(1, 14))]
    adapter.update_state_after_alloc(a, FakeBlocks(tuple(blocks_a)), 0)

    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (blocks_a[0],), 0)], num_scheduled_tokens={"A": 128})
    )
    assert plan.loads == ()
    (op,) = plan.stores
    assert (op.start_token, op.end_token) == (0, 128)
    assert _decode(op) == prompt[:128]
    assert op.block_ids == [blocks_a[0][:8]]
    _store(server, plan.stores)

    plan = adapter.build_connector_meta(
        StepOutput(
            scheduled_cached_reqs=CachedReqs(["A"], set(), [None], [128]),
            num_scheduled_tokens={"A": 72},
        )
    )
    (op,) = plan.stores
    assert (op.start_token, op.end_token) == (128, 192)  # the partial chunk stays out
    _store(server, plan.stores)
    # A's blocks stay vLLM's until the workers report its stores done.
    assert adapter.request_finished(a) == (True, None)
    adapter.transfers_finished({"A"})

    # Same prompt again; vLLM's own prefix cache holds the first 32 tokens.
    b = FakeRequest("B", list(prompt))
    before = server.paths().count("POST /cache/lookup")
    assert ask(adapter, b, 32) == (160, True)
    assert ask(adapter, b, 32) == (160, True)  # memoised
    assert server.paths().count("POST /cache/lookup") == before + 1
    blocks_b = list(range(20, 33))
    adapter.update_state_after_alloc(b, FakeBlocks((blocks_b,)), 160)
    plan = adapter.build_connector_meta(StepOutput())
    (load,) = plan.loads
    assert (load.start_token, load.end_token) == (0, 192)
    assert load.block_ids == [[0, 0, *blocks_b[2:12]]]  # local blocks never written
    assert _decode(load) == prompt[:192]


def test_only_requests_with_stores_delay_their_free(adapters: list[SchedulerAdapter]) -> None:
    """vLLM keeps a finished request's blocks while a store may read them; the
    session ends once they are freed, and preemptions are passed to the workers
    only for requests whose stores may still run."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, heartbeat=True)
    a, b = FakeRequest("A", _tokens(128)), FakeRequest("B", _tokens(10, 7))
    for r in (a, b):
        assert ask(adapter, r, 0) == (0, False)
    adapter.update_state_after_alloc(a, FakeBlocks((list(range(1, 9)),)), 0)
    adapter.update_state_after_alloc(b, FakeBlocks(([9],)), 0)
    step = StepOutput(
        [NewReq("A", (list(range(1, 9)),), 0), NewReq("B", ([9],), 0)],
        num_scheduled_tokens={"A": 64, "B": 10},
    )
    step.preempted_req_ids = {"A", "B"}  # type: ignore[attr-defined]
    plan = adapter.build_connector_meta(step)
    assert [op.request_id for op in plan.stores] == ["A"]
    assert plan.preempted == ()  # nothing was being stored before this plan
    step = StepOutput()
    step.preempted_req_ids = {"A", "B"}  # type: ignore[attr-defined]
    assert adapter.build_connector_meta(step).preempted == ("A",)

    assert adapter.request_finished(b) == (False, None)  # no store: freed at once
    assert adapter.request_finished(a) == (True, None)
    assert not adapter.build_connector_meta(StepOutput())  # B's end is the scheduler's
    wait_until(lambda: server.ended == ["B"])
    adapter.transfers_finished({"A"})  # ended at once, without waiting for a step
    wait_until(lambda: server.ended == ["B", "A"])


def test_a_prompt_like_one_whose_stores_are_landing_waits_for_them(
    adapters: list[SchedulerAdapter],
) -> None:
    """The same prompt right after A finished would miss A's stores by milliseconds:
    vLLM is told "not yet" until they have landed (or their call's timeout passed),
    and then the prompt hits what they stored."""
    now = [0.0]
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, clock=lambda: now[0])
    prompt = _tokens(200)
    a = FakeRequest("A", list(prompt))
    assert ask(adapter, a, 0) == (0, False)
    blocks = list(range(1, 14))
    adapter.update_state_after_alloc(a, FakeBlocks((blocks,)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (blocks,), 0)], num_scheduled_tokens={"A": 200})
    )
    assert adapter.request_finished(a) == (True, None)  # its store is on its way

    b = FakeRequest("B", list(prompt))
    other = FakeRequest("C", _tokens(200, 5))  # starts otherwise: never held back
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    assert ask(adapter, other, 0) == (0, False)
    _store(server, plan.stores)  # the worker's store lands ...
    adapter.transfers_finished({"A"})  # ... and vLLM frees A
    assert ask(adapter, b, 0) == (192, True)

    # A report that never comes holds a like prompt back for one call's timeout.
    d = FakeRequest("D", _tokens(200, 9))
    assert ask(adapter, d, 0) == (0, False)
    adapter.update_state_after_alloc(d, FakeBlocks((blocks,)), 0)
    adapter.build_connector_meta(
        StepOutput([NewReq("D", (blocks,), 0)], num_scheduled_tokens={"D": 200})
    )
    assert adapter.request_finished(d) == (True, None)
    e = FakeRequest("E", _tokens(200, 9))
    assert adapter.get_num_new_matched_tokens(e, 0) == (None, False)
    now[0] += adapter.config.request_timeout_s
    assert ask(adapter, e, 0) == (0, False)  # D's stores never reached this server


def test_last_token_is_never_a_hit(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    prompt = _tokens(128)
    a = FakeRequest("A", prompt)
    ask(adapter, a, 0)
    adapter.update_state_after_alloc(a, FakeBlocks((list(range(1, 9)),)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (list(range(1, 9)),), 0)], num_scheduled_tokens={"A": 128})
    )
    _store(server, plan.stores)
    b = FakeRequest("B", list(prompt))
    # 128 tokens are cached but the last one must be computed: only one chunk counts.
    assert ask(adapter, b, 0) == (64, True)


def test_short_prompt_makes_no_call(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    # Nothing to hit short of one whole unit (a block, 16 tokens) before the last token,
    # or beyond what vLLM's own cache holds.
    assert ask(adapter, FakeRequest("A", _tokens(16)), 0) == (0, False)
    assert ask(adapter, FakeRequest("B", _tokens(300)), 288) == (0, False)
    assert "POST /cache/lookup" not in server.paths()


def test_store_limited_to_prompt_and_resumed_blocks(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    a = FakeRequest("A", _tokens(100), num_prompt_tokens=70)
    ask(adapter, a, 0)
    adapter.update_state_after_alloc(a, FakeBlocks(([1, 2, 3, 4, 5, 6, 7],)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", ([1, 2, 3],), 0)], num_scheduled_tokens={"A": 48})
    )
    assert plan.stores == ()
    plan = adapter.build_connector_meta(
        StepOutput(
            scheduled_cached_reqs=CachedReqs(["A"], {"A"}, [([9, 8, 7, 6, 5],)], [48]),
            num_scheduled_tokens={"A": 52},
        )
    )
    (op,) = plan.stores
    assert (op.start_token, op.end_token) == (0, 64)
    assert op.block_ids == [[9, 8, 7, 6]]  # resumed: block ids replaced, not appended


def test_block_ids_only_for_cacheable_groups(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, spans=(16, 32), scratch=8)
    a = FakeRequest("A", _tokens(70))
    ask(adapter, a, 0)
    groups = (list(range(1, 6)), [99], [11, 12, 13])  # vLLM order: g0, ring, g2
    adapter.update_state_after_alloc(a, FakeBlocks(groups), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", groups, 0)], num_scheduled_tokens={"A": 70})
    )
    (op,) = plan.stores
    assert op.block_ids == [[1, 2, 3, 4], [11, 12]]


# ------------------------------------------------------------- degraded, health


def test_degraded_lookup_and_stores(
    adapters: list[SchedulerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    server.up = False
    a = FakeRequest("A", _tokens(200))
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        assert ask(adapter, a, 0) == (0, False)
        assert not adapter.available
        assert ask(adapter, FakeRequest("B", _tokens(200)), 0) == (0, False)
        # Logged on the loop thread, just after the link turned unhealthy.
        wait_until(lambda: any("unhealthy" in r.message for r in caplog.records))
    assert sum("unhealthy" in r.message for r in caplog.records) == 1
    adapter.update_state_after_alloc(a, FakeBlocks((list(range(1, 14)),)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (list(range(1, 14)),), 0)], num_scheduled_tokens={"A": 200})
    )
    assert plan.stores == ()


def test_lookup_5xx_counts_as_miss_without_degrading(adapters: list[SchedulerAdapter]) -> None:

    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    server.fail_next["/cache/lookup"] = httpx.Response(500, json={"detail": "x"})
    assert ask(adapter, FakeRequest("A", _tokens(200)), 0) == (0, False)
    assert adapter.available


def test_heartbeat_recovers_after_outage(
    adapters: list[SchedulerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    server = FakeServer(min_chunk_size=64)
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        adapter = make(adapters, server, heartbeat=True)
        link = adapter.links[server.url]
        server.up = False
        wait_until(lambda: not link.healthy)
        server.restart()
        server.up = True
        # The link turns healthy just before the heartbeat thread logs it.
        wait_until(lambda: any("healthy again" in r.message for r in caplog.records))
    assert link.healthy
    assert link.boot_id == server.boot_id
    assert server.chunk_size == 64  # re-negotiated with the original alignment
    messages = [r.message for r in caplog.records]
    assert sum("unhealthy" in m for m in messages) == 1
    assert sum("healthy again" in m for m in messages) == 1


def test_restart_between_pings_detected_by_boot_id(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, heartbeat=True, interval=0.05)
    link = adapter.links[server.url]
    old = server.boot_id
    server.restart()  # never unreachable: only the boot_id tells
    wait_until(lambda: link.healthy and link.boot_id == server.boot_id)
    assert link.boot_id != old
    assert server.chunk_size == 64


def test_restart_with_other_size_stays_degraded(
    adapters: list[SchedulerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    server = FakeServer(min_chunk_size=64)
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        adapter = make(adapters, server, heartbeat=True, interval=0.02)
        link = adapter.links[server.url]
        server.restart(min_chunk_size=100)  # alignment 16 -> 112, not 64
        wait_until(lambda: not link.healthy)
        rounds = adapter.heartbeat.rounds
        wait_until(lambda: adapter.heartbeat.rounds >= rounds + 5)
    assert not link.healthy
    assert ask(adapter, FakeRequest("A", _tokens(300)), 0) == (0, False)
    failures = [r for r in caplog.records if "cannot re-join" in r.message]
    assert len(failures) == 1  # logged once, not every heartbeat
    assert "112" in failures[0].message and "64" in failures[0].message


def test_finished_sessions_are_ended_off_thread(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, heartbeat=True, interval=10)
    for rid in ("A", "B"):
        adapter.request_finished(FakeRequest(rid, _tokens(10)))
    adapter.build_connector_meta(StepOutput())
    wait_until(lambda: server.ended == ["A", "B"])
    assert server.paths().count("POST /cache/end") == 1  # one batched call per step


def test_an_end_the_server_failed_is_sent_again_and_the_other_server_is_not_held(
    adapters: list[SchedulerAdapter],
) -> None:
    """A 503 on one server's /cache/end leaves its sessions to the next round, not to
    the server's TTL; the other server gets its end in the same round."""
    a, b = FakeServer("http://a:1", 64), FakeServer("http://b:2", 64)
    adapter = make(adapters, a, b, world_size=2, heartbeat=True, interval=10)
    a.fail_next["/cache/end"] = httpx.Response(503, json={"detail": "busy"})
    adapter.request_finished(FakeRequest("A", _tokens(10)))
    adapter.build_connector_meta(StepOutput())
    wait_until(lambda: a.ended == ["A"] and b.ended == ["A"])
    assert a.paths().count("POST /cache/end") == 2
    assert b.paths().count("POST /cache/end") == 1


def test_steps_queue_ended_sessions_for_the_heartbeat_loop(
    adapters: list[SchedulerAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step hands the heartbeat's thread nothing (waking it took the engine's GIL
    from the step that scheduled a load): ended sessions wait for the loop's next
    round of ending them, and the ends of several steps go out as one call."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)

    def no_handover(*_: object) -> None:
        raise AssertionError("a step handed work to the heartbeat's thread")

    monkeypatch.setattr(adapter.heartbeat, "submit", no_handover)
    monkeypatch.setattr(adapter.heartbeat, "wake", no_handover)
    for rid in ("A", "B"):
        adapter.request_finished(FakeRequest(rid, _tokens(10)))
        assert not adapter.build_connector_meta(StepOutput())  # nothing for the workers
    assert server.ended == []
    adapter.heartbeat.start()
    wait_until(lambda: server.ended == ["A", "B"])
    assert server.paths().count("POST /cache/end") == 1
    with pytest.raises(RuntimeError, match="before the heartbeat starts"):
        adapter.heartbeat.every(1.0, adapter._end_queued)


def test_shutdown_flushes_ended_sessions(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    adapter.request_finished(FakeRequest("A", _tokens(10)))
    adapter.shutdown()
    assert server.ended == ["A"]


def test_multi_server_lookup_needs_every_server(adapters: list[SchedulerAdapter]) -> None:
    a, b = FakeServer("http://a:1", 64), FakeServer("http://b:2", 64)
    adapter = make(adapters, a, b, world_size=2)
    prompt = _tokens(200)
    r = FakeRequest("A", list(prompt))
    ask(adapter, r, 0)
    adapter.update_state_after_alloc(r, FakeBlocks((list(range(1, 14)),)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (list(range(1, 14)),), 0)], num_scheduled_tokens={"A": 200})
    )
    _store(a, plan.stores)  # rank 0 lives on server a, rank 1 on b
    assert ask(adapter, FakeRequest("B", list(prompt)), 0) == (0, False)
    _store(b, plan.stores)
    assert ask(adapter, FakeRequest("C", list(prompt)), 0) == (192, True)


# ------------------------------------------------------ lookup age, guarded plans


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _computed(adapter: SchedulerAdapter, server: FakeServer, prompt: list[int], end: int) -> None:
    """Run request "W" through one step that computes (and stores) ``end`` tokens."""
    w = FakeRequest(f"W{end}", list(prompt))
    ask(adapter, w, 0)
    blocks = list(range(1, 14))
    adapter.update_state_after_alloc(w, FakeBlocks((blocks,)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq(w.request_id, (blocks,), 0)], num_scheduled_tokens={w.request_id: end})
    )
    _store(server, plan.stores)
    assert adapter.request_finished(w) == (True, None)
    adapter.transfers_finished({w.request_id})  # the worker's report: its store is done


def test_old_lookup_is_looked_up_again(adapters: list[SchedulerAdapter]) -> None:
    """A memo older than lookup_max_age_s is refreshed: the server's lease on the hit
    chunks is renewed and the hit count is current when vLLM finally allocates."""
    server = FakeServer(min_chunk_size=64)
    clock = FakeClock()
    adapter = make(adapters, server, clock=clock)
    assert adapter.config.lookup_max_age_s == 10.0
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 64)

    b = FakeRequest("B", list(prompt))
    lookups = server.paths().count("POST /cache/lookup")
    assert ask(adapter, b, 0) == (64, True)
    _computed(adapter, server, prompt, 192)  # more chunks arrive while B waits
    clock.now += 9
    assert ask(adapter, b, 0) == (64, True)  # memo still young
    assert server.paths().count("POST /cache/lookup") == lookups + 2  # B once, W192 once
    clock.now += 1
    assert ask(adapter, b, 0) == (192, True)  # looked up again
    assert server.paths().count("POST /cache/lookup") == lookups + 3
    clock.now += 5
    assert ask(adapter, b, 0) == (192, True)
    assert server.paths().count("POST /cache/lookup") == lookups + 3

    blocks = list(range(20, 33))
    adapter.update_state_after_alloc(b, FakeBlocks((blocks,)), 192)
    (load,) = adapter.build_connector_meta(StepOutput()).loads
    assert (load.start_token, load.end_token) == (0, 192)


def _three_requests(adapter: SchedulerAdapter, server: FakeServer) -> list[int]:
    """C waits for a load of 128 cached tokens; A and B are new, computing 128 each."""
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 128)
    c = FakeRequest("C", list(prompt))
    assert ask(adapter, c, 0) == (128, True)
    adapter.update_state_after_alloc(c, FakeBlocks((list(range(40, 53)),)), 128)
    for rid, seed in (("A", 1), ("B", 2)):
        r = FakeRequest(rid, _tokens(200, seed))
        ask(adapter, r, 0)
        adapter.update_state_after_alloc(r, FakeBlocks((list(range(1, 14)),)), 0)
    return list(range(1, 14))


def test_store_planning_failure_costs_that_request_only(
    adapters: list[SchedulerAdapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    blocks = _three_requests(adapter, server)
    real_store_op = adapter._planner._store_op

    def store_op(st: Any, computed: int) -> TransferOp | None:
        if st.request.request_id == "A":
            raise OverflowError("token id out of int32 range")
        return real_store_op(st, computed)

    monkeypatch.setattr(adapter._planner, "_store_op", store_op)
    step = StepOutput(
        [NewReq("A", (blocks,), 0), NewReq("B", (blocks,), 0)],
        num_scheduled_tokens={"A": 128, "B": 128},
    )
    with caplog.at_level(logging.DEBUG, logger="mpcache.connector"):
        plan = adapter.build_connector_meta(step)
        assert [op.request_id for op in plan.loads] == ["C"]  # the load is not lost
        assert [(op.request_id, op.end_token) for op in plan.stores] == [("B", 128)]

        later = StepOutput(
            scheduled_cached_reqs=CachedReqs(["A", "B"], set(), [None, None], [128, 128]),
            num_scheduled_tokens={"A": 64, "B": 64},
        )
        plan = adapter.build_connector_meta(later)
    assert [(op.request_id, op.end_token) for op in plan.stores] == [("B", 192)]  # A: never
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "planning the store of A failed" in errors[0].message
    assert errors[0].exc_info is not None


def test_load_planning_failure_is_reported_not_lost(
    adapters: list[SchedulerAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM waits for every accepted async load: one that cannot be planned goes to
    failed_loads (the workers report it failed), the others still load."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    _three_requests(adapter, server)
    d = FakeRequest("D", _tokens(200))
    assert ask(adapter, d, 64) == (64, True)
    adapter.update_state_after_alloc(d, FakeBlocks((list(range(60, 73)),)), 64)
    real_load_op = adapter._planner._load_op

    def load_op(st: Any, local: int, end: int) -> TransferOp | None:
        if st.request.request_id == "D":
            raise IndexError("block ids of a group missing")
        return real_load_op(st, local, end)

    monkeypatch.setattr(adapter._planner, "_load_op", load_op)
    plan = adapter.build_connector_meta(StepOutput())
    assert [op.request_id for op in plan.loads] == ["C"]
    assert plan.failed_loads == ("D",)
    assert StepPlan(failed_loads=("D",))  # a plan holding only failed loads is work too


# ------------------------------------------------------------ asynchronous lookups


def test_lookups_start_on_first_sight_and_go_in_one_batch_per_step(
    adapters: list[SchedulerAdapter],
) -> None:
    """vLLM's thread never waits: each new request answers None, nothing is sent
    until the step ends, then one call carries every request first seen in it."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 128)
    before = len(server.lookups())
    requests = [FakeRequest(rid, list(prompt)) for rid in ("A", "B", "C")]
    for r in requests:
        assert adapter.get_num_new_matched_tokens(r, 0) == (None, False)
    assert adapter.get_num_new_matched_tokens(requests[0], 0) == (None, False)  # asked again
    assert len(server.lookups()) == before  # nothing sent on vLLM's thread
    adapter.build_connector_meta(StepOutput())  # the end of vLLM's schedule()
    for r in requests:
        assert ask(adapter, r, 0) == (128, True)
    assert server.lookups()[before:] == [["A", "B", "C"]]
    (call,) = [c for c in server.calls if c[1] == "/cache/lookup"][before:]
    assert [item["num_tokens"] for item in call[2]["requests"]] == [192, 192, 192]
    # Answered: memoised, no further call.
    assert adapter.get_num_new_matched_tokens(requests[1], 64) == (64, True)
    assert len(server.lookups()) == before + 1


def _in_flight(adapter: SchedulerAdapter, server: FakeServer) -> FakeRequest:
    """Request B, whose 128 tokens are cached, asked once: its lookup is sent and
    held at the server (``server.lookup_gate``) until the test sets the gate."""
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 128)
    server.lookup_gate.clear()
    b = FakeRequest("B", list(prompt))
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    adapter.build_connector_meta(StepOutput())
    return b


def test_pending_lookup_answers_none_until_it_lands(adapters: list[SchedulerAdapter]) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    b = _in_flight(adapter, server)
    wait_until(lambda: server.lookup_gate.is_set() or _sent(adapter))
    for _ in range(3):  # several steps: still in flight, still None, nothing resent
        assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
        adapter.build_connector_meta(StepOutput())
    server.lookup_gate.set()
    assert ask(adapter, b, 0) == (128, True)
    assert server.lookups()[-1] == ["B"]
    assert sum(ids == ["B"] for ids in server.lookups()) == 1


def _sent(adapter: SchedulerAdapter) -> bool:
    return not adapter._lookups._unsent


def test_lookup_that_never_lands_answers_zero(
    adapters: list[SchedulerAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """A stuck call cannot hold a request back: past lookup_timeout_s (+ grace) on the
    adapter's clock the answer is 0, and the late answer is ignored."""
    server = FakeServer(min_chunk_size=64)
    clock = FakeClock()
    adapter = make(adapters, server, clock=clock)
    b = _in_flight(adapter, server)
    clock.now += adapter.config.lookup_timeout_s
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    clock.now += 1.0
    with caplog.at_level(logging.ERROR, logger="mpcache.connector"):
        assert adapter.get_num_new_matched_tokens(b, 0) == (0, False)
    assert any("has not landed" in r.message for r in caplog.records)
    server.lookup_gate.set()
    wait_until(lambda: len(server.lookups()) >= 2)
    assert adapter.get_num_new_matched_tokens(b, 0) == (0, False)  # memo: the answer given
    assert adapter.available


def test_failed_lookup_answers_zero(adapters: list[SchedulerAdapter]) -> None:
    import httpx

    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 128)
    server.fail_next["/cache/lookup"] = httpx.Response(503, json={"detail": "busy"})
    assert ask(adapter, FakeRequest("B", list(prompt)), 0) == (0, False)
    assert ask(adapter, FakeRequest("C", list(prompt)), 0) == (128, True)


def test_degraded_answers_zero_at_once_even_while_pending(
    adapters: list[SchedulerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    b = _in_flight(adapter, server)
    link = adapter.links[server.url]
    link.mark_unhealthy("test")
    assert adapter.get_num_new_matched_tokens(b, 0) == (0, False)
    server.lookup_gate.set()
    wait_until(lambda: len(server.lookups()) >= 2)
    link.mark_healthy(server.boot_id)
    # The answer that was in flight is not used: a fresh lookup starts.
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    assert ask(adapter, b, 0) == (128, True)
    assert server.lookups()[-2:] == [["B"], ["B"]]


def test_vllm_own_cache_covering_the_prompt_answers_zero_while_pending(
    adapters: list[SchedulerAdapter],
) -> None:
    """A waiting request's lookup is in flight when vLLM's own prefix cache comes to
    hold the whole lookup (another request computed it): the answer is 0 at once,
    not None until the lookup lands."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    b = _in_flight(adapter, server)
    assert adapter.get_num_new_matched_tokens(b, 64) == (None, False)  # still short of it
    assert adapter.get_num_new_matched_tokens(b, 192) == (0, False)
    server.lookup_gate.set()


def test_request_finished_before_its_lookup_is_sent_is_never_looked_up(
    adapters: list[SchedulerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, heartbeat=True, interval=10)  # its loop sends ends
    a, b = FakeRequest("A", _tokens(200)), FakeRequest("B", _tokens(200, 1))
    assert adapter.get_num_new_matched_tokens(a, 0) == (None, False)
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    adapter.request_finished(a)  # aborted while waiting
    adapter.build_connector_meta(StepOutput())
    assert ask(adapter, b, 0) == (0, False)
    assert server.lookups() == [["B"]]
    wait_until(lambda: server.ended == ["A"])


def test_request_finished_while_its_lookup_is_in_flight_leaks_no_session(
    adapters: list[SchedulerAdapter],
) -> None:
    """The end sent with the next step may reach the server before the lookup, which
    would reopen the session: the lookup's own landing ends it again."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server, heartbeat=True, interval=10)  # its loop sends ends
    server.lookup_gate.clear()
    a = FakeRequest("A", _tokens(200))
    assert adapter.get_num_new_matched_tokens(a, 0) == (None, False)
    adapter.build_connector_meta(StepOutput())
    adapter.request_finished(a)
    adapter.build_connector_meta(StepOutput())  # sends the end; the lookup is held
    wait_until(lambda: server.ended == ["A"])
    server.lookup_gate.set()
    wait_until(lambda: server.ended == ["A", "A"])
    paths = [p for p in server.paths() if p in ("POST /cache/lookup", "POST /cache/end")]
    assert paths[-2:] == ["POST /cache/lookup", "POST /cache/end"]  # ended after the lookup
    assert "A" not in adapter._requests


def test_old_memo_is_refreshed_asynchronously(adapters: list[SchedulerAdapter]) -> None:
    """Past lookup_max_age_s the memo is not used: the request waits (None) for the
    refreshed answer, which renews the server's lease."""
    server = FakeServer(min_chunk_size=64)
    clock = FakeClock()
    adapter = make(adapters, server, clock=clock)
    prompt = _tokens(200)
    _computed(adapter, server, prompt, 64)
    b = FakeRequest("B", list(prompt))
    assert ask(adapter, b, 0) == (64, True)
    _computed(adapter, server, prompt, 192)
    clock.now += adapter.config.lookup_max_age_s
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)  # not the old 64
    assert adapter.get_num_new_matched_tokens(b, 0) == (None, False)
    assert ask(adapter, b, 0) == (192, True)


def test_lookups_after_the_lookup_thread_stopped_answer_zero(
    adapters: list[SchedulerAdapter],
) -> None:
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    adapter._lookups._sender._thread.shutdown()
    a = FakeRequest("A", _tokens(200))
    assert adapter.get_num_new_matched_tokens(a, 0) == (None, False)
    adapter.build_connector_meta(StepOutput())
    assert adapter.get_num_new_matched_tokens(a, 0) == (0, False)
    assert server.lookups() == []


def test_tokens_are_packed_once_per_request(
    adapters: list[SchedulerAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup packs the prompt; the store plan reuses those bytes."""
    server = FakeServer(min_chunk_size=64)
    adapter = make(adapters, server)
    packed: list[int] = []
    real = adapter._requests.packer

    def counting(tokens: Any, start: int, end: int) -> bytes:
        packed.append(end - start)
        return real(tokens, start, end)

    monkeypatch.setattr(adapter._requests, "packer", counting)
    a = FakeRequest("A", _tokens(200))
    assert ask(adapter, a, 0) == (0, False)
    blocks = list(range(1, 14))
    adapter.update_state_after_alloc(a, FakeBlocks((blocks,)), 0)
    plan = adapter.build_connector_meta(
        StepOutput([NewReq("A", (blocks,), 0)], num_scheduled_tokens={"A": 192})
    )
    (op,) = plan.stores
    assert _decode(op) == a.all_token_ids[:192]
    assert packed == [192]
