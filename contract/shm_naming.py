"""Shared-memory segment names, and the housekeeping around them.

The one named segment mpcache makes is the server's cache pool,
``mpcache-pool-<pidns>-<pid>-<token>`` (the scheme is ``mpcache-<kind>-...``).
Workers' KV caches are never named: they travel as sealed memfds
(``contract.fdpass``).

``<pid>`` is the creating process and ``<pidns>`` the identity of its PID namespace
(the inode of ``/proc/self/ns/pid``; 0 where unknown). Containers that share one
/dev/shm see each other's segments, but a pid is only meaningful inside its own
namespace: a segment is judged stale (``stale_segments``, unlinked by
``sweep_stale``) only when its ``<pidns>`` is ours and its ``<pid>`` is dead here.
The server sweeps pools at start (``dataplane.segments``).

``check_free_space`` turns a /dev/shm too small for a new segment into
``SharedMemoryExhausted`` up front (a full tmpfs must be a clear error, never a
SIGBUS on a later write). Ownership (the creator unlinks, attachers only unmap) is
enforced by the class that holds segments, ``dataplane.segments.Segment``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets

from contract.errors import SharedMemoryExhausted

__all__ = [
    "INDEX_PREFIX",
    "POOL_PREFIX",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "check_free_space",
    "fmt_bytes",
    "pid_namespace",
    "segment_name",
    "stale_segments",
    "sweep_stale",
]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "mpcache-"
POOL_PREFIX = "mpcache-pool-"
INDEX_PREFIX = "mpcache-index-"
SHM_DIR = "/dev/shm"

_NAME_RE = re.compile(
    r"^mpcache-(?P<kind>[a-z]+)-(?P<pidns>[0-9]+)-(?P<pid>[0-9]+)-[A-Za-z0-9_.]+$"
)
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.]+")
_PIDNS_PATH = "/proc/self/ns/pid"


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

    ``kind`` is ``pool`` (tests use others); ``pid`` and ``pidns`` default to this process's,
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
    import posix_ipc  # here, not at import: the contract stays import-light

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
            f"{shm_dir} has {fmt_bytes(free_bytes)} free but {fmt_bytes(size_bytes)} "
            f"is needed; {advice}",
            free_bytes=free_bytes,
            needed_bytes=size_bytes,
        )


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
