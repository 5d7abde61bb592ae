"""The committed OpenAPI document matches the app and the endpoint table, and the
docs show examples."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.routes.declare import route_kwargs
from contract import endpoints, schemas
from contract.endpoints import ENDPOINTS, Endpoint
from scripts.gen_openapi import TARGET, render

_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def test_openapi_file_is_in_sync() -> None:
    assert TARGET.read_text() == render(), "openapi/openapi.json is stale: run `make openapi`"


def _ref(media: dict[str, Any]) -> str | None:
    ref = media.get("schema", {}).get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.name for e in ENDPOINTS])
def test_every_table_entry_is_served_as_written(endpoint: Endpoint[Any, Any]) -> None:
    spec = json.loads(render())
    op = spec["paths"][endpoint.path][endpoint.method.lower()]
    assert op["summary"] == endpoint.summary
    assert op.get("description") == endpoint.description
    body = op.get("requestBody", {}).get("content", {})
    request = endpoint.request.__name__ if endpoint.request is not None else None
    assert _ref(body.get("application/json", {})) == request
    binary = endpoint.binary_body
    assert set(body) - {"application/json"} == ({binary.media_type} if binary else set())
    if binary is not None:
        assert body[binary.media_type]["schema"]["description"] == binary.description
    success = op["responses"][str(endpoint.status)]
    response = endpoint.response.__name__ if endpoint.response is not None else None
    assert _ref(success.get("content", {}).get("application/json", {})) == response
    problems = {int(s): r for s, r in op["responses"].items() if int(s) != endpoint.status}
    assert {s: r["description"] for s, r in problems.items()} == endpoint.all_problems()
    for reply in problems.values():
        assert _ref(reply["content"]["application/json"]) == "Problem"
    assert ("401" in op["responses"]) == endpoint.guarded


def test_every_json_operation_has_a_table_entry() -> None:
    """A route declared without an entry in contract/endpoints.py fails here."""
    spec = json.loads(render())
    served = {
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        for method in operations
        if method in _METHODS
    }
    table = [(e.method, e.path) for e in ENDPOINTS]
    assert len(set(table)) == len(table), "two table entries for one operation"
    assert served == set(table)
    assert len({e.name for e in ENDPOINTS}) == len(ENDPOINTS)


def test_a_slashed_parameter_is_matched_whole() -> None:
    """``instance_id`` may hold ``/`` (sent as ``%2F``): its route takes the decoded rest."""
    assert route_kwargs(endpoints.UNREGISTER)["path"] == "/register/{instance_id:path}/{rank}"


def _body_models(spec: dict[str, Any]) -> set[str]:
    """Names of every request and reply model the routes use."""
    names: set[str] = set()
    for operations in spec["paths"].values():
        for op in operations.values():
            refs = [op.get("requestBody", {}).get("content", {}).get("application/json", {})]
            refs += [
                r.get("content", {}).get("application/json", {}) for r in op["responses"].values()
            ]
            for media in refs:
                ref = media.get("schema", {}).get("$ref", "")
                if ref:
                    names.add(ref.rsplit("/", 1)[-1])
    return names


def test_every_body_model_shows_valid_examples() -> None:
    spec = json.loads(render())
    names = _body_models(spec)
    assert {"NegotiateRequest", "RegisterRequest", "StoreRequest", "Problem"} <= names
    for name in sorted(names):
        examples = spec["components"]["schemas"][name].get("examples")
        assert examples, f"{name} has no example for /docs"
        model = getattr(schemas, name)
        for example in examples:
            model.model_validate(example)  # an example a reader could send or expect


def test_replies_tolerate_new_fields_requests_do_not() -> None:
    reply = {"status": "ok", "boot_id": "b", "chunk_size": None, "final": False}
    reply |= {"uptime_s": 1.0, "sessions": 0, "registrations": 0, "version": "x"}
    schemas.HealthResponse.model_validate({**reply, "added_later": 1})
    with pytest.raises(ValidationError):
        schemas.NegotiateRequest.model_validate({"required_alignment": 16, "typo": 1})


def test_swagger_ui_is_served(client: TestClient) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/negotiate", "/chunk-size", "/health"} <= set(spec["paths"])
    # /metrics is prometheus_client's own ASGI app, outside the schema.
    assert client.get("/metrics").status_code == 200
    errors = spec["paths"]["/negotiate"]["post"]["responses"]
    assert {"409", "422", "503"} <= set(errors)
