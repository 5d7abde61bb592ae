"""Shared fixtures for the data-plane tests (helpers are in ``support``).

- ``shm_kv``: worker-side KV caches in sealed memfds (closed at teardown, even when
  the test fails), laid out like vLLM's CPU caches.
- ``make_client``: in-process servers (``CacheClient``: a ``TestClient`` that passes
  memfds over the registration socket and keeps registration tokens, as a worker
  does; it runs the lifespan, so a real pool segment is created, and unlinked at
  teardown), already negotiated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from app.main import create_app
from app.settings import Settings
from tests.dataplane.support import CacheClient, KVFactory, LayerSpec, ShmKV, build_kv


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
def make_client() -> Iterator[Callable[..., CacheClient]]:
    """Start in-process servers (small pool, negotiated to ``alignment``)."""
    stack: list[CacheClient] = []

    def make(
        *,
        chunk_size: int = 64,
        alignment: int | None = 16,
        pool_size: int | str = "4MiB",
        pool_page_size: int | str = 4096,
        **settings: Any,
    ) -> CacheClient:
        app = create_app(
            Settings(
                chunk_size=chunk_size,
                pool_size=pool_size,
                pool_page_size=pool_page_size,
                pool_prefault=False,
                **settings,
            )
        )
        client = CacheClient(app)
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
            client = stack.pop()
            client.close_worker()
            client.__exit__(None, None, None)
