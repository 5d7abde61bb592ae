"""bench/null_connector.py: vLLM builds it and schedules every prompt in full.

bench/ttft_bench.py --null reads the null engine's miss as "vLLM's connector path
with no mpcache in it": that holds only if vLLM's factory takes the class (vLLM's
connector base has no abstract method it leaves out) and the real Scheduler, asking
it, computes each prompt from its first token in one step, holding nothing back.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.vllm
def test_the_null_connector_loads_nothing_and_holds_nothing_back(tiny_model_dir: Path) -> None:
    from tests.connector.vllm_support import (
        make_connector,
        make_kv_cache_config,
        make_request,
        make_scheduler,
        make_vllm_config,
    )

    config = make_vllm_config(tiny_model_dir, {})
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector = "NullConnector"
    config.kv_transfer_config.kv_connector_module_path = "bench.null_connector"
    kv_cache_config = make_kv_cache_config(64)
    worker = make_connector(config, "worker", kv_cache_config)
    scheduler = make_scheduler(config, kv_cache_config)
    assert type(scheduler.connector).__name__ == "NullConnector"
    scheduler.add_request(make_request("A", range(3, 203)))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"A": 200}
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0]
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
