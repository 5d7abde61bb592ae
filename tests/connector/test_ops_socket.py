"""Store and retrieve over the server's ops socket (``connector.transfer_calls``,
``app.ops_socket``), against a real server process and, for the faults, a listener
that plays a server which misbehaves."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from connector.alignment import layout_from_groups
from connector.errors import ServerRejected, ServerTimeout, ServerUnreachable
from connector.metadata import TransferOp
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from contract.ops_frames import FRAME_HEAD, encode_frame, frame_lengths
from contract.schemas import REGISTRATION_TOKEN_HEADER, StoreRequest, StoreResponse
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, FakeBlocks, FakeRequest, Group, NewReq, StepOutput, ask
from tests.support import quick_connector_config, server_process

pytestmark = pytest.mark.slow

NUM_BLOCKS = 16
BS = 16
NS = "tiny@test/ws1"
TOKEN_HEADER = REGISTRATION_TOKEN_HEADER


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with server_process("--chunk-size", "64") as (url, _proc):
        yield url


def _adapters(
    url: str, instance: str, *, ops_socket: bool = True
) -> tuple[SchedulerAdapter, WorkerAdapter]:
    layout = layout_from_groups([Group(AttnSpec(BS), ["l0", "l1"])])
    common: dict[str, Any] = {"model": "tiny", "instance_id": instance, "namespace": NS}
    config = quick_connector_config(url, heartbeat_interval_s=10.0, ops_socket=ops_socket)
    sched = SchedulerAdapter(config, layout, world_size=1, **common)
    worker = WorkerAdapter(config, layout, rank=0, world_size=1, num_blocks=NUM_BLOCKS, **common)
    return sched, worker


class _HttpCalls:
    """Counts the store and retrieve calls a worker sends over HTTP."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, worker: WorkerAdapter) -> None:
        self.calls: list[str] = []
        client = worker.link.client
        for name in ("store", "retrieve"):
            real = getattr(client, name)
            monkeypatch.setattr(client, name, self._counting(name, real))

    def _counting(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return real(*args, **kwargs)

        return call


def _store_then_load(sched: SchedulerAdapter, worker: WorkerAdapter, tag: str) -> None:
    """A prompt stored from blocks 1..5, then loaded into 8..12: the bytes must match."""
    kv = {n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")}
    worker.register_kv_caches(kv)
    assert worker.registered
    prompt = [(i * 31 + len(tag)) % 991 for i in range(80)]
    a = FakeRequest(f"{tag}-a", list(prompt))
    assert ask(sched, a, 0) == (0, False)
    src = [1, 2, 3, 4, 5]
    sched.update_state_after_alloc(a, FakeBlocks((src,)), 0)
    for j, b in enumerate(src):
        for n in kv:
            kv[n][b].fill_(float(j + 1) + (0.25 if n == "l1" else 0.0))
    plan = sched.build_connector_meta(
        StepOutput([NewReq(a.request_id, (src,), 0)], num_scheduled_tokens={a.request_id: 80})
    )
    worker.save(plan)
    assert worker.flush(10.0)
    sched.request_finished(a)
    sched.transfers_finished({a.request_id})
    b = FakeRequest(f"{tag}-b", list(prompt))
    assert ask(sched, b, 0) == (64, True)
    dst = [8, 9, 10, 11, 12]
    sched.update_state_after_alloc(b, FakeBlocks((dst,)), 64)
    worker.start_load(sched.build_connector_meta(StepOutput()))
    assert worker.flush(10.0)
    assert worker.take_transfer_results() == ({b.request_id}, set())
    assert worker.take_load_errors() == set()
    for j in range(4):  # one chunk of 64 tokens: four blocks
        for n in kv:
            assert torch.equal(kv[n][dst[j]], kv[n][src[j]]), (n, j)


@pytest.mark.parametrize("ops_socket", [True, False], ids=["ops-socket", "http"])
def test_stores_and_loads_take_the_ops_socket_with_the_same_bytes(
    server: str, ops_socket: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched, worker = _adapters(server, f"ops-{ops_socket}", ops_socket=ops_socket)
    http = _HttpCalls(monkeypatch, worker)
    try:
        _store_then_load(sched, worker, f"t{ops_socket}")
        assert http.calls == ([] if ops_socket else ["store", "retrieve"])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_an_ops_socket_out_of_reach_leaves_the_calls_on_http(
    server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sched, worker = _adapters(server, "unreachable")
    http = _HttpCalls(monkeypatch, worker)
    real_register = worker._registration.register

    def register_elsewhere() -> Any:  # a server on another host: its path is not here
        reply = real_register()
        worker._registration.ops_path = str(tmp_path / "nowhere.sock")
        return reply

    monkeypatch.setattr(worker._registration, "register", register_elsewhere)
    try:
        _store_then_load(sched, worker, "far")
        assert http.calls == ["store", "retrieve"]
    finally:
        worker.shutdown()
        sched.shutdown()


# ---------------------------------------------------------------- a misbehaving peer


class _Peer:
    """A listener that greets with ``boot_id`` and then does what ``serve`` says
    with each connection: it records every frame it reads."""

    def __init__(
        self,
        path: Path,
        boot_id: str | None,
        serve: Callable[[_Peer, socket.socket], None],
    ):
        self.path = path
        self.boot_id = boot_id  # None: accepts, never greets
        self.frames: list[dict[str, Any]] = []
        self.connections = 0
        self._serve = serve
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(4)
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._socks.append(sock)
            if self.boot_id is not None:
                sock.sendall(encode_frame({"boot_id": self.boot_id}))
            thread = threading.Thread(target=self._serve, args=(self, sock), daemon=True)
            thread.start()
            self._threads.append(thread)

    def read_frame(self, sock: socket.socket) -> dict[str, Any] | None:
        prefix = _recv(sock, FRAME_HEAD.size)
        if prefix is None:
            return None
        head_len, body_len = frame_lengths(prefix, 1 << 24)
        head = json.loads(_recv(sock, head_len) or b"{}")
        body = _recv(sock, body_len) or b""
        self.frames.append({"head": head, "body": json.loads(body)})
        return head

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._socks:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


def _recv(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        try:
            part = sock.recv(size - len(data))
        except OSError:
            return None
        if not part:
            return None
        data += part
    return data


STORE_REPLY = StoreResponse(results=[]).model_dump_json().encode()


def _store_body(worker: WorkerAdapter) -> StoreRequest:
    op = TransferOp("r1", 0, 64, encode_tokens(list(range(64))), [[1, 2, 3, 4]], None)
    return StoreRequest(**worker._body([op], None))


@pytest.fixture
def worker(server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerAdapter]:
    """A registered worker of the real server; its HTTP store and retrieve counted."""
    sched, w = _adapters(server, f"peer-{time.monotonic_ns()}")
    try:
        w.register_kv_caches({n: torch.zeros(NUM_BLOCKS, 2, BS, 2, 8) for n in ("l0", "l1")})
        assert w.registered
        w.http_calls = _HttpCalls(monkeypatch, w)  # type: ignore[attr-defined]
        yield w
    finally:
        w.shutdown()
        sched.shutdown()


@pytest.fixture
def peer_dir() -> Iterator[Path]:
    # A short path: sun_path holds 108 bytes, and pytest's tmp_path can be longer.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mpops-") as folder:
        yield Path(folder)


def _behind(worker: WorkerAdapter, peer: _Peer) -> None:
    worker._registration.ops_path = str(peer.path)


def test_a_socket_of_another_server_process_is_not_used(
    worker: WorkerAdapter, peer_dir: Path
) -> None:
    peer = _Peer(peer_dir / "p.sock", "another-boot", lambda p, s: p.read_frame(s))
    try:
        _behind(worker, peer)
        reply = worker._transfers.store(
            _store_body(worker), timeout_s=5.0, registration_token=worker.registration_token
        )
        assert isinstance(reply, StoreResponse)  # the real server answered over HTTP
        assert peer.frames == []
        assert worker.http_calls.calls == ["store"]  # type: ignore[attr-defined]
    finally:
        peer.close()


def test_a_connection_lost_after_the_frame_is_sent_fails_the_call_and_never_resends(
    worker: WorkerAdapter, peer_dir: Path
) -> None:
    def read_then_hang_up(p: _Peer, sock: socket.socket) -> None:
        p.read_frame(sock)
        sock.close()

    peer = _Peer(peer_dir / "p.sock", str(worker.link.boot_id), read_then_hang_up)
    try:
        _behind(worker, peer)
        with pytest.raises(ServerUnreachable, match="ops socket"):
            worker._transfers.store(
                _store_body(worker), timeout_s=5.0, registration_token=worker.registration_token
            )
        assert len(peer.frames) == 1 and peer.frames[0]["head"]["op"] == "store"
        assert worker.http_calls.calls == []  # type: ignore[attr-defined]
    finally:
        peer.close()


def test_a_reply_that_never_comes_ends_the_call_at_its_timeout(
    worker: WorkerAdapter, peer_dir: Path
) -> None:
    silent = threading.Event()
    gave_up = threading.Event()

    def read_then_say_nothing(p: _Peer, sock: socket.socket) -> None:
        p.read_frame(sock)
        if not silent.wait(10):
            gave_up.set()  # a client still waiting now would see a lost connection
            sock.close()

    peer = _Peer(peer_dir / "p.sock", str(worker.link.boot_id), read_then_say_nothing)
    try:
        _behind(worker, peer)
        with pytest.raises(ServerTimeout):
            worker._transfers.store(
                _store_body(worker), timeout_s=0.3, registration_token=worker.registration_token
            )
        assert not gave_up.is_set()  # ended by the call's timeout, not by the peer
        assert len(peer.frames) == 1
        assert worker.http_calls.calls == []  # type: ignore[attr-defined]
    finally:
        silent.set()
        peer.close()


def test_a_server_that_never_greets_fails_the_call_at_its_timeout(
    worker: WorkerAdapter, peer_dir: Path
) -> None:
    stuck = threading.Event()
    gave_up = threading.Event()

    def never_greet(p: _Peer, sock: socket.socket) -> None:
        if not stuck.wait(10):
            gave_up.set()  # a client still waiting now would see a lost connection
            sock.close()

    peer = _Peer(peer_dir / "p.sock", None, never_greet)
    try:
        _behind(worker, peer)
        with pytest.raises(ServerTimeout, match="greeting"):
            worker._transfers.store(
                _store_body(worker), timeout_s=0.3, registration_token=worker.registration_token
            )
        assert not gave_up.is_set()  # ended by the call's timeout, not by the peer
        assert worker.http_calls.calls == []  # type: ignore[attr-defined]
    finally:
        stuck.set()
        peer.close()


def test_an_idle_connection_the_server_closed_is_opened_again_before_sending(
    worker: WorkerAdapter, peer_dir: Path
) -> None:
    hung_up = threading.Event()

    def answer_once_then_hang_up(p: _Peer, sock: socket.socket) -> None:
        if p.read_frame(sock) is not None:
            sock.sendall(encode_frame({"status": 200}, STORE_REPLY))
        if p.connections == 1:
            sock.shutdown(socket.SHUT_RDWR)  # idle: the server went away under it
            hung_up.set()
        else:
            p.read_frame(sock)

    peer = _Peer(peer_dir / "p.sock", str(worker.link.boot_id), answer_once_then_hang_up)
    try:
        _behind(worker, peer)
        body = _store_body(worker)
        worker._transfers.store(body, timeout_s=5.0, registration_token=worker.registration_token)
        assert hung_up.wait(5)
        reply = worker._transfers.store(
            body, timeout_s=5.0, registration_token=worker.registration_token
        )
        assert reply.results == []
        assert peer.connections == 2 and len(peer.frames) == 2
        assert worker.http_calls.calls == []  # type: ignore[attr-defined]
    finally:
        peer.close()


# ---------------------------------------------------------------- the server's side


def _ops_path(url: str) -> str:
    path = httpx.get(f"{url}/register", timeout=5.0).json()["ops_socket_path"]
    assert isinstance(path, str)
    return path


def _exchange(path: str, frames: list[bytes]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Send each frame on one connection; the replies' heads and bodies."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        greeting = _read(sock)
        assert greeting[0]["boot_id"]
        for frame in frames:
            sock.sendall(frame)
            replies.append(_read(sock))
    return replies


def _read(sock: socket.socket) -> tuple[dict[str, Any], dict[str, Any]]:
    prefix = _recv(sock, FRAME_HEAD.size)
    assert prefix is not None, "the server closed the connection"
    head_len, body_len = frame_lengths(prefix, 1 << 24)
    head = json.loads(_recv(sock, head_len) or b"")
    body = json.loads(_recv(sock, body_len) or b"{}") if body_len else {}
    return head, body


def test_refusals_over_the_socket_are_the_problems_http_sends(worker: WorkerAdapter) -> None:
    url = worker.link.url
    body = _store_body(worker).model_dump_json(exclude_none=True)
    path = _ops_path(url)
    (wrong_token, malformed, unknown) = _exchange(
        path,
        [
            encode_frame({"op": "store", "registration_token": "not-it"}, body.encode()),
            encode_frame({"op": "retrieve"}, b'{"instance_id": 7}'),
            encode_frame({"op": "lookup"}, b"{}"),
        ],
    )
    over_http = httpx.post(
        f"{url}/cache/store",
        content=body,
        headers={"content-type": "application/json", TOKEN_HEADER: "not-it"},
        timeout=5.0,
    )
    assert over_http.status_code == 403
    assert wrong_token == ({"status": 403}, over_http.json())
    assert malformed[0] == {"status": 422}
    assert malformed[1]["type"] == "urn:mpcache:problem:malformed-request"
    assert malformed[1]["error_count"] >= 1 and malformed[1]["errors"]
    assert unknown[0] == {"status": 404} and "store or retrieve" in unknown[1]["detail"]


def test_a_frame_that_is_not_ours_is_refused_and_the_connection_closed(server: str) -> None:
    path = _ops_path(server)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        _read(sock)  # the greeting
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        head, problem = _read(sock)
        assert head == {"status": 400} and "magic" in problem["detail"]
        # Closed (the stream cannot be trusted past it); the unread rest resets it.
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""


def test_with_an_api_token_the_socket_wants_it_and_its_file_goes_with_the_server() -> None:
    env = {"MPCACHE_API_TOKEN": "sesame"}
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.settimeout(10)
    with server_process("--chunk-size", "64", env=env) as (url, proc):
        path = _ops_path(url)
        idle.connect(path)
        _read(idle)  # greeted; it stays open, idle, while the server stops
        assert os.stat(path).st_mode & 0o777 == 0o600
        (refused, let_in) = _exchange(
            path,
            [
                encode_frame({"op": "store"}, b"{}"),
                encode_frame({"op": "store", "api_token": "sesame"}, b"{}"),
            ],
        )
        assert refused[0] == {"status": 401}
        assert refused[1]["type"] == "urn:mpcache:problem:unauthorized"
        assert let_in[0] == {"status": 422}  # past the token: the body is checked
    with idle:
        # Stopped by its SIGTERM (128 + 15), not killed after the wait: nothing held it.
        assert proc.returncode == 143
        assert idle.recv(1) == b""  # the server ended the idle connection
    assert not os.path.exists(path)
    assert not os.path.exists(os.path.dirname(path))


def test_a_wrong_registration_token_is_the_same_error_as_over_http(
    worker: WorkerAdapter,
) -> None:
    with pytest.raises(ServerRejected) as over_socket:
        worker._transfers.store(_store_body(worker), timeout_s=5.0, registration_token="bad")
    assert worker.http_calls.calls == []  # type: ignore[attr-defined]
    with pytest.raises(ServerRejected) as over_http:
        worker.link.client.store(_store_body(worker), timeout_s=5.0, registration_token="bad")
    assert over_socket.value.status == over_http.value.status == 403
    assert over_socket.value.problem == over_http.value.problem
