"""Late answers, said in the log: an event loop that could not run, a slow request.

A connector that waits longer than its timeout for a call (by default 1 s for a
lookup, 2 s for the heartbeat's ``/health``) puts vLLM in degraded mode; the
operator then needs to know whether the server was slow and why. The thresholds
sit well below those timeouts, so a stall or a request that cost a lookup its
answer is in the log even when it fell just short of a timeout. Two things are
watched:

- **Event-loop stalls** (``watch_event_loop``): a task that sleeps ``TICK_S`` and
  measures how late it woke. ``STALL_S`` or later means every request, ``/health``
  included, waited at least that long: a thread holding the GIL in a long C call,
  or no CPU for this process. Logged as a warning, counted in
  ``mpcache_event_loop_stall_seconds_total``.
- **Slow requests** (``SlowRequests``, used by ``RequestTimer``): a request that
  took ``SLOW_REQUEST_S`` or more, logged with its route and status, at most once
  per route every ``REPEAT_S`` (with how many more there were).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["REPEAT_S", "SLOW_REQUEST_S", "STALL_S", "TICK_S", "SlowRequests", "watch_event_loop"]

logger = logging.getLogger(__name__)

TICK_S = 0.25
STALL_S = 0.5
SLOW_REQUEST_S = 1.0
REPEAT_S = 60.0


async def watch_event_loop(
    on_stall: Callable[[float], None],
    *,
    tick_s: float = TICK_S,
    stall_s: float = STALL_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run until cancelled: ``on_stall(seconds)`` and a warning for every wake-up
    ``stall_s`` or more late."""
    while True:
        before = clock()
        await asyncio.sleep(tick_s)
        late = clock() - before - tick_s
        if late >= stall_s:
            on_stall(late)
            logger.warning(
                "the event loop could not run for %.1f s: every request waited at least "
                "that long (a thread holding the GIL, or no CPU for this process); "
                "connectors whose heartbeat timeout is shorter went degraded",
                late,
            )


class SlowRequests:
    """Warns of requests that took ``threshold_s`` or more, once per route per
    ``repeat_s`` (the next warning says how many were not logged). Thread-safe."""

    def __init__(
        self,
        threshold_s: float = SLOW_REQUEST_S,
        repeat_s: float = REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold_s = threshold_s
        self._repeat_s = repeat_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        if seconds < self.threshold_s:
            return
        key = f"{method} {route}"
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._repeat_s:
                self._unlogged[key] = self._unlogged.get(key, 0) + 1
                return
            self._last[key] = now
            more = self._unlogged.pop(key, 0)
        logger.warning(
            "slow request: %s answered %d after %.1f s%s",
            key,
            status,
            seconds,
            f" ({more} more slower than {self.threshold_s:g} s since the last warning)"
            if more
            else "",
        )
