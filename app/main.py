"""ASGI entry point: ``uvicorn app.main:app`` (settings from ``MPCACHE_*``).

``/docs`` (Swagger UI) and ``/redoc`` load their scripts and styles from the assets
fastapi-offline ships inside its wheel, served under ``/static-offline-docs``: they
work on an air-gapped cluster.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ByteSize
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

from app import __version__
from app.bodies import BodyLimit
from app.deps import ReceiptStamp
from app.heap import (
    TRIM_THRESHOLD_BYTES,
    freeze_startup_objects,
    keep_freed_memory,
    unfreeze_objects,
)
from app.logs import configure_logging, host_configured_logging
from app.problems import install_error_handlers
from app.routes import cache, control, register
from app.routes.declare import body_models
from app.settings import Settings, unknown_variables
from app.stalls import watch_event_loop
from app.state import Runtime, build_runtime
from app.telemetry import MetricsEndpoint, RequestTimer
from contract.endpoints import ENDPOINTS
from contract.shm_naming import fmt_bytes
from dataplane import streaming

__all__ = ["app", "create_app"]

logger = logging.getLogger(__name__)

DESCRIPTION = """\
External KV-cache server for vLLM. The connector negotiates one chunk size at
startup (`POST /negotiate`), workers register their KV caches, and each engine step
moves whole chunks through shared memory. Every error body is problem-style JSON;
a body over `--max-body-size` is refused with 413.

**Trying it here.** On a fresh server, run the examples in this order: `GET /health`,
`POST /negotiate` (selects chunk size 288: alignment 96 over the default minimum 256),
`GET /chunk-size`, `POST /cache/lookup` (0 hit tokens: nothing is cached yet),
`POST /cache/blend/match` (needs `--enable-blend`; 409 otherwise), `POST /cache/end`.
`POST /register` needs a ticket for a vLLM worker's sealed memfd (passed over the
socket `GET /register` names; one-time, so no static example can hold one) or a CUDA
IPC handle; with a live ticket in its `ticket` field, the register example succeeds,
and then so do the store and retrieve examples, sent with the `registration_token`
it returned in the `mpcache-registration-token` header.

**Credentials.** With `MPCACHE_API_TOKEN` set, every mutating route (`POST`,
`DELETE`) needs `Authorization: Bearer <token>` (401 otherwise); reads stay open.
A registration's own `registration_token` guards its store, retrieve, replace and
DELETE (403 otherwise).

