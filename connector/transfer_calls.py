"""A worker's store and retrieve calls: over its server's ops socket, else HTTP.

``TransferCalls.store`` / ``.retrieve`` send the same ``StoreRequest`` /
``RetrieveRequest`` as ``ControlClient``'s, over the server's ops socket (``GET
/register`` names it; frames in ``contract.ops_frames``) where this process can reach
it, and over HTTP where it cannot. The socket skips the HTTP stack on both sides and
the server's event loop and thread-pool hop: what is left of a call is its copy.

Each thread that calls (a worker has a load lane and a store lane) keeps its own
connection, opened on its first call. A connection is used only for the server the
worker registered with: the server's greeting carries its ``boot_id``, checked
against the link's. Which transport a call takes:

- no socket named, ``mpcache.ops_socket`` off, the connection cannot be opened, or
  it greets with another ``boot_id``: HTTP, for this call (the next one tries again);
- the frame could not be sent (the server closed an idle connection): one fresh
  connection, then HTTP as above; a server that accepts but never greets fails the
  call with ``ServerTimeout`` (opening and sending share the call's timeout, and the
  reply has its own from when the frame is sent, as an HTTP call's);
- once the frame is sent, the socket's outcome is the call's: a timeout is a
  ``ServerTimeout`` and a lost connection a ``ServerUnreachable`` (the server may
  have run the call: it is never sent twice), an error reply the same
  ``ServerError`` HTTP would raise (``connector.client.reply_or_raise``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from connector.client import ControlClient, reply_or_raise
from connector.errors import ProtocolError, ServerTimeout, ServerUnreachable
from contract.ops_frames import (
    FRAME_HEAD,
    FrameError,
    decode_head,
    encode_frame,
    frame_lengths,
)
from contract.schemas import RetrieveRequest, RetrieveResponse, StoreRequest, StoreResponse

__all__ = ["MAX_REPLY_BYTES", "TransferCalls"]

logger = logging.getLogger("mpcache.connector")

MAX_REPLY_BYTES = 64 << 20
"""The largest reply body taken from the socket (a retrieve's reply lists failed
block ids at most)."""

_M = TypeVar("_M", bound=BaseModel)


class _NotSent(Exception):
    """The frame did not reach the server: the call may go another way."""


class _Connection:
    """One thread's connection to the ops socket at ``path``."""

    def __init__(self, path: str, boot_id: str | None, deadline: float) -> None:
        self.path = path
        self.boot_id = boot_id
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(path)
            head, _ = _read_frame(sock, deadline, 0)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.greeted_boot = head.get("boot_id")

    def close(self) -> None:
        self.sock.close()


def _read_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    parts, left = [], size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the ops socket's reply did not come in time")
        sock.settimeout(remaining)
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("the server closed the ops socket")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read_frame(
    sock: socket.socket, deadline: float, max_body: int
) -> tuple[dict[str, object], bytes]:
    head_len, body_len = frame_lengths(_read_exact(sock, FRAME_HEAD.size, deadline), max_body)
    head = decode_head(_read_exact(sock, head_len, deadline))
    return head, _read_exact(sock, body_len, deadline)


