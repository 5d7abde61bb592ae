"""POSIX shared-memory segments that back vLLM's CPU KV cache (zero copy).

``ShmKVSegment.adopt`` moves one torch storage into a new segment *in place*: it
creates the segment, maps it, copies the storage's bytes in, and swaps the
storage's data pointer with the mapping (``UntypedStorage._swap_data_ptr_``). Every
tensor and view vLLM holds on that storage -- the ``kv_caches`` dict, the attention
layers' bound caches, kernel-block views -- now reads and writes the segment, so the
server, which maps the same segment by name, sees the very same pages.

Layout: byte ``i`` of the segment is byte ``i`` of the storage; a tensor's data starts
at ``storage_offset() * element_size()`` (the descriptor's ``offset_bytes``).

Ownership: the creating worker owns the *name* and is the only one to unlink it
(``unlink``, at shutdown). The *mapping* is owned by the torch storage (its data
pointer keeps the mmap alive), so vLLM's tensors stay valid after the unlink. The
server only maps and unmaps. Names carry the creator's PID namespace and pid
(``mpcache-w-<pidns>-<pid>-...``) so a sweep of stale segments can tell live owners
from dead ones; names, prefixes, the free-space check and the sweep are defined once,
in ``contract.shm_naming``, and re-exported here. A worker may call
``sweep_stale_worker_segments()`` at its start to remove segments of crashed workers.

posix_ipc and OS errors are translated into ``SegmentError`` here, and only here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterator

import torch

from connector.errors import SegmentError
from contract.errors import SharedMemoryExhausted
from contract.shm_naming import (
    SEGMENT_PREFIX,
    WORKER_PREFIX,
    check_free_space,
    sweep_stale_worker_segments,
)
from contract.shm_naming import segment_name as _segment_name

__all__ = [
    "SEGMENT_PREFIX",
    "WORKER_PREFIX",
    "ShmKVSegment",
    "segment_name",
    "sweep_stale_worker_segments",
]

_SPACE_ADVICE = (
    "enlarge /dev/shm (e.g. docker --shm-size) or lower --gpu-memory-utilization / "
    "--kv-cache-memory"
)


def segment_name(rank: int, index: int) -> str:
    """A fresh name ``mpcache-w-<pidns>-<pid>-r<rank>_<index>_<random>`` (no leading slash).

    The server's scheme is ``mpcache-<kind>-<pidns>-<pid>-<token>``
    (``contract.shm_naming``): it maps only ``mpcache-w-`` names and sweeps one only
    when its ``<pidns>`` is its own and its ``<pid>`` is dead.
    """
    return _segment_name("w", token=f"r{rank}_{index}_{secrets.token_hex(3)}")


@contextlib.contextmanager
def _translate(name: str, action: str) -> Iterator[None]:
    import posix_ipc

    try:
        yield
    except (posix_ipc.Error, OSError, ValueError) as exc:
        raise SegmentError(f"shared-memory segment {name!r}: {action} failed: {exc}") from exc


class ShmKVSegment:
    """One POSIX shm segment holding one torch storage (see module docstring)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self._unlinked = False

    @classmethod
    def adopt(cls, storage: torch.UntypedStorage, name: str) -> ShmKVSegment:
        """Move ``storage`` into a new segment named ``name``, in place."""
        import posix_ipc

        nbytes = storage.nbytes()
        if nbytes <= 0:
            raise SegmentError(f"cannot place an empty storage in segment {name!r}")
        if storage.device.type != "cpu":
            raise SegmentError(f"only CPU storages go to shared memory, got {storage.device}")
        try:
            check_free_space(nbytes, advice=_SPACE_ADVICE)
        except SharedMemoryExhausted as exc:
            raise SegmentError(exc.detail) from exc
        segment = cls(name, nbytes)
        created = False
        try:
            with _translate(name, "create"):
                shm = posix_ipc.SharedMemory(f"/{name}", posix_ipc.O_CREX, mode=0o600, size=0)
                created = True
                try:
                    # Reserve the pages now: a full tmpfs is an error here, never a
                    # SIGBUS on first touch later.
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(shm.fd, 0, nbytes)
                    else:  # pragma: no cover - macOS has no posix_fallocate
                        os.ftruncate(shm.fd, nbytes)
                    mapping = mmap.mmap(shm.fd, nbytes)
                finally:
                    shm.close_fd()
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            fresh = view.untyped_storage()
            fresh.copy_(storage)
            storage._swap_data_ptr_(fresh)  # type: ignore[attr-defined]
        except BaseException:
            if created:
                segment.unlink()
            raise
        return segment

    def unlink(self) -> None:
        """Remove the name (the owner only); mapped memory stays valid. Idempotent."""
        if self._unlinked:
            return
        import posix_ipc

        self._unlinked = True
        try:
            posix_ipc.unlink_shared_memory(f"/{self.name}")
        except posix_ipc.ExistentialError:
            pass  # already gone (swept, or unlinked by a test)
        except (posix_ipc.Error, OSError) as exc:
            raise SegmentError(
                f"shared-memory segment {self.name!r}: unlink failed: {exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"ShmKVSegment({self.name!r}, nbytes={self.nbytes})"
