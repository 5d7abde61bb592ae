"""A lookup's L2 cost is bounded (``app.l2.MAX_LOOKUP_KEYS``), whatever world size a
client registers: a real server on a real ``redis-server``, Redis's own command count."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import redis as redis_py

from app.l2 import MAX_LOOKUP_KEYS
from tests.dataplane.support import build_kv, register_body, register_over, vllm_layer
from tests.support import RedisServer, server_process

pytestmark = pytest.mark.slow

CHUNK = 256
TOKENS = 64 * 1024  # 256 chunks


def _exists(client: redis_py.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_exists", {}).get("calls", 0))


def _lookup(http: httpx.Client, namespace: str, world_size: int, request_id: str) -> int:
    tokens = np.arange(TOKENS, dtype=np.int32)
    item = {
        "request_id": request_id,
        "namespace": namespace,
        "world_size": world_size,
        "tokens_b64": base64.b64encode(tokens.tobytes()).decode(),
    }
    reply = http.post("/cache/lookup", json={"requests": [item, {**item, "request_id": "2"}]})
    assert reply.status_code == 200, reply.text
    return int(reply.json()["results"][0]["hit_tokens"])


@pytest.mark.parametrize("world_size", [1, 4096])
def test_lookup_asks_a_bounded_number_of_l2_keys(redis: RedisServer, world_size: int) -> None:
    args = ["--coordinator-url", redis.url, "--l2-url", redis.url, "--deployment", "t"]
    args += ["--chunk-size", str(CHUNK), "--pool-size", "4MiB", "--pool-page-size", "4KiB"]
    kv = build_kv([vllm_layer("l0", 0, 17)])
    client = redis_py.Redis.from_url(redis.url)
    try:
        with server_process(*args) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
            http.post("/negotiate", json={"required_alignment": 16}).raise_for_status()
            body = register_body(
                kv, "i", [(0, "attention", 16)], chunk_size=CHUNK, world_size=world_size
            )
            namespace = body["namespace"]
            _, sock = register_over(http, body)
            try:
                before = _exists(client)
                assert _lookup(http, namespace, world_size, "1") == 0  # nothing stored
                asked = _exists(client) - before  # one EXISTS per chunk asked, all its ranks
            finally:
                sock.close()
    finally:
        client.close()
        kv.close()
    # Two items of 256 chunks each; the call's budget covers them all at world size 1,
    # and only MAX_LOOKUP_KEYS // 4096 chunks in all at 4096 (not 2 x 256 x 4096 keys).
    if world_size == 1:
        assert asked == 2 * TOKENS // CHUNK
    else:
        assert asked == MAX_LOOKUP_KEYS // world_size
