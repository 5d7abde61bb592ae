"""A server's KV events and ``POST /cluster/lookup``, through its HTTP API (in-process,
real pool, real ZMQ sockets), read by vLLM's own decoder classes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contract.chunk_keys import block_hashes
from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    lookup,
    post_ok,
    random_tokens,
    register_body,
    store,
    transfer_item,
    vllm_layer,
)
from tests.events import Consumer
from tests.support import free_port, wait_until

CHUNK = 64
GROUPS = [(0, "attention", 16)]
LAYERS = [vllm_layer(f"l{i}", 0, 64) for i in range(2)]
# A namespace without "@" is its own model name (contract.chunk_keys.model_of).
MODEL = NAMESPACE

ClientFactory = Callable[..., CacheClient]


def _endpoints() -> dict[str, str]:
    return {
        "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }


def _cluster_lookup(client: CacheClient, tokens: list[int]) -> dict[str, object]:
    return post_ok(client, "/cluster/lookup", {"model": MODEL, "tokens": tokens})


@pytest.mark.vllm
def test_stores_and_evictions_reach_a_subscriber_and_the_server_closes_the_stream(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    sockets = _endpoints()
    # Room for 3 chunks (2 layers x 4 blocks x 1 KiB = 8 KiB, two pages each).
    client = make_client(pool_size=6 * 4096, **sockets)
    kv = shm_kv(LAYERS)
    post_ok(client, "/register", register_body(kv, "a", GROUPS, chunk_size=CHUNK))
    consumer = Consumer(sockets["kv_events_endpoint"], sockets["kv_events_replay_endpoint"])
    try:
        opening = consumer.next()
        assert isinstance(opening.batch.events[0], consumer.kv.AllBlocksCleared)
        # Two whole chunks and a tail of one 16-token unit: the tail is no block.
        p1 = random_tokens(2 * CHUNK + 16, seed=1)
        item = {**transfer_item("p1", p1, [list(range(1, 10))]), "unit_tokens": 16}
        assert store(client, "a", item)[0]["stored_chunks"] == 3
        (stored,) = consumer.next().batch.events
        assert stored.block_hashes == block_hashes(MODEL, None, p1, CHUNK)
        assert stored.token_ids == p1[: 2 * CHUNK].tolist()
        # Stored again: present, nothing new to say.
        assert (
            store(client, "a", transfer_item("p1b", p1, [list(range(1, 10))]))[0]["present_chunks"]
            == 2
        )
        assert consumer.quiet()
        # Two more chunks: the pool holds three entries, so p1's first two go.
        p2 = random_tokens(2 * CHUNK, seed=2)
        assert (
            store(client, "a", transfer_item("p2", p2, [list(range(10, 18))]))[0]["stored_chunks"]
            == 2
        )
        p2_hashes = block_hashes(MODEL, None, p2, CHUNK)
        stored_hashes: list[int] = []
        removed: list[int] = []
        while stored_hashes != p2_hashes:
            for event in consumer.next().batch.events:
                if isinstance(event, consumer.kv.BlockRemoved):
                    removed += event.block_hashes
                else:
                    stored_hashes += event.block_hashes
        # The LRU entries went: p1's tail (never announced), then p1's first chunk.
        assert removed == block_hashes(MODEL, None, p1, CHUNK)[:1]
        assert lookup(client, p1) == 0
        client.close_worker()
        client.__exit__(None, None, None)
        closing = consumer.next()
        assert [type(e).__name__ for e in closing.batch.events] == ["AllBlocksCleared"]
    finally:
        consumer.close()


def test_cluster_lookup_of_a_standalone_server_answers_what_a_lookup_hits(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv(LAYERS)
    post_ok(client, "/register", register_body(kv, "a", GROUPS, chunk_size=CHUNK))
    prompt = random_tokens(3 * CHUNK + 5, seed=3)
    assert store(client, "a", transfer_item("p", prompt[: 2 * CHUNK], [list(range(1, 9))]))
    wait_until(
        lambda: (
            _cluster_lookup(client, prompt.tolist())["servers"][0]["l1_tokens"]  # type: ignore[index]
            == lookup(client, prompt)
        ),
        what="the ledger taking in the store",
    )
    answer = _cluster_lookup(client, prompt.tolist())
    assert answer["chunk_size"] == CHUNK and answer["l2_tokens"] == 0
    (server,) = answer["servers"]  # type: ignore[misc]
    assert server["l1_tokens"] == 2 * CHUNK == lookup(client, prompt)
    # Another salt, another model, another prompt: nothing.
    salted = post_ok(
        client,
        "/cluster/lookup",
        {"model": MODEL, "tokens": prompt.tolist(), "cache_salt": "tenant-b"},
    )
    assert salted["servers"][0]["l1_tokens"] == 0
    other = post_ok(client, "/cluster/lookup", {"model": "other", "tokens": prompt.tolist()})
    assert other["servers"][0]["l1_tokens"] == 0


def test_cluster_lookup_before_a_chunk_size_is_a_409(make_client: ClientFactory) -> None:
    client = make_client(alignment=None)
    reply = client.post("/cluster/lookup", json={"model": MODEL, "tokens": [1, 2, 3]})
    assert reply.status_code == 409, reply.text
    assert reply.json()["type"].endswith("not-negotiated")


def test_the_example_router_picks_the_instance_beside_the_longest_prefix(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    from examples.prefix_router import Router

    client = make_client()
    kv = shm_kv(LAYERS)
    post_ok(client, "/register", register_body(kv, "a", GROUPS, chunk_size=CHUNK))
    prompt = random_tokens(2 * CHUNK, seed=4)
    me = _cluster_lookup(client, [1])["servers"][0]["url"]  # type: ignore[index]
    pairs = {"http://10.9.9.9:8733": "http://vllm-b:8000", str(me): "http://vllm-a:8000"}
    router = Router(str(me), pairs, client=client)
    # Nothing cached anywhere: round robin, in the order the pairs were given.
    first = router.route(MODEL, prompt.tolist())
    assert (first.vllm_url, first.hit_tokens) == ("http://vllm-b:8000", 0)
    store(client, "a", transfer_item("p", prompt, [list(range(1, 9))]))
    wait_until(
        lambda: router.route(MODEL, prompt.tolist()).hit_tokens == 2 * CHUNK,
        what="the router seeing the stored prefix",
    )
    choice = router.route(MODEL, prompt.tolist())
    assert (choice.vllm_url, choice.mpcache_url) == ("http://vllm-a:8000", me)
