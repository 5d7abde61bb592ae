"""Registration rules, unregistering, and refusals of cache operations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    kernel_populates,
    lookup,
    metric,
    post_ok,
    random_tokens,
    register_body,
    shm_mappings,
    shm_residency,
    store,
    token_field,
    transfer_item,
    vllm_layer,
)
from tests.support import wait_until

CHUNK = 64
GROUPS = [(0, "attention", 16)]

ClientFactory = Callable[..., CacheClient]


def test_register_before_negotiation_is_refused(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client(alignment=None)
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    reply = client.post("/register", json=register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    assert reply.status_code == 409
    assert reply.json()["type"] == "urn:mpcache:problem:not-negotiated"
    assert shm_mappings(kv.name) == 1


def test_register_with_another_chunk_size_is_refused(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    reply = client.post("/register", json=register_body(kv, "w", GROUPS, chunk_size=128))
    assert reply.status_code == 409
    problem = reply.json()
    assert problem["type"] == "urn:mpcache:problem:chunk-size-mismatch"
    assert "128" in problem["detail"] and "64" in problem["detail"]
    assert problem["chunk_size"] == 64


def test_register_is_idempotent_and_unregister_releases_mappings(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8), vllm_layer("l1", 0, 8)])
    body = register_body(kv, "w", GROUPS, chunk_size=CHUNK)
    first = post_ok(client, "/register", body)
    assert first["refreshed"] is False
    assert first["num_layers"] == 2
    assert first["chunk_bytes"] == 2 * 4 * 1024
    assert post_ok(client, "/register", body)["refreshed"] is True
    assert client.get("/health").json()["registrations"] == 1
    assert shm_mappings(kv.name) == 2  # ours, and the server's one live registration
    assert metric(client, "mpcache_registrations") == 1

    assert client.delete("/register/w/0").status_code == 204
    assert shm_mappings(kv.name) == 1
    assert client.get("/health").json()["registrations"] == 0
    missing = client.delete("/register/w/0")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")
    tokens = random_tokens(CHUNK, seed=1)
    reply = client.post(
        "/cache/store",
        json={"instance_id": "w", "rank": 0, "requests": [transfer_item("r", tokens, [[1] * 4])]},
    )
    assert reply.status_code == 404


@pytest.mark.skipif(not kernel_populates(), reason="no MADV_POPULATE_WRITE (Linux < 5.14)")
def test_the_server_populates_a_registered_memfd_so_first_copies_do_not_fault(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 64)])  # the worker's own mapping: written, resident
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))

    def both_resident() -> bool:
        maps = shm_residency(kv.name)
        return len(maps) == 2 and all(size == rss for size, rss in maps)

    wait_until(both_resident, what="the server's mapping fully populated")


def _edit(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *keys, last = path.split(".")
    target: Any = body
    for key in keys:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = value
    return body


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        pytest.param("rank", 2, "world_size", id="rank-outside-world"),
        pytest.param("groups.0.token_span", 48, "does not divide", id="span-not-dividing"),
        pytest.param("layers.0.group_id", 5, "group 5", id="unknown-group"),
        pytest.param("layers.1.name", "l0", "unique", id="duplicate-layer"),
    ],
)
def test_inconsistent_registration_is_refused(
    make_client: ClientFactory, shm_kv: KVFactory, path: str, value: Any, needle: str
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8), vllm_layer("l1", 0, 8)])
    body = _edit(register_body(kv, "w", GROUPS, chunk_size=CHUNK), path, value)
    reply = client.post("/register", json=body)
    assert reply.status_code == 422, reply.text
    assert needle in reply.json()["detail"]
    assert shm_mappings(kv.name) == 1


def test_group_without_layers_is_refused(make_client: ClientFactory, shm_kv: KVFactory) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    body = register_body(kv, "w", [*GROUPS, (1, "sliding_window", 16)], chunk_size=CHUNK)
    reply = client.post("/register", json=body)
    assert reply.status_code == 422
    assert "no layers" in reply.json()["detail"]


def test_cache_operations_need_a_final_chunk_size(make_client: ClientFactory) -> None:
    client = make_client(alignment=None)
    tokens = random_tokens(CHUNK, seed=1)
    item = {"request_id": "r", "namespace": NAMESPACE, **token_field(tokens)}
    reply = client.post("/cache/lookup", json={"requests": [item]})
    assert reply.status_code == 409
    assert reply.json()["type"] == "urn:mpcache:problem:not-negotiated"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        pytest.param({"namespace": "other"}, "namespace", id="other-namespace"),
        pytest.param({"start_token": 10}, "multiple of the chunk size", id="unaligned-start"),
        pytest.param({"start_token": 64, "end_token": 0}, "before start_token", id="end-before"),
        pytest.param({"block_ids": [[1], [2]]}, "block-id lists", id="group-count"),
        pytest.param({"block_ids": [[1, 2, 3, 8]]}, "[0, 8)", id="block-out-of-range"),
        pytest.param(
            {"block_ids": [[1, -2, 3, 4]]}, "greater than or equal to 0", id="negative-block"
        ),
        pytest.param({"block_ids": [[1, 2**70]]}, "less than 4611686018427387904", id="huge-block"),
        pytest.param(
            {"tokens": [1, 2**40], "tokens_b64": None}, "less than 2147483648", id="huge-token"
        ),
        pytest.param(
            {"tokens": [-1], "tokens_b64": None}, "greater than or equal to 0", id="negative-token"
        ),
        pytest.param({"tokens_b64": "/////w=="}, "negative token", id="negative-token-b64"),
        pytest.param({"tokens_b64": "!!"}, "bad tokens", id="bad-b64"),
    ],
)
def test_bad_transfer_item_refuses_the_whole_call(
    make_client: ClientFactory, shm_kv: KVFactory, change: dict[str, Any], needle: str
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    tokens = random_tokens(2 * CHUNK, seed=4)
    good = transfer_item("good", tokens, [[1, 2, 3, 4, 5, 6, 7, 0]])
    bad = {**transfer_item("bad", tokens, [[1, 2, 3, 4]]), **change}
    for path in ("/cache/store", "/cache/retrieve"):
        reply = client.post(path, json={"instance_id": "w", "rank": 0, "requests": [good, bad]})
        assert reply.status_code == 422, reply.text
        assert needle in reply.json()["detail"]
    assert lookup(client, tokens) == 0  # the good item was not stored either


def test_malformed_token_fields_are_refused(make_client: ClientFactory) -> None:
    client = make_client()
    both = {"request_id": "r", "namespace": "n", "tokens": [1], "tokens_b64": "AQAAAA=="}
    assert client.post("/cache/lookup", json={"requests": [both]}).status_code == 422
    ragged = {"request_id": "r", "namespace": "n", "tokens_b64": "AQAA"}  # 3 bytes
    reply = client.post("/cache/lookup", json={"requests": [ragged]})
    assert reply.status_code == 422
    assert "int32" in reply.json()["detail"]


def test_end_drops_sessions_and_metrics_count_the_traffic(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    tokens = random_tokens(2 * CHUNK + 3, seed=8)
    store(client, "w", transfer_item("r1", tokens, [list(range(1, 10))]))
    assert lookup(client, tokens, "r2") == 2 * CHUNK
    assert lookup(client, random_tokens(CHUNK, seed=9), "r3") == 0
    assert client.get("/health").json()["sessions"] == 3
    assert post_ok(client, "/cache/end", {"request_ids": ["r1", "r2", "nope"]})["ended"] == 2
    assert client.get("/health").json()["sessions"] == 1
    assert metric(client, "mpcache_chunks_stored_total") == 2
    assert metric(client, "mpcache_chunks_hit_total") == 2
    assert metric(client, "mpcache_chunks_missed_total") == 1
    assert metric(client, "mpcache_copied_bytes_total", op="store") == 8192
    assert metric(client, "mpcache_pool_capacity_bytes") == 4 << 20
    assert metric(client, "mpcache_pool_used_bytes") == 2 * 4096


def test_instance_ids_with_slashes_unregister(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    from urllib.parse import quote

    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "host-1/engine 0", GROUPS, chunk_size=CHUNK))
    assert client.delete(f"/register/{quote('host-1/engine 0', safe='')}/0").status_code == 204
    assert client.get("/health").json()["registrations"] == 0


def _b64(*values: int) -> str:
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(values)}I", *values)).decode()


def _lookup_body(**change: Any) -> dict[str, Any]:
    item = {"request_id": "r", "namespace": NAMESPACE, "tokens": [1, 2, 3], **change}
    return {"requests": [item]}


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        pytest.param(
            "/cache/lookup", _lookup_body(tokens=[1, 2**31]), "less than 2147483648", id="token"
        ),
        pytest.param(
            "/cache/lookup", _lookup_body(tokens=[-1]), "greater than or equal to 0", id="neg"
        ),
        pytest.param(
            "/cache/lookup",
            _lookup_body(tokens=None, tokens_b64=_b64(1, 2**31)),
            "negative token",
            id="token-b64",
        ),
        pytest.param(
            "/cache/lookup",
            _lookup_body(world_size=4097),
            "less than or equal to 4096",
            id="world-size",
        ),
        pytest.param(
            "/cache/lookup", _lookup_body(world_size=0), "greater than or equal to 1", id="ws-0"
        ),
        pytest.param(
            "/cache/blend/match",
            {"namespace": NAMESPACE, "tokens": [2**31]},
            "less than 2147483648",
            id="blend-token",
        ),
    ],
)
def test_out_of_range_values_are_refused_with_a_problem(
    make_client: ClientFactory, path: str, body: dict[str, Any], needle: str
) -> None:
    client = make_client(enable_blend=True)
    reply = client.post(path, json=body)
    assert reply.status_code == 422, reply.text
    assert reply.headers["content-type"].startswith("application/problem+json")
    problem = reply.json()
    assert problem["status"] == 422 and problem["type"].startswith("urn:mpcache:problem:")
    assert problem["title"] and needle in problem["detail"]
    assert client.get("/health").json()["sessions"] == 0


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        pytest.param({"tokens": [1, 2**31], "tokens_b64": None}, "less than 2147483648", id="tok"),
        pytest.param({"tokens_b64": _b64(5, 2**31 + 5)}, "negative token", id="tok-b64"),
        pytest.param({"block_ids": [[1, 2**62]]}, "less than 4611686018427387904", id="block"),
        pytest.param({"start_token": -64}, "greater than or equal to 0", id="neg-start"),
    ],
)
def test_out_of_range_transfer_values_are_refused_with_a_problem(
    make_client: ClientFactory, shm_kv: KVFactory, change: dict[str, Any], needle: str
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    item = {**transfer_item("r", random_tokens(CHUNK, seed=2), [[1, 2, 3, 4]]), **change}
    for path in ("/cache/store", "/cache/retrieve"):
        reply = client.post(path, json={"instance_id": "w", "rank": 0, "requests": [item]})
        assert reply.status_code == 422, reply.text
        assert reply.headers["content-type"].startswith("application/problem+json")
        assert reply.json()["status"] == 422 and needle in reply.json()["detail"]


@pytest.mark.parametrize(
    ("world_size", "rank", "needle"),
    [
        pytest.param(4097, 0, "less than or equal to 4096", id="world-size"),
        pytest.param(0, 0, "greater than or equal to 1", id="world-size-0"),
        pytest.param(2, -1, "greater than or equal to 0", id="negative-rank"),
    ],
)
def test_register_out_of_range_world_is_refused_with_a_problem(
    make_client: ClientFactory, shm_kv: KVFactory, world_size: int, rank: int, needle: str
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    body = register_body(kv, "w", GROUPS, chunk_size=CHUNK, rank=rank, world_size=world_size)
    reply = client.post("/register", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.headers["content-type"].startswith("application/problem+json")
    assert needle in reply.json()["detail"]
    assert client.get("/health").json()["registrations"] == 0
    # A body refused before its tickets are read leaves them unused; they are
    # unmapped when the worker's connection closes.
    client.close_worker()
    wait_until(lambda: shm_mappings(kv.name) == 1, what="unused tickets unmapped")
    # The largest world is accepted.
    ok = register_body(kv, "w", GROUPS, chunk_size=CHUNK, rank=4095, world_size=4096)
    assert post_ok(client, "/register", ok)["rank"] == 4095


def test_a_malformed_lookup_item_opens_no_session_and_takes_no_lease(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    tokens = random_tokens(CHUNK, seed=3)
    store(client, "w", transfer_item("s", tokens, [[1, 2, 3, 4]]))
    post_ok(client, "/cache/end", {"request_ids": ["s"]})
    good = {"request_id": "good", "namespace": NAMESPACE, **token_field(tokens)}
    bad = {"request_id": "bad", "namespace": NAMESPACE, "tokens_b64": _b64(1, 2**31)}
    reply = client.post("/cache/lookup", json={"requests": [good, bad]})
    assert reply.status_code == 422
    assert client.get("/health").json()["sessions"] == 0
    assert client.app.state.runtime.pool.stats().leased_keys == 0  # type: ignore[attr-defined]
