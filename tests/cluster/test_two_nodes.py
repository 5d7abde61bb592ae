"""Two mpcache servers and one Redis on one machine stand in for two nodes.

Real parts only: ``redis-server``, two ``mpcache server`` processes sharing it as
coordinator and L2 tier, and two vLLM instances (the connector's adapters, each with
its own KV cache in shared memory), one per server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis as redis_py
import torch

from tests.cluster.nodes import Instance
from tests.support import RedisServer, server_process, wait_until

pytestmark = pytest.mark.slow

# Two whole 64-token chunks, one whole block (the tail, kept in the pool that stored it,
# never in L2), 6 tokens more.
PROMPT = [(i * 37) % 997 for i in range(150)]


def _server(stack: ExitStack, redis: RedisServer, *flags: str) -> str:
    args = ["--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "t"]
    args += ["--pool-size", "4MiB", "--pool-page-size", "4KiB", "--copy-threads", "1"]
    args += ["--membership-ttl-s", "3", "--redis-timeout-s", "1"]
    url, _ = stack.enter_context(server_process(*args, *flags))
    return url


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            total += float(match.group(2))
    return total


def _instance(stack: ExitStack, url: str, instance_id: str) -> Instance:
    instance = Instance(url, instance_id)
    stack.callback(instance.close)
    return instance


def _cluster(url: str) -> dict[str, object]:
    body: dict[str, object] = httpx.get(f"{url}/cluster", timeout=10).json()
    return body


@pytest.fixture
def two_nodes(redis: RedisServer) -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        a = _server(stack, redis, "--chunk-size", "64")
        b = _server(stack, redis, "--chunk-size", "64")
        yield a, b


def test_stored_on_a_served_by_b_bytes_identical(
    redis: RedisServer, two_nodes: tuple[str, str]
) -> None:
    a_url, b_url = two_nodes
    with ExitStack() as stack:
        a = _instance(stack, a_url, "instance-a")
        b = _instance(stack, b_url, "instance-b")
        assert a.chunk_size == b.chunk_size == 64

        blocks_a = list(range(1, 11))
        a.store("req-a", PROMPT, blocks_a, seed=1.0)
        wait_until(
            lambda: _metric(a_url, 'mpcache_l2_writes_total{outcome="written"}') >= 2,
            what="server A writing its two chunks behind to L2",
        )

        blocks_b = list(range(20, 30))
        hits, ok = b.load("req-b", PROMPT, blocks_b)
        assert (hits, ok) == (128, True)
        for j in range(8):  # blocks 0..7 hold tokens 0..127
            got, want = b.block(blocks_b[j]), a.block(blocks_a[j])
            for name in want:
                assert torch.equal(got[name], want[name]), (name, j)
        assert torch.all(b.kv["l0"][blocks_b[8]] == 0)  # past the hit: untouched

        assert _metric(b_url, "mpcache_chunks_l2_hit_total") == 2
        assert _metric(b_url, 'mpcache_l2_reads_total{outcome="hit"}') == 2
        # Promoted into B's L1: the next lookup is an L1 hit, not another L2 one.
        assert b.hit_tokens("req-b2", PROMPT) == 128
        assert _metric(b_url, "mpcache_chunks_l2_hit_total") == 2

        # A corrupted L2 value is refused (counted, deleted), never served: the load
        # is reported failed, so vLLM recomputes those blocks.
        other = [(i * 53) % 991 for i in range(150)]
        a.store("req-a3", other, list(range(11, 21)), seed=5.0)
        wait_until(
            lambda: _metric(a_url, 'mpcache_l2_writes_total{outcome="written"}') >= 4,
            what="the second prompt written behind",
        )
        client = redis_py.Redis.from_url(redis.url)
        try:
            for key in client.scan_iter(match="mpcache:l2:*", count=100):
                value = client.get(key)
                assert value is not None
                client.set(key, value[:-1] + bytes([value[-1] ^ 0xFF]))
            assert b.load("req-b3", other, list(range(1, 11))) == (128, False)
            # Both chunks were fetched in one pipeline: both refused, none served.
            assert _metric(b_url, 'mpcache_l2_reads_total{outcome="corrupt"}') == 2
            assert _metric(b_url, 'mpcache_l2_reads_total{outcome="hit"}') == 2  # as before
            assert b.hit_tokens("req-b4", other) == 0  # the refused value is gone
        finally:
            client.close()

        cluster = _cluster(b_url)
        assert cluster["deployment_chunk_size"] == 64
        assert cluster["l2"] == "up" and cluster["coordinator"] == "up"
        members = cluster["members"]
        assert isinstance(members, list)
        assert sorted(m["port"] for m in members) == sorted(
            int(u.rsplit(":", 1)[1]) for u in (a_url, b_url)
        )


def test_other_chunk_size_refused_with_both_sizes(redis: RedisServer) -> None:
    with ExitStack() as stack:
        a_url = _server(stack, redis, "--chunk-size", "64")
        c_url = _server(stack, redis, "--chunk-size", "128")
        ok = httpx.post(f"{a_url}/negotiate", json={"required_alignment": 16}, timeout=10)
        assert ok.status_code == 200 and ok.json()["chunk_size"] == 64
        for _ in range(2):  # the retry resumes at the coordinator binding, and fails again
            refused = httpx.post(f"{c_url}/negotiate", json={"required_alignment": 16}, timeout=10)
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/problem+json"
            problem = refused.json()
            assert problem["binding"] == "coordinator"
            assert problem["deployment_chunk_size"] == 64
            assert problem["server_chunk_size"] == 128
            assert "64" in problem["detail"] and "128" in problem["detail"]
        health = httpx.get(f"{c_url}/health", timeout=5).json()
        assert health["final"] is False  # it never serves with another size
        conflict = httpx.post(
            f"{c_url}/cache/lookup",
            json={"requests": [{"request_id": "r", "namespace": "n", "tokens": [1] * 128}]},
            timeout=5,
        )
        assert conflict.status_code == 409


def test_redis_killed_and_restarted_mid_run(redis: RedisServer, two_nodes: tuple[str, str]) -> None:
    a_url, b_url = two_nodes
    with ExitStack() as stack:
        a = _instance(stack, a_url, "instance-a")
        b = _instance(stack, b_url, "instance-b")
        a.store("before", PROMPT, list(range(1, 11)), seed=2.0)
        wait_until(
            lambda: _metric(a_url, 'mpcache_l2_writes_total{outcome="written"}') >= 2,
            what="write-behind before the fault",
        )

        redis.stop()
        # vLLM's calls keep working, L1 only: A stores and serves, B misses, nothing fails.
        other = [(i * 53) % 991 for i in range(150)]
        a.store("during", other, list(range(11, 21)), seed=3.0)
        # From A's own pool: the two chunks and the prompt's tail (one block of 16).
        assert a.load("during-again", other, list(range(21, 31))) == (144, True)
        assert b.load("during-b", other, list(range(1, 11))) == (0, True)
        for url in (a_url, b_url):
            wait_until(
                lambda url=url: (
                    httpx.get(f"{url}/health", timeout=5).json()["cluster"]
                    == {"mode": "redis", "deployment": "t", "coordinator": "down", "l2": "down"}
                ),
                what="/health reporting Redis down",
            )
            assert _metric(url, "mpcache_l2_up") == 0
            assert _metric(url, "mpcache_coordinator_up") == 0
        assert _cluster(b_url)["members"] == []

        redis.start()  # back, empty (no persistence)
        for url in (a_url, b_url):
            wait_until(
                lambda url=url: (
                    httpx.get(f"{url}/health", timeout=5).json()["cluster"]["l2"] == "up"
                    and httpx.get(f"{url}/health", timeout=5).json()["cluster"]["coordinator"]
                    == "up"
                ),
                what="coordinator and L2 back up",
            )
        wait_until(lambda: len(_cluster(a_url)["members"]) == 2, what="membership renewed")  # type: ignore[arg-type]
        assert _cluster(a_url)["deployment_chunk_size"] == 64  # re-published

        # Write-behind resumes: a new prompt stored through A is served by B from L2.
        third = [(i * 71) % 983 for i in range(150)]
        written = _metric(a_url, 'mpcache_l2_writes_total{outcome="written"}')
        a.store("after", third, list(range(1, 11)), seed=4.0)
        wait_until(
            lambda: _metric(a_url, 'mpcache_l2_writes_total{outcome="written"}') >= written + 2,
            what="write-behind after Redis came back",
        )
        assert b.load("after-b", third, list(range(11, 21))) == (128, True)
        assert torch.equal(b.block(11)["l0"], a.block(1)["l0"])
