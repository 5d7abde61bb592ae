"""``POST /cluster/lookup`` across two real servers on one real Redis: any server's
answer agrees with what each server's own lookup hits, and with what L2 holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import redis as redis_py

from app.cluster_lookup import held_key
from contract.chunk_keys import block_hashes
from tests.cluster.nodes import NAMESPACE, Instance
from tests.support import RedisServer, server_process, wait_until

pytestmark = pytest.mark.slow

CHUNK = 64
MODEL = "tiny"  # the model part of tests.cluster.nodes.NAMESPACE
# Two whole chunks, then a 16-token block (a tail, in A's pool only) and 6 tokens more.
PROMPT = [(i * 37) % 997 for i in range(150)]
OTHER = [(i * 53) % 991 for i in range(70)]


def _server(stack: ExitStack, redis: RedisServer) -> tuple[str, Any]:
    args = ["--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "t"]
    args += ["--pool-size", "4MiB", "--pool-page-size", "4KiB", "--copy-threads", "1"]
    args += ["--membership-ttl-s", "3", "--redis-timeout-s", "1", "--chunk-size", str(CHUNK)]
    url, proc = stack.enter_context(server_process(*args))
    return url, proc


def _instance(stack: ExitStack, url: str, instance_id: str) -> Instance:
    instance = Instance(url, instance_id)
    stack.callback(instance.close)
    return instance


def _ask(url: str, tokens: list[int]) -> dict[str, Any]:
    reply = httpx.post(f"{url}/cluster/lookup", json={"model": MODEL, "tokens": tokens}, timeout=10)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def _by_url(answer: dict[str, Any]) -> dict[str, int]:
    return {s["url"]: s["l1_tokens"] for s in answer["servers"]}


def _lookup(url: str, tokens: list[int], request_id: str) -> int:
    """What the server's own lookup hits, in whole chunks (no unit_tokens)."""
    item = {"request_id": request_id, "namespace": NAMESPACE, "tokens": tokens}
    reply = httpx.post(f"{url}/cache/lookup", json={"requests": [item]}, timeout=10)
    assert reply.status_code == 200, reply.text
    hits = int(reply.json()["results"][0]["hit_tokens"])
    httpx.post(f"{url}/cache/end", json={"request_ids": [request_id]}, timeout=10)
    return hits


@pytest.fixture
def nodes(redis: RedisServer) -> Iterator[tuple[ExitStack, str, str]]:
    with ExitStack() as stack:
        a_url, _ = _server(stack, redis)
        b_url, _ = _server(stack, redis)
        yield stack, a_url, b_url


def test_any_server_answers_what_each_servers_lookup_hits(
    redis: RedisServer, nodes: tuple[ExitStack, str, str]
) -> None:
    stack, a_url, b_url = nodes
    a = _instance(stack, a_url, "instance-a")
    b = _instance(stack, b_url, "instance-b")
    assert a.chunk_size == b.chunk_size == CHUNK
    a.store("req-a", PROMPT, list(range(1, 11)), seed=1.0)
    b.store("req-b", OTHER, list(range(1, 6)), seed=2.0)
    # A holds the prompt in its pool; B holds OTHER, and finds the prompt in L2 once A
    # has written it behind.
    wait_until(
        lambda: _ask(b_url, PROMPT)["l2_tokens"] == 2 * CHUNK, what="A's chunks written to L2"
    )
    for asked in (a_url, b_url):
        wait_until(
            lambda asked=asked: _by_url(_ask(asked, PROMPT)) == {a_url: 2 * CHUNK, b_url: 0},  # type: ignore[misc]
            what=f"{asked} answering what each server's pool holds",
        )
    answer = _ask(b_url, PROMPT)
    assert answer["chunk_size"] == CHUNK
    assert answer["servers"][0]["url"] == b_url  # the answering server first
    # Each server's own lookup hits its pool's chunks, then L2's past them.
    for url, l1 in _by_url(answer).items():
        assert _lookup(url, PROMPT, f"check-{url[-5:]}") == max(l1, answer["l2_tokens"])
    other = _ask(a_url, OTHER)
    assert _by_url(other) == {a_url: 0, b_url: CHUNK}
    wait_until(lambda: _ask(a_url, OTHER)["l2_tokens"] == CHUNK, what="B's chunk in L2")
    assert _lookup(b_url, OTHER, "o-b") == CHUNK

    # B loads the prompt from L2 (promoted into its pool): both now hold it.
    assert b.load("req-b2", PROMPT, list(range(10, 20))) == (2 * CHUNK, True)
    wait_until(
        lambda: _by_url(_ask(a_url, PROMPT)) == {a_url: 2 * CHUNK, b_url: 2 * CHUNK},
        what="B's promotion seen from A",
    )
    assert _lookup(b_url, PROMPT, "check-b2") == 2 * CHUNK

    # What each member keeps in Redis is the block hashes a router derives itself.
    members = httpx.get(f"{a_url}/cluster", timeout=10).json()["members"]
    a_id = next(m["member_id"] for m in members if a_url.endswith(f":{m['port']}"))
    client = redis_py.Redis.from_url(redis.url)
    try:
        held = {int.from_bytes(h, "big") for h in client.smembers(held_key("t", a_id))}
    finally:
        client.close()
    assert held == set(block_hashes(MODEL, None, PROMPT, CHUNK))

    # A third member is listed while it lives, and not once it has left.
    with ExitStack() as third:
        c_url, _ = _server(third, redis)
        httpx.post(f"{c_url}/negotiate", json={"required_alignment": 16}, timeout=10)
        wait_until(lambda: c_url in _by_url(_ask(a_url, PROMPT)), what="C joining")
        assert _by_url(_ask(a_url, PROMPT))[c_url] == 0
    wait_until(lambda: c_url not in _by_url(_ask(a_url, PROMPT)), what="C leaving")
