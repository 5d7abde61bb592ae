"""The connector's settings, parsed once from vLLM's ``kv_connector_extra_config``.

``parse_extra_config`` builds the frozen ``ConnectorConfig``, whose docstring lists
every key with its meaning and default. A bad value, or an unknown ``mpcache.*``
key, raises ``ConfigError`` naming the key, at startup.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from connector.errors import ConfigError
from contract import DEFAULT_PORT

__all__ = ["DEFAULT_SERVER_URL", "KNOWN_KEYS", "ConnectorConfig", "parse_extra_config"]

logger = logging.getLogger("mpcache.connector")

DEFAULT_SERVER_URL = f"http://127.0.0.1:{DEFAULT_PORT}"


def _normalise_url(raw: str) -> str:
    text = raw.strip().rstrip("/")
    if not text:
        raise ValueError("empty server URL")
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "tcp":  # LMCache's ZMQ-style spelling; mpcache speaks HTTP on it
        scheme = "http"
    if scheme not in ("http", "https"):
        raise ValueError(f"server URL {raw!r} must use http:// or https://")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"server URL {raw!r} has an invalid port") from exc
    if not parts.hostname:
        raise ValueError(f"server URL {raw!r} has no host")
    if parts.query or parts.fragment:
        raise ValueError(f"server URL {raw!r} must not carry a query or fragment")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path}"


def _url_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items: list[Any] = [v for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"expected a list or a comma-separated string, got {value!r}")
    if not items:
        raise ValueError("no server URL given")
    urls = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"server URLs must be strings, got {item!r}")
        urls.append(_normalise_url(item))
    if len(set(urls)) != len(urls):
        raise ValueError(f"duplicate server URL in {urls}")
    return tuple(urls)


def _number(value: Any) -> Any:
    """Strings are stripped; booleans are not numbers here (JSON ``true`` is a typo)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value.strip() if isinstance(value, str) else value


def _non_empty(value: Any) -> Any:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value.strip()


Seconds = Annotated[float, BeforeValidator(_number), Field(gt=0, allow_inf_nan=False)]
ServerUrls = Annotated[tuple[str, ...], BeforeValidator(_url_list)]


def _seconds(default: float, *keys: str) -> Any:
    return Field(default, validation_alias=AliasChoices(*keys))


class ConnectorConfig(BaseModel):
    """Validated connector settings; every duration is in seconds.

    Built from the extra-config keys by ``parse_extra_config``; tests and tools may
    also build it from the field names.

    Keys (values may arrive as strings from a JSON command line; they are coerced):

    =================================== ============================ =========================
    key                                 meaning                      default
    =================================== ============================ =========================
    ``mpcache.server_urls``             list, or comma-separated     ``http://127.0.0.1:8733``
                                        string, of server base URLs
    ``lmcache.mp.server_urls``          same (LMCache spelling)
    ``lmcache.mp.host`` / ``.port``     one server as host + port
    ``mpcache.heartbeat_interval``      seconds between health pings ``10``
    ``lmcache.mp.heartbeat_interval``   same (LMCache spelling)
    ``mpcache.request_timeout``         seconds for a control call   ``2``
                                        on vLLM's thread (store,
                                        retrieve, register)
    ``mpcache.lookup_timeout``          seconds for one lookup       ``1``
    ``mpcache.lookup_max_age``          seconds a lookup answer is   ``10``
                                        reused while a request waits
                                        for blocks; older answers are
                                        looked up again (renewing the
                                        server's lease on the hit
                                        chunks: keep it well below
                                        the server's --lease-ttl-s)
    ``mpcache.heartbeat_timeout``       seconds for one health ping  ``2``
    ``mpcache.startup_timeout``         seconds to keep retrying the ``30``
                                        first negotiation
    ``mpcache.lookup_area``             with one server, write       ``true``
                                        lookups' token ids into
                                        shared memory (a lookup area)
    ``mpcache.key_index``               with one server on this      ``true``
                                        host, answer lookups from its
                                        key index, without a call
    ``mpcache.ops_socket``              store and retrieve over the  ``true``
                                        server's ops socket (same
                                        host), HTTP where it cannot
    ``mpcache.instance_id``             identity shared by the       vLLM's ``engine_id``
                                        scheduler and its workers
    ``mpcache.api_token``               the server's                 unset
                                        ``MPCACHE_API_TOKEN``, sent
                                        as a bearer token
    =================================== ============================ =========================

    When both spellings are given, the ``mpcache.`` one wins. A ``null`` value means
    "not set".
    """

    model_config = ConfigDict(
        frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True
    )

    server_urls: ServerUrls = Field(
        (DEFAULT_SERVER_URL,),
        validation_alias=AliasChoices("mpcache.server_urls", "lmcache.mp.server_urls"),
    )
    heartbeat_interval_s: Seconds = _seconds(
        10.0, "mpcache.heartbeat_interval", "lmcache.mp.heartbeat_interval"
    )
    request_timeout_s: Seconds = _seconds(2.0, "mpcache.request_timeout")
    lookup_timeout_s: Seconds = _seconds(1.0, "mpcache.lookup_timeout")
    lookup_max_age_s: Seconds = _seconds(10.0, "mpcache.lookup_max_age")
    heartbeat_timeout_s: Seconds = _seconds(2.0, "mpcache.heartbeat_timeout")
    startup_timeout_s: Seconds = _seconds(30.0, "mpcache.startup_timeout")
    instance_id: Annotated[str | None, BeforeValidator(_non_empty)] = Field(
        None, validation_alias=AliasChoices("mpcache.instance_id")
    )
    api_token: Annotated[str | None, BeforeValidator(_non_empty)] = Field(
        None, validation_alias=AliasChoices("mpcache.api_token"), repr=False
    )
    lookup_area: bool = Field(True, validation_alias=AliasChoices("mpcache.lookup_area"))
    """With one server: write lookups' token ids into a lookup area shared with it
    (``connector.lookup_area``) rather than the body, where it can register one."""
    key_index: bool = Field(True, validation_alias=AliasChoices("mpcache.key_index"))
    """With one server on this host: answer lookups on vLLM's thread from the server's
    key index (``connector.key_index``), asking the server only what it cannot say."""
    ops_socket: bool = Field(True, validation_alias=AliasChoices("mpcache.ops_socket"))
    """Send a worker's store and retrieve calls over its server's ops socket
    (``connector.transfer_calls``) where it can reach it, over HTTP where it cannot."""


