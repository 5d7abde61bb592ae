"""A vLLM KV connector that does nothing: what vLLM's own connector path costs.

Loaded by vLLM (``kv_connector_module_path: bench.null_connector``,
``kv_connector: NullConnector``) in ``bench/ttft_bench.py --null``'s engine; it
imports vLLM, so only the e2e venv's python imports it.

It matches no tokens, plans nothing and moves nothing, and like
``MPCacheConnector`` it declares ``SupportsHMA`` (vLLM then keeps its hybrid KV
cache manager on, as for mpcache's engine), so an engine given it runs
vLLM's connector steps (the scheduler's and model runner's connector calls, a
``kv_transfer_config``) with no mpcache in them: its miss over the ``none`` engine's
is what configuring any connector costs, and mpcache's miss over it is what mpcache
adds.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

__all__ = ["NullConnector"]


class _NoWork(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoWork()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # nothing is sent: vLLM frees the blocks at once
