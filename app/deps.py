"""FastAPI dependencies: the runtime, and when a request was received.

``ReceiptStamp`` (pure ASGI middleware, installed by ``create_app``) stamps each
HTTP request with ``time.monotonic()`` as soon as the app is called, before its
body is read and parsed; ``ReceivedAtDep`` reads that stamp (or, without the
middleware, stamps now: an async dependency runs on the event loop before a sync
handler waits for a worker thread). Deadlines of store and retrieve (their
``timeout_s``) count from it.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.state import Runtime

__all__ = ["ReceiptStamp", "ReceivedAtDep", "RuntimeDep", "get_runtime", "received_at"]

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
