"""Real server processes: both entry points start, and boot_id is per process."""

from __future__ import annotations

import socket

import httpx
import pytest

from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, encode_lookup_frame
from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import pack_tokens
from tests.support import server_process, wait_until


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


@pytest.mark.slow
def test_a_client_that_leaves_mid_body_is_one_warning_and_drops_its_lookup() -> None:
    """A connector whose lookup times out closes its connection while the server
    still reads the body: the server logs one line (no traceback, nothing at ERROR),
    records the request as 499, serves nothing, and keeps serving."""
    header = LookupFrameHeader(
        requests=[LookupFrameItem(request_id="gone", namespace="ns", num_tokens=4096)]
    )
    frame = encode_lookup_frame(header, [pack_tokens(list(range(4096)))])
    with server_process("--chunk-size", "256", "--pool-size", "16MiB") as (url, proc):
        httpx.post(f"{url}/negotiate", json={"required_alignment": 16}).raise_for_status()
        host, port = url.removeprefix("http://").split(":")
        head = (
            "POST /cache/lookup HTTP/1.1\r\nhost: mpcache\r\n"
            f"content-type: {LOOKUP_FRAME_MEDIA_TYPE}\r\ncontent-length: {len(frame)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + frame[: len(frame) // 2])
        dropped = (
            "mpcache_http_request_duration_seconds_count"
            '{method="POST",route="/cache/lookup",status="499"}'
        )
        wait_until(lambda: dropped in httpx.get(f"{url}/metrics").text, what="the 499")
        health = httpx.get(f"{url}/health").json()
        assert health["sessions"] == 0  # nothing of the half-read lookup was served
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        log = proc.stdout.read().decode(errors="replace")
    assert "client closed the connection before its POST /cache/lookup" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
