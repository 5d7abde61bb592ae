"""POSIX shared-memory segments: naming, ownership, free-space checks, stale sweep.

This module holds the one definition of our segment names, prefixes and /dev/shm
free-space check; the connector (``connector.shm``) imports them from here.

Every segment mpcache touches is named ``mpcache-<kind>-<pidns>-<pid>-<token>``:

- ``mpcache-pool-<pidns>-<pid>-<token>``: the server's cache pool, created by the server;
- ``mpcache-w-<pidns>-<pid>-<token>``: a worker's KV cache, created by the connector.

``<pid>`` is the creating process and ``<pidns>`` the identity of its PID namespace
(the inode of ``/proc/self/ns/pid``; 0 where unknown). Containers that share one
/dev/shm see each other's segments, but a pid is only meaningful inside its own
namespace: a segment is judged stale (and unlinked by ``sweep_stale``) only when
its ``<pidns>`` is ours and its ``<pid>`` is dead here. The server sweeps both kinds
at start (``sweep_stale_segments``); a worker may sweep worker segments at its start
(``sweep_stale_worker_segments``).

Ownership (enforced by ``Segment``): the creator owns a segment and is the only
process that unlinks it; ``close`` of an owner unmaps and unlinks, ``close`` of an
attacher only unmaps. The server creates only its pool; it attaches worker
segments and never unlinks them (except stale ones, whose creator is gone).

posix_ipc and OS errors are translated to ``app.errors`` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import re
import secrets
import sys
import threading
from collections.abc import Iterator

import posix_ipc

from app.errors import SegmentAccessError, SegmentNotFound, SharedMemoryExhausted

__all__ = [
    "POOL_PREFIX",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "SWEPT_PREFIXES",
    "WORKER_PREFIX",
    "Segment",
    "check_free_space",
    "pid_namespace",
    "segment_name",
    "stale_segments",
    "sweep_stale",
    "sweep_stale_segments",
    "sweep_stale_worker_segments",
]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "mpcache-"
POOL_PREFIX = "mpcache-pool-"
WORKER_PREFIX = "mpcache-w-"
SHM_DIR = "/dev/shm"

SWEPT_PREFIXES = (POOL_PREFIX, WORKER_PREFIX)
"""The kinds of segment the server sweeps at start."""

_NAME_RE = re.compile(
    r"^mpcache-(?P<kind>[a-z]+)-(?P<pidns>[0-9]+)-(?P<pid>[0-9]+)-[A-Za-z0-9_.]+$"
)
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.]+")
_PIDNS_PATH = "/proc/self/ns/pid"
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python's mmap module
_PREFAULT_STEP_BYTES = 64 << 20


def pid_namespace() -> int:
    """Identity of this process's PID namespace (inode of its ns file); 0 if unknown."""
    try:
        return os.stat(_PIDNS_PATH).st_ino
    except OSError:
        return 0


def segment_name(
    kind: str,
    pid: int | None = None,
    *,
    pidns: int | None = None,
    token: str | None = None,
) -> str:
    """A fresh segment name ``mpcache-<kind>-<pidns>-<pid>-<token>``.

    ``kind`` is ``pool`` or ``w``; ``pid`` and ``pidns`` default to this process's,
    ``token`` to a random one (letters, digits, ``_`` and ``.`` only).
    """
    if not re.fullmatch(r"[a-z]+", kind):
        raise ValueError(f"segment kind must be lowercase letters, got {kind!r}")
    if token is None:
        token = secrets.token_hex(6)
    elif _TOKEN_RE.fullmatch(token) is None:
        raise ValueError(f"segment token must be letters, digits, '_' or '.', got {token!r}")
    pid = os.getpid() if pid is None else pid
    pidns = pid_namespace() if pidns is None else pidns
    return f"{SEGMENT_PREFIX}{kind}-{pidns}-{pid}-{token}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stale_segments(prefix: str = POOL_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Names under ``prefix`` whose creating process no longer exists.

    Only names of the form ``mpcache-<kind>-<pidns>-<pid>-<token>`` created in our
    own PID namespace are judged: a pid from another namespace (another container
    sharing /dev/shm) says nothing here, so such names are never reported, nor are
    any when our own namespace is unknown.
    """
    ours = pid_namespace()
    if ours == 0:
        return []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []  # no /dev/shm listing on this platform: nothing to sweep
    stale = []
    for name in sorted(names):
        match = _NAME_RE.match(name)
        if not name.startswith(prefix) or match is None or int(match["pidns"]) != ours:
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and not _pid_alive(pid):
            stale.append(name)
    return stale


def sweep_stale(prefix: str = POOL_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments ``stale_segments`` finds; return the names removed.

    Never raises for a segment it cannot remove (logged and skipped).
    """
    removed = []
    for name in stale_segments(prefix, shm_dir):
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            continue  # another process swept it first
        except (posix_ipc.Error, OSError) as exc:
            logger.warning("could not unlink stale segment %s: %s", name, exc)
            continue
        logger.warning("unlinked stale segment %s (its creator is gone)", name)
        removed.append(name)
    return removed


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink stale pool *and* worker segments (the server, at start)."""
    return [name for prefix in SWEPT_PREFIXES for name in sweep_stale(prefix, shm_dir)]


def sweep_stale_worker_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink stale worker segments (``mpcache-w-...``); for a worker, at its start."""
    return sweep_stale(WORKER_PREFIX, shm_dir)


