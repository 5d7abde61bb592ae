"""Lookups answered from the server's key index, in the step vLLM first asks."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from app.hashing import TokenHasher
from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.index_slot import IndexSlot
from connector.key_index import KeyIndexReader
from connector.metadata import StepPlan, TransferOp
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from contract import keychain
from contract.tokens import encode_tokens
from dataplane.key_index import KeyIndex
from tests.connector.fakes import (
    AttnSpec,
    FakeBlocks,
    FakeRequest,
    Group,
    NewReq,
    StepOutput,
    ask,
)
from tests.support import free_port, require_kernel, server_process, wait_until

BS = 16
CHUNK = 64
NS = "tiny@index/ws1"
NUM_BLOCKS = 32


def _config(url: str, *, key_index: bool = True, interval: float = 10.0) -> ConnectorConfig:
    return ConnectorConfig(
        server_urls=(url,),
        key_index=key_index,
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=1.0,
        request_timeout_s=5.0,
        lookup_timeout_s=2.0,
        startup_timeout_s=10.0,
    )


def _layout() -> Any:
    return layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])


def _scheduler(url: str, name: str, **config: Any) -> SchedulerAdapter:
    return SchedulerAdapter(
        _config(url, **config), _layout(), model="tiny", instance_id=name, namespace=NS
    )


def _worker(url: str, name: str, **config: Any) -> WorkerAdapter:
    worker = WorkerAdapter(
        _config(url, **config),
        _layout(),
        rank=0,
        world_size=1,
        num_blocks=NUM_BLOCKS,
        model="tiny",
        instance_id=name,
        namespace=NS,
    )
    worker.register_kv_caches({n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")})
    return worker


def _store(worker: WorkerAdapter, rid: str, prompt: list[int], end: int) -> None:
    """Store ``prompt[:end]``: whole chunks, then whole units (blocks) as a tail."""
    op = TransferOp(
        rid, 0, end, encode_tokens(prompt[:end]), [list(range(-(-end // BS)))], unit_tokens=BS
    )
    worker.save(StepPlan(stores=(op,)))
    assert worker.flush(10.0)  # its lane has sent it


def _indexed(sched: SchedulerAdapter) -> None:
    wait_until(lambda: sched._lookups._sender.index._current() is not None, what="the index")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with server_process("--chunk-size", str(CHUNK)) as (url, _proc):
        yield url


@pytest.mark.slow
def test_the_first_ask_is_answered_as_the_server_would(server: str) -> None:
    worker = _worker(server, "idx-w")
    indexed = _scheduler(server, "idx")
    asked = _scheduler(server, "idx-http", key_index=False)
    try:
        _indexed(indexed)
        prompt = [(i * 67 + 3) % 991 for i in range(150)]
        _store(worker, "S", prompt, 144)  # two chunks and a tail of one block
        cases = {
            "full": prompt,  # all but the last partial block: 144
            "part": prompt[:100],  # whole blocks before its last token: 96
            "diverges": prompt[:70] + [5] * 80,  # chunk 0 and the shared block: 64
            "longer": prompt + [7] * 80,
            "new": [3] * 150,
        }
        for name, tokens in cases.items():
            indexed.send_lookups()  # a new step, with its budget (IndexSlot)
            at_once = indexed.get_num_new_matched_tokens(FakeRequest(f"i-{name}", tokens), 0)
            assert at_once[0] is not None, name  # no step waits for this answer
            by_http = ask(asked, FakeRequest(f"h-{name}", list(tokens)))
            assert at_once == by_http, name
        salted = FakeRequest("salted", list(prompt))
        salted.cache_salt = "tenant-b"
        indexed.send_lookups()  # a new step: the last one's budget may be spent
        assert indexed.get_num_new_matched_tokens(salted, 0) == (0, False)
    finally:
        for adapter in (indexed, asked, worker):
            adapter.shutdown()


@pytest.mark.slow
def test_a_prompt_like_a_landing_one_stops_waiting_once_the_index_shows_its_stores(
    server: str,
) -> None:
    """The same prompt right after A finished waits for A's stores, but only until
    the key index shows them, not for vLLM's report that they are done."""
    worker = _worker(server, "land-w")
    sched = _scheduler(server, "land")
    try:
        _indexed(sched)
        prompt = [(i * 53 + 11) % 991 for i in range(150)]
        a = FakeRequest("A", list(prompt))
        assert ask(sched, a, 0) == (0, False)
        blocks = list(range(1, 11))
        sched.update_state_after_alloc(a, FakeBlocks((blocks,)), 0)
        plan = sched.build_connector_meta(
            StepOutput([NewReq("A", (blocks,), 0)], num_scheduled_tokens={"A": 150})
        )
        assert [(op.start_token, op.end_token) for op in plan.stores] == [(0, 144)]
        assert sched.request_finished(a) == (True, None)  # its store is on its way

        b = FakeRequest("B", list(prompt))
        sched.send_lookups()  # a new step
        assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # not stored yet
        worker.save(plan)
        assert worker.flush(10.0)  # stored; vLLM has not been told (no finished_sending)
        sched.send_lookups()
        assert sched.get_num_new_matched_tokens(b, 0) == (144, True)
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.slow
def test_a_restarted_server_is_answered_from_its_new_index() -> None:
    port = free_port()
    prompt = [(i * 29 + 1) % 997 for i in range(150)]
    with server_process("--chunk-size", str(CHUNK), port=port) as (url, proc):
        sched = _scheduler(url, "idx-restart", interval=0.2)
        worker = _worker(url, "idx-restart-w", interval=0.2)
        _indexed(sched)
        _store(worker, "S", prompt, 128)
        assert sched.get_num_new_matched_tokens(FakeRequest("a", list(prompt)), 0) == (128, True)
        proc.kill()
        proc.wait(timeout=10)
    try:
        with server_process("--chunk-size", str(CHUNK), port=port) as (url, _):
            wait_until(lambda: worker.available and sched.links[url].healthy, timeout_s=20)
            # The old index is dropped (its server is gone), the new one opened.
            ask(sched, FakeRequest("b", list(prompt)))
            _indexed(sched)
            sched.send_lookups()
            assert sched.get_num_new_matched_tokens(FakeRequest("c", list(prompt)), 0) == (0, False)
            _store(worker, "S2", prompt, 144)
            sched.send_lookups()
            answer = sched.get_num_new_matched_tokens(FakeRequest("d", list(prompt)), 0)
            assert answer == (144, True)
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("kernel", [pytest.param(False, id="python"), pytest.param(True, id="c")])
def test_the_reader_derives_the_servers_keys(kernel: bool) -> None:
    """The connector's keys (contract.chunk_keys, or the C loop) are the server's."""
    hasher = TokenHasher(seed=987654321)
    index = KeyIndex.create(1024, secret=hasher.secret, boot_id="ab" * 16, authoritative=True)
    try:
        tokens = np.arange(3 * CHUNK + 40, dtype=np.int32)
        keys = hasher.prefix_keys(NS, "salt", tokens, chunk_size=CHUNK)
        for key in keys[:2]:
            index.set(key, 0, True)
        units = hasher.unit_keys(NS, "salt", keys[1], tokens[128:192], BS, 3, chunk_size=CHUNK)
        index.set(units[1], 0, True)  # two units of chunk 2
        mapping = mmap.mmap(-1, index.segment.size_bytes)
        mapping[:] = index.segment.buffer[:]
        chain = require_kernel(keychain.load, "key chain kernel") if kernel else None
        reader = KeyIndexReader(mapping, namespace=NS, chunk_size=CHUNK, world_size=1, chain=chain)
        packed = tokens.tobytes()
        assert reader.hit_tokens(packed, len(tokens), "salt", BS) == 2 * CHUNK + 2 * BS
        assert reader.hit_tokens(packed, len(tokens), "salt", None) == 2 * CHUNK
        assert reader.hit_tokens(packed, len(tokens), None, BS) == 0  # another salt's keys
        reader.close()
    finally:
        index.close()


