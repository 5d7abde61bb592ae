"""Logging for the server: the one place its loggers are configured.

The server's own loggers (``app``, ``dataplane``, ``contract``) and uvicorn's share one
handler on stderr, in plain text (default) or one JSON object per line
(``--log-format json``). uvicorn's access log (a line per request; vLLM makes
several per engine step) is shown only at ``debug`` and ``trace``; the
``mpcache_http_request_duration_seconds`` histogram covers requests at other levels.

uvicorn logs a warning per bad request ("Invalid HTTP request received."), which a
client can send in a loop: ``RepeatFilter`` passes each of uvicorn's warnings at
most once a minute, with a count.

``mpcache server`` configures logging before uvicorn starts and tells uvicorn to
leave it alone. Under plain ``uvicorn app.main:app`` the lifespan configures the
server's loggers only, unless the host process already configured logging.
"""

from __future__ import annotations

import json
import logging
import logging.config
import threading
import time
from collections.abc import Callable
from typing import Any

from app.settings import LogFormat, LogLevel
from dataplane.repeats import REPEAT_INTERVAL_S

__all__ = [
    "SERVER_LOGGERS",
    "JsonFormatter",
    "RepeatFilter",
    "configure_logging",
    "host_configured_logging",
    "logging_config",
]

SERVER_LOGGERS = ("app", "dataplane", "contract")
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error")
_ACCESS_LOGGER = "uvicorn.access"

TRACE = 5  # uvicorn's TRACE level
_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
}
_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's coloured copy of the message
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, any
    ``extra=`` fields, and exc_info as text when there is an exception."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in body:
                body[key] = value
        if record.exc_info:
            body["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


class RepeatFilter(logging.Filter):
    """Passes a warning at most once per ``interval_s`` per logger and message
    template; the next one passed says how many were dropped. Errors always pass."""

    def __init__(
        self, interval_s: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more since the last such warning)"
        return True


def logging_config(level: LogLevel, fmt: LogFormat, *, uvicorn: bool = True) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dict for the server's loggers (and uvicorn's)."""
    number = _LEVELS[level]
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else {"format": _TEXT_FORMAT}
    )
    loggers: dict[str, Any] = {
        name: {"handlers": ["mpcache"], "level": number, "propagate": False}
        for name in SERVER_LOGGERS
    }
    if uvicorn:
        for name in _UVICORN_LOGGERS:
            loggers[name] = {
                "handlers": ["mpcache"],
                "level": number,
                "propagate": False,
                "filters": ["repeats"],
            }
        loggers[_ACCESS_LOGGER] = {
            "handlers": ["mpcache"],
            "level": number if number <= logging.DEBUG else logging.WARNING,
            "propagate": False,
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"mpcache": formatter},
        "filters": {"repeats": {"()": f"{__name__}.RepeatFilter"}},
        "handlers": {
            "mpcache": {
                "class": "logging.StreamHandler",
                "formatter": "mpcache",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": loggers,
    }


def configure_logging(level: LogLevel, fmt: LogFormat, *, uvicorn: bool = True) -> None:
    logging.addLevelName(TRACE, "TRACE")
    logging.config.dictConfig(logging_config(level, fmt, uvicorn=uvicorn))


def host_configured_logging() -> bool:
    """Whether something other than us already configured logging in this process."""
    if logging.getLogger().handlers:
        return True
    return any(logging.getLogger(name).handlers for name in SERVER_LOGGERS)