Prometheus metrics: `GET /metrics` (text format; not described in this schema).
"""

TAGS = [
    {"name": "control", "description": "Negotiation, health and reads: start here."},
    {
        "name": "cache",
        "description": "Per engine step: lookup, store, retrieve, end. Store and retrieve "
        "need a registered worker (404 otherwise).",
    },
    {
        "name": "registration",
        "description": "Workers share their KV caches: sealed memfds passed over the "
        "registration socket, or CUDA IPC handles of a vLLM worker; the example cannot "
        "succeed from this page.",
    },
]

SWAGGER_UI_PARAMETERS = {
    "validatorUrl": None,  # Swagger UI would otherwise fetch a badge from the internet
    "displayRequestDuration": True,
}


def _startup_summary(runtime: Runtime) -> None:
    s = runtime.settings
    pool = runtime.pool
    logger.info("mpcache %s started: boot_id %s", __version__, runtime.boot_id)
    logger.info(
        "chunk size: minimum %d tokens, at most %d; the first negotiation selects it",
        s.chunk_size,
        s.max_chunk_size,
    )
    logger.info(
        "cache pool: %s in %s pages (/dev/shm/%s), prefault %s; lease %gs, session ttl %gs",
        s.pool_size.human_readable(),
        s.pool_page_size.human_readable(),
        pool.segment.name,
        "on" if s.pool_prefault else "off",
        s.lease_ttl_s,
        s.session_ttl_s,
    )
    cluster = runtime.cluster_health()
    status = runtime.coordinator.status()
    rates = ", ".join(f"{n}: {gbps:.1f} GB/s" for n, gbps in runtime.copy_rates.items())
    logger.info(
        "blend matcher %s; coordinator %s; L2 %s; deployment %r; copy threads %d (%s), "
        "each taking %s of a chunk at least; %s; %s; %s",
        "on" if s.enable_blend else "off",
        f"{status.url} ({cluster.coordinator})" if status.url else "standalone",
        f"{runtime.l2.url} ({cluster.l2})" if runtime.l2 is not None else "off",
        cluster.deployment,
        runtime.copier.threads,
        f"measured {rates}" if rates else "--copy-threads",
        ByteSize(runtime.copier.share_bytes).human_readable()
        if runtime.copier.share_bytes
        else "any part",
        streaming.describe(os.environ),
        runtime.block_kernel,
        runtime.key_chain,
    )
    logger.info(
        "%s; held blocks %s",
        runtime.events.describe(),
        "mirrored to the coordinator's Redis" if runtime.held_mirror else "kept here only",
    )


def _shutdown_summary(runtime: Runtime) -> None:
    logger.info(
        "shutting down after %.0fs: ending %d session(s), releasing %d registration(s), "
        "removing pool /dev/shm/%s",
        runtime.uptime_s,
        runtime.sessions.live_count(),
        runtime.registry.count(),
        runtime.pool.segment.name,
    )


def _settings_from_environment() -> Settings:
    """Settings for plain ``uvicorn app.main:app``, where no CLI has checked them."""
    problems = unknown_variables(os.environ)
    if problems:
        raise RuntimeError("mpcache: " + "; ".join(problems))
    settings = Settings()
    if not host_configured_logging():
        configure_logging(settings.log_level, settings.log_format, uvicorn=False)
    return settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; its runtime (state, segments) is made by the lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = build_runtime(settings if settings is not None else _settings_from_environment())
        app.state.runtime = runtime
        heap = runtime.settings.keep_freed_memory and keep_freed_memory()
        _startup_summary(runtime)
        logger.info(
            "heap: %s",
            f"keeps up to {fmt_bytes(TRIM_THRESHOLD_BYTES)} of freed memory"
            if heap
            else "the C library's defaults (freed memory goes back at once)",
        )
        frozen = freeze_startup_objects()
        logger.info("gc: %d objects alive at startup frozen (later collections skip them)", frozen)
        watchdog = asyncio.create_task(
            watch_event_loop(runtime.telemetry.event_loop_stall_seconds.inc),
            name="mpcache-event-loop-watch",
        )
        try:
            yield
        finally:
            watchdog.cancel()
            _shutdown_summary(runtime)
            runtime.close()
            unfreeze_objects()
            logger.info("mpcache stopped")

    app = FastAPIOffline(
        title="mpcache",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_tags=TAGS,
        swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit)  # innermost: its 413s are timed like any reply
    app.add_middleware(ReceiptStamp)  # store/retrieve deadlines count from its stamp
    app.add_middleware(RequestTimer)
    for router in (control.router, register.router, cache.router):
        app.include_router(router)
    app.router.routes.append(Route("/metrics", MetricsEndpoint(), methods=["GET"]))
    _document_models(app, body_models(ENDPOINTS), settings)
    return app


def _document_models(
    app: FastAPI, models: list[type[BaseModel]], settings: Settings | None
) -> None:
    """Add schemas of bodies a route parses itself (``openapi_extra`` refers to them),
    and the bounds this server's settings put on them (``_server_bounds``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        _, defs = models_json_schema(
            [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
        )
        known = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in defs.get("$defs", {}).items():
            known.setdefault(name, definition)
        _integer_bounds(schema)
        runtime = getattr(app.state, "runtime", None)
        _server_bounds(known, runtime.settings if runtime is not None else settings)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _server_bounds(schemas: dict[str, Any], settings: Settings | None) -> None:
    """Bounds that come from the server's settings: an alignment above
    ``--max-chunk-size`` can never be served, so the schema says so (the settings of
    the running server; the defaults where there is none, as for openapi.json)."""
    most = (
        settings.max_chunk_size
        if settings is not None
        else Settings.model_fields["max_chunk_size"].default
    )
    schemas["NegotiateRequest"]["properties"]["required_alignment"]["maximum"] = most


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _integer_bounds(node: Any) -> None:
    """Write the bounds of integer fields as integers (FastAPI writes some as 1.0)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)


app = create_app()
