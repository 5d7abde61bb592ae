"""Tests marked ``vllm`` skip without vLLM, but fail under MPCACHE_REQUIRE_VLLM=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.mark.parametrize(
    ("require", "rc", "outcome"),
    [
        pytest.param("0", 0, "1 skipped", id="skips"),
        pytest.param("1", 1, "1 error", id="fails-under-ci"),
    ],
)
def test_missing_vllm(tmp_path: Path, require: str, rc: int, outcome: str) -> None:
    blocked = tmp_path / "vllm"
    blocked.mkdir()
    (blocked / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "MPCACHE_REQUIRE_VLLM": require,
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/connector/test_alignment.py::test_real_kv_cache_config_groups",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert outcome in proc.stdout, proc.stdout + proc.stderr
