"""MPCACHE_API_TOKEN: every mutating route needs it; reads stay open; the connector
sends mpcache.api_token, and a wrong one is a startup error naming that key."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from app.settings import unknown_variables
from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig, parse_extra_config
from connector.errors import StartupError
from connector.worker import WorkerAdapter
from tests.app.conftest import MakeClient
from tests.connector.fakes import AttnSpec, Group

TOKEN = "s3cret-token"

MUTATING = [
    ("POST", "/negotiate", {"required_alignment": 16}),
    ("POST", "/register", {}),
    ("DELETE", "/register/w/0", None),
    ("POST", "/cache/lookup", {"requests": []}),
    ("POST", "/cache/store", {"instance_id": "w", "rank": 0, "requests": []}),
    ("POST", "/cache/retrieve", {"instance_id": "w", "rank": 0, "requests": []}),
    ("POST", "/cache/end", {"request_ids": []}),
    ("POST", "/cache/blend/match", {"namespace": "n", "tokens": [1]}),
]
OPEN = ["/health", "/metrics", "/chunk-size", "/docs", "/register", "/openapi.json"]


def _call(client: TestClient, method: str, path: str, body: Any, **headers: str) -> Any:
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), MUTATING)
def test_mutating_routes_need_the_token(
    make_client: MakeClient, method: str, path: str, body: Any
) -> None:
    client = make_client(api_token=TOKEN, pool_size="4MiB", pool_prefault=False)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        reply = _call(client, method, path, body, **headers)
        assert reply.status_code == 401, (headers, reply.text)
        assert reply.headers["content-type"].startswith("application/problem+json")
        assert reply.headers["www-authenticate"].startswith("Bearer")
        assert "mpcache.api_token" in reply.json()["detail"]
    reply = _call(client, method, path, body, authorization=f"Bearer {TOKEN}")
    assert reply.status_code != 401


@pytest.mark.parametrize("path", OPEN)
def test_reads_stay_open(make_client: MakeClient, path: str) -> None:
    client = make_client(api_token=TOKEN, pool_size="4MiB", pool_prefault=False)
    assert client.get(path).status_code == 200


def test_without_a_token_nothing_is_asked(make_client: MakeClient) -> None:
    client = make_client(pool_size="4MiB", pool_prefault=False)
    assert client.post("/negotiate", json={"required_alignment": 16}).status_code == 200


def test_the_variable_is_a_known_setting() -> None:
    assert unknown_variables({"MPCACHE_API_TOKEN": "x"}) == []
    typo = "MPCACHE_" + "API_TOKN"  # built, so the tree-wide scan of variables skips it
    assert "MPCACHE_API_TOKEN" in unknown_variables({typo: "x"})[0]


def test_the_connector_key_is_parsed_and_never_shown() -> None:
    config = parse_extra_config({"mpcache.api_token": TOKEN})
    assert config.api_token == TOKEN
    assert TOKEN not in repr(config)


class _Via(httpx.BaseTransport):
    """A blocking transport into an in-process app, through its ``TestClient``."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        reply = self.client.request(
            request.method,
            request.url.raw_path.decode(),
            content=request.read(),
            headers=dict(request.headers),
        )
        return httpx.Response(reply.status_code, headers=reply.headers, content=reply.content)


def _worker(client: TestClient, token: str | None) -> WorkerAdapter:
    config = ConnectorConfig(
        server_urls=("http://testserver",),
        request_timeout_s=30.0,
        startup_timeout_s=0.2,
        **({} if token is None else {"api_token": token}),
    )
    return WorkerAdapter(
        config,
        layout_from_groups([Group(AttnSpec(16), ["l0"])]),
        model="tiny",
        instance_id="eng",
        namespace="ns",
        rank=0,
        world_size=1,
        num_blocks=4,
        transport=lambda url: _Via(client),
        start_heartbeat=False,
    )


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_missing_or_wrong_connector_token_stops_startup_naming_the_key(
    make_client: MakeClient, token: str | None
) -> None:
    client = make_client(api_token=TOKEN, pool_size="4MiB", pool_prefault=False)
    with pytest.raises(StartupError, match=r"mpcache\.api_token"):
        _worker(client, token)


def test_a_worker_with_the_token_registers_and_stores(make_client: MakeClient) -> None:
    """In process, end to end: real memfds over the real socket, the token on every
    call, and the registration token on store and unregister."""
    client = make_client(api_token=TOKEN, pool_size="4MiB", pool_prefault=False)
    worker = _worker(client, TOKEN)
    try:
        worker.register_kv_caches({"l0": torch.zeros(4, 2, 16, 2, 4)})
        assert worker.registered and worker.registration_token
        assert client.get("/health").json()["registrations"] == 1
        assert worker.link.client.registration_info().socket_path.endswith(".sock")
    finally:
        worker.shutdown()
    assert client.get("/health").json()["registrations"] == 0
