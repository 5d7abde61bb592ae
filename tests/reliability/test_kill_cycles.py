"""SIGKILL of a real server at each step, recovered through the real connector
(issue 8, item 6): after negotiate, after register, mid-store, mid-retrieve.

One scheduler adapter and one worker adapter (the connector's public adapters,
registering through ``register_kv_caches`` as vLLM does) live through every cycle.
Each cycle kills the server process with SIGKILL at its step, starts a new one on
the same port, waits for the adapters' heartbeat to notice and recover
(re-negotiate, re-register), then checks a store/retrieve round trip byte for
byte. Nothing the vLLM-facing calls do may raise meanwhile. At the end no
/dev/shm byte made by this test, its servers or its worker is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.metadata import StepPlan, TransferOp
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, Group
from tests.reliability.support import shm_bytes
from tests.support import free_port, quick_connector_config, server_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

NUM_BLOCKS = 32
BS = 16
CHUNK = 64
NS = "tiny@kill/ws1"
LAYERS = ("l0", "l1")
STEPS = ("after-negotiate", "after-register", "mid-store", "mid-retrieve")
ROUNDS = 2
PROMPT_BLOCKS = 8  # 128 tokens: two chunks
SRC, DST, BUSY = list(range(1, 9)), list(range(9, 17)), list(range(17, 25))


def _config(url: str) -> ConnectorConfig:
    config: ConnectorConfig = quick_connector_config(
        url, lookup_timeout_s=2.0, startup_timeout_s=60.0
    )
    return config


def _prompt(tag: int) -> list[int]:
    return [(tag * 7919 + i * 37) % 30000 for i in range(PROMPT_BLOCKS * BS)]


def _op(request_id: str, prompt: list[int], blocks: list[int]) -> TransferOp:
    return TransferOp(request_id, 0, len(prompt), encode_tokens(prompt), [blocks])


class Node:
    """The two adapters of one engine, with their KV caches."""

    def __init__(self, url: str) -> None:
        layout = layout_from_groups([Group(AttnSpec(BS), list(LAYERS))])
        common = {"model": "tiny", "instance_id": "kill", "namespace": NS}
        self.sched = SchedulerAdapter(_config(url), layout, world_size=1, **common)  # type: ignore[arg-type]
        self.worker = WorkerAdapter(
            _config(url),
            layout,
            rank=0,
            world_size=1,
            num_blocks=NUM_BLOCKS,
            **common,  # type: ignore[arg-type]
        )
        self.kv = {name: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for name in LAYERS}

    def register(self) -> None:
        self.worker.register_kv_caches(self.kv)

    def recovered(self) -> bool:
        links = [*self.sched.links.values(), self.worker.link]
        return all(link.healthy for link in links) and self.worker.available

    def store(self, request_id: str, prompt: list[int], blocks: list[int]) -> None:
        self.worker.save(StepPlan(stores=(_op(request_id, prompt, blocks),)))
        assert self.worker.flush(10.0)  # its lane has sent it

    def load(self, request_id: str, prompt: list[int], blocks: list[int]) -> bool:
        """Load into ``blocks``; whether the load finished without errors."""
        self.worker.start_load(StepPlan(loads=(_op(request_id, prompt, blocks),)))
        assert self.worker.flush(10.0)  # its lane has sent it
        finished, failed = self.worker.take_transfer_results()
        errors = self.worker.take_load_errors()
        return request_id in finished and not failed and not errors

    def round_trip(self, tag: int) -> None:
        """Store a prompt's blocks, load them elsewhere: the very same bytes."""
        gen = torch.Generator().manual_seed(tag)
        for name in LAYERS:
            self.kv[name][SRC] = torch.rand(self.kv[name][SRC].shape, generator=gen)
            self.kv[name][DST] = 0
        prompt = _prompt(tag)
        self.store(f"s{tag}", prompt, SRC)
        assert self.load(f"l{tag}", prompt, DST), f"round trip {tag}: load failed"
        for name in LAYERS:
            assert torch.equal(self.kv[name][DST], self.kv[name][SRC]), (tag, name)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@contextlib.contextmanager
