"""bench/floor_connector.py: a load is reported loaded in full without a server call.

bench/ttft_bench.py --floor reads the floor engine's hit as "everything but the
copy": that holds only if the floor skips exactly the retrieve call (no bytes move,
nothing reported failed) and goes through the shipped load lane and ledger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.connector.fakes import FakeServer


def _floor_worker(tiny_model_dir: Path, fake: FakeServer, kv: dict[str, Any]) -> Any:
    from tests.connector.vllm_support import make_connector, make_kv_cache_config, make_vllm_config

    config = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": fake.url})
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector = "FloorMPCacheConnector"
    config.kv_transfer_config.kv_connector_module_path = "bench.floor_connector"
    conn = make_connector(config, "worker", make_kv_cache_config(16))
    conn.register_kv_caches(kv)
    return conn


@pytest.mark.vllm
def test_a_floor_load_finishes_whole_without_the_server_or_a_copy(
    tiny_model_dir: Path, fake_server: FakeServer
) -> None:
    import torch

    from connector import MPCacheConnectorMetadata
    from connector.metadata import StepPlan, TransferOp
    from contract.tokens import encode_tokens
    from tests.connector.vllm_support import LAYERS

    kv = {name: torch.full((16, 2, 16, 2, 8), 7.0) for name in LAYERS}
    worker = _floor_worker(tiny_model_dir, fake_server, kv)
    try:
        load = TransferOp("A", 0, 64, encode_tokens(range(64)), [[1, 2, 3, 4]])
        worker.bind_connector_metadata(MPCacheConnectorMetadata(StepPlan(loads=(load,))))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        finished: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 10
        while "A" not in finished and time.monotonic() < deadline:
            results = worker.get_transfer_results(set())
            finished |= results.finished_recving or set()
            failed |= results.failed_recving or set()
            time.sleep(0.01)
        errors = worker.get_block_ids_with_load_errors()
    finally:
        worker.shutdown()
    assert finished == {"A"}
    assert not failed and not errors
    assert not any(path.endswith("/cache/retrieve") for path in fake_server.paths())
    assert all(bool((t == 7.0).all()) for t in kv.values())  # no byte was written