class _HostPort(BaseModel):
    """LMCache's one-server spelling: ``lmcache.mp.host`` + ``lmcache.mp.port``."""

    model_config = ConfigDict(extra="ignore")

    host: Annotated[str, BeforeValidator(_non_empty), AfterValidator(_normalise_url)] = Field(
        "127.0.0.1", validation_alias="lmcache.mp.host", validate_default=True
    )
    port: Annotated[int, BeforeValidator(_number)] = Field(
        DEFAULT_PORT, ge=1, le=65535, validation_alias="lmcache.mp.port"
    )


_URL_KEYS = ("mpcache.server_urls", "lmcache.mp.server_urls")
_HOST_PORT_KEYS = ("lmcache.mp.host", "lmcache.mp.port")
KNOWN_KEYS = frozenset(
    str(alias)
    for field in ConnectorConfig.model_fields.values()
    if isinstance(field.validation_alias, AliasChoices)
    for alias in field.validation_alias.choices
) | frozenset(_HOST_PORT_KEYS)
"""Every key the connector reads."""


def _check_keys(extra: Mapping[str, Any]) -> None:
    known_mpcache = sorted(k for k in KNOWN_KEYS if k.startswith("mpcache."))
    for key in sorted(extra):
        if key.startswith("mpcache.") and key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, known_mpcache, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(key, f"unknown key; {hint}known mpcache keys: {known_mpcache}")
    ignored = sorted(k for k in extra if k.startswith("lmcache.mp.") and k not in KNOWN_KEYS)
    if ignored:
        logger.warning(
            "kv_connector_extra_config: mpcache does not implement %s; ignored (the "
            "lmcache.mp keys it reads: %s)",
            ", ".join(ignored),
            ", ".join(sorted(k for k in KNOWN_KEYS if k.startswith("lmcache.mp."))),
        )


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Build a ``ConnectorConfig``; raise ``ConfigError`` naming the bad key.

    **Unknown keys** (one rule: never silent inside our two namespaces). vLLM hands
    one dict to every connector, so keys under other prefixes belong to someone else
    and are ignored. An unknown ``mpcache.*`` key is refused at startup, naming the
    closest known key: a typo must not leave a default in force. An ``lmcache.mp.*``
    key mpcache does not implement (e.g. ``lmcache.mp.mq_timeout``) is accepted,
    since a config written for LMCache may be reused as is, and listed once in a
    warning saying it has no effect.
    """
    values = {k: v for k, v in (extra or {}).items() if v is not None}
    _check_keys(values)
    try:
        config = ConnectorConfig.model_validate(values)
        if not any(k in values for k in _URL_KEYS) and any(k in values for k in _HOST_PORT_KEYS):
            one = _HostPort.model_validate(values)
            config = config.model_copy(update={"server_urls": (f"{one.host}:{one.port}",)})
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "kv_connector_extra_config"
        raise ConfigError(key, str(err["msg"]).removeprefix("Value error, ")) from None
    return config
