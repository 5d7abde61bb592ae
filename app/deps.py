"""FastAPI dependencies: the runtime, when a request was received, and credentials.

``require_api_token`` guards every mutating route when ``MPCACHE_API_TOKEN`` is set:
``Authorization: Bearer <token>``, compared in constant time, else 401 with a
problem body. ``RegistrationTokenDep`` reads the registration's own secret
(``contract.schemas.REGISTRATION_TOKEN_HEADER``), which the registry checks.

``ReceiptStamp`` (pure ASGI middleware, installed by ``create_app``) stamps each
HTTP request with ``time.monotonic()`` as soon as the app is called, before its
body is read and parsed; ``ReceivedAtDep`` reads that stamp (or, without the
middleware, stamps now: an async dependency runs on the event loop before a sync
handler waits for a worker thread). Deadlines of store and retrieve (their
``timeout_s``) count from it.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.state import Runtime
from contract.errors import Unauthorized
from contract.schemas import REGISTRATION_TOKEN_HEADER

__all__ = [
    "GUARDED",
    "ReceiptStamp",
    "ReceivedAtDep",
    "RegistrationTokenDep",
    "RuntimeDep",
    "get_runtime",
    "received_at",
    "require_api_token",
]

_RECEIVED_AT = "mpcache_received_at"


class ReceiptStamp:
    """Record when each HTTP request reached the app (``time.monotonic()``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[_RECEIVED_AT] = time.monotonic()
        await self.app(scope, receive, send)


async def get_runtime(request: Request) -> Runtime:
    # async: a sync dependency would cost every route a hop to the thread pool.
    runtime: Runtime = request.app.state.runtime
    return runtime


async def received_at(request: Request) -> float:
    """When the request was received, on the ``time.monotonic()`` clock."""
    stamp = request.scope.get("state", {}).get(_RECEIVED_AT)
    return float(stamp) if stamp is not None else time.monotonic()


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
ReceivedAtDep = Annotated[float, Depends(received_at)]


async def require_api_token(request: Request) -> None:
    """401 unless the request carries the server's API token (when one is set)."""
    runtime: Runtime = request.app.state.runtime
    expected = runtime.settings.api_token
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), expected.get_secret_value().encode()
    ):
        raise Unauthorized(
            "this server requires its API token (MPCACHE_API_TOKEN) as "
            "'Authorization: Bearer <token>' on every mutating route; the connector sends "
            "mpcache.api_token from kv_connector_extra_config"
        )


RegistrationTokenDep = Annotated[
    str | None,
    Header(
        alias=REGISTRATION_TOKEN_HEADER,
        description="The `registration_token` POST /register returned for this "
        "`(instance_id, rank)`.",
    ),
]


GUARDED = [Depends(require_api_token)]
"""``dependencies=`` of every route whose table entry is ``guarded``."""