def _busy(action: Callable[[int], None]) -> Iterator[Callable[[], int]]:
    """Run ``action(i)`` for i = 0, 1, ... on a thread until the block exits; yield a
    function giving how many ran. The connector must never raise, server dead or not."""
    stop = threading.Event()
    count = 0
    errors: list[BaseException] = []

    def run() -> None:
        nonlocal count
        while not stop.is_set() and count < 100_000:
            try:
                action(count)
            except BaseException as exc:  # reported on the test's thread
                errors.append(exc)
                return
            count += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield lambda: count
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    assert not thread.is_alive()


def _chunks_stored(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("mpcache_chunks_stored_total "):
            return float(line.split()[1])
    return 0.0


_NAME = re.compile(r"^mpcache-[a-z]+-[0-9]+-(?P<pid>[0-9]+)-")


def _ours(pids: set[int]) -> dict[str, int]:
    """The /dev/shm segments made by this test process or its servers."""
    return {
        name: size
        for name, size in shm_bytes().items()
        if (m := _NAME.match(name)) is not None and int(m["pid"]) in pids
    }


class Servers:
    """One real ``mpcache server`` at a time on one port; SIGKILL, then restart."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.pids: set[int] = set()
        self._stack: contextlib.ExitStack | None = None
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        stack = contextlib.ExitStack()
        self.url, self.proc = stack.enter_context(
            server_process("--chunk-size", str(CHUNK), port=self.port)
        )
        self._stack = stack
        self.pids.add(self.proc.pid)
        return self.url

    def kill(self) -> None:
        assert self.proc is not None and self._stack is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.stop()

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()  # terminates a live server (a clean exit)
            self._stack = None


def test_sigkill_at_each_step_recovers_through_the_connector_and_leaks_nothing() -> None:
    servers = Servers(free_port())
    pids = {os.getpid()}
    survived = 0
    tag = 0

    def restart_and_check(node: Node, step: str) -> None:
        nonlocal survived, tag
        url = servers.start()
        wait_until(node.recovered, what=f"recovery after a SIGKILL {step}")
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert (health["chunk_size"], health["registrations"]) == (CHUNK, 1)
        tag += 1
        node.round_trip(tag)
        survived += 1

    try:
        for _ in range(ROUNDS):
            url = servers.start()
            node = Node(url)  # both adapters negotiate
            try:
                servers.kill()  # after negotiate
                node.register()  # vLLM registers next: refused, never raised
                assert not node.worker.available
                restart_and_check(node, "after negotiate")

                servers.kill()  # after register
                restart_and_check(node, "after register")

                def store(i: int, node: Node = node) -> None:
                    node.store(f"busy-s{tag}-{i}", _prompt(10_000 + i), BUSY)

                with _busy(store) as done:
                    wait_until(lambda: _chunks_stored(servers.url) > 0, what="stores")
                    servers.kill()  # mid-store
                    ran = done()
                    wait_until(lambda ran=ran: done() > ran + 2, what="stores, server down")
                restart_and_check(node, "mid-store")

                warm = _prompt(20_000 + tag)
                node.store(f"warm{tag}", warm, SRC)

                def load(i: int, node: Node = node, warm: list[int] = warm) -> None:
                    node.load(f"busy-l{tag}-{i}", warm, BUSY)

                with _busy(load) as done:
                    wait_until(lambda: done() > 2, what="loads")
                    servers.kill()  # mid-retrieve
                    ran = done()
                    wait_until(lambda ran=ran: done() > ran + 2, what="loads, server down")
                restart_and_check(node, "mid-retrieve")
            finally:
                node.shutdown()  # unregisters while the server is up, unlinks its segments
            servers.stop()
    finally:
        servers.stop()
        pids |= servers.pids
    print(f"kill cycles survived: {survived}")
    assert survived == ROUNDS * len(STEPS)
    # Killed servers' pools were swept by the next server start; the last server
    # exited cleanly and the worker unlinked its segments: no byte is left.
    leaked = _ours(pids)
    assert sum(leaked.values()) == 0 and leaked == {}, leaked
