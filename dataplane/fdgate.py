"""The registration socket: sealed memfds in, one-time tickets out (``contract.fdpass``).

``FdGate`` serves the socket and holds the tickets (its docstring has the rules);
``map_sealed`` checks and maps one passed descriptor (``SealedMemory``, which owns
the mapping). Nothing here opens memory by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import secrets
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import InvalidDescriptor, InvalidRequest
from contract.fdpass import (
    F_SEAL_SHRINK,
    HANDSHAKE_MAGIC,
    MAX_FDS_PER_HANDSHAKE,
    MAX_TICKETS_PER_CONNECTION,
    encode_reply,
    seals_of,
)
from dataplane import libc
from dataplane.repeats import RepeatedWarning

__all__ = [
    "FdGate",
    "GateError",
    "Peer",
    "SealedMemory",
    "default_socket_path",
    "map_sealed",
    "ops_socket_path",
    "sweep_stale_socket_dirs",
]

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
"""How long shutdown waits for the socket thread."""

ACCEPT_PAUSE_S = 0.5
"""How long the gate stops accepting after ``accept`` failed for want of a resource
(descriptors, memory): the pending connection stays in the backlog, and the thread
neither spins nor logs in a loop (asyncio's own servers pause a second)."""

_TMPFS_MAGIC = 0x01021994  # <linux/magic.h>: shmem, which backs every memfd but hugetlb
_SOCKET_NAME = "register.sock"
_MAX_PATH_BYTES = 107  # sun_path holds 108 bytes with the NUL


class GateError(ValueError):
    """A descriptor or handshake the gate refuses (the message is sent to the peer)."""


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (``SO_PEERCRED``)."""

    conn_id: int
    pid: int
    uid: int


class SealedMemory:
    """One memfd the server mapped; the descriptor itself is closed already.

    Layout: byte ``i`` of ``buffer`` is byte ``i`` of the worker's storage. The seal
    forbids shrinking, so every byte up to ``size_bytes`` stays backed for the
    mapping's life: a copy can never fault on a truncated page.

    Mapped with libc's ``mmap`` rather than Python's ``mmap.mmap``, which keeps a
    duplicate of the descriptor open for its whole life: the server holds no
    descriptor per registration. ``buffer`` owns the mapping: it is unmapped when
    the last reference goes (``close`` drops this object's; views made with
    ``torch.frombuffer`` hold theirs), so no view ever dangles.
    """

    def __init__(self, buffer: ctypes.Array[ctypes.c_char], size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._buffer: ctypes.Array[ctypes.c_char] | None = buffer

    @property
    def buffer(self) -> ctypes.Array[ctypes.c_char]:
        buffer = self._buffer
        if buffer is None:
            raise ValueError("sealed memory is closed")
        return buffer

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def close(self) -> None:
        self._buffer = None


@functools.cache
def _mmap_calls() -> tuple[Any, Any]:
    """libc's mmap and munmap (ctypes), loaded on first use."""
    mmap_ = libc.function(
        "mmap",
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    munmap = libc.function("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
    if mmap_ is None or munmap is None:
        raise OSError("no C library with mmap/munmap found")
    return mmap_, munmap


_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int) -> ctypes.Array[ctypes.c_char]:
    """Map ``fd`` read-write, shared; the returned buffer unmaps when it is freed."""
    map_, unmap = _mmap_calls()
    addr = map_(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    # A subclass: plain ctypes arrays take no weak references, which finalize needs.
    kind: type[ctypes.Array[ctypes.c_char]] = type("SealedMapping", (ctypes.c_char * size,), {})
    buffer = kind.from_address(addr)
    weakref.finalize(buffer, unmap, addr, size)
    return buffer


def _fs_type(fd: int) -> int | None:
    """``statfs.f_type`` of the file behind ``fd`` (Linux), or None if unknown."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    fstatfs = libc.function("fstatfs", ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    if fstatfs is None or fstatfs(fd, buf) != 0:
        return None
    return int(ctypes.c_long.from_buffer(buf).value)


def map_sealed(fd: int) -> SealedMemory:
    """Check ``fd`` is sealed memory that cannot shrink, and map it whole.

    The caller keeps ownership of ``fd`` (and closes it); raises ``GateError``.
    """
    try:
        seals = seals_of(fd)
    except OSError as exc:
        raise GateError(
            "a descriptor is not a sealable memfd (F_GET_SEALS failed: "
            f"{exc.strerror}); pass memfd_create(MFD_ALLOW_SEALING) memory"
        ) from exc
    if not seals & F_SEAL_SHRINK:
        raise GateError(
            "a memfd is not sealed against shrinking; add F_SEAL_SHRINK "
            "(fcntl F_ADD_SEALS) before passing it"
        )
    try:
        info = os.fstat(fd)
    except OSError as exc:
        raise GateError(f"cannot stat a descriptor: {exc.strerror}") from exc
    if not stat.S_ISREG(info.st_mode) or info.st_size < 1:
        raise GateError(f"a memfd holds {info.st_size} bytes; it must hold at least one")
    fs_type = _fs_type(fd)
    if fs_type is not None and fs_type != _TMPFS_MAGIC:
        # hugetlbfs: a page that cannot be allocated later would SIGBUS the server.
        raise GateError(
            f"a memfd lives on a filesystem of type {fs_type:#x}, not shmem; pass a "
            "plain memfd (no MFD_HUGETLB)"
        )
    try:
        buffer = _map_shared(fd, info.st_size)
    except OSError as exc:
        raise GateError(f"cannot map a memfd read-write: {exc.strerror}") from exc
    return SealedMemory(buffer, info.st_size)


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    tickets: set[str] = field(default_factory=set)


def ops_socket_path(register_socket: Path) -> Path:
    """The ops socket (``app.ops_socket``) beside ``register_socket``: ``register.sock``
    -> ``register.ops.sock``, in the same directory."""
    return register_socket.with_name(f"{register_socket.stem}.ops{register_socket.suffix}")


def default_socket_path(port: int) -> Path:
    """A socket in a new private directory (mode 0700) under $XDG_RUNTIME_DIR or /tmp.

    Directories that killed servers left there are removed first
    (``sweep_stale_socket_dirs``)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base) or len(base) > 60:
        base = None
    sweep_stale_socket_dirs(Path(base or tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"mpcache-{port}-", dir=base)) / _SOCKET_NAME


def sweep_stale_socket_dirs(base: Path, *, min_age_s: float = 60.0) -> list[Path]:
    """Remove ``base/mpcache-*`` directories of ours that hold nothing but a socket no
    server listens on (its server was killed); return them. Never raises.

    A socket younger than ``min_age_s`` is left alone: its server may be between
    ``bind`` and ``listen``."""
    removed = []
    try:
        candidates = sorted(base.glob("mpcache-*"))
    except OSError:
        return []
    ours = {_SOCKET_NAME, ops_socket_path(Path(_SOCKET_NAME)).name}
    for folder in candidates:
        sock_path = folder / _SOCKET_NAME
        try:
            info = os.lstat(folder)
            if (
                not stat.S_ISDIR(info.st_mode)
                or info.st_uid != os.geteuid()
                or _SOCKET_NAME not in (names := os.listdir(folder))
                or not set(names) <= ours
                or not stat.S_ISSOCK(os.lstat(sock_path).st_mode)
                or time.time() - os.lstat(sock_path).st_mtime < min_age_s
            ):
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(sock_path))
                continue  # a live server
            except ConnectionRefusedError:
                pass
            finally:
                probe.close()
            for name in names:
                os.unlink(folder / name)
            os.rmdir(folder)
        except OSError:
            continue
        removed.append(folder)
    return removed


class FdGate:
    """The registration socket and its tickets.

    Listens on a Unix socket (a file of mode 0600 in a directory of mode 0700) and
    runs one thread that serves every connection with ``selectors``:

    - **accept**: reads the peer's uid and pid (``SO_PEERCRED``); a peer of another
      uid (other than root) is dropped. At most ``max_connections`` at once; more
      are dropped at accept, so no client can run the server out of descriptors.
    - **handshake** (a message ``HANDSHAKE_MAGIC`` carrying up to
      ``MAX_FDS_PER_HANDSHAKE`` descriptors): each descriptor must be a memfd on
      tmpfs sealed against shrinking (``F_GET_SEALS`` has ``F_SEAL_SHRINK``) and at
      least one byte long; it is mapped whole (``map_sealed``) and closed at once,
      so the server holds no descriptor past the handshake. The reply is one JSON
      line of tickets, or of an error (then nothing was kept): all or nothing.
    - **EOF** (the worker closed the socket, or died): the connection's unused
      tickets are unmapped and ``on_disconnect(conn_id)`` releases its
      registrations (the registry waits for copies in flight before unmapping).

    ``take`` redeems tickets for ``POST /register``: once, all from one live
    connection. ``close`` removes the socket, and its directory when
    ``owns_directory`` (the gate made it).
    """

    def __init__(
        self,
        path: Path,
        *,
        on_disconnect: Callable[[int], object],
        max_connections: int = 64,
        owns_directory: bool = False,
    ) -> None:
        if len(os.fsencode(path)) > _MAX_PATH_BYTES:
            raise InvalidRequest(
                f"registration socket path {str(path)!r} is longer than {_MAX_PATH_BYTES} "
                "bytes; choose a shorter --register-socket"
            )
        self.path = path
        self._on_disconnect = on_disconnect
        self._max_connections = max_connections
        self._owns_directory = owns_directory
        self._lock = threading.Lock()
        self._tickets: dict[str, tuple[int, SealedMemory]] = {}
        self._conns: dict[int, _Conn] = {}
        self._next_conn = 1
        self._uid = os.geteuid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind()
        except BaseException:
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            raise
        self._thread = threading.Thread(target=self._run, name="mpcache-fdgate", daemon=True)
        self._stopping = False
        self._accept_paused_until: float | None = None
        self._warn = RepeatedWarning(logger)

    def _bind(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(self.path))
                except OSError:
                    os.unlink(self.path)  # a dead server's socket
                else:
                    raise InvalidRequest(
                        f"another server is listening on {self.path}; choose another "
                        "--register-socket"
                    )
                finally:
                    probe.close()
        old = os.umask(0o177)
        try:
            self._listener.bind(str(self.path))
        except OSError as exc:
            raise InvalidRequest(
                f"cannot listen on registration socket {self.path}: {exc.strerror}"
            ) from exc
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()

    # ------------------------------------------------------------------ tickets

    def take(self, tickets: Iterable[str]) -> tuple[int, dict[str, SealedMemory]]:
        """Redeem ``tickets`` (each once): ``(connection id, ticket -> memory)``.

        Refused (``InvalidDescriptor``, nothing taken) when a ticket is unknown or
        used, or when they come from more than one connection.
        """
        wanted = set(tickets)
        with self._lock:
            unknown = sorted(t for t in wanted if t not in self._tickets)
            if unknown:
                raise InvalidDescriptor(
                    f"ticket {unknown[0][:16]!r}... is unknown or already used; tickets "
                    "come from the registration socket (GET /register) and are good "
                    "for one registration",
                    reason="unknown-ticket",
                )
            conns = {self._tickets[t][0] for t in wanted}
            if len(conns) > 1:
                raise InvalidDescriptor(
                    "the tickets of one registration must come from one socket connection",
                    reason="mixed-connections",
                )
            taken = {t: self._tickets.pop(t)[1] for t in wanted}
            conn_id = conns.pop()
            conn = self._conns.get(conn_id)
            if conn is not None:
                conn.tickets -= wanted
        return conn_id, taken

    def alive(self, conn_id: int) -> bool:
        with self._lock:
            return conn_id in self._conns

    def peer(self, conn_id: int) -> Peer | None:
        with self._lock:
            conn = self._conns.get(conn_id)
            return None if conn is None else conn.peer

    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stopping:
            timeout = None
            if self._accept_paused_until is not None:
                timeout = self._accept_paused_until - time.monotonic()
                if timeout <= 0:
                    self._accept_paused_until, timeout = None, None
                    self._selector.register(self._listener, selectors.EVENT_READ, None)
            for key, _ in self._selector.select(timeout):
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                try:
                    if sock is self._listener:
                        self._accept()
                    else:
                        assert isinstance(key.data, int)
                        self._serve(key.data)
                except Exception:
                    # One bad peer must never stop the gate for every worker.
                    logger.exception("registration socket: serving a peer failed")
                    if isinstance(key.data, int):
                        self._disconnect(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._warn.warn(
                "accept",
                "registration socket: accept failed: %s; accepting again in %g s",
                exc,
                ACCEPT_PAUSE_S,
            )
            self._selector.unregister(self._listener)
            self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (self._uid, 0):
            self._warn.warn(
                "uid",
                "registration socket: refused pid %d of uid %d (this server runs as uid %d)",
                pid,
                uid,
                self._uid,
            )
            sock.close()
            return
        with self._lock:
            if len(self._conns) >= self._max_connections:
                full = True
            else:
                full = False
                conn_id = self._next_conn
                self._next_conn += 1
                self._conns[conn_id] = _Conn(sock, Peer(conn_id, pid, uid))
        if full:
            self._warn.warn(
                "full",
                "registration socket: %d connections open; refused pid %d",
                self._max_connections,
                pid,
            )
            sock.close()
            return
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, conn_id)

    def _serve(self, conn_id: int) -> None:
        with self._lock:
            conn = self._conns.get(conn_id)
        if conn is None:
            return
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, 64, MAX_FDS_PER_HANDSHAKE + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._disconnect(conn_id)
            return
        if not data and not fds:
            self._disconnect(conn_id)
            return
        try:
            reply = self._handshake(conn, data, fds, flags)
        finally:
            for fd in fds:
                os.close(fd)  # mapped or refused: no descriptor outlives the handshake
        try:
            sent = conn.sock.send(reply)
        except OSError:
            sent = -1
        if sent != len(reply):  # a peer that does not read its replies is dropped
            self._disconnect(conn_id)

    def _handshake(self, conn: _Conn, data: bytes, fds: list[int], flags: int) -> bytes:
        try:
            if data != HANDSHAKE_MAGIC:
                raise GateError(f"expected the handshake {HANDSHAKE_MAGIC!r}, got {data[:16]!r}")
            if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS_PER_HANDSHAKE:
                raise GateError(
                    f"a handshake passes at most {MAX_FDS_PER_HANDSHAKE} descriptors; "
                    "register fewer segments (one per KV storage)"
                )
            with self._lock:
                if len(conn.tickets) + len(fds) > MAX_TICKETS_PER_CONNECTION:
                    raise GateError(
                        f"this connection holds {len(conn.tickets)} unused tickets; at most "
                        f"{MAX_TICKETS_PER_CONNECTION}: register or reconnect"
                    )
            mapped: list[SealedMemory] = []
            try:
                for fd in fds:
                    mapped.append(map_sealed(fd))
            except BaseException:
                for memory in mapped:
                    memory.close()
                raise
        except GateError as exc:
            self._warn.warn(
                "handshake",
                "registration socket: refused a handshake from pid %d: %s",
                conn.peer.pid,
                exc,
            )
            return encode_reply(error=str(exc))
        tickets = [secrets.token_urlsafe(24) for _ in mapped]
        with self._lock:
            if conn.peer.conn_id in self._conns:
                for ticket, memory in zip(tickets, mapped, strict=True):
                    self._tickets[ticket] = (conn.peer.conn_id, memory)
                conn.tickets.update(tickets)
        return encode_reply(tickets=tickets)

    def _disconnect(self, conn_id: int) -> None:
        with self._lock:
            conn = self._conns.pop(conn_id, None)
            dropped = [] if conn is None else [self._tickets.pop(t)[1] for t in conn.tickets]
        if conn is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        for memory in dropped:
            memory.close()
        try:
            self._on_disconnect(conn_id)
        except Exception:
            logger.exception("registration socket: releasing connection %d failed", conn_id)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the thread, close every connection, remove the socket (and its
        private directory, when the gate made it)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            # Bounded: the thread may be stuck closing a descriptor a peer passed
            # (one whose last close blocks); shutdown goes on without it.
            self._thread.join(timeout=_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("registration socket: its thread did not stop; leaving it")
        with self._lock:
            conn_ids = list(self._conns)
        for conn_id in conn_ids:
            self._disconnect(conn_id)
        with self._lock:
            leftovers = [memory for _, memory in self._tickets.values()]
            self._tickets.clear()
        for memory in leftovers:
            memory.close()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._owns_directory:
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)
