"""The OpenAPI document says what the server enforces, and its examples work in order
(issue 8, item 5).

- Tried in the order the API description gives, on a fresh server, every request
  example of a route that needs no registration succeeds.
- The routes that need a live registration succeed too, in
  order, once a real sealed memfd's ticket fills the register example's ``ticket``.
- ``tokens``/``tokens_b64``: the schema says exactly one (``oneOf``), as the server does.
- Integer fields have integer bounds; every status a route can answer is documented.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from contract.schemas import REGISTRATION_TOKEN_HEADER
from scripts.gen_openapi import render
from tests.dataplane.support import WorkerSocket, sealed_memfd, with_tickets

ORDERED = [
    ("get", "/health"),
    ("post", "/negotiate"),
    ("get", "/chunk-size"),
    ("post", "/cache/lookup"),
    ("post", "/cache/blend/match"),
    ("post", "/cache/end"),
]
"""The order of the API description (``app.main.DESCRIPTION``); blend needs
``--enable-blend``."""


@pytest.fixture
def spec() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(render())
    return loaded


@pytest.fixture
def fresh() -> Iterator[TestClient]:
    app = create_app(Settings(pool_prefault=False, enable_blend=True))
    with TestClient(app) as client:
        yield client


def _example(spec: dict[str, Any], method: str, path: str) -> dict[str, Any] | None:
    body = spec["paths"][path][method].get("requestBody")
    if body is None:
        return None
    ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    example: dict[str, Any] = spec["components"]["schemas"][ref]["examples"][0]
    return example


def test_request_examples_succeed_in_order_on_a_fresh_server(
    spec: dict[str, Any], fresh: TestClient
) -> None:
    for method, path in ORDERED:
        example = _example(spec, method, path)
        reply = fresh.request(method.upper(), path, json=example)
        assert 200 <= reply.status_code < 300, (method, path, reply.text)
        documented = spec["paths"][path][method]["responses"]
        assert str(reply.status_code) in documented, (method, path, reply.status_code)


def test_examples_that_need_a_registration_succeed_with_a_live_worker_memfd(
    spec: dict[str, Any], fresh: TestClient
) -> None:
    """register, store, retrieve: each example as published, in order, on a fresh server.

    The one thing no static example can carry is the ticket (a worker's sealed memfd,
    passed over the registration socket, is one-time), so only that field is filled in.
    """
    assert fresh.post("/negotiate", json=_example(spec, "post", "/negotiate")).status_code == 200
    register = _example(spec, "post", "/register")
    assert register is not None
    tensor = register["layers"][0]["tensors"][0]
    nbytes = 2 * math.prod(tensor["shape"])  # bfloat16
    fd = sealed_memfd(nbytes, "mpcache-example-kv")
    worker = WorkerSocket(fresh.get("/register").json()["socket_path"])
    try:
        tensor["ticket"] = f"fd:{fd}"
        reply = fresh.post("/register", json=with_tickets(register, worker))
        assert reply.status_code == 200, reply.text
        token = {REGISTRATION_TOKEN_HEADER: reply.json()["registration_token"]}

        store = fresh.post(
            "/cache/store", json=_example(spec, "post", "/cache/store"), headers=token
        )
        assert store.status_code == 200, store.text
        assert store.json()["results"][0]["stored_chunks"] == 1

        retrieve = _example(spec, "post", "/cache/retrieve")
        assert retrieve is not None
        got = fresh.post("/cache/retrieve", json=retrieve, headers=token)
        assert got.status_code == 200, got.text
        result = got.json()["results"][0]
        assert result["loaded_tokens"] == retrieve["requests"][0]["end_token"]
        assert result["failed_block_ids"] == []

        gone = fresh.delete(
            f"/register/{register['instance_id']}/{register['rank']}", headers=token
        )
        assert gone.status_code == 204, gone.text
    finally:
        worker.close()
        os.close(fd)


def _components(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = spec["components"]["schemas"][name]
    return found


@pytest.mark.parametrize(
    "model", ["LookupItem", "TransferItem", "BlendMatchRequest"], ids=lambda m: str(m)
)
def test_the_schema_says_exactly_one_token_form(spec: dict[str, Any], model: str) -> None:
    one_of = _components(spec, model)["oneOf"]
    assert sorted(tuple(branch["required"]) for branch in one_of) == [
        ("tokens",),
        ("tokens_b64",),
    ]


def _integers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            yield node
        for value in node.values():
            yield from _integers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _integers(value)


def test_integer_bounds_are_integers(spec: dict[str, Any]) -> None:
    bounds = [
        (key, node[key])
        for node in _integers(spec)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        if key in node
    ]
    assert bounds
    assert all(type(value) is int for _, value in bounds), bounds


@pytest.mark.parametrize(
    ("method", "path", "statuses"),
    [
        ("post", "/negotiate", {"200", "409", "413", "415", "422", "503"}),
        ("post", "/cache/lookup", {"200", "409", "413", "415", "422", "503"}),
        ("post", "/cache/store", {"200", "404", "409", "413", "415", "422", "503"}),
        ("post", "/cache/retrieve", {"200", "404", "409", "413", "415", "422", "503"}),
        ("post", "/cache/end", {"200", "413", "415", "422"}),
        ("post", "/register", {"200", "409", "413", "422"}),
    ],
)
def test_every_status_a_route_answers_is_documented(
    spec: dict[str, Any], method: str, path: str, statuses: set[str]
) -> None:
    assert statuses <= set(spec["paths"][path][method]["responses"])


@pytest.mark.parametrize("method", ["OPTIONS", "PUT"])
def test_a_405_names_every_method_the_path_serves(
    spec: dict[str, Any], fresh: TestClient, method: str
) -> None:
    reply = fresh.request(method, "/register")
    assert reply.status_code == 405
    assert reply.headers["content-type"].startswith("application/problem+json")
    documented = {m.upper() for m in spec["paths"]["/register"]}
    assert set(reply.headers["allow"].split(", ")) == documented == {"GET", "POST"}
