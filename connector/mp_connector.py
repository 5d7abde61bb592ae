"""``MPCacheConnector``: the class vLLM loads (imports vLLM; import it lazily).

vLLM builds one instance per role: ``KVConnectorRole.SCHEDULER`` in the engine core
and ``KVConnectorRole.WORKER`` in every worker. This class only adapts vLLM's
interface to the role adapters (``connector.scheduler``, ``connector.worker``) and
keeps the rule that no connector call raises into vLLM's step loop: every step-time
method catches what the adapter did not and degrades instead.

mpcache is a best-effort cache: a load that fails is recomputed, never an error
for the user's request. vLLM 0.33 defaults ``kv_load_failure_policy`` to ``"fail"``
and reads it only after building the scheduler's connector, so the scheduler-role
instance switches ``"fail"`` to ``"recompute"`` (with a warning) in its constructor.

Use::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MPCacheConnector",
      "kv_connector_module_path": "connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"mpcache.server_urls": "http://127.0.0.1:8733"}}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.alignment import layout_from_groups
from connector.client import TransportFactory
from connector.config import ConnectorConfig, parse_extra_config
from connector.heartbeat import AsyncTransportFactory
from connector.identity import namespace_for
from connector.metadata import StepPlan
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["MPCacheConnector", "MPCacheConnectorMetadata"]

logger = logging.getLogger("mpcache.connector")

_EMPTY_PLAN = StepPlan()


def _recompute_failed_loads(transfer: KVTransferConfig) -> None:
    """Make vLLM recompute failed loads instead of failing the request.

    vLLM's Scheduler reads ``kv_load_failure_policy`` right after it has built its
    connector (vLLM 0.33 ``Scheduler.__init__``), so setting it here takes effect.
    """
    if transfer.kv_load_failure_policy != "fail":
        return
    transfer.kv_load_failure_policy = "recompute"
    logger.warning(
        "mpcache: kv_load_failure_policy 'fail' (vLLM's default) changed to 'recompute': "
        "mpcache is a best-effort cache (a server restart or eviction can fail a load), "
        "so a failed load is recomputed and never fails the request; 'fail' cannot be "
        'had from it. Set "kv_load_failure_policy": "recompute" in '
        "--kv-transfer-config to silence this (required when mpcache runs inside "
        "MultiConnector, whose own setting this connector cannot change)."
    )


class MPCacheConnectorMetadata(KVConnectorMetadata):
    """The step's ``StepPlan``, shipped from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        super().__init__()
        self.plan = plan

    def __repr__(self) -> str:
        return (
            f"MPCacheConnectorMetadata(loads={len(self.plan.loads)}, "
            f"stores={len(self.plan.stores)}, failed_loads={len(self.plan.failed_loads)})"
        )


class MPCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector for the mpcache server (best-effort prefix cache)."""

    _cache_hit_source = CacheHitSource.HOST

    # Test seam: transports for the adapters' HTTP clients (None: the network).
    transport_factory: ClassVar[TransportFactory | None] = None
    async_transport_factory: ClassVar[AsyncTransportFactory | None] = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        self.mp_config: ConnectorConfig = parse_extra_config(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        self.layout = layout_from_groups(
            kv_cache_config.kv_cache_groups, parallel.decode_context_parallel_size
        )
        model = str(vllm_config.model_config.model)
        world_size = int(parallel.world_size)
        instance_id = self.mp_config.instance_id or str(transfer.engine_id)
        namespace = namespace_for(
            model,
            self.layout,
            world_size,
            [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups],
        )
        self.scheduler_adapter: SchedulerAdapter | None = None
        self.worker_adapter: WorkerAdapter | None = None
        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(transfer)
            self.scheduler_adapter = SchedulerAdapter(
                self.mp_config,
                self.layout,
                model=model,
                instance_id=instance_id,
                namespace=namespace,
                world_size=world_size,
                transport=type(self).transport_factory,
                async_transport=type(self).async_transport_factory,
            )
        else:
            self.worker_adapter = WorkerAdapter(
                self.mp_config,
                self.layout,
                model=model,
                instance_id=instance_id,
                namespace=namespace,
                rank=int(parallel.rank),
                world_size=world_size,
                num_blocks=int(kv_cache_config.num_blocks),
                transport=type(self).transport_factory,
                async_transport=type(self).async_transport_factory,
            )
        self._warned: set[str] = set()

    @property
    def chunk_size(self) -> int:
        adapter = self.scheduler_adapter or self.worker_adapter
        assert adapter is not None
        return adapter.chunk_size

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a dropped store is a future cache miss

    def _swallow(self, where: str, exc: BaseException) -> None:
        if where not in self._warned:
            self._warned.add(where)
            logger.error(
                "mpcache %s failed (reported once); continuing without cache", where, exc_info=exc
            )

    # ================================================================ worker side

    def _plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, MPCacheConnectorMetadata) else _EMPTY_PLAN

    def _worker(self) -> WorkerAdapter:
        assert self.worker_adapter is not None, "worker method called on the scheduler"
        return self.worker_adapter

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self._worker().register_kv_caches(kv_caches)
        except Exception as exc:
            self._swallow("register_kv_caches", exc)

    def unregister_kv_caches(self) -> None:
        self._worker().unregister()

    def restore_kv_caches(self) -> None:
        self._worker().reregister()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward, in every vLLM that binds (not all call handle_preemptions).
        self.handle_preemptions(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        plan = kv_connector_metadata
        if not isinstance(plan, MPCacheConnectorMetadata) or not plan.plan.preempted:
            return
        try:
            self._worker().handle_preemptions(plan.plan)
        except Exception as exc:
            self._swallow("handle_preemptions", exc)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        try:
            self._worker().start_load(plan)
        except Exception as exc:
            self._swallow("start_load_kv", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load's request waits in vLLM until its load is reported finished

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # the server reads the shared blocks after the forward, no per-layer copy

    def wait_for_save(self) -> None:
        plan = self._plan()
        try:
            self._worker().save(plan)
        except Exception as exc:
            self._swallow("wait_for_save", exc)

    def _finished_stores(self, finished_req_ids: set[str]) -> set[str]:
        try:
            return self._worker().take_finished_stores(finished_req_ids)
        except Exception as exc:  # nothing raises into vLLM's step
            self._swallow("finished stores", exc)
            return set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished stores, finished loads), for callers of vLLM's older API (vLLM
        0.33's model runner calls ``get_transfer_results``). Block-level load
        failures still reach vLLM through ``get_block_ids_with_load_errors``;
        request-level ones cannot be told apart from successes here, so they stay
        queued for ``get_transfer_results`` rather than be reported as loaded."""
        sending = self._finished_stores(finished_req_ids)
        return sending or None, self._worker().take_finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM's contract: failed receives appear in finished_recving too.
        sending = self._finished_stores(finished_req_ids)
        finished, failed = self._worker().take_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=finished, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def shutdown(self) -> None:
        for adapter in (self.worker_adapter, self.scheduler_adapter):
            if adapter is not None:
                try:
                    adapter.shutdown()
                except Exception as exc:
                    self._swallow("shutdown", exc)

    # ============================================================= scheduler side

    def _scheduler(self) -> SchedulerAdapter:
        assert self.scheduler_adapter is not None, "scheduler method called on a worker"
        return self.scheduler_adapter

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            self._swallow("get_num_new_matched_tokens", exc)
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        try:
            self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:
            self._swallow("update_state_after_alloc", exc)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        try:
            plan = self._scheduler().build_connector_meta(scheduler_output)
        except Exception as exc:
            self._swallow("build_connector_meta", exc)
            plan = _EMPTY_PLAN
        return MPCacheConnectorMetadata(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        try:
            self._scheduler().transfers_finished(connector_output.finished_sending or ())
        except Exception as exc:
            self._swallow("update_connector_output", exc)
