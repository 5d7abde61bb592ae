"""Redis down when a server starts: a clear refusal, or standalone when asked."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.support import DEADLINE_S, ROOT, free_port, server_process

pytestmark = pytest.mark.slow


def _nobody_listening() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.mark.parametrize(
    ("flag", "variable"),
    [
        pytest.param("--coordinator-url", "MPCACHE_COORDINATOR_URL", id="coordinator"),
        pytest.param("--l2-url", "MPCACHE_L2_URL", id="l2"),
    ],
)
def test_redis_down_at_start_is_refused_naming_the_setting(flag: str, variable: str) -> None:
    url = _nobody_listening()
    cmd = [sys.executable, "-m", "app", "server", "--port", "0", "--pool-size", "1MiB"]
    done = subprocess.run(
        [*cmd, flag, url], cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mpcache: cannot reach")
    assert variable in last and url in last and "--coordinator-optional" in last


def test_redis_down_at_start_runs_standalone_when_optional() -> None:
    url = _nobody_listening()
    flags = ["--coordinator-url", url, "--l2-url", url, "--coordinator-optional"]
    with server_process(*flags, "--pool-size", "1MiB", "--deployment", "opt") as (base, _):
        health = httpx.get(f"{base}/health", timeout=5).json()
        assert health["cluster"] == {
            "mode": "standalone",
            "deployment": "opt",
            "coordinator": "standalone",
            "l2": "off",
        }
        reply = httpx.post(f"{base}/negotiate", json={"required_alignment": 16}, timeout=10)
        assert reply.status_code == 200
        members = httpx.get(f"{base}/cluster", timeout=5).json()["members"]
        assert [m["chunk_size"] for m in members] == [reply.json()["chunk_size"]]
