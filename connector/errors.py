"""The connector's exception tree.

Foreign errors (httpx, posix_ipc, torch) are translated into these at exactly one
boundary each (``connector.client`` for HTTP, ``connector.shm`` for segments) and
re-raised ``from`` the original. vLLM never sees them from a step-loop call: the
adapters catch ``ConnectorError`` there and degrade instead.

    ConnectorError
    ├── ConfigError               bad kv_connector_extra_config value (startup)
    ├── LayoutError               KV cache groups that cannot be cached, bad chunk size
    ├── StartupError              negotiation failed or servers disagree (startup)
    ├── RecoveryError             a restarted server cannot be re-joined (stays degraded)
    ├── SegmentError              a KV-cache memfd could not be made, sealed or passed
    └── ServerError               any failed call to an mpcache server
        ├── ServerUnreachable     connect/read/write failure
        │   └── ServerTimeout     the call ran past its timeout
        ├── ServerRejected        4xx with a problem body (our request was wrong)
        ├── ServerFailure         5xx (503 carries retry_after_s)
        └── ProtocolError         a 2xx whose body does not match contract.schemas
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "ConnectorError",
    "LayoutError",
    "ProtocolError",
    "RecoveryError",
    "SegmentError",
    "ServerError",
    "ServerFailure",
    "ServerRejected",
    "ServerTimeout",
    "ServerUnreachable",
    "StartupError",
]


class ConnectorError(Exception):
    """Base of every error the connector raises."""


class ConfigError(ConnectorError, ValueError):
    """A kv_connector_extra_config value is missing or invalid; names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"kv_connector_extra_config[{key!r}]: {message}")
        self.key = key


class LayoutError(ConnectorError, ValueError):
    """The KV cache layout cannot be cached with the given chunk size."""


class StartupError(ConnectorError):
    """The connector could not agree a chunk size with its server(s)."""


class RecoveryError(ConnectorError):
    """Re-joining a restarted server failed; it stays unhealthy for this adapter."""


class SegmentError(ConnectorError):
    """A POSIX shared-memory segment could not be created, mapped or unlinked."""


class ServerError(ConnectorError):
    """A call to an mpcache server failed."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class ServerUnreachable(ServerError):
    """The server could not be reached (refused, reset, DNS, ...)."""


class ServerTimeout(ServerUnreachable):
    """The call did not finish within its timeout."""


class _ProblemError(ServerError):
    """An HTTP error reply: ``status`` and the problem body; ``retry_after_s`` from
    the Retry-After header, when the server sent one."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        status: int,
        problem: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.problem: dict[str, Any] = problem or {}
        self.retry_after_s = retry_after_s

    @property
    def detail(self) -> str:
        return str(self.problem.get("detail", ""))

    @property
    def problem_type(self) -> str:
        return str(self.problem.get("type", ""))


class ServerRejected(_ProblemError):
    """The server refused the request (4xx); ``problem`` holds its body."""


class ServerFailure(_ProblemError):
    """The server failed (5xx); ``retry_after_s`` is set from Retry-After (503)."""


class ProtocolError(ServerError):
    """A successful reply whose body does not match the wire schema."""
