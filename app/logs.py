"""Logging for the server: the one place its loggers are configured.

The server's own loggers (``app``, ``dataplane``, ``contract``) and uvicorn's share one
handler on stderr, in plain text (default) or one JSON object per line
(``--log-format json``). uvicorn's access log (a line per request; vLLM makes
several per engine step) is shown only at ``debug`` and ``trace``; the
``mpcache_http_request_duration_seconds`` histogram covers requests at other levels.

``mpcache server`` configures logging before uvicorn starts and tells uvicorn to
leave it alone. Under plain ``uvicorn app.main:app`` the lifespan configures the
server's loggers only, unless the host process already configured logging.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from typing import Any

from app.settings import LogFormat, LogLevel

__all__ = [
    "SERVER_LOGGERS",
    "JsonFormatter",
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
            loggers[name] = {"handlers": ["mpcache"], "level": number, "propagate": False}
        loggers[_ACCESS_LOGGER] = {
            "handlers": ["mpcache"],
            "level": number if number <= logging.DEBUG else logging.WARNING,
            "propagate": False,
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"mpcache": formatter},
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
