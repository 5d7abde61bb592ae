"""Bounded HTTP connections: what a client that opens sockets and sends nothing can hold.

uvicorn closes a connection that idles between requests (``--keep-alive-timeout-s``,
its ``timeout_keep_alive``), but not one that never finishes a request's head or
body, and it accepts connections until the process runs out of descriptors: then
neither ``/health`` nor a worker's registration can be answered, whatever the API
token (docs/design.md s.4.2; tests/reliability/test_hostile_process.py). So ``mpcache server``
serves HTTP with uvicorn's own protocol class (``AutoHTTPProtocol``) wrapped by
``guarded_protocol``, whose connections a ``ConnectionGuard`` keeps in three phases:

- **head**: waiting for a request's head (a new connection, or one whose reply was
  sent). Closed once it has waited ``header_timeout_s``, however slowly bytes trickle.
- **body**: the head arrived, the body has not all arrived. Closed once the body has
  taken ``body_timeout_s``; the request sees a client disconnect.
- **busy**: the request is being served. Never closed by the guard.

At ``max_connections`` open, a new connection closes the one that has waited longest
for a head (else for a body) to make room; if every connection is busy, the new one
is closed. Each closing is counted and logged once a minute with a count
(``dataplane.repeats``). ``open_file_limit`` raises the soft descriptor limit to the
hard one and says how many connections fit beside what the rest of the server needs.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from typing import Any, Literal

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from dataplane.repeats import RepeatedWarning

__all__ = [
    "RESERVED_DESCRIPTORS",
    "ConnectionGuard",
    "Phase",
    "Watch",
    "fit_connections",
    "guarded_protocol",
    "open_file_limit",
]

logger = logging.getLogger(__name__)

Phase = Literal["head", "body", "busy"]

RESERVED_DESCRIPTORS = 256
"""Descriptors kept for everything but HTTP connections: the registration socket's
connections and the memfds of a handshake (64 each), the pool, the body decoder's
pipes, Redis, the libraries' own."""

_MOST_DESCRIPTORS = 1 << 16
"""``open_file_limit`` raises the soft limit no higher (some hard limits are huge)."""

_MESSAGES = {
    "header_timeout": "closed a connection that sent no whole request head within %g s "
    "(--header-timeout-s)",
    "body_timeout": "closed a connection whose request body had not arrived within %g s "
    "(--body-timeout-s)",
    "evicted": "%d connections open (--max-connections): closed the one that waited "
    "longest for a request, to admit a new one",
    "refused": "%d connections open (--max-connections), each serving a request: closed a new one",
}


class Watch:
    """One connection as the guard sees it: its phase, its timer, its transport."""

    __slots__ = ("cycle", "guard", "phase", "timer", "transport")

    def __init__(self, guard: ConnectionGuard, transport: asyncio.BaseTransport) -> None:
        self.guard = guard
        self.transport = transport
        self.phase: Phase | None = None
        self.cycle: object | None = None
        self.timer: asyncio.TimerHandle | None = None

    def enter(self, phase: Phase, cycle: object | None, loop: asyncio.AbstractEventLoop) -> None:
        """Now in ``phase`` with ``cycle`` (uvicorn's request cycle, or None). A phase
        that goes on (more bytes of the same head) keeps its timer."""
        if phase == self.phase and cycle is self.cycle:
            return
        self.cancel()
        self.phase, self.cycle = phase, cycle
        self.guard.moved(self)
        if phase == "head":
            self.timer = loop.call_later(self.guard.header_timeout_s, self.expire, "header_timeout")
        elif phase == "body":
            self.timer = loop.call_later(self.guard.body_timeout_s, self.expire, "body_timeout")

    def expire(self, reason: str) -> None:
        self.timer = None
        self.guard.close(self, reason)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ConnectionGuard:
    """The open HTTP connections of one server, and their limits (module docstring).

    Event-loop only: every call comes from a protocol callback or a timer."""

    def __init__(
        self, *, max_connections: int, header_timeout_s: float, body_timeout_s: float
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.closed: Counter[str] = Counter()
        """Connections the guard closed, by reason (``_MESSAGES``' keys)."""
        self._open: set[Watch] = set()
        # Insertion-ordered: the first is the one that has waited longest.
        self._waiting: dict[Phase, dict[Watch, None]] = {"head": {}, "body": {}}
        self._warn = RepeatedWarning(logger)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def holds(self, watch: Watch) -> bool:
        return watch in self._open

    def phases(self) -> Counter[Phase]:
        """How many open connections are in each phase."""
        return Counter(watch.phase for watch in self._open if watch.phase is not None)

    def admit(self, watch: Watch) -> bool:
        """Count a new connection in; make room, or refuse it (closed: False)."""
        self._open.add(watch)
        if len(self._open) <= self.max_connections:
            return True
        for phase in ("head", "body"):
            victim = next((w for w in self._waiting[phase] if w is not watch), None)
            if victim is not None:
                self.close(victim, "evicted")
                return True
        self.close(watch, "refused")
        return False

    def moved(self, watch: Watch) -> None:
        """``watch`` entered its phase: it waits at the end of that phase's queue."""
        for phase, queue in self._waiting.items():
            if phase == watch.phase:
                queue[watch] = None
            else:
                queue.pop(watch, None)

    def forget(self, watch: Watch) -> None:
        """The connection is gone (or going): it counts no more."""
        watch.cancel()
        self._open.discard(watch)
        for queue in self._waiting.values():
            queue.pop(watch, None)

    def close(self, watch: Watch, reason: str) -> None:
        self.forget(watch)
        watch.transport.close()
        self.closed[reason] += 1
        values = {"header_timeout": self.header_timeout_s, "body_timeout": self.body_timeout_s}
        self._warn.warn(reason, _MESSAGES[reason], values.get(reason, self.max_connections))


def _phase(cycle: Any) -> Phase:
    """The phase of a connection whose current request cycle is ``cycle``."""
    if cycle is None or cycle.response_complete:
        return "head"
    return "body" if cycle.more_body else "busy"


def guarded_protocol(
    guard: ConnectionGuard, base: type[asyncio.Protocol] = AutoHTTPProtocol
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (h11 or httptools, as uvicorn picks),
    its connections kept by ``guard``: pass it as ``uvicorn.Config(http=...)``.

    It watches the hooks both of uvicorn's protocols have (``connection_made``,
    ``data_received``, ``on_response_complete``, ``connection_lost``) and reads the
    phase from their request cycle (``cycle.more_body``, ``cycle.response_complete``)."""

    class GuardedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        _watch: Watch | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            watch = Watch(guard, transport)
            if guard.admit(watch):
                self._watch = watch
                self._settle()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._settle()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._settle()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._watch is not None:
                guard.forget(self._watch)
                self._watch = None
            super().connection_lost(exc)

        def _settle(self) -> None:
            watch = self._watch
            if watch is None or not guard.holds(watch) or self.transport.is_closing():
                return
            watch.enter(_phase(self.cycle), self.cycle, self.loop)

    return GuardedHTTPProtocol


def open_file_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one (at most 65,536);
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _MOST_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, _MOST_DESCRIPTORS)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # a sandbox may refuse: the limit stays as it was
    return soft


def fit_connections(max_connections: int, soft_limit: int) -> int:
    """``max_connections``, lowered (at least 16) to leave ``RESERVED_DESCRIPTORS``
    of ``soft_limit`` for the rest of the server."""
    return max(16, min(max_connections, soft_limit - RESERVED_DESCRIPTORS))
