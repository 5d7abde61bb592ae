"""Handing KV-cache memory to the server: sealed memfds over a Unix socket.

A worker never names its memory. It puts each CPU KV storage in a memfd
(``memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)``), sizes it, seals it with at
least ``F_SEAL_SHRINK`` (the connector adds ``F_SEAL_GROW`` and ``F_SEAL_SEAL``), and
passes the descriptors to the server over the server's registration socket
(``GET /register`` says where it is) with ``SCM_RIGHTS``:

    worker                                         server
    connect(socket_path) ------------------------> accept; SO_PEERCRED: uid, pid
    sendmsg(HANDSHAKE_MAGIC, fds=[m0, m1, ...]) -> per fd: F_GET_SEALS has SHRINK,
                                                   on tmpfs, size >= 1, mmap, close fd
    <---------------- one JSON line: {"tickets": ["t0", "t1", ...]}
                      (or {"error": "...why..."}, and no ticket at all)
    POST /register with each tensor's ``ticket`` (HTTP; ``contract.schemas``)
    ... the connection stays open for the worker's whole life ...
    close / process death ---------------------->  EOF: this connection's
                                                   registrations and unused tickets
                                                   are released (after copies in flight)

Possession of the descriptor is the proof of ownership: nothing is opened by name,
so a client can only register memory it holds, and the seal means the size the
server mapped cannot shrink under it (a shrunk mapping would SIGBUS the server).
Tickets are opaque, one-time, and belong to the connection that received them: a
registration's tickets must all come from one connection, whose life then bounds the
registration's.
"""

from __future__ import annotations

import fcntl
import json
from typing import Any

__all__ = [
    "F_ADD_SEALS",
    "F_GET_SEALS",
    "F_SEAL_GROW",
    "F_SEAL_SEAL",
    "F_SEAL_SHRINK",
    "F_SEAL_WRITE",
    "HANDSHAKE_MAGIC",
    "MAX_FDS_PER_HANDSHAKE",
    "MAX_TICKETS_PER_CONNECTION",
    "REPLY_MAX_BYTES",
    "decode_reply",
    "encode_reply",
    "seals_of",
]

# Linux's (<linux/fcntl.h>, <linux/memfd.h>); Python's fcntl module has them from
# 3.8 on most builds, so they are taken from it when present.
F_ADD_SEALS: int = getattr(fcntl, "F_ADD_SEALS", 1024 + 9)
F_GET_SEALS: int = getattr(fcntl, "F_GET_SEALS", 1024 + 10)
F_SEAL_SEAL: int = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK: int = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW: int = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_WRITE: int = getattr(fcntl, "F_SEAL_WRITE", 0x0008)

HANDSHAKE_MAGIC = b"MPFD1"
"""The data bytes that carry the descriptors (SCM_RIGHTS needs at least one byte)."""

MAX_FDS_PER_HANDSHAKE = 64
"""Descriptors one handshake (hence one registration) may pass: more are discarded by
the kernel and the handshake is refused. vLLM's CPU KV cache is one storage per
layer at most; a registration needing more is refused."""

MAX_TICKETS_PER_CONNECTION = 128
"""Unused tickets one connection may hold; a handshake beyond it is refused."""

REPLY_MAX_BYTES = 64 * 1024
"""Upper bound on one reply line (64 tickets of ~43 characters fit many times over)."""


def seals_of(fd: int) -> int:
    """The seals on ``fd`` (``F_GET_SEALS``); raises ``OSError`` (EINVAL) for a file
    that cannot be sealed (not a memfd)."""
    return int(fcntl.fcntl(fd, F_GET_SEALS))


def encode_reply(*, tickets: list[str] | None = None, error: str | None = None) -> bytes:
    """The server's one reply line: tickets in the order the fds arrived, or an error."""
    body: dict[str, Any] = {"tickets": tickets} if error is None else {"error": error}
    return json.dumps(body).encode() + b"\n"


def decode_reply(line: bytes) -> list[str]:
    """The tickets in a reply line; ``ValueError`` carrying the server's reason if it
    refused the handshake or the line is malformed."""
    try:
        body = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"malformed handshake reply {line[:80]!r}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"malformed handshake reply {line[:80]!r}")
    if "error" in body:
        raise ValueError(str(body["error"]))
    tickets = body.get("tickets")
    if not isinstance(tickets, list) or not all(isinstance(t, str) for t in tickets):
        raise ValueError(f"malformed handshake reply {line[:80]!r}")
    return tickets
