"""The one place where errors become HTTP replies: problem-style JSON bodies.

Replies stay small whatever the request was (docs/design.md s.4.2): a validation
failure reports its first ``MAX_REPORTED_ERRORS`` errors and how many there were,
each error's location and message cut short (``brief_errors``), and no ``detail``
or text extra passes ``MAX_DETAIL_CHARS``: a hostile body of any number of bad items
gets a 422 as small as one bad item's (tests/app/test_hostile_input.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from contract.errors import MPCacheError, Unavailable
from contract.schemas import Problem
from dataplane.repeats import RepeatedWarning

__all__ = [
    "MAX_DETAIL_CHARS",
    "MAX_REPORTED_ERRORS",
    "PROBLEM_MEDIA_TYPE",
    "BriefValidationError",
    "brief_errors",
    "domain_problem",
    "install_error_handlers",
    "problem_body",
    "problem_doc",
    "problem_response",
    "unexpected_problem",
    "validation_problem",
]

logger = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"

CLIENT_CLOSED_REQUEST = 499
"""The status recorded (``mpcache_http_request_duration_seconds``) for a request whose
client closed its connection before the body was read whole; nothing is sent."""

FASTAPI_BODY_ERROR = "There was an error parsing the body"
"""The detail of the 400 FastAPI raises when it cannot decode a body it parses."""

MAX_REPORTED_ERRORS = 5
"""Validation errors a 422 lists; it says how many more there were."""
MAX_DETAIL_CHARS = 2048
"""Longest ``detail``, or text extra, of a problem reply (a longer one is cut)."""
_MAX_LOC_CHARS = 120
_MAX_MSG_CHARS = 200


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The first ``MAX_REPORTED_ERRORS`` of pydantic-style ``errors``, each as
    ``{"loc", "msg", "type"}`` with its location and message cut short (a location
    may hold a client's key of any length, a message a client's value)."""
    brief = []
    for err in errors[:MAX_REPORTED_ERRORS]:
        loc = [_cut(str(p), _MAX_LOC_CHARS) for p in err.get("loc", ())]
        while len(".".join(loc)) > _MAX_LOC_CHARS and len(loc) > 1:
            loc.pop(0)  # the innermost parts say most
        brief.append(
            {
                "loc": loc,
                "msg": _cut(str(err.get("msg", "invalid")), _MAX_MSG_CHARS),
                "type": _cut(str(err.get("type", "")), 64),
            }
        )
    return brief


class BriefValidationError(RequestValidationError):
    """A validation failure carried by its first errors (``brief_errors``) and its
    error count: what the body decoder's helper process sends back."""

    def __init__(self, errors: Sequence[Mapping[str, Any]], count: int | None = None) -> None:
        super().__init__(brief_errors(errors))
        self.count = len(errors) if count is None else count


def problem_doc(description: str) -> dict[str, Any]:
    """OpenAPI entry for an error reply (a route's ``responses={status: ...}``)."""
    return {"model": Problem, "content": {PROBLEM_MEDIA_TYPE: {}}, "description": description}


def problem_body(status: int, title: str, slug: str, detail: str, **extras: Any) -> dict[str, Any]:
    """The problem-style body every error reply carries, over HTTP or the ops socket."""
    return {
        "type": f"urn:mpcache:problem:{slug}",
        "title": title,
        "status": status,
        "detail": _cut(detail, MAX_DETAIL_CHARS),
        **{k: _cut(v, MAX_DETAIL_CHARS) if isinstance(v, str) else v for k, v in extras.items()},
    }


def problem_response(
    status: int,
    title: str,
    slug: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extras: Any,
) -> JSONResponse:
    body = problem_body(status, title, slug, detail, **extras)
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def domain_problem(exc: MPCacheError) -> dict[str, Any]:
    """The body of ``exc``'s reply; an internal error is logged with its traceback."""
    if exc.status >= 500 and not isinstance(exc, Unavailable):
        logger.error("internal error: %s", exc.detail, exc_info=exc)
    return problem_body(exc.status, exc.title, exc.slug, exc.detail, **exc.extras)


def validation_problem(errors: Sequence[Mapping[str, Any]], count: int) -> dict[str, Any]:
    """The 422 body of a validation failure with ``count`` errors, of which it reports
    the first few of ``errors`` (locations without FastAPI's leading ``body``)."""
    brief = brief_errors(
        [
            {**err, "loc": [p for p in err.get("loc", ()) if p != "body"]}
            for err in errors[:MAX_REPORTED_ERRORS]
        ]
    )
    parts = [f"{'.'.join(err['loc']) or 'body'}: {err['msg']}" for err in brief]
    if count > len(brief):
        parts.append(f"and {count - len(brief)} more error(s)")
    detail = "; ".join(parts) or "the request body is not valid"
    return problem_body(
        422, "Malformed request", "malformed-request", detail, errors=brief, error_count=count
    )


def unexpected_problem(exc: BaseException) -> dict[str, Any]:
    """The 500 body of an error no handler expected; logged with its traceback."""
    logger.exception("unhandled error", exc_info=exc)
    return problem_body(
        500, "Internal server error", "internal", "unexpected server error; see server log"
    )


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


def _json(body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        body, status_code=body["status"], headers=headers, media_type=PROBLEM_MEDIA_TYPE
    )


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to one problem-style body."""
    repeats = RepeatedWarning(logger)

    async def on_domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MPCacheError)
        return _json(domain_problem(exc), exc.headers())

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        found = exc.errors()
        count = exc.count if isinstance(exc, BriefValidationError) else len(found)
        return _json(validation_problem(found, count))

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
        # flight, or whose body took past --body-timeout-s: the request is dropped, as
        # it stood. One line, no traceback, once a minute with a count.
        route = getattr(request.scope.get("route"), "path", None) or "a path no route serves"
        repeats.warn(
            "client-disconnect",
            "client closed the connection before its %s %s was read whole (or the body "
            "took past --body-timeout-s); dropped",
            _cut(request.method, 16),
            route,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _json(unexpected_problem(exc))

    app.add_exception_handler(MPCacheError, on_domain)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
