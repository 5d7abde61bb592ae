"""The connector's settings, parsed once from vLLM's ``kv_connector_extra_config``.

Keys (values may arrive as strings from a JSON command line; they are coerced):

=============================== ============================ =======================
key                             meaning                      default
=============================== ============================ =======================
``mpcache.server_urls``         list, or comma-separated     ``http://127.0.0.1:8000``
                                string, of server base URLs
``lmcache.mp.server_urls``      same (LMCache spelling)
``lmcache.mp.host`` / ``.port`` one server as host + port
``mpcache.heartbeat_interval``  seconds between health pings ``10``
``lmcache.mp.heartbeat_interval`` same (LMCache spelling)
``mpcache.request_timeout``     seconds for a control call   ``2``
                                on vLLM's thread (store,
                                retrieve, register)
``mpcache.lookup_timeout``      seconds for one lookup       ``1``
``mpcache.lookup_max_age``      seconds a lookup answer is   ``10``
                                reused while a request waits
                                for blocks; older answers are
                                looked up again (renewing the
                                server's lease on the hit
                                chunks: keep it well below
                                the server's --lease-ttl-s)
``mpcache.heartbeat_timeout``   seconds for one health ping  ``2``
``mpcache.startup_timeout``     seconds to keep retrying the ``30``
                                first negotiation
``mpcache.instance_id``         identity shared by the       vLLM's ``engine_id``
                                scheduler and its workers
=============================== ============================ =======================

A bad value raises ``ConfigError`` naming the key, at startup. Unknown
``mpcache.*`` keys are errors too (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from connector.errors import ConfigError

__all__ = ["DEFAULT_SERVER_URL", "ConnectorConfig", "parse_extra_config"]

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"

_KNOWN_MPCACHE_KEYS = frozenset(
    {
        "mpcache.server_urls",
        "mpcache.heartbeat_interval",
        "mpcache.request_timeout",
        "mpcache.lookup_timeout",
        "mpcache.lookup_max_age",
        "mpcache.heartbeat_timeout",
        "mpcache.startup_timeout",
        "mpcache.instance_id",
    }
)


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings; every duration is in seconds."""

    server_urls: tuple[str, ...] = (DEFAULT_SERVER_URL,)
    heartbeat_interval_s: float = 10.0
    request_timeout_s: float = 2.0
    lookup_timeout_s: float = 1.0
    lookup_max_age_s: float = 10.0
    heartbeat_timeout_s: float = 2.0
    startup_timeout_s: float = 30.0
    instance_id: str | None = None


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a number of seconds, got {value!r}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(key, f"expected a number of seconds, got {value!r}") from exc
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(key, f"must be a positive, finite number of seconds, got {value!r}")
    return number


def _normalise_url(key: str, raw: str) -> str:
    text = raw.strip().rstrip("/")
    if not text:
        raise ConfigError(key, "empty server URL")
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "tcp":  # LMCache's ZMQ-style spelling; mpcache speaks HTTP on it
        scheme = "http"
    if scheme not in ("http", "https"):
        raise ConfigError(key, f"server URL {raw!r} must use http:// or https://")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"server URL {raw!r} has an invalid port") from exc
    if not parts.hostname:
        raise ConfigError(key, f"server URL {raw!r} has no host")
    if parts.query or parts.fragment:
        raise ConfigError(key, f"server URL {raw!r} must not carry a query or fragment")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path}"


def _url_list(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items: list[Any] = [v for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(key, f"expected a list or a comma-separated string, got {value!r}")
    if not items:
        raise ConfigError(key, "no server URL given")
    urls = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(key, f"server URLs must be strings, got {item!r}")
        urls.append(_normalise_url(key, item))
    if len(set(urls)) != len(urls):
        raise ConfigError(key, f"duplicate server URL in {urls}")
    return tuple(urls)


def _host_port(extra: Mapping[str, Any]) -> tuple[str, ...]:
    host = extra.get("lmcache.mp.host", "127.0.0.1")
    port = extra.get("lmcache.mp.port", 8000)
    if not isinstance(host, str) or not host.strip():
        raise ConfigError("lmcache.mp.host", f"expected a host name, got {host!r}")
    try:
        port_number = int(str(port).strip())
    except ValueError as exc:
        raise ConfigError("lmcache.mp.port", f"expected a port number, got {port!r}") from exc
    if isinstance(port, bool) or not 0 < port_number < 65536:
        raise ConfigError("lmcache.mp.port", f"port must be in 1..65535, got {port!r}")
    host_url = _normalise_url("lmcache.mp.host", host)
    return (f"{host_url}:{port_number}",)


def _first(extra: Mapping[str, Any], *keys: str) -> tuple[str, Any] | None:
    for key in keys:
        if key in extra and extra[key] is not None:
            return key, extra[key]
    return None


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Build a ``ConnectorConfig``; raise ``ConfigError`` naming the bad key."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k.startswith("mpcache.") and k not in _KNOWN_MPCACHE_KEYS)
    if unknown:
        raise ConfigError(
            unknown[0], f"unknown key; known mpcache keys are {sorted(_KNOWN_MPCACHE_KEYS)}"
        )

    found = _first(extra, "mpcache.server_urls", "lmcache.mp.server_urls")
    if found is not None:
        urls = _url_list(*found)
    elif "lmcache.mp.host" in extra or "lmcache.mp.port" in extra:
        urls = _host_port(extra)
    else:
        urls = (DEFAULT_SERVER_URL,)

    def seconds(default: float, *keys: str) -> float:
        hit = _first(extra, *keys)
        return default if hit is None else _positive_float(*hit)

    instance_id = extra.get("mpcache.instance_id")
    if instance_id is not None and (not isinstance(instance_id, str) or not instance_id.strip()):
        raise ConfigError(
            "mpcache.instance_id", f"expected a non-empty string, got {instance_id!r}"
        )

    return ConnectorConfig(
        server_urls=urls,
        heartbeat_interval_s=seconds(
            10.0, "mpcache.heartbeat_interval", "lmcache.mp.heartbeat_interval"
        ),
        request_timeout_s=seconds(2.0, "mpcache.request_timeout"),
        lookup_timeout_s=seconds(1.0, "mpcache.lookup_timeout"),
        lookup_max_age_s=seconds(10.0, "mpcache.lookup_max_age"),
        heartbeat_timeout_s=seconds(2.0, "mpcache.heartbeat_timeout"),
        startup_timeout_s=seconds(30.0, "mpcache.startup_timeout"),
        instance_id=instance_id.strip() if isinstance(instance_id, str) else None,
    )
