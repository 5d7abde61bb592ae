"""Helpers for the reliability suite: raw HTTP over sockets, kernel socket queues,
process memory, and this machine's mpcache segments in /dev/shm."""

from __future__ import annotations

import socket
from pathlib import Path

SHM = Path("/dev/shm")


def shm_bytes(prefix: str = "mpcache-") -> dict[str, int]:
    """Every mpcache segment in /dev/shm with its size."""
    sizes = {}
    for path in SHM.glob(f"{prefix}*"):
        try:
            sizes[path.name] = path.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def tcp_queues(local_port: int, remote_port: int) -> tuple[int, int] | None:
    """(send queue, receive queue) of the IPv4 socket ``local -> remote`` on 127.0.0.1."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == (
            remote_port
        ):
            tx, rx = queues.split(":")
            return int(tx, 16), int(rx, 16)
    return None


def request_head(method: str, path: str, port: int, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        f"host: 127.0.0.1:{port}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_status(sock: socket.socket) -> int:
    """The status code of the reply on ``sock`` (reads its head)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a status line: {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])


def readable(sock: socket.socket) -> bool:
    """Whether a reply (or a close) is waiting on ``sock``, without blocking."""
    import select

    ready, _, _ = select.select([sock], [], [], 0)
    return bool(ready)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


__all__ = [
    "connect",
    "peak_rss_bytes",
    "port_of",
    "read_status",
    "readable",
    "request_head",
    "shm_bytes",
    "tcp_queues",
]
