"""Session memory against the process's RSS (issue 25, item 4).

``--session-memory`` is filled with worst-case sessions (the longest request id,
namespace and salt, in the widest characters; or sessions holding token ids) until
the server answers 503 ``sessions-full``; the server's resident memory must have
grown by at most 1.25x the setting. Was: each session of long strings was charged
512 bytes and cost 1,700-4,700, so a 16 MiB setting let the server grow 52-146 MiB.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import server_process

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

SESSION_MEMORY = 16 << 20
BATCH = 256
"""Sessions opened per lookup: small batches, so that what one call holds for a
moment (its body, decoded) is small beside the sessions."""


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _ids(prefix: str, fill: str) -> list[str]:
    return [f"{prefix}{i:05d}".ljust(256, fill) for i in range(BATCH)]


def _lookup(http: httpx.Client, prefix: str, fill: str, num_tokens: int) -> httpx.Response:
    items: list[dict[str, Any]] = [
        {
            "request_id": rid,
            "namespace": "n" * 512,
            "cache_salt": fill * 256,
            "tokens": list(range(num_tokens)),
        }
        for rid in _ids(prefix, fill)
    ]
    return http.post("/cache/lookup", json={"requests": items})


@pytest.mark.parametrize(
    ("fill", "num_tokens"),
    [
        pytest.param("\U0001f600", 0, id="longest-widest-strings"),
        pytest.param("x", 640, id="token-ids-and-keys"),
    ],
)
def test_sessions_grow_the_server_by_at_most_their_memory_setting(
    fill: str, num_tokens: int
) -> None:
    with (
        server_process(
            "--chunk-size", "64", "--session-memory", "16MiB", "--lease-ttl-s", "3600"
        ) as (url, proc),
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        assert http.post("/negotiate", json={"required_alignment": 64}).status_code == 200
        for w in range(2):  # the first calls' one-off costs (the body decoder, the heap)
            assert _lookup(http, f"warm{w}-", fill, num_tokens).status_code == 200
            http.post("/cache/end", json={"request_ids": _ids(f"warm{w}-", fill)})
        time.sleep(0.5)
        before = _rss_bytes(proc.pid)
        for b in range(SESSION_MEMORY // (BATCH * 512) + 1):  # 512 bytes a session at least
            reply = _lookup(http, f"s{b}-", fill, num_tokens)
            if reply.status_code != 200:
                break
        assert reply.status_code == 503, reply.text
        assert reply.json()["type"] == "urn:mpcache:problem:sessions-full"
        sessions = http.get("/health").json()["sessions"]
        time.sleep(0.5)
        grown = _rss_bytes(proc.pid) - before
    print(f"{sessions} sessions: RSS grew {grown / SESSION_MEMORY:.2f}x --session-memory")
    assert grown <= 1.25 * SESSION_MEMORY, f"{grown / 2**20:.1f} MiB for {sessions} sessions"
