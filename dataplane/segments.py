"""POSIX shared-memory segments on the server: ``Segment`` (create, close).

Names, prefixes, the stale judgement and the /dev/shm free-space check are the
contract's (``contract.shm_naming``); this module holds the server's mappings.

Ownership (enforced by ``Segment``): the creator owns a segment and is the only
process that unlinks it; ``close`` unmaps and unlinks. The server's only segment is
its pool; pools of crashed servers are swept at start (``sweep_stale_segments``).
Workers' KV caches never come by name: they arrive as sealed memfds
(``dataplane.fdgate``).

posix_ipc and OS errors are translated to ``contract.errors`` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import sys
import threading

import posix_ipc

from contract.errors import SegmentAccessError, SharedMemoryExhausted
from contract.shm_naming import (
    INDEX_PREFIX,
    POOL_PREFIX,
    SEGMENT_PREFIX,
    SHM_DIR,
    check_free_space,
    fmt_bytes,
    sweep_stale,
)

__all__ = ["SWEPT_PREFIXES", "Segment", "sweep_stale_segments"]

logger = logging.getLogger(__name__)

SWEPT_PREFIXES = (POOL_PREFIX, INDEX_PREFIX)
"""The kinds of segment the server sweeps at start."""


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink stale pool and key-index segments (the server, at start)."""
    return [name for prefix in SWEPT_PREFIXES for name in sweep_stale(prefix, shm_dir)]


def _check_name(name: str) -> None:
    if "/" in name or not name.startswith(SEGMENT_PREFIX) or len(name) > 250:
        raise ValueError(f"not an mpcache segment name: {name!r}")


class Segment:
    """One mapped POSIX shared-memory segment.

    Layout: raw bytes from offset 0 to ``size_bytes``; the user defines what they
    hold (the pool: fixed pages; a worker: its KV cache tensors).

    Ownership: ``create`` makes the caller the owner; ``close`` then unmaps *and*
    unlinks. ``close`` is idempotent. Views made with ``torch.frombuffer`` keep the
    mapping alive: if any still exist at ``close``, the unmap happens when the last
    one goes (the name is still unlinked at once), so no view ever dangles.
    """

    def __init__(self, name: str, mm: mmap.mmap, size_bytes: int, owner: bool) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"Segment({self.name!r}, {self.size_bytes} bytes, {role})"

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, name: str, size_bytes: int, *, check_space: bool = True) -> Segment:
        """Create, size and map a new segment; its pages are allocated up front.

        Allocating with ``posix_fallocate`` makes a full tmpfs fail here with
        ``SharedMemoryExhausted`` instead of a SIGBUS on a later write.
        """
        _check_name(name)
        if size_bytes < 1:
            raise ValueError(f"size_bytes must be >= 1, got {size_bytes}")
        if check_space:
            check_free_space(size_bytes)
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError as exc:
            raise SegmentAccessError(f"shared-memory segment {name!r} already exists") from exc
        except (posix_ipc.Error, OSError) as exc:
            raise SegmentAccessError(f"cannot create segment {name!r}: {exc}") from exc
        try:
            try:
                os.posix_fallocate(shm.fd, 0, size_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise SharedMemoryExhausted(
                        f"cannot allocate {fmt_bytes(size_bytes)} for segment {name!r} "
                        f"in {SHM_DIR}: {exc.strerror}; lower --pool-size or give the "
                        "machine more shared memory",
                        needed_bytes=size_bytes,
                    ) from exc
                # Some filesystems lack fallocate: size it and rely on the space check.
                os.ftruncate(shm.fd, size_bytes)
            mm = mmap.mmap(shm.fd, size_bytes)
        except BaseException:
            shm.close_fd()
            with contextlib.suppress(posix_ipc.Error):
                shm.unlink()
            raise
        shm.close_fd()
        return cls(name, mm, size_bytes, owner=True)

    def close(self) -> None:
        with self._lock:
            mm, self._mm = self._mm, None
        if mm is None:
            return
        # torch.frombuffer views hold a reference to the mmap object, not a buffer
        # export, so mmap.close() would succeed under them and leave them dangling.
        # Unmap only when this is the last reference; otherwise the last view's
        # release unmaps (mmap's deallocation does).
        if sys.getrefcount(mm) <= 2:  # this frame's name and the call's argument
            mm.close()
        else:
            logger.debug("segment %s still has live views; unmapped when they go", self.name)
        del mm
        if self.owner:
            try:
                posix_ipc.unlink_shared_memory("/" + self.name)
            except posix_ipc.ExistentialError:
                logger.warning("segment %s was already unlinked", self.name)

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def buffer(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return mm