class _Reader:
    boot_id = "b1"
    authoritative = False

    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.closed = False

    def hit_tokens(self, packed: bytes, n: int, salt: str | None, unit: int | None) -> int:
        return self.hit

    def close(self) -> None:
        self.closed = True


class _Link:
    url = "http://x"
    boot_id: str | None = "b1"


def _slot(now: list[float]) -> IndexSlot:
    slot = IndexSlot(
        None,  # type: ignore[arg-type]
        _Link(),  # type: ignore[arg-type]
        namespace=NS,
        chunk_size=CHUNK,
        world_size=1,
        unit_tokens=BS,
        enabled=False,
        submit=lambda call: None,
        clock=lambda: now[0],
    )
    return slot


def test_the_step_budget_sends_the_rest_of_a_burst_to_the_server() -> None:
    now = [0.0]
    slot = _slot(now)
    slot._fresh = _Reader(64)  # type: ignore[assignment]

    def packed() -> bytes:
        now[0] += 0.0003  # each answer costs vLLM's thread 0.3 ms
        return b""

    answers = [slot.answer(packed, 100, None) for _ in range(3)]
    assert answers == [64, 64, None]  # 0.6 ms spent: over the 0.5 ms budget
    slot.refill()  # the next step
    assert slot.answer(packed, 100, None) == 64


def test_a_miss_from_an_index_that_is_not_authoritative_asks_the_server() -> None:
    slot = _slot([0.0])
    slot._fresh = _Reader(0)  # type: ignore[assignment]
    assert slot.answer(lambda: b"", 100, None) is None


def test_an_index_of_another_server_process_is_dropped() -> None:
    slot = _slot([0.0])
    reader = _Reader(64)
    slot._fresh = reader  # type: ignore[assignment]
    assert slot.answer(lambda: b"", 100, None) == 64
    slot._link.boot_id = "b2"  # type: ignore[attr-defined]  # the server restarted
    assert slot.answer(lambda: b"", 100, None) is None
    assert reader.closed
