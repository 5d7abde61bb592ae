"""An in-memory mpcache server double and doubles of vLLM's scheduler objects.

``FakeServer`` speaks the wire contract (``contract.schemas``, the binary lookup
form of ``contract.frames``) through ``httpx.MockTransport`` for both the blocking
and the async client (``lookup_gate`` can hold lookups back), keeps chunks as
prefix keys per (namespace, rank), and can be taken down or "restarted" (new
boot_id, forgotten state, optionally another minimum chunk size). Its registration
socket is the server's real one (``dataplane.fdgate``, started on the first
``GET /register``; ``close_gates`` stops them all): workers pass real memfds and
the fake redeems their tickets. It hands out registration tokens and checks them.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, decode_lookup_frame
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    EndSessionsRequest,
    LookupRequest,
    MemfdTensor,
    NegotiateRequest,
    RegisterRequest,
    RetrieveRequest,
    StoreRequest,
)
from dataplane.fdgate import FdGate
from tests.support import wait_until

_GATES: list[FdGate] = []


def close_gates() -> None:
    """Stop every registration socket fakes started (a fixture calls it after each test)."""
    while _GATES:
        _GATES.pop().close()


def _problem(status: int, detail: str, **extra: Any) -> httpx.Response:
    body = {"type": "urn:test", "title": "t", "status": status, "detail": detail, **extra}
    return httpx.Response(status, json=body)


class FakeServer:
    def __init__(self, url: str = "http://fake:8000", min_chunk_size: int = 256) -> None:
        self.url = url
        self.min_chunk_size = min_chunk_size
        self.lock = threading.Lock()
        self.up = True
        self.calls: list[tuple[str, str, Any]] = []
        # Per call: the httpx timeouts the client gave it (connect/read/write/pool).
        self.client_timeouts: list[tuple[str, dict[str, float | None]]] = []
        self.fail_next: dict[str, httpx.Response] = {}
        # Cleared: lookups wait until it is set again.
        self.lookup_gate = threading.Event()
        self.lookup_gate.set()
        # Per path: a cleared gate holds that path's calls until it is set again;
        # ``arrived`` counts the calls that reached the server, held or not.
        self.gates: dict[str, threading.Event] = {}
        self.arrived: dict[str, int] = {}
        self.gate: FdGate | None = None
        self.redeemed: list[int] = []  # per registration: memfds redeemed
        self._headers: httpx.Headers = httpx.Headers()
        self._boot()

    def _boot(self) -> None:
        self.boot_id = uuid.uuid4().hex
        self.chunk_size: int | None = None
        self.chunks: set[tuple[str, int, bytes]] = set()
        self.registrations: dict[tuple[str, int], RegisterRequest] = {}
        self.tokens: dict[tuple[str, int], str] = {}
        self.ended: list[str] = []

    def restart(self, min_chunk_size: int | None = None) -> None:
        with self.lock:
            if min_chunk_size is not None:
                self.min_chunk_size = min_chunk_size
            self._boot()

    # --------------------------------------------------------------- transports

    def transport(self, url: str = "") -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def lookups(self) -> list[list[str]]:
        """Request ids of each lookup call, in order."""
        with self.lock:
            return [
                [item["request_id"] for item in body["requests"]]
                for _, path, body in self.calls
                if path == "/cache/lookup"
            ]

    def paths(self) -> list[str]:
        with self.lock:
            return [f"{m} {p}" for m, p, _ in self.calls]

    def hold(self, path: str) -> threading.Event:
        """Hold calls to ``path`` until the returned event is set."""
        gate = self.gates[path] = threading.Event()
        return gate

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        with self.lock:
            self.arrived[path] = self.arrived.get(path, 0) + 1
        if path == "/cache/lookup":  # the scheduler's lookup thread waits
            assert self.lookup_gate.wait(timeout=60), "lookup_gate never opened"
        gate = self.gates.get(path)
        if gate is not None:
            assert gate.wait(timeout=60), f"the gate of {path} never opened"
        with self.lock:
            if not self.up:
                raise httpx.ConnectError("connection refused", request=request)
            path = request.url.path
            frame = request.headers.get("content-type") == LOOKUP_FRAME_MEDIA_TYPE
            if frame:
                items = decode_lookup_frame(request.content)
                body = {"requests": [item.model_dump() for item, _ in items], "frame": items}
            else:
                body = json.loads(request.content) if request.content else None
            self.calls.append((request.method, path, body))
            self._headers = request.headers
            self.client_timeouts.append((path, dict(request.extensions.get("timeout", {}))))
            injected = self.fail_next.pop(path, None)
            if injected is not None:
                return injected
            return self._route(request.method, path, body)

    def _route(self, method: str, path: str, body: Any) -> httpx.Response:
        if path == "/health":
            return httpx.Response(
                200,
                json={
                    "status": "ok",
                    "boot_id": self.boot_id,
                    "chunk_size": self.chunk_size,
                    "final": self.chunk_size is not None,
                    "uptime_s": 1.0,
                    "sessions": 0,
                    "registrations": len(self.registrations),
                    "version": "fake",
                },
            )
        if path == "/negotiate":
            req = NegotiateRequest.model_validate(body)
            a = req.required_alignment
            if self.chunk_size is None:
                self.chunk_size = -(-self.min_chunk_size // a) * a
            elif self.chunk_size % a:
                return _problem(409, f"chunk size {self.chunk_size} not a multiple of {a}")
            return httpx.Response(
                200,
                json={
                    "chunk_size": self.chunk_size,
                    "min_chunk_size": self.min_chunk_size,
                    "required_alignment": a,
                    "boot_id": self.boot_id,
                },
            )
        if path == "/register" and method == "GET":
            if self.gate is None:
                folder = Path(tempfile.mkdtemp(prefix="mpcache-fake-"))
                self.gate = FdGate(
                    folder / "r.sock", on_disconnect=lambda _: None, owns_directory=True
                )
                self.gate.start()
                _GATES.append(self.gate)
            return httpx.Response(
                200,
                json={
                    "socket_path": str(self.gate.path),
                    "max_fds_per_handshake": 64,
                    "max_tickets_per_connection": 128,
                },
            )
        if self.chunk_size is None:
            return _problem(409, "not negotiated")
        token = self._headers.get(REGISTRATION_TOKEN_HEADER)
        if path == "/register" and method == "POST":
            reg = RegisterRequest.model_validate(body)
            tickets = {
                t.ticket for la in reg.layers for t in la.tensors if isinstance(t, MemfdTensor)
            }
            if tickets:
                if self.gate is None:
                    return _problem(422, "unknown ticket")
                try:
                    _, memories = self.gate.take(tickets)
                except Exception as exc:
                    return _problem(422, str(exc))
                for memory in memories.values():
                    memory.close()
                self.redeemed.append(len(memories))
            if reg.chunk_size != self.chunk_size:
                return _problem(409, "chunk size mismatch")
            key = (reg.instance_id, reg.rank)
            refreshed = key in self.registrations
            if refreshed and token != self.tokens[key]:
                return _problem(403, "registered by another client")
            self.registrations[key] = reg
            self.tokens[key] = token or secrets.token_urlsafe(32)
            return httpx.Response(
                200,
                json={
                    "instance_id": reg.instance_id,
                    "rank": reg.rank,
                    "chunk_size": reg.chunk_size,
                    "num_layers": len(reg.layers),
                    "chunk_bytes": 1,
                    "refreshed": refreshed,
                    "registration_token": self.tokens[key],
                },
            )
        if path.startswith("/register/") and method == "DELETE":
            _, _, instance_id, rank = path.split("/")
            key = (instance_id, int(rank))
            if key not in self.registrations:
                return _problem(404, "unknown registration")
            if token != self.tokens[key]:
                return _problem(403, "registered by another client")
            del self.registrations[key]
            return httpx.Response(204)
        if path in ("/cache/store", "/cache/retrieve"):
            key = (body["instance_id"], body["rank"])
            if key in self.registrations and token != self.tokens[key]:
                return _problem(403, "not this registration's token")
        if path == "/cache/lookup":
            if "frame" in body:
                pairs = body["frame"]
            else:
                pairs = [(i, i.token_array()) for i in LookupRequest.model_validate(body).requests]
            results = []
            for item, tokens in pairs:
                keys = self._keys(tokens)
                hit = 0
                for key in keys:
                    ranks = range(item.world_size)
                    if all((item.namespace, r, key) in self.chunks for r in ranks):
                        hit += self.chunk_size
                    else:
                        break
                results.append({"request_id": item.request_id, "hit_tokens": hit})
            return httpx.Response(200, json={"results": results})
        if path == "/cache/store":
            sreq = StoreRequest.model_validate(body)
            out = []
            for t in sreq.requests:
                keys = self._keys(t.token_array())
                stored = present = 0
                last = min(t.end_token // self.chunk_size, len(keys))
                for i in range(t.start_token // self.chunk_size, last):
                    k = (t.namespace, sreq.rank, keys[i])
                    if k in self.chunks:
                        present += 1
                    else:
                        self.chunks.add(k)
                        stored += 1
                out.append(
                    {
                        "request_id": t.request_id,
                        "stored_chunks": stored,
                        "present_chunks": present,
                        "failed_chunks": 0,
                    }
                )
            return httpx.Response(200, json={"results": out})
        if path == "/cache/retrieve":
            rreq = RetrieveRequest.model_validate(body)
            reg_of = self.registrations.get((rreq.instance_id, rreq.rank))
            if reg_of is None:
                return _problem(404, "unknown registration")
            spans = [g.token_span for g in reg_of.groups]
            size = self.chunk_size
            out = []
            for t in rreq.requests:
                keys = self._keys(t.token_array())
                last = min(t.end_token // size, len(keys))
                chunk = t.start_token // size
                while chunk < last and (t.namespace, rreq.rank, keys[chunk]) in self.chunks:
                    chunk += 1
                loaded = (chunk - t.start_token // size) * size
                failed: set[int] = set()
                for ids, span in zip(t.block_ids, spans, strict=True):
                    lo, hi = chunk * size // span, last * size // span
                    failed.update(b for b in ids[lo:hi] if b)
                out.append(
                    {
                        "request_id": t.request_id,
                        "loaded_tokens": loaded,
                        "failed_block_ids": sorted(failed),
                    }
                )
            return httpx.Response(200, json={"results": out})
        if path == "/cache/end":
            ereq = EndSessionsRequest.model_validate(body)
            self.ended.extend(ereq.request_ids)
            return httpx.Response(200, json={"ended": len(ereq.request_ids)})
        return _problem(404, f"no route {method} {path}")

    def _keys(self, tokens: np.ndarray) -> list[bytes]:
        assert self.chunk_size is not None
        n = len(tokens) // self.chunk_size
        return [tokens[: (i + 1) * self.chunk_size].tobytes() for i in range(n)]


# ---------------------------------------------------------------- vLLM doubles


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = -1
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)


@dataclass
class FakeBlocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AttnSpec:
    """A KV cache spec double (attention, DCP-sharded like vLLM's AttentionSpec)."""

    block_size: int
    dcp_sharded: bool = True
    prefix_cacheable: bool = True


@dataclass
class Group:
    kv_cache_spec: Any
    layer_names: list[str] = field(default_factory=list)
    enable_kv_transfer: bool = True


def ask(adapter: Any, request: Any, computed: int = 0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM drives it: while the answer is ``None``
    (lookup in flight) the step ends (which sends the step's lookups) and the
    scheduler asks again."""
    answer = adapter.get_num_new_matched_tokens(request, computed)
    if answer[0] is None:
        adapter.send_lookups()
        wait_until(
            lambda: adapter.get_num_new_matched_tokens(request, computed)[0] is not None,
            what=f"an answer for {request.request_id}",
        )
        answer = adapter.get_num_new_matched_tokens(request, computed)
    assert answer[0] is not None
    return answer[0], answer[1]
