"""The one place where errors become HTTP replies: problem-style JSON bodies."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from contract.errors import MPCacheError, Unavailable
from contract.schemas import Problem

__all__ = ["PROBLEM_MEDIA_TYPE", "install_error_handlers", "problem_doc", "problem_response"]

logger = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"

CLIENT_CLOSED_REQUEST = 499
"""The status recorded (``mpcache_http_request_duration_seconds``) for a request whose
client closed its connection before the body was read whole; nothing is sent."""

FASTAPI_BODY_ERROR = "There was an error parsing the body"
"""The detail of the 400 FastAPI raises when it cannot decode a body it parses."""


def problem_doc(description: str) -> dict[str, Any]:
    """OpenAPI entry for an error reply (a route's ``responses={status: ...}``)."""
    return {"model": Problem, "content": {PROBLEM_MEDIA_TYPE: {}}, "description": description}


def problem_response(
    status: int,
    title: str,
    slug: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extras: Any,
) -> JSONResponse:
    body = {
        "type": f"urn:mpcache:problem:{slug}",
        "title": title,
        "status": status,
        "detail": detail,
        **extras,
    }
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def _describe_validation(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors: list[dict[str, Any]] = []
    parts: list[str] = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        msg = str(err.get("msg", "invalid"))
        parts.append(f"{where}: {msg}")
        errors.append({"loc": loc, "msg": msg, "type": str(err.get("type", ""))})
    return "; ".join(parts) or "the request body is not valid", errors


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path.

    Starlette's 405 names only the methods of the first route that matched the path,
    and ``/register`` has two (GET and POST)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to one problem-style body."""

    async def on_domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MPCacheError)
        if exc.status >= 500 and not isinstance(exc, Unavailable):
            logger.error("internal error: %s", exc.detail, exc_info=exc)
        return problem_response(
            exc.status, exc.title, exc.slug, exc.detail, exc.headers(), **exc.extras
        )

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        detail, errors = _describe_validation(exc)
        return problem_response(
            422, "Malformed request", "malformed-request", detail, errors=errors
        )

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
            # FastAPI's own body parsing (routes that take a model argument) fails so
            # on bytes that are not UTF-8: malformed input, like every other one.
            return problem_response(
                422,
                "Malformed request",
                "malformed-request",
                "body: the body is not JSON text (it must be UTF-8)",
                errors=[{"loc": [], "msg": "not UTF-8 JSON", "type": "json_invalid"}],
            )
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return problem_response(
            exc.status_code,
            "Not found" if exc.status_code == 404 else "HTTP error",
            "not-found" if exc.status_code == 404 else "http",
            str(exc.detail),
            headers,
        )

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        # A client that gives up (a connector's lookup timeout) while its body is in
        # flight: the request is dropped, as it stood. One line, no traceback.
        logger.warning(
            "client closed the connection before its %s %s was read whole; dropped",
            request.method,
            request.url.path,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return problem_response(
            500, "Internal server error", "internal", "unexpected server error; see server log"
        )

    app.add_exception_handler(MPCacheError, on_domain)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
