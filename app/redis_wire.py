"""Raw connections to Redis for the L2 tier's bulk reads: ``GET`` replies read straight
into a caller's buffer (``socket.recv_into``), no parser copy in between.

redis-py builds every reply as a ``bytes`` object, copying the value once more than
the socket needs; for chunks of tens of MiB that copy (and its allocation) halved
the L2 retrieve's throughput. Here a bulk reply's header is read from a small
buffer and its payload lands where the caller says (``Wire.read_into``): a pool
entry's memory. Only plain TCP and unix sockets: a ``rediss://`` URL, or one with
connection options this client does not know, gets no ``WireParams``
(``wire_params``) and the L2 tier reads through redis-py instead.

Every socket call is bounded by the timeout (connect and each send or receive); any
fault raises ``RedisUnavailable`` (``app.redis_io``) and leaves the connection
closed: a connection is reused only after every reply sent on it was read.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from app.redis_io import RedisUnavailable
from app.resp import MAX_LINE_BYTES, Header, ProtocolError, ReplyError, encode, parse_header

__all__ = ["Wire", "WireParams", "Wires", "wire_params"]

_KNOWN = {"username", "password", "host", "port", "db", "path", "connection_class"}
IDLE_WIRES = 4
"""Connections kept open between reads (more may be open while reads overlap)."""


@dataclass(frozen=True)
class WireParams:
    """Where and how to connect: a TCP ``host``/``port`` or a unix ``path``."""

    host: str | None
    port: int
    path: str | None
    username: str | None
    password: str | None
    db: int
    timeout_s: float
    name: str


def wire_params(
    url: str, *, password: SecretStr | None, timeout_s: float, name: str
) -> WireParams | None:
    """The raw client's parameters for ``url`` (redis-py parses it, so both agree), or
    None where only redis-py can connect (TLS, other connection options)."""
    parsed: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    cls = parsed.get("connection_class")
    if cls is SSLConnection or set(parsed) - _KNOWN:
        return None
    if cls is not None and cls is not UnixDomainSocketConnection:
        return None
    secret = parsed.get("password")
    if secret is None and password is not None:
        secret = password.get_secret_value()
    return WireParams(
        host=None if cls is UnixDomainSocketConnection else str(parsed.get("host", "localhost")),
        port=int(parsed.get("port", 6379)),
        path=parsed.get("path"),
        username=parsed.get("username"),
        password=secret,
        db=int(parsed.get("db", 0)),
        timeout_s=timeout_s,
        name=name,
    )


class Wire:
    """One connection: ``send`` commands, then read their replies in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(MAX_LINE_BYTES)
        self._start = self._end = 0  # unread bytes: self._buf[self._start:self._end]
        self.closed = False
        self.generation = 0
        """``Wires``' generation when it was opened (an older one is not reused)."""

    @classmethod
    def open(cls, params: WireParams) -> Wire:
        """Connect, authenticate and select the database (one round trip after connect)."""
        try:
            if params.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(params.timeout_s)
                try:
                    sock.connect(params.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(
                    (params.host, params.port), timeout=params.timeout_s
                )
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except BaseException:
                    sock.close()
                    raise
        except OSError as exc:
            raise RedisUnavailable(f"connect: {type(exc).__name__}: {exc}") from exc
        wire = cls(sock)
        try:
            wire.handshake(params)
        except BaseException:
            wire.close()
            raise
        return wire

    def handshake(self, params: WireParams) -> None:
        commands = []
        if params.password is not None:
            user = (params.username,) if params.username else ()
            commands.append(encode("AUTH", *user, params.password))
        if params.db:
            commands.append(encode("SELECT", params.db))
        commands.append(encode("CLIENT", "SETNAME", params.name))
        self.send(b"".join(commands))
        for _ in commands:
            self.read_ok()

    def close(self) -> None:
        self.closed = True
        self._sock.close()

    # ------------------------------------------------------------------ I/O

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.close()
        raise RedisUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _fill(self) -> None:
        """Read more bytes into the small buffer (after what is unread)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                self._fail(ProtocolError(f"a reply line over {MAX_LINE_BYTES} bytes"))
            # Move the unread tail to the front.
            tail = self._buf[self._start : self._end]
            self._buf[: len(tail)] = tail
            self._start, self._end = 0, len(tail)
        try:
            n = self._sock.recv_into(memoryview(self._buf)[self._end :])
        except OSError as exc:
            self._fail(exc)
        if n == 0:
            self._fail(ConnectionError("Redis closed the connection"))
        self._end += n

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            self._fill()

    def header(self) -> Header:
        """The next reply's header (an error reply is returned, not raised)."""
        try:
            return parse_header(self._line())
        except ProtocolError as exc:
            self._fail(exc)
            raise  # unreachable: _fail raises

    def read_into(self, target: memoryview) -> None:
        """Fill ``target`` with the next ``len(target)`` bytes of the stream."""
        have = min(self._end - self._start, len(target))
        target[:have] = self._buf[self._start : self._start + have]
        self._start += have
        done = have
        while done < len(target):
            try:
                n = self._sock.recv_into(target[done:])
            except OSError as exc:
                self._fail(exc)
            if n == 0:
                self._fail(ConnectionError("Redis closed the connection mid-reply"))
            done += n

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (a value no one wants, in pieces)."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self.read_into(scratch[:step])
            n -= step

    def end_of_bulk(self) -> None:
        """Read the ``\\r\\n`` that ends a bulk string."""
        crlf = bytearray(2)
        self.read_into(memoryview(crlf))
        if crlf != b"\r\n":
            self._fail(ProtocolError("a bulk string not ended by CRLF"))

    def read_ok(self) -> None:
        """Read a reply that must be a simple string (``+OK``); raise ``ReplyError`` on an
        error reply, ``RedisUnavailable`` on anything else."""
        head = self.header()
        if head.kind == "error":
            self.close()  # the handshake failed: this connection is not usable
            raise ReplyError(head.text)
        if head.kind != "simple":
            self._fail(ProtocolError(f"expected a status reply, got {head.kind}"))


class Wires:
    """Open connections to one Redis, shared by threads: ``take`` one (opened if none
    is idle), ``give`` it back when every reply on it was read. ``reset`` (Redis went
    down) closes the idle ones, and those in use when they come back."""

    def __init__(self, params: WireParams) -> None:
        self.params = params
        self._idle: list[Wire] = []
        self._lock = threading.Lock()
        self._generation = 0

    def take(self) -> Wire:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            generation = self._generation
        try:
            wire = Wire.open(self.params)
        except ReplyError as exc:
            raise RedisUnavailable(f"Redis refused the connection: {exc}") from exc
        wire.generation = generation
        return wire

    def give(self, wire: Wire) -> None:
        with self._lock:
            if (
                not wire.closed
                and wire.generation == self._generation
                and len(self._idle) < IDLE_WIRES
            ):
                self._idle.append(wire)
                return
        wire.close()

    def reset(self) -> None:
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for wire in idle:
            wire.close()

    def close(self) -> None:
        self.reset()
