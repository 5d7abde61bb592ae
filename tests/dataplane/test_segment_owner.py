"""A worker's segment (mode 0600) can be mapped only by its own uid, and the error says
what to do: run the server as vLLM's uid (README "Container")."""

from __future__ import annotations

import os

import posix_ipc
import pytest

from contract.errors import SegmentAccessError
from contract.shm_naming import segment_name
from dataplane.segments import Segment

NOBODY = 65534


def _attach_as(uid: int, name: str) -> str:
    """Fork; in the child drop to ``uid`` and try to map ``name``; return the outcome.

    A fork, not a new interpreter: the child needs no file of the venv (under /root)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        outcome = "mapped"
        try:
            os.setgid(uid)
            os.setuid(uid)
            Segment.attach(name).close()
        except SegmentAccessError as exc:
            outcome = exc.detail
        except BaseException as exc:
            outcome = f"unexpected {exc!r}"
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_only_the_creating_uid_maps_a_0600_segment() -> None:
    name = segment_name("w")
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        assert _attach_as(os.geteuid(), name) == "mapped"
        refused = _attach_as(NOBODY, name)
        assert "belongs to another user" in refused, refused
        assert f"same uid as vLLM (this server runs as uid {NOBODY})" in refused
    finally:
        shm.close_fd()
        shm.unlink()


def test_permission_error_names_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise posix_ipc.PermissionsError("Permission denied")

    monkeypatch.setattr(posix_ipc, "SharedMemory", refuse)
    with pytest.raises(SegmentAccessError, match="same uid as vLLM"):
        Segment.attach(segment_name("w"))
