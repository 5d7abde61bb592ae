"""Bad tensor descriptors get a 4xx and map nothing."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.dataplane.support import (
    KVFactory,
    ShmKV,
    mla_layer,
    register_body,
    shm_mappings,
    vllm_layer,
)

CHUNK = 64
GROUPS = [(0, "attention", 16)]

ClientFactory = Callable[..., TestClient]
Mutation = Callable[[dict[str, Any], ShmKV, TestClient], None]


def _first(body: dict[str, Any]) -> dict[str, Any]:
    tensor: dict[str, Any] = body["layers"][0]["tensors"][0]
    return tensor


def _set(key: str, value: Any) -> Mutation:
    def mutate(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
        _first(body)[key] = value

    return mutate


def _past_end(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["offset_bytes"] = kv.segment.size_bytes - 64


def _too_long(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["shape"][1] *= 100


def _pool_name(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["segment"] = client.app.state.runtime.pool.segment.name  # type: ignore[attr-defined]


def _unknown_segment(body: dict[str, Any], kv: ShmKV, client: TestClient) -> None:
    _first(body)["segment"] = f"mpcache-w-{os.getpid()}-nosuchsegment"


CASES = [
    pytest.param(_unknown_segment, 422, "unknown-segment", id="unknown-segment"),
    pytest.param(_set("segment", "other-segment"), 422, "bad-segment-name", id="outside-prefix"),
    pytest.param(_pool_name, 422, "bad-segment-name", id="server-pool-name"),
    pytest.param(_set("segment", "mpcache-w-../../x"), 422, "bad-segment-name", id="dotdot-slash"),
    pytest.param(_set("segment", "mpcache-w-..x"), 422, "bad-segment-name", id="dotdot"),
    pytest.param(_set("segment", "/mpcache-w-1-x"), 422, "bad-segment-name", id="leading-slash"),
    pytest.param(_past_end, 422, "out-of-bounds", id="view-past-end"),
    pytest.param(_too_long, 422, "out-of-bounds", id="shape-past-end"),
    pytest.param(_set("dtype", "float128"), 422, "unknown-dtype", id="unknown-dtype"),
    pytest.param(_set("offset_bytes", -256), 422, None, id="negative-offset"),
    pytest.param(_set("offset_bytes", 257), 422, "misaligned", id="misaligned-offset"),
    pytest.param(_set("stride", [1, 2]), 422, "bad-geometry", id="stride-rank"),
    pytest.param(_set("block_dim", 7), 422, "bad-geometry", id="block-dim"),
    pytest.param(_set("stride", [0, 0, 0, 0, 0]), 422, "bad-geometry", id="aliasing-stride"),
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
        assert "layer 'l0' tensor 0" in problem["detail"]
    assert shm_mappings(good.name) == before
    assert client.get("/health").json()["registrations"] == 0
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
    second["tensors"][0]["offset_bytes"] = kv2.segment.size_bytes  # past the end
    body["layers"].append(second)
    before = (shm_mappings(kv1.name), shm_mappings(kv2.name))

    reply = client.post("/register", json=body)

    assert reply.status_code == 422
    assert reply.json()["reason"] == "out-of-bounds"
    assert (shm_mappings(kv1.name), shm_mappings(kv2.name)) == before
