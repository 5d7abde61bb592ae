"""Lookup areas: shared memory a client writes its lookups' token ids into.

A binary lookup carries a burst's ids in its body (1 MiB for 64 prompts of 4k
tokens), and reading that through uvicorn and h11 is a large share of the burst's
time (``bench/scheduler_burst_bench.py`` measures it with and without an area).
A client on this host can instead register an area (``POST /cache/lookup-areas``):
a memfd sealed against shrinking and growing, passed over the registration socket
(``app.routes.register``, ``dataplane.fdgate``) like a KV cache. It writes each
lookup's ids there and the lookup frame names the area (``contract.frames``); the
server copies the items' ids out when their marks arrive, so a client that
rewrites its area meanwhile changes only its own answers, never what the server
keeps or hashes later.

An area lives as long as the socket connection it came over (as a registration
does), or until ``DELETE``. Its id is unguessable and only its client learns it.
The mapping is read through views that keep it alive (``SealedMemory``), so a
release while a lookup reads never leaves a dangling pointer.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import numpy as np

from contract.errors import InvalidRequest, NotFound
from contract.tokens import TOKEN_DTYPE
from dataplane.fdgate import FdGate

__all__ = ["MAX_AREAS", "MAX_AREAS_PER_CONNECTION", "MAX_AREA_BYTES", "LookupAreas"]

MAX_AREAS = 64
"""Areas the server keeps at once (one per scheduler-side connector)."""

MAX_AREAS_PER_CONNECTION = 2
"""Areas one socket connection may hold (a connector holds one), so one client
cannot take every slot."""

MAX_AREA_BYTES = 16 << 20
"""The largest area (4M token ids): a lookup's ids are copied out on the event
loop, and this bounds one copy (the connector's area is 4 MiB)."""


@dataclass(frozen=True)
class _Area:
    tokens: np.ndarray  # an int32 view of the whole mapping (it keeps it mapped)
    conn_id: int


class LookupAreas:
    """The registered areas; thread-safe (the gate's thread releases them too).

    An area is entered only while its connection is alive, under this object's lock;
    the gate drops a closed connection first and then calls ``release_connection``
    (which takes this lock), so no area outlives its connection. Lock order: this
    object's lock, then the gate's (the gate calls ``release_connection`` without
    holding its own)."""

    def __init__(self, gate: FdGate) -> None:
        self._gate = gate
        self._lock = threading.Lock()
        self._areas: dict[str, _Area] = {}

    def register(self, ticket: str) -> tuple[str, int]:
        """Map the memfd behind ``ticket``: ``(area id, size in bytes)``."""
        conn_id, taken = self._gate.take([ticket])
        memory = taken[ticket]
        try:
            size = memory.size_bytes
            if not 4 <= size <= MAX_AREA_BYTES:
                raise InvalidRequest(
                    f"a lookup area holds 4 to {MAX_AREA_BYTES} bytes, not {size}",
                    size_bytes=size,
                )
            raw = memoryview(memory.buffer).cast("B")  # keeps the mapping alive
            view = np.frombuffer(raw, dtype=TOKEN_DTYPE, count=size // 4)
        finally:
            memory.close()  # the view keeps the mapping
        area_id = secrets.token_urlsafe(18)
        with self._lock:
            if len(self._areas) >= MAX_AREAS:
                raise InvalidRequest(
                    f"this server keeps {MAX_AREAS} lookup areas at most; DELETE unused ones",
                    areas=len(self._areas),
                )
            mine = sum(1 for area in self._areas.values() if area.conn_id == conn_id)
            if mine >= MAX_AREAS_PER_CONNECTION:
                raise InvalidRequest(
                    f"one socket connection holds {MAX_AREAS_PER_CONNECTION} lookup areas "
                    "at most; DELETE one first",
                    areas=mine,
                )
            # The connection may have closed since the ticket was taken, and its
            # release run already: then the area would never be released.
            if not self._gate.alive(conn_id):
                raise InvalidRequest(
                    "the socket connection that passed this memfd has closed", reason="closed"
                )
            self._areas[area_id] = _Area(view, conn_id)
        return area_id, size

    def tokens(self, area_id: str, offset_bytes: int, num_tokens: int) -> np.ndarray:
        """A copy of ``num_tokens`` ids at ``offset_bytes`` of the area."""
        with self._lock:
            area = self._areas.get(area_id)
        if area is None:
            raise NotFound(
                "no such lookup area: it was deleted, its client's socket connection "
                "closed, or the server restarted; register one again",
                area_id=area_id,
            )
        start = offset_bytes // 4
        if offset_bytes % 4 or start + num_tokens > len(area.tokens):
            raise InvalidRequest(
                f"the items' ids run past the lookup area's {4 * len(area.tokens)} bytes",
                area_id=area_id,
            )
        return area.tokens[start : start + num_tokens].copy()

    def release(self, area_id: str) -> bool:
        with self._lock:
            return self._areas.pop(area_id, None) is not None

    def release_connection(self, conn_id: int) -> None:
        """Drop the areas registered over a connection that closed."""
        with self._lock:
            for area_id in [a for a, area in self._areas.items() if area.conn_id == conn_id]:
                del self._areas[area_id]

    def count(self) -> int:
        with self._lock:
            return len(self._areas)
