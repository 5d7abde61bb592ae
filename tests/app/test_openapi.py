"""The committed OpenAPI document matches the app, and the docs show examples."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from contract import schemas
from scripts.gen_openapi import TARGET, render


def test_openapi_file_is_in_sync() -> None:
    assert TARGET.read_text() == render(), "openapi/openapi.json is stale: run `make openapi`"


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
