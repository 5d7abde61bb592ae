"""The ops socket: store and retrieve for workers on this host, without HTTP.

The frames are ``contract.ops_frames``'. ``OpsSocket`` listens beside the registration
socket (same private directory, mode 0600) and gives each connection a thread of its
own that reads a frame, validates the same ``StoreRequest`` / ``RetrieveRequest`` as
the routes, runs the same ``CacheService`` operation and writes the reply: no event
loop, no thread-pool hop, no HTTP parsing between a worker and its copy. Errors are
``app.problems``' bodies with the status HTTP would have sent. The routes stay the
documented path; a connector uses this one where it can reach it and falls back to
HTTP where it cannot.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError

from app.problems import (
    domain_problem,
    problem_body,
    unexpected_problem,
    validation_problem,
)
from app.service import CacheService
from contract.errors import InvalidRequest, MPCacheError, Unauthorized
from contract.ops_frames import (
    FRAME_HEAD,
    FrameError,
    decode_head,
    encode_frame,
    frame_lengths,
)
from contract.schemas import RetrieveRequest, StoreRequest
from dataplane.repeats import RepeatedWarning

__all__ = ["FRAME_TIMEOUT_S", "OpsSocket"]

logger = logging.getLogger(__name__)

FRAME_TIMEOUT_S = 30.0
"""How long the rest of a frame may take once its first bytes came (an idle
connection waits for its next frame without a bound)."""

_JOIN_TIMEOUT_S = 5.0

Operation = Callable[[Any, float, str | None], BaseModel]


class _Closed(Exception):
    """The peer closed the connection (between frames or inside one)."""


def _read(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise _Closed
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class OpsSocket:
    """Serves store and retrieve frames on a Unix socket (see the module docstring).

    At most ``max_connections`` at once (a connector opens one per lane, two per
    worker); a peer of another uid (other than root) is refused at accept. ``close``
    stops accepting, ends every connection and waits (bounded) for their threads.
    """

    def __init__(
        self,
        path: Path,
        cache: CacheService,
        *,
        boot_id: str,
        max_body_bytes: int,
        api_token: SecretStr | None = None,
        max_connections: int = 64,
    ) -> None:
        self.path = path
        self._boot_id = boot_id
        self._max_body = max_body_bytes
        self._api_token = None if api_token is None else api_token.get_secret_value().encode()
        self._max_connections = max_connections
        self._ops: dict[str, tuple[type[BaseModel], Operation]] = {
            "store": (
                StoreRequest,
                lambda body, at, token: cache.store(body, received_at=at, token=token),
            ),
            "retrieve": (
                RetrieveRequest,
                lambda body, at, token: cache.retrieve(body, received_at=at, token=token),
            ),
        }
        self._uid = os.geteuid()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self._warn = RepeatedWarning(logger)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the registration socket's checks found its server dead
            old = os.umask(0o177)
            try:
                self._listener.bind(str(path))
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            self._listener.listen(64)
        except OSError as exc:
            self._listener.close()
            raise InvalidRequest(f"cannot listen on ops socket {path}: {exc.strerror}") from exc
        self._thread = threading.Thread(target=self._accept_loop, name="mpcache-ops", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    # ------------------------------------------------------------------ accept

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                self._warn.warn("accept", "ops socket: accept failed: %s", exc)
                time.sleep(0.5)  # out of descriptors: the backlog keeps the peer
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (self._uid, 0):
            self._warn.warn(
                "uid", "ops socket: refused pid %d of uid %d (server uid %d)", pid, uid, self._uid
            )
            sock.close()
            return
        thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"mpcache-ops-{pid}", daemon=True
        )
        with self._lock:
            full = self._stopping or len(self._conns) >= self._max_connections
            if not full:
                self._conns[sock] = thread
        if full:
            self._warn.warn(
                "full",
                "ops socket: %d connections open; refused pid %d",
                self._max_connections,
                pid,
            )
            sock.close()
            return
        thread.start()

    # ------------------------------------------------------------------ a connection

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.sendall(encode_frame({"boot_id": self._boot_id}))
            while not self._stopping:
                sock.settimeout(None)
                first = _read(sock, 1)  # idle until the next frame starts
                received_at = time.monotonic()  # the call's budget counts from here
                sock.settimeout(FRAME_TIMEOUT_S)
                prefix = first + _read(sock, FRAME_HEAD.size - 1)
                try:
                    head_len, body_len = frame_lengths(prefix, self._max_body)
                    head = decode_head(_read(sock, head_len))
                except FrameError as exc:
                    # The stream cannot be trusted past a bad frame: answer, then close.
                    sock.sendall(_reply(problem_body(400, "Bad frame", "bad-frame", str(exc))))
                    return
                body = _read(sock, body_len)
                sock.sendall(self._answer(head, body, received_at))
        except (_Closed, OSError):
            pass  # the peer went away, or close() ended the connection
        except Exception:
            logger.exception("ops socket: serving a connection failed")
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _answer(self, head: dict[str, Any], body: bytes, received_at: float) -> bytes:
        """The reply frame of one request frame."""
        op = self._ops.get(str(head.get("op")))
        if op is None:
            detail = f"unknown operation {str(head.get('op'))[:40]!r}; expected store or retrieve"
            return _reply(problem_body(404, "Not found", "not-found", detail))
        if not self._authorised(head.get("api_token")):
            refused = Unauthorized(
                "this server requires its API token (MPCACHE_API_TOKEN) in the frame's "
                "api_token; the connector sends mpcache.api_token from kv_connector_extra_config"
            )
            return _reply(domain_problem(refused))
        model, run = op
        token = head.get("registration_token")
        try:
            request = model.model_validate_json(body)
            reply = run(request, received_at, token if isinstance(token, str) else None)
        except ValidationError as exc:
            found = exc.errors(include_url=False)
            return _reply(validation_problem(found, len(found)))
        except MPCacheError as exc:
            return _reply(domain_problem(exc), exc.headers())
        except Exception as exc:
            return _reply(unexpected_problem(exc))
        return encode_frame({"status": 200}, reply.model_dump_json().encode())

    def _authorised(self, given: object) -> bool:
        expected = self._api_token
        if expected is None:
            return True
        return isinstance(given, str) and hmac.compare_digest(given.encode(), expected)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop accepting, end every connection, remove the socket."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept
        self._listener.close()
        if self._thread.is_alive():
            self._thread.join(timeout=_JOIN_TIMEOUT_S)
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting for a frame
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for _, thread in conns:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _reply(problem: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """A problem reply frame; ``Retry-After`` (a 503's) travels in its head."""
    head: dict[str, Any] = {"status": problem["status"]}
    retry_after = (headers or {}).get("Retry-After")
    if retry_after is not None:
        head["retry_after"] = retry_after
    return encode_frame(head, json.dumps(problem, separators=(",", ":")).encode())
