"""Connector test setup: vLLM gating, tiny model folder, real server processes.

Tests marked ``vllm`` skip when vLLM is missing, except when
``MPCACHE_REQUIRE_VLLM=1`` (CI): then they fail, so a broken venv cannot pass as
"all skipped".
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.connector.fakes import FakeServer

# vLLM reads these at import time; set them before any test imports it.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def require_vllm() -> ModuleType:
    """Import vLLM, skipping the test when it is missing (failing under CI)."""
    if os.environ.get("MPCACHE_REQUIRE_VLLM") == "1":
        import vllm

        return vllm
    # ImportError too: a half-installed vLLM skips locally, with its error as reason.
    return pytest.importorskip("vllm", reason="vLLM 0.33 is not importable", exc_type=ImportError)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is not None:
        require_vllm()


@pytest.fixture(autouse=True)
def _close_fake_gates() -> Iterator[None]:
    """Fakes' registration sockets (``tests.connector.fakes``) end with each test."""
    yield
    from tests.connector.fakes import close_gates

    close_gates()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only a tiny ``config.json`` (no weights, no tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return path


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """Collects segment names a test creates; unlinks leftovers afterwards."""
    names: list[str] = []
    yield names
    import posix_ipc

    for name in names:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


@pytest.fixture
def built() -> Iterator[list[Any]]:
    """Connectors (or anything with ``shutdown``) a test builds; shut down afterwards."""
    made: list[Any] = []
    yield made
    for c in made:
        c.shutdown()


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    """An in-memory server every connector built in the test talks to."""
    require_vllm()
    from connector import MPCacheConnector

    fake = FakeServer("http://fake:1", min_chunk_size=64)
    monkeypatch.setattr(MPCacheConnector, "transport_factory", lambda url: fake.transport())
    monkeypatch.setattr(MPCacheConnector, "async_transport_factory", lambda url: fake.transport())
    return fake
