"""Real vLLM objects for connector tests: configs, a Scheduler, a CPU worker driver.

Import only from tests marked ``vllm`` (this module imports vLLM lazily, inside the
functions, so collecting it never needs vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_SIZE = 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def make_vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    *,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 4096,
    prefix_caching: bool = False,
) -> Any:
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="float32",
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=64,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MPCacheConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )


def make_kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)],
    )


def make_connector(vllm_config: Any, role: str, kv_cache_config: Any) -> Any:
    """The connector for ``role`` ("scheduler" or "worker"), built by vLLM's factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    return KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole[role.upper()], kv_cache_config
    )


def make_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=False,
    )


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int = 1) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
    )


def kv_value(token: int, position: int, layer: int) -> float:
    """What the fake forward writes for a token: exact in float32."""
    return float((token * 131 + position * 7 + layer * 1009) % 65521)


class CpuWorker:
    """Drives a worker-role connector the way vLLM's model runner does, on CPU.

    The "forward" writes ``kv_value`` into every computed token's slot, so a test can
    check that loaded blocks hold exactly what an earlier request computed.
    """

    def __init__(self, connector: Any, scheduler: Any, num_blocks: int) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        shape = (num_blocks, 2, self.block_size, NUM_KV_HEADS, HEAD_SIZE)
        self.kv = {name: torch.zeros(shape, dtype=torch.float32) for name in LAYERS}
        connector.register_kv_caches(self.kv)

    def blocks_of(self, request_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return list(ids)

    def slot(self, layer: str, blocks: list[int], position: int) -> torch.Tensor:
        block = blocks[position // self.block_size]
        return self.kv[layer][block, :, position % self.block_size]

    def _forward(self, request_id: str, start: int, count: int) -> None:
        request = self.scheduler.requests[request_id]
        blocks = self.blocks_of(request_id)
        tokens = request.all_token_ids
        for li, layer in enumerate(LAYERS):
            for p in range(start, start + count):
                self.slot(layer, blocks, p).fill_(kv_value(tokens[p], p, li))

    def step(self) -> tuple[Any, Any]:
        """One engine step: schedule, load, forward, save, report back."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        c = self.connector
        c.handle_preemptions(out.kv_connector_metadata)
        c.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            c.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, count in out.num_scheduled_tokens.items():
            self._forward(rid, starts[rid], count)
        if not out.has_sync_kv_loads:
            c.start_load_kv(None)
        c.wait_for_save()
        results = c.get_transfer_results(out.finished_req_ids)
        invalid = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()

        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.scheduler.requests[rid]
            sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
            ),
        )
        engine_out = self.scheduler.update_from_output(out, runner_out)
        return out, engine_out
