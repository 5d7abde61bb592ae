"""The committed OpenAPI document matches the app, and the docs show examples."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from scripts.gen_openapi import TARGET, render


def test_openapi_file_is_in_sync() -> None:
    assert TARGET.read_text() == render(), "openapi/openapi.json is stale: run `make openapi`"


def test_control_models_carry_examples() -> None:
    schemas = json.loads(render())["components"]["schemas"]
    for name in (
        "NegotiateRequest",
        "NegotiateResponse",
        "ChunkSizeResponse",
        "HealthResponse",
        "Problem",
    ):
        assert schemas[name].get("examples"), f"{name} has no example for /docs"


def test_swagger_ui_is_served(client: TestClient) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/negotiate", "/chunk-size", "/health", "/metrics"} <= set(spec["paths"])
    errors = spec["paths"]["/negotiate"]["post"]["responses"]
    assert {"409", "422", "503"} <= set(errors)
