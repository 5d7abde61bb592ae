"""The connector runs inside vLLM's processes: it must not drag the server in.

``make lint`` checks the static import graph (import-linter); this checks what a
real import loads, in a fresh interpreter, so a lazy or transitive import that the
static graph cannot see is caught too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

SERVER_ONLY = ("app", "dataplane", "fastapi", "starlette", "uvicorn", "prometheus_client")

PROBE = """
import json, sys
import connector, connector.scheduler, connector.worker
loaded = sorted({name.split(".")[0] for name in sys.modules})
print(json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def loaded() -> list[str]:
    """Top-level packages a fresh interpreter holds after importing the connector."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    names: list[str] = json.loads(out.stdout)
    assert "contract" in names  # the probe really imported the connector's modules
    return names


@pytest.mark.parametrize("forbidden", SERVER_ONLY)
def test_importing_the_connector_loads_nothing_of_the_server(
    loaded: list[str], forbidden: str
) -> None:
    assert forbidden not in loaded
