"""Segment ownership, stale sweeps and free-space checks."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import posix_ipc
import pytest

import contract.shm_naming
from contract.errors import SharedMemoryExhausted
from contract.shm_naming import (
    SHM_DIR,
    check_free_space,
    pid_namespace,
    segment_name,
    stale_segments,
    sweep_stale,
)
from dataplane.segments import Segment, sweep_stale_segments


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def _exists(name: str) -> bool:
    return os.path.exists(f"{SHM_DIR}/{name}")


@contextmanager
def _bare_segments(*names: str) -> Iterator[None]:
    """Create empty segments by name (as a crashed process would leave them); unlink after."""
    made = []
    try:
        for name in names:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
            shm.close_fd()
            made.append(name)
        yield
    finally:
        for name in made:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + name)


def test_names_carry_pid_namespace_and_pid() -> None:
    assert pid_namespace() == os.stat("/proc/self/ns/pid").st_ino != 0
    assert segment_name("w", pid=42, pidns=7, token="r0_1_ab") == "mpcache-w-7-42-r0_1_ab"
    name = segment_name("pool")
    assert name.startswith(f"mpcache-pool-{pid_namespace()}-{os.getpid()}-")
    with pytest.raises(ValueError, match="token"):
        segment_name("w", token="a-b")


@pytest.mark.parametrize("kind", ["pool"])
def test_sweep_judges_only_segments_of_our_pid_namespace(kind: str) -> None:
    dead = _dead_pid()
    ours = pid_namespace()
    stale = segment_name(kind, pid=dead)
    foreign = segment_name(kind, pid=dead, pidns=ours + 1)  # another container's
    alive = segment_name(kind, pid=os.getppid())
    old_style = f"mpcache-{kind}-{dead}-0123456789ab"  # no pid namespace: never judged
    with _bare_segments(stale, foreign, alive, old_style):
        removed = sweep_stale_segments()
        assert stale in removed
        assert not _exists(stale)
        for name in (foreign, alive, old_style):
            assert _exists(name) and name not in removed


def test_server_sweeps_pools_only() -> None:
    # Workers' KV caches are memfds now: a named segment of another kind (a left-over
    # of an older version, or anyone's) is never the server's to remove.
    dead = _dead_pid()
    worker, pool = segment_name("w", pid=dead), segment_name("pool", pid=dead)
    with _bare_segments(worker, pool):
        assert sweep_stale_segments() == [pool]
        assert _exists(worker) and not _exists(pool)


def test_nothing_is_swept_when_our_pid_namespace_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = segment_name("pool", pid=_dead_pid())
    with _bare_segments(name):
        monkeypatch.setattr(contract.shm_naming, "_PIDNS_PATH", "/nonexistent/ns/pid")
        assert pid_namespace() == 0
        assert stale_segments() == []
        assert sweep_stale_segments() == []
        assert _exists(name)


def test_the_creator_unlinks_on_close() -> None:
    owner = Segment.create(segment_name("pool"), 8192)
    try:
        owner.buffer[:5] = b"hello"
        assert _exists(owner.name)
    finally:
        owner.close()
        owner.close()
    assert not _exists(owner.name)


def test_close_with_live_views_still_unlinks() -> None:
    import torch

    seg = Segment.create(segment_name("w"), 4096)
    view = torch.frombuffer(seg.buffer, dtype=torch.uint8)
    seg.close()  # the view keeps the mapping; the name goes now
    assert not _exists(seg.name)
    view.fill_(1)  # still valid memory
    del view


def test_sweep_removes_only_dead_creators_segments() -> None:
    dead = segment_name("pool", pid=_dead_pid())
    alive = segment_name("pool", pid=os.getppid())
    odd = "mpcache-pool-notapid"
    made = []
    try:
        for name in (dead, alive, odd):
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
            shm.close_fd()
            made.append(name)
        assert dead in stale_segments()
        removed = sweep_stale()
        assert dead in removed
        assert not _exists(dead) and _exists(alive) and _exists(odd)
        assert alive not in removed and odd not in removed
    finally:
        for name in made:
            if _exists(name):
                posix_ipc.unlink_shared_memory("/" + name)


def test_sweep_leaves_other_kinds_alone() -> None:
    worker = segment_name("w", pid=_dead_pid())
    shm = posix_ipc.SharedMemory("/" + worker, posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    try:
        assert worker not in sweep_stale()  # pool prefix by default
        assert _exists(worker)
    finally:
        posix_ipc.unlink_shared_memory("/" + worker)


def test_full_dev_shm_is_a_clear_error_not_a_sigbus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asking the up-front check for more than is free allocates nothing: it reads statvfs.
    st = os.statvfs(SHM_DIR)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(SharedMemoryExhausted, match="lower --pool-size"):
        check_free_space(too_big)
    name = segment_name("pool")
    with pytest.raises(SharedMemoryExhausted):
        Segment.create(name, too_big)
    assert not _exists(name)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOMEM, errno.EFBIG])
def test_a_refused_allocation_is_a_clear_error_and_leaves_no_segment(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    # Past the check (another process may fill /dev/shm in between), the kernel's
    # refusal is the backstop. It is driven here without touching real memory: on a
    # tmpfs larger than what is free, a real oversized fallocate fills it page by page.
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    name = segment_name("pool")
    with pytest.raises(SharedMemoryExhausted, match=r"cannot allocate 4\.0 MiB") as info:
        Segment.create(name, 4 << 20, check_space=False)
    assert info.value.extras["needed_bytes"] == 4 << 20
    assert not _exists(name)


@pytest.mark.parametrize("name", ["x", "mpcache-w/a", "/mpcache-w-1-a"])
def test_names_outside_our_scheme_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not an mpcache segment name"):
        Segment.create(name, 4096)