class TransferCalls:
    """Store and retrieve for one worker's server (see the module docstring).

    ``ops_path`` gives the socket its latest registration was told of (None: none);
    the link gives the ``boot_id`` a greeting must carry."""

    def __init__(
        self,
        client: ControlClient,
        *,
        ops_path: Callable[[], str | None],
        boot_id: Callable[[], str | None],
        enabled: bool,
        api_token: str | None,
    ) -> None:
        self._client = client
        self._url = client.base_url
        self._ops_path = ops_path
        self._boot_id = boot_id
        self._enabled = enabled
        self._api_token = api_token
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[_Connection] = set()
        self._said: str | None = None  # the last transport logged

    def store(
        self, body: StoreRequest, *, timeout_s: float, registration_token: str
    ) -> StoreResponse:
        return self._send(
            "store", body, StoreResponse, self._client.store, timeout_s, registration_token
        )

    def retrieve(
        self, body: RetrieveRequest, *, timeout_s: float, registration_token: str
    ) -> RetrieveResponse:
        return self._send(
            "retrieve", body, RetrieveResponse, self._client.retrieve, timeout_s, registration_token
        )

    def _send(
        self,
        op: str,
        body: BaseModel,
        model: type[_M],
        http: Callable[..., _M],
        timeout_s: float,
        token: str,
    ) -> _M:
        """``op`` over the socket, else over HTTP (``http``, the client's call)."""
        reply = self._call(op, body, model, timeout_s, token)
        if reply is None:
            return http(body, timeout_s=timeout_s, registration_token=token)
        return reply

    def close(self) -> None:
        """Close every thread's connection (the threads have stopped calling)."""
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()

    # ------------------------------------------------------------------ the socket

    def _call(
        self, op: str, body: BaseModel, model: type[_M], timeout_s: float, token: str
    ) -> _M | None:
        """The reply over the socket, or None: this call goes over HTTP."""
        path = self._ops_path() if self._enabled else None
        if path is None:
            return None
        head: dict[str, object] = {"op": op, "registration_token": token}
        if self._api_token is not None:
            head["api_token"] = self._api_token
        frame = encode_frame(head, body.model_dump_json(exclude_none=True).encode())
        # Opening and sending share one timeout, both tries together; the reply has
        # its own from when the frame is sent, as an HTTP call's (worker.server_budget_s).
        sent_by = time.monotonic() + timeout_s
        for fresh in (False, True):
            conn = self._connection(path, sent_by, fresh=fresh)
            if conn is None:
                return None
            try:
                conn.sock.settimeout(max(0.001, sent_by - time.monotonic()))
                conn.sock.sendall(frame)
            except OSError:
                self._drop(conn)  # closed while idle (a restart): nothing was sent
                continue
            return self._reply(conn, model, time.monotonic() + timeout_s)
        return None

    def _connection(self, path: str, deadline: float, *, fresh: bool) -> _Connection | None:
        """This thread's connection to ``path`` of the current server, or None. A
        server that accepts but does not greet by ``deadline`` fails the call
        (``ServerTimeout``): it is stuck, and HTTP would wait for it too."""
        boot_id = self._boot_id()
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and (fresh or conn.path != path or conn.boot_id != boot_id):
            self._drop(conn)
            conn = None
        if conn is None:
            try:
                conn = _Connection(path, boot_id, deadline)
            except TimeoutError as exc:
                url = f"{self._url} (ops socket)"
                raise ServerTimeout(f"{url}: no greeting in time", url=self._url) from exc
            except (OSError, FrameError) as exc:
                self._say("HTTP", f"the ops socket {path} cannot be used ({exc})")
                return None
            if conn.greeted_boot != boot_id:
                conn.close()
                self._say("HTTP", f"the ops socket {path} belongs to another server process")
                return None
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
            self._say("the ops socket", path)
        return conn

    def _reply(self, conn: _Connection, model: type[_M], deadline: float) -> _M:
        url = f"{self._url} (ops socket)"
        try:
            head, content = _read_frame(conn.sock, deadline, MAX_REPLY_BYTES)
        except TimeoutError as exc:
            self._drop(conn)
            raise ServerTimeout(f"{url}: timed out", url=self._url) from exc
        except OSError as exc:
            self._drop(conn)
            raise ServerUnreachable(f"{url}: {type(exc).__name__}: {exc}", url=self._url) from exc
        except FrameError as exc:
            self._drop(conn)
            raise ProtocolError(f"{url}: {exc}", url=self._url) from exc
        status = head.get("status")
        if not isinstance(status, int):
            self._drop(conn)
            raise ProtocolError(f"{url}: a reply frame without a status", url=self._url)
        retry_after = head.get("retry_after")
        reply = reply_or_raise(
            status,
            content,
            model,
            url,
            retry_after=retry_after if isinstance(retry_after, str) else None,
        )
        assert reply is not None
        return reply

    def _drop(self, conn: _Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def _say(self, transport: str, why: str) -> None:
        """Log a change of transport once (not once per call)."""
        if self._said != transport:
            self._said = transport
            logger.info("mpcache worker: store and retrieve go over %s: %s", transport, why)
