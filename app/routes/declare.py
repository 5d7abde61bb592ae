"""A route's declaration from its endpoint-table entry (``contract.endpoints``).

The method, path, models, status, summary, description and problem replies of every
route are written once, in the table; this turns an entry into what FastAPI's
``APIRouter.api_route`` takes, so the OpenAPI document says what the table says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fastapi import APIRouter, Response
from pydantic import BaseModel

from app.bodies import json_body_doc
from app.deps import GUARDED
from app.problems import problem_doc
from contract.endpoints import BinaryBody, Endpoint

__all__ = ["body_models", "declare", "route_kwargs"]

F = TypeVar("F", bound=Callable[..., Any])


def declare(router: APIRouter, endpoint: Endpoint[Any, Any]) -> Callable[[F], F]:
    """Decorator: serve the handler below as ``endpoint``, on ``router``."""
    return router.api_route(**route_kwargs(endpoint))


def route_kwargs(endpoint: Endpoint[Any, Any]) -> dict[str, Any]:
    """``APIRouter.api_route`` keyword arguments for ``endpoint``."""
    kwargs: dict[str, Any] = {
        "path": _route_path(endpoint),
        "methods": [endpoint.method],
        "name": endpoint.name,  # its operationId is built from it
        "response_model": endpoint.response,
        "status_code": endpoint.status,
        "summary": endpoint.summary,
        "description": endpoint.description,
        "responses": {
            status: problem_doc(meaning) for status, meaning in endpoint.all_problems().items()
        },
    }
    if endpoint.guarded:
        kwargs["dependencies"] = GUARDED
    if endpoint.response is None:
        kwargs["response_class"] = Response
    if endpoint.request is not None:
        # Most handlers read their body themselves (``app.bodies.read_json``), so
        # FastAPI cannot see it: the entry documents it.
        kwargs["openapi_extra"] = _body_doc(endpoint.request, endpoint.binary_body)
    return kwargs


def body_models(endpoints: Iterable[Endpoint[Any, Any]]) -> list[type[BaseModel]]:
    """The request models (and binary bodies' headers) the entries' bodies refer to."""
    models: list[type[BaseModel]] = []
    for endpoint in endpoints:
        if endpoint.request is not None:
            models.append(endpoint.request)
        if endpoint.binary_body is not None and endpoint.binary_body.header is not None:
            models.append(endpoint.binary_body.header)
    return models


def _route_path(endpoint: Endpoint[Any, Any]) -> str:
    """The path template with Starlette's ``:path`` converter on each slashed parameter."""
    path = endpoint.path
    for name in endpoint.slashed:
        path = path.replace(f"{{{name}}}", f"{{{name}:path}}")
    return path


def _body_doc(model: type[BaseModel], binary: BinaryBody | None) -> dict[str, Any]:
    """``openapi_extra`` documenting the JSON body, and the binary form if there is one."""
    doc = json_body_doc(model)
    if binary is not None:
        schema = {"type": "string", "format": "binary", "description": binary.description}
        doc["requestBody"]["content"][binary.media_type] = {"schema": schema}
    return doc
