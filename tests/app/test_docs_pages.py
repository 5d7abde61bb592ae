"""/docs and /redoc work offline, and the Swagger examples succeed in the order given."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from typing import Any

import pytest
from fastapi.testclient import TestClient

from scripts.gen_openapi import render


class _Links(HTMLParser):
    """Every src/href attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value for name, value in attrs if name in ("src", "href") and value]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_need_no_network(client: TestClient, page: str) -> None:
    reply = client.get(page)
    assert reply.status_code == 200
    html = reply.text
    # No URL outside this server, anywhere in the page (links, inline scripts).
    assert not re.findall(r"https?://", html), re.findall(r"https?://\S+", html)
    parser = _Links()
    parser.feed(html)
    assert any(link.endswith(".js") for link in parser.links), parser.links
    for link in parser.links:
        assert link.startswith("/"), link
        asset = client.get(link)
        assert asset.status_code == 200, link
        assert asset.content, link
    # The schema the page loads is served too.
    assert client.get("/openapi.json").status_code == 200


def test_swagger_ui_fetches_no_validator_badge(client: TestClient) -> None:
    assert '"validatorUrl": null' in client.get("/docs").text


def _example(spec: dict[str, Any], path: str) -> dict[str, Any]:
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    name = body["schema"]["$ref"].rsplit("/", 1)[-1]
    example: dict[str, Any] = spec["components"]["schemas"][name]["examples"][0]
    return example


def test_examples_succeed_in_the_documented_order(client: TestClient) -> None:
    """What a reader of /docs can run on a fresh server, in the order the page gives."""
    spec = json.loads(render())
    assert client.get("/health").status_code == 200
    negotiated = client.post("/negotiate", json=_example(spec, "/negotiate"))
    assert negotiated.status_code == 200, negotiated.text
    assert negotiated.json()["chunk_size"] == 288  # as the description says
    assert client.get("/chunk-size").json()["final"] is True
    lookup = client.post("/cache/lookup", json=_example(spec, "/cache/lookup"))
    assert lookup.status_code == 200, lookup.text
    assert lookup.json()["results"][0]["hit_tokens"] == 0
    assert client.post("/cache/end", json=_example(spec, "/cache/end")).status_code == 200
    # Store and retrieve need a registered worker: a clear 404, never a 500.
    for path in ("/cache/store", "/cache/retrieve"):
        reply = client.post(path, json=_example(spec, path))
        assert reply.status_code == 404, reply.text
        assert "register" in reply.json()["detail"]
