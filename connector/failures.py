"""Failures that repeat every step, logged in full once."""

from __future__ import annotations

import logging

__all__ = ["FailureLog"]


class FailureLog:
    """Logs a failure of each kind (``key``) at error level with its traceback the
    first time, then at debug: a planning or lookup failure can repeat every engine
    step, and one full report is what a person needs.

    Shared by the scheduler adapter's collaborators (vLLM's thread and the lookup
    thread): ``set.add`` is atomic, and a race costs at most one extra full report.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str, *args: object, exc: BaseException | None) -> None:
        first = key not in self._seen
        self._seen.add(key)
        level = logging.ERROR if first else logging.DEBUG
        self._logger.log(level, message, *args, exc_info=exc if first else None)
