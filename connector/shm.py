"""Sealed memfds that back vLLM's CPU KV cache (zero copy), and the socket that hands
them to the server.

``MemfdKVSegment`` moves one torch storage into a sealed memfd in place, so vLLM
and the server, which maps the descriptor the worker passes it, use the very same
pages (its docstring gives the layout and who owns what). ``RegistrationChannel``
is the worker's end of the server's registration socket (``contract.fdpass``): it
passes the descriptors and gets one-time tickets back, and stays connected for the
worker's life, which is how the server learns that a worker died (its registration
is then released).

OS errors are translated into ``SegmentError`` here, and only here.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import threading
from collections.abc import Iterator, Sequence

import torch

from connector.errors import SegmentError
from contract.fdpass import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    HANDSHAKE_MAGIC,
    REPLY_MAX_BYTES,
    decode_reply,
)

__all__ = ["SEALS", "MemfdKVSegment", "RegistrationChannel", "memfd_name"]

SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
"""What the worker seals: the size can never change again, nor the seals."""


def memfd_name(rank: int, index: int) -> str:
    """The memfd's label (``/proc/<pid>/fd`` shows ``/memfd:<label>``): no meaning to
    the server, which never sees names."""
    return f"mpcache-kv-r{rank}-{index}"


@contextlib.contextmanager
def _translate(name: str, action: str) -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError) as exc:
        raise SegmentError(f"KV-cache memfd {name!r}: {action} failed: {exc}") from exc


class MemfdKVSegment:
    """One sealed memfd holding one torch storage.

    ``adopt`` moves the storage into a new memfd *in place*: it creates the memfd
    (``MFD_CLOEXEC | MFD_ALLOW_SEALING``), allocates its pages (``posix_fallocate``:
    a shortage is an error here, never a fault later), seals it against shrinking
    and growing and seals the seals (``contract.fdpass``), maps it, copies the
    storage's bytes in, and swaps the storage's data pointer with the mapping
    (``UntypedStorage._swap_data_ptr_``). Every tensor and view vLLM holds on that
    storage -- the ``kv_caches`` dict, the attention layers' bound caches,
    kernel-block views -- now reads and writes the memfd.

    Layout: byte ``i`` of the memfd is byte ``i`` of the storage; a tensor's data
    starts at ``storage_offset() * element_size()`` (the descriptor's
    ``offset_bytes``).

    Ownership: the worker owns the descriptor (``fd``) and closes it at shutdown;
    the *mapping* is owned by the torch storage (its data pointer keeps the mmap
    alive), so vLLM's tensors stay valid after the close. The memory has no name:
    it goes away when the worker and the server have both let go of it, including
    when the worker dies.
    """

    def __init__(self, name: str, fd: int, nbytes: int) -> None:
        self.name = name
        self.fd = fd
        self.nbytes = nbytes

    @classmethod
    def adopt(cls, storage: torch.UntypedStorage, name: str) -> MemfdKVSegment:
        """Move ``storage`` into a new sealed memfd labelled ``name``, in place."""
        nbytes = storage.nbytes()
        if nbytes <= 0:
            raise SegmentError(f"cannot place an empty storage in memfd {name!r}")
        if storage.device.type != "cpu":
            raise SegmentError(f"only CPU storages go to shared memory, got {storage.device}")
        with _translate(name, "create"):
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            with _translate(name, "allocate"):
                os.posix_fallocate(fd, 0, nbytes)
                fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
                mapping = mmap.mmap(fd, nbytes)
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            fresh = view.untyped_storage()
            fresh.copy_(storage)
            storage._swap_data_ptr_(fresh)  # type: ignore[attr-defined]
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, nbytes)

    def close(self) -> None:
        """Close the descriptor; the mapping (vLLM's tensors) stays valid. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __repr__(self) -> str:
        return f"MemfdKVSegment({self.name!r}, nbytes={self.nbytes})"


class RegistrationChannel:
    """The worker's connection to the server's registration socket.

    ``handshake`` passes descriptors and returns their tickets, reconnecting first if
    the socket path changed or the server closed the connection (it restarted).
    Thread-safe: vLLM's thread and the heartbeat's may both register.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._path: str | None = None

    def handshake(self, path: str, fds: Sequence[int]) -> list[str]:
        with self._lock:
            try:
                return self._exchange(path, fds)
            except (OSError, ValueError) as first:
                # A restarted server closed the old connection: one fresh try.
                self._close()
                try:
                    return self._exchange(path, fds)
                except (OSError, ValueError) as exc:
                    self._close()
                    raise SegmentError(
                        f"passing {len(fds)} KV-cache memfd(s) over {path} failed: {exc}"
                    ) from first

    def _exchange(self, path: str, fds: Sequence[int]) -> list[str]:
        if self._sock is None or self._path != path:
            self._close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(path)
            except BaseException:
                sock.close()
                raise
            self._sock, self._path = sock, path
        sock = self._sock
        socket.send_fds(sock, [HANDSHAKE_MAGIC], list(fds))
        reply = b""
        while not reply.endswith(b"\n"):
            part = sock.recv(REPLY_MAX_BYTES)
            if not part:
                raise ConnectionError("the server closed the registration socket")
            reply += part
            if len(reply) > REPLY_MAX_BYTES:
                raise ValueError("handshake reply too long")
        tickets = decode_reply(reply)
        if len(tickets) != len(fds):
            raise ValueError(f"{len(tickets)} tickets for {len(fds)} descriptors")
        return tickets

    def _close(self) -> None:
        sock, self._sock, self._path = self._sock, None, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Disconnect: the server then releases every registration made over it."""
        with self._lock:
            self._close()
