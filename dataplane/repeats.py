"""Warnings that may repeat, logged once per interval with a count.

A fault a client can make happen in a tight loop (a socket that fails to accept at
"too many open files", connections closed for idling) must not fill the disk with
its log: the first is logged at once, the next after ``interval_s`` with how many
there were in between (``RepeatedWarning``). Used by the registration socket
(``dataplane.fdgate``) and the HTTP connection guard (``app.connections``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["REPEAT_INTERVAL_S", "RepeatedWarning"]

REPEAT_INTERVAL_S = 60.0


class RepeatedWarning:
    """``warn(key, msg, *args)`` logs at most once per ``interval_s`` per ``key`` (a
    fixed name of the fault, never a client's value); a line after a quiet spell
    says how many were not logged. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = REPEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def warn(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged within the interval; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._unlogged[key] = self._unlogged.get(key, 0) + 1
                return False
            self._last[key] = now
            more = self._unlogged.pop(key, 0)
        if more:
            msg += " (%d more since the last such warning)"
            args = (*args, more)
        self._logger.warning(msg, *args)
        return True
