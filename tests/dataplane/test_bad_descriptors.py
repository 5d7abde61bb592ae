"""Bad tensor descriptors get a 4xx and map nothing."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    ShmKV,
    mla_layer,
    register_body,
    shm_mappings,
    vllm_layer,
)
from tests.support import wait_until

CHUNK = 64
GROUPS = [(0, "attention", 16)]

ClientFactory = Callable[..., CacheClient]
Mutation = Callable[[dict[str, Any], ShmKV, TestClient], None]


def _first(body: dict[str, Any]) -> dict[str, Any]:
    tensor: dict[str, Any] = body["layers"][0]["tensors"][0]
    return tensor


def _set(key: str, value: Any) -> Mutation:
    def mutate(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
        _first(body)[key] = value

    return mutate


def _past_end(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["offset_bytes"] = kv.size_bytes - 64


def _too_long(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["shape"][1] *= 100


def _by_name(name: str) -> Mutation:
    """The old registration by segment name: never opened, whatever the name."""

    def mutate(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
        tensor = _first(body)
        del tensor["ticket"]
        tensor.update(transport="shm", segment=name)

    return mutate


def _pool_by_name(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    pool = client.app.state.runtime.pool.segment.name  # type: ignore[attr-defined]
    _by_name(pool)(body, kv, client)


def _forged_ticket(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["ticket"] = "forged-ticket-0123456789"


_WORKER_NAME = f"mpcache-w-{os.getpid()}-r0_0_abc"

CASES = [
    pytest.param(_by_name(_WORKER_NAME), 422, None, id="by-segment-name"),
    pytest.param(_pool_by_name, 422, None, id="server-pool-by-name"),
    pytest.param(_by_name("mpcache-w-../../x"), 422, None, id="dotdot-slash-name"),
    pytest.param(_forged_ticket, 422, "unknown-ticket", id="forged-ticket"),
    pytest.param(_past_end, 422, "out-of-bounds", id="view-past-end"),
    pytest.param(_too_long, 422, "out-of-bounds", id="shape-past-end"),
    pytest.param(_set("dtype", "float128"), 422, None, id="unknown-dtype"),  # the schema's enum
    pytest.param(_set("offset_bytes", -256), 422, None, id="negative-offset"),
    pytest.param(_set("offset_bytes", 257), 422, "misaligned", id="misaligned-offset"),
    pytest.param(_set("stride", [1, 2]), 422, "bad-geometry", id="stride-rank"),
    pytest.param(_set("block_dim", 7), 422, "bad-geometry", id="block-dim"),
    pytest.param(_set("stride", [0, 0, 0, 0, 0]), 422, "bad-geometry", id="aliasing-stride"),
    pytest.param(_set("stride", [2**63, 256, 16, 8, 1]), 422, None, id="stride-2**63"),
    pytest.param(_set("offset_bytes", 2**62), 422, None, id="offset-2**62"),
]


@pytest.mark.parametrize(("mutate", "status", "reason"), CASES)
def test_bad_descriptor_is_refused_and_maps_nothing(
    make_client: ClientFactory,
    shm_kv: KVFactory,
    mutate: Mutation,
    status: int,
    reason: str | None,
) -> None:
    client = make_client()
    good = shm_kv([vllm_layer("l0", 0, 8), vllm_layer("l1", 0, 8)])
    body = register_body(good, "w", GROUPS, chunk_size=CHUNK)
    bad = copy.deepcopy(body)
    mutate(bad, good, client)
    before = shm_mappings(good.name)

    reply = client.post("/register", json=bad)

    assert reply.status_code == status, reply.text
    problem = reply.json()
    assert reply.headers["content-type"].startswith("application/problem+json")
    assert problem["status"] == status and problem["detail"]
    if reason is not None:
        assert problem["reason"] == reason
        if reason != "unknown-ticket":
            assert "layer 'l0' tensor 0" in problem["detail"]
    assert client.get("/health").json()["registrations"] == 0
    # Nothing stays mapped: tickets a refused registration read are unmapped at once,
    # any it did not read when the worker's connection closes.
    client.close_worker()
    wait_until(lambda: shm_mappings(good.name) == before, what="refused memfd unmapped")
    # The good body still registers, and maps the segment exactly once.
    assert client.post("/register", json=body).status_code == 200
    assert shm_mappings(good.name) == before + 1


def test_a_bad_second_layer_leaves_the_first_unmapped(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv1 = shm_kv([mla_layer("l0", 0, 8)])
    kv2 = shm_kv([mla_layer("l1", 0, 8)])
    body = register_body(kv1, "w", GROUPS, chunk_size=CHUNK)
    second = copy.deepcopy(register_body(kv2, "w", GROUPS, chunk_size=CHUNK)["layers"][0])
    second["tensors"][0]["offset_bytes"] = kv2.size_bytes  # past the end
    body["layers"].append(second)
    before = (shm_mappings(kv1.name), shm_mappings(kv2.name))

    reply = client.post("/register", json=body)

    assert reply.status_code == 422
    assert reply.json()["reason"] == "out-of-bounds"
    assert (shm_mappings(kv1.name), shm_mappings(kv2.name)) == before
