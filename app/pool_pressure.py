"""Pool pressure in the log: evictions and chunks the full pool could not take."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pydantic import ByteSize

__all__ = ["PoolPressureLog"]

logger = logging.getLogger(__name__)


class PoolPressureLog:
    """Evictions and chunks the full pool could not take, summarised in the log.

    The first event is logged at once; after that, at most one summary line per
    ``interval_s`` (counted when the next event arrives), and ``flush`` logs what is
    left at shutdown. Per-chunk detail is in the metrics, not the log.
    """

    def __init__(self, *, interval_s: float = 60.0, clock: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()  # stores run on several threads at once
        self._since: float | None = None
        self._last_log: float | None = None
        self._evicted = self._evicted_bytes = self._not_stored = 0

    def evicted(self, chunks: int, nbytes: int) -> None:
        with self._lock:
            self._evicted += chunks
            self._evicted_bytes += nbytes
            self._maybe_log()

    def not_stored(self, chunks: int) -> None:
        with self._lock:
            self._not_stored += chunks
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = self._clock()
        if self._since is None:
            self._since = now
        if self._last_log is None or now - self._last_log >= self._interval_s:
            self._log()

    def flush(self) -> None:
        with self._lock:
            self._log()

    def _log(self) -> None:
        if self._since is None:
            return
        now = self._clock()
        parts = []
        if self._evicted:
            parts.append(
                f"evicted {self._evicted} least recently used chunk(s) "
                f"({ByteSize(self._evicted_bytes).human_readable()}) to make room"
            )
        if self._not_stored:
            parts.append(
                f"{self._not_stored} chunk(s) not stored: no room that could be freed "
                "(the rest is pinned or leased)"
            )
        logger.info("cache pool full: %s in the last %.0fs", "; ".join(parts), now - self._since)
        self._last_log = now
        self._since = None
        self._evicted = self._evicted_bytes = self._not_stored = 0