_POOL_SPACE_ADVICE = (
    "lower --pool-size (MPCACHE_POOL_SIZE) or give the machine more shared memory "
    "(e.g. docker run --shm-size)"
)


def check_free_space(
    size_bytes: int, shm_dir: str = SHM_DIR, *, advice: str = _POOL_SPACE_ADVICE
) -> None:
    """Raise ``SharedMemoryExhausted`` unless ``shm_dir`` has ``size_bytes`` free.

    ``advice`` ends the message: what the reader should do about it.
    """
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return  # no statvfs for this path; fallocate still refuses cleanly
    free_bytes = st.f_bavail * st.f_frsize
    if free_bytes < size_bytes:
        raise SharedMemoryExhausted(
            f"{shm_dir} has {_fmt_bytes(free_bytes)} free but {_fmt_bytes(size_bytes)} "
            f"is needed; {advice}",
            free_bytes=free_bytes,
            needed_bytes=size_bytes,
        )


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _check_name(name: str) -> None:
    if "/" in name or not name.startswith(SEGMENT_PREFIX) or len(name) > 250:
        raise ValueError(f"not an mpcache segment name: {name!r}")


class Segment:
    """One mapped POSIX shared-memory segment.

    Layout: raw bytes from offset 0 to ``size_bytes``; the user defines what they
    hold (the pool: fixed pages; a worker: its KV cache tensors).

    Ownership: ``create`` makes the caller the owner; ``close`` then unmaps *and*
    unlinks. ``attach`` maps an existing segment; ``close`` only unmaps. ``close``
    is idempotent. Views made with ``torch.frombuffer`` keep the mapping alive: if
    any still exist at ``close``, the unmap happens when the last one goes (the
    name is still unlinked at once by an owner), so no view ever dangles.
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
                        f"cannot allocate {_fmt_bytes(size_bytes)} for segment {name!r} "
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

    @staticmethod
    def probe(name: str) -> int:
        """Size in bytes of an existing segment, without mapping it."""
        with _opened(name) as shm:
            return int(os.fstat(shm.fd).st_size)

    @classmethod
    def attach(cls, name: str, *, min_size_bytes: int = 0) -> Segment:
        """Map an existing segment (not owned: ``close`` never unlinks it)."""
        with _opened(name) as shm:
            size = int(os.fstat(shm.fd).st_size)
            if size < max(min_size_bytes, 1):
                raise SegmentAccessError(
                    f"segment {name!r} holds {size} bytes, fewer than the "
                    f"{min_size_bytes} its descriptors need",
                    segment=name,
                )
            try:
                mm = mmap.mmap(shm.fd, size)
            except OSError as exc:
                raise SegmentAccessError(f"cannot map segment {name!r}: {exc}") from exc
        return cls(name, mm, size, owner=False)

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

    # ------------------------------------------------------------------ pre-fault

    def prefault(self, address: int, stop: threading.Event | None = None) -> None:
        """Populate the page tables of the whole mapping, in steps (stoppable).

        ``address`` is the mapping's start (e.g. a tensor's ``data_ptr()``). Uses
        ``MADV_POPULATE_WRITE`` through libc (which releases the GIL); the pages
        already exist (``create`` allocated them), so no data is written.
        """
        madvise = _libc_madvise()
        for start in range(0, self.size_bytes, _PREFAULT_STEP_BYTES):
            if (stop is not None and stop.is_set()) or self.closed:
                return
            length = min(_PREFAULT_STEP_BYTES, self.size_bytes - start)
            if madvise is None or madvise(address + start, length, _MADV_POPULATE_WRITE) != 0:
                return  # old kernel or no libc: first touches fault the pages instead


def _libc_madvise() -> ctypes._NamedFuncPointer | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@contextlib.contextmanager
def _opened(name: str) -> Iterator[posix_ipc.SharedMemory]:
    _check_name(name)
    try:
        shm = posix_ipc.SharedMemory("/" + name)
    except posix_ipc.ExistentialError as exc:
        raise SegmentNotFound(f"no shared-memory segment named {name!r}", segment=name) from exc
    except (posix_ipc.Error, OSError) as exc:
        raise SegmentAccessError(f"cannot open segment {name!r}: {exc}", segment=name) from exc
    try:
        yield shm
    finally:
        shm.close_fd()
