"""Real server processes: both entry points start, and boot_id is per process."""

from __future__ import annotations

import httpx
import pytest

from tests.support import server_process


@pytest.mark.slow
def test_boot_id_changes_across_processes() -> None:
    boot_ids = []
    for uvicorn in (True, False):
        env = {"MPCACHE_CHUNK_SIZE": "600"}
        with server_process(uvicorn=uvicorn, env=env) as (url, _):
            health = httpx.get(f"{url}/health").json()
            assert health["chunk_size"] is None  # health never selects
            boot_ids.append(health["boot_id"])
            reply = httpx.post(f"{url}/negotiate", json={"required_alignment": 544})
            assert reply.json() == {
                "chunk_size": 1088,
                "min_chunk_size": 600,
                "required_alignment": 544,
                "boot_id": health["boot_id"],
            }
            assert httpx.get(f"{url}/health").json()["boot_id"] == health["boot_id"]
    assert len(set(boot_ids)) == 2


@pytest.mark.slow
def test_cli_flags_override_env() -> None:
    with server_process("--chunk-size", "512", env={"MPCACHE_CHUNK_SIZE": "600"}) as (url, _):
        assert httpx.get(f"{url}/chunk-size").json()["min_chunk_size"] == 512
