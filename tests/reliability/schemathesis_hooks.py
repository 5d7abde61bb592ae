"""schemathesis hooks for test_schemathesis.py: a registered worker, and live tickets.

Loaded by ``st run`` (``SCHEMATHESIS_HOOKS``, this file's path) in its own process,
which acts as a vLLM worker would (``ST_MPCACHE_URL`` names the server):

- **a registered worker**: on the first call, sealed memfd KV caches are passed over
  the registration socket and registered as ``WORKER``; every store and retrieve
  case is sent as that worker (its instance, rank, namespace and token), so they
  reach the copies instead of a 404;
- **live tickets**: the ``ticket`` of every registration and lookup-area case is
  swapped for a fresh one, from a memfd passed over the socket just before the call
  (a registration's all in one handshake; a lookup area's over a connection of its
  own, of which the last ``AREA_CONNECTIONS`` stay open: an area lives as long as its
  connection, and the server holds two a connection, 64 in all),
  and a registration's ``chunk_size`` is the server's, so it reaches its descriptors;
- **valid frames**: a binary lookup's random bytes become a well-formed frame.

schemathesis revalidates each case after ``before_call``, so a case counts as
positive or negative by what is sent. ``filter_failure`` keeps every ST202 ("schema-
valid request rejected") but those answered 422 for a rule the schema cannot state:
one across fields or against the server's state (an ``invalid-request`` or
``invalid-descriptor`` problem: a view past its memfd, block ids past the
registration's, a start off a chunk boundary). A 422 ``malformed-request`` (the
model refused what the schema admits) stays a failure: the schema says every static
rule (issue 25, item 5).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import schemathesis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contract.fdpass import MAX_FDS_PER_HANDSHAKE  # noqa: E402
from contract.schemas import REGISTRATION_TOKEN_HEADER  # noqa: E402
from tests.dataplane.support import (  # noqa: E402
    NAMESPACE,
    WorkerSocket,
    build_kv,
    register_body,
    sealed_memfd,
    vllm_layer,
    with_tickets,
)

WORKER = "st-worker"
CHUNK = 64
TICKETS_PER_CONNECTION = 100
"""Tickets taken over one connection before the next: a case refused before its
ticket is redeemed leaves it unused, and a connection holds at most 128."""

AREA_CONNECTIONS = 16

STATE_RULES = frozenset(
    {"urn:mpcache:problem:invalid-request", "urn:mpcache:problem:invalid-descriptor"}
)
"""Problems of rules across fields or against the server's state."""


class _Worker:
    """The registered worker, and the connection that hands out tickets."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        self.kv = build_kv([vllm_layer("l0", 0, 64)])
        self.area = sealed_memfd(1 << 16, "mpcache-st-area")
        path = self.http.get("/register").json()["socket_path"]
        self.home = WorkerSocket(path)  # keeps the registration alive
        body = register_body(self.kv, WORKER, [(0, "attention", 16)], chunk_size=CHUNK)
        reply = self.http.post("/register", json=with_tickets(body, self.home))
        reply.raise_for_status()
        self.token = str(reply.json()["registration_token"])
        self.path = path
        self.lock = threading.Lock()
        self.tickets: WorkerSocket | None = None
        self.issued = 0
        self.area_sockets: list[WorkerSocket] = []

    def ticket_batch(self, fd: int, count: int) -> list[str]:
        """``count`` tickets of ``fd``, from one handshake over one connection."""
        with self.lock:
            if self.tickets is None or self.issued + count > TICKETS_PER_CONNECTION:
                if self.tickets is not None:
                    self.tickets.close()
                self.tickets, self.issued = WorkerSocket(self.path), 0
            self.issued += count
            return self.tickets.tickets([fd] * count)

    def area_ticket(self) -> str:
        """A ticket of the lookup-area memfd, over a new connection."""
        with self.lock:
            if len(self.area_sockets) >= AREA_CONNECTIONS:
                self.area_sockets.pop(0).close()
            self.area_sockets.append(WorkerSocket(self.path))
            return self.area_sockets[-1].tickets([self.area])[0]


_worker: _Worker | None = None
_lock = threading.Lock()


def _the_worker() -> _Worker:
    global _worker
    with _lock:
        if _worker is None:
            _worker = _Worker(os.environ["ST_MPCACHE_URL"])
        return _worker


def _as_registration(body: dict[str, Any], worker: _Worker) -> None:
    if isinstance(body.get("chunk_size"), int):
        body["chunk_size"] = CHUNK
    tensors = [
        tensor
        for layer in (body.get("layers") if isinstance(body.get("layers"), list) else [])
        if isinstance(layer, dict) and isinstance(layer.get("tensors"), list)
        for tensor in layer["tensors"]
        if isinstance(tensor, dict) and isinstance(tensor.get("ticket"), str)
    ][:MAX_FDS_PER_HANDSHAKE]
    if tensors:
        for tensor, ticket in zip(
            tensors, worker.ticket_batch(worker.kv.fd, len(tensors)), strict=True
        ):
            tensor["ticket"] = ticket


def _as_worker(body: dict[str, Any]) -> None:
    body["instance_id"], body["rank"] = WORKER, 0
    for item in body.get("requests", []) if isinstance(body.get("requests"), list) else []:
        if isinstance(item, dict):
            item["namespace"] = NAMESPACE


def _frame(noise: bytes) -> bytes:
    """A well-formed lookup frame whose token ids come from ``noise``."""
    ids = [b & 0x7F for b in noise[:4096]]
    head = json.dumps(
        {"requests": [{"request_id": "st-frame", "namespace": NAMESPACE, "num_tokens": len(ids)}]}
    ).encode()
    pad = b"\0" * (-len(head) % 4)
    return b"MPL1" + struct.pack("<I", len(head)) + head + pad + struct.pack(f"<{len(ids)}i", *ids)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    worker = _the_worker()
    body = case.body
    if case.method == "POST" and case.path in ("/cache/store", "/cache/retrieve"):
        if isinstance(body, dict):
            _as_worker(body)
        case.headers[REGISTRATION_TOKEN_HEADER] = worker.token
    elif case.method == "POST" and case.path == "/register" and isinstance(body, dict):
        _as_registration(body, worker)
    elif case.method == "POST" and case.path == "/cache/lookup-areas" and isinstance(body, dict):
        if isinstance(body.get("ticket"), str):
            body["ticket"] = worker.area_ticket()
    elif case.path == "/cache/lookup" and case.media_type == "application/octet-stream":
        case.body = _frame(body if isinstance(body, bytes) else str(body).encode())


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """False (dropped) for an ST202 answered 422 for a rule of ``STATE_RULES``."""
    if failure.code != "ST202" or response.status_code != 422:
        return True
    try:
        problem = json.loads(response.content)
    except ValueError:
        return True
    return not (isinstance(problem, dict) and problem.get("type") in STATE_RULES)
