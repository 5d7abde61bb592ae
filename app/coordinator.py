"""Coordinator membership: which chunk size this server serves, as seen by peers.

With no coordinator configured the server is a standalone member: joining records
the membership locally and succeeds. A networked coordinator implements the same
``Coordinator`` protocol (join with the bound chunk size, leave at shutdown).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Coordinator", "Membership", "StandaloneCoordinator"]


@dataclass(frozen=True)
class Membership:
    member_id: str
    chunk_size: int
    mode: str
    joined_at: float


class Coordinator(Protocol):
    @property
    def membership(self) -> Membership | None: ...

    def join(self, chunk_size: int) -> Membership: ...

    def leave(self) -> None: ...


class StandaloneCoordinator:
    """No peers: membership is recorded locally."""

    def __init__(self, member_id: str) -> None:
        self._member_id = member_id
        self._membership: Membership | None = None

    @property
    def membership(self) -> Membership | None:
        return self._membership

    def join(self, chunk_size: int) -> Membership:
        self._membership = Membership(self._member_id, chunk_size, "standalone", time.time())
        return self._membership

    def leave(self) -> None:
        self._membership = None
