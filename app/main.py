"""ASGI entry point: ``uvicorn app.main:app`` (settings from ``MPCACHE_*``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app import __version__
from app.deps import ReceiptStamp
from app.problems import install_error_handlers, problem_doc
from app.routes import cache, control, register
from app.settings import Settings
from app.state import build_runtime

__all__ = ["app", "create_app"]

logger = logging.getLogger(__name__)

DESCRIPTION = """\
External KV-cache server for vLLM. The connector negotiates one chunk size at
startup (`POST /negotiate`), workers register their KV caches, and each engine step
moves whole chunks through shared memory. Every error body is problem-style JSON.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; its runtime (state, segments) is made by the lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = build_runtime(settings if settings is not None else Settings())
        app.state.runtime = runtime
        logger.info(
            "mpcache %s up: boot_id=%s min_chunk_size=%d",
            __version__,
            runtime.boot_id,
            runtime.settings.chunk_size,
        )
        try:
            yield
        finally:
            runtime.close()

    app = FastAPI(
        title="mpcache",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(ReceiptStamp)  # store/retrieve deadlines count from its stamp
    # Every route answers malformed input with a problem body, not FastAPI's default.
    malformed: dict[int | str, dict[str, Any]] = {422: problem_doc("Malformed request")}
    for router in (control.router, register.router, cache.router):
        app.include_router(router, responses=malformed)
    return app


app = create_app()
