"""Shared fixtures for the data-plane tests (helpers are in ``support``).

- ``shm_kv``: worker-side KV caches in POSIX shm segments (unlinked at teardown,
  even when the test fails), laid out like vLLM's CPU caches.
- ``make_client``: in-process servers (``TestClient`` runs the lifespan, so a real
  pool segment is created, and unlinked at teardown), already negotiated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.dataplane.support import KVFactory, LayerSpec, ShmKV, build_kv


@pytest.fixture
def shm_kv() -> Iterator[KVFactory]:
    made: list[ShmKV] = []

    def make(layers: Sequence[LayerSpec]) -> ShmKV:
        kv = build_kv(layers)
        made.append(kv)
        return kv

    try:
        yield make
    finally:
        for kv in made:
            kv.close()


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    """Start in-process servers (small pool, negotiated to ``alignment``)."""
    stack: list[TestClient] = []

    def make(
        *,
        chunk_size: int = 64,
        alignment: int | None = 16,
        pool_size: int | str = "4MiB",
        pool_page_size: int | str = 4096,
        **settings: Any,
    ) -> TestClient:
        app = create_app(
            Settings(
                chunk_size=chunk_size,
                pool_size=pool_size,
                pool_page_size=pool_page_size,
                pool_prefault=False,
                **settings,
            )
        )
        client = TestClient(app)
        client.__enter__()
        stack.append(client)
        if alignment is not None:
            r = client.post("/negotiate", json={"required_alignment": alignment})
            assert r.status_code == 200, r.text
        return client

    try:
        yield make
    finally:
        while stack:
            stack.pop().__exit__(None, None, None)
