"""The one boundary to Redis/Valkey: clients are built here, and redis-py's errors
are translated here (``RedisUnavailable``), so the coordinator and the L2 tier never
see a foreign exception.

Every client is redis-py's synchronous one, used only from threads (a negotiation
or transfer on FastAPI's thread pool, the membership renewer, the L2 writer), never
from the event loop that answers ``/health``. Each call is bounded by
``--redis-timeout-s`` (connect and socket timeouts) and is not retried here: the
callers decide (a binding fails and is retried by the next negotiation; the L2
tier marks itself down and probes until Redis answers again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import SecretStr

__all__ = ["RedisUnavailable", "connect", "ping", "redacted", "translated"]


class RedisUnavailable(Exception):
    """Redis could not be reached, timed out, or refused the call."""


def redacted(url: str) -> str:
    """The URL without its password (for logs, /health and /cluster)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def connect(url: str, *, password: SecretStr | None, timeout_s: float, name: str) -> redis.Redis:
    """A client for ``url`` (the password from the URL, else ``password``); no I/O yet.

    ``name`` is the client name Redis shows in ``CLIENT LIST``.
    """
    kwargs: dict[str, object] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 0,
        "retry_on_timeout": False,
        "client_name": name,
    }
    if urlsplit(url).password is None and password is not None:
        kwargs["password"] = password.get_secret_value()
    return redis.Redis.from_url(url, **kwargs)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raise redis-py's errors (and socket errors) as ``RedisUnavailable``."""
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise RedisUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


def ping(url: str, *, password: SecretStr | None, timeout_s: float) -> None:
    """Raise ``RedisUnavailable`` unless the Redis at ``url`` answers a PING."""
    client = connect(url, password=password, timeout_s=timeout_s, name="mpcache-preflight")
    try:
        with translated("ping"):
            client.ping()
    finally:
        client.close()
