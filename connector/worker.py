"""Worker-side adapter: KV cache registration and the step's batched loads/stores.

Runs in each vLLM worker process. It negotiates with its own server (chosen by rank,
``connector.servers.server_for_rank``), then ``register_kv_caches`` shares the KV
cache with that server:

- CPU tensors: their storages move into POSIX shm segments in place
  (``connector.shm``), so vLLM and the server use the same pages;
- CUDA tensors: IPC handles (``connector.cuda_ipc``, Note [mpcache CUDA IPC invariants]).

Each step makes at most one ``/cache/retrieve`` (``start_load_kv``) and one
``/cache/store`` (``wait_for_save``) call, batching every request of the step.
Loads follow vLLM's async-load protocol: every load is reported finished in the
same step; a failed one is reported through ``take_load_errors`` (single-group
layouts: the exact blocks) or ``take_transfer_results`` (multi-group layouts: the
request) so vLLM recomputes it. While the server is unhealthy or the caches are not
registered, stores are skipped and loads are reported failed; nothing raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from app.schemas import (
    GroupInfo,
    LayerInfo,
    NegotiateRequest,
    RegisterRequest,
    RetrieveRequest,
    ShmTensor,
    StoreRequest,
    TensorDescriptor,
)
from connector.alignment import KVLayout, check_chunk_size
from connector.client import AsyncControlClient, ControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.cuda_ipc import describe_cuda_tensor, dtype_name
from connector.errors import (
    ConnectorError,
    LayoutError,
    RecoveryError,
    ServerError,
    ServerRejected,
    ServerUnreachable,
    StartupError,
)
from connector.heartbeat import AsyncTransportFactory, Heartbeat
from connector.metadata import StepPlan, TransferOp
from connector.servers import ServerLink, negotiate_until, ranks_of_server, server_for_rank
from connector.shm import ShmKVSegment, segment_name

__all__ = ["WorkerAdapter"]

logger = logging.getLogger("mpcache.connector")


def _block_view(tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
    """``tensor`` (or a view of it) and the dimension that indexes vLLM blocks."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return tensor, dim
    if tensor.dim() and tensor.shape[0] % num_blocks == 0:
        # Kernel-block split: manager block b is rows [b*r, (b+1)*r) of dim 0.
        return tensor.view(num_blocks, -1, *tensor.shape[1:]), 0
    raise LayoutError(
        f"no dimension of a KV tensor of shape {tuple(tensor.shape)} indexes the "
        f"{num_blocks} KV cache blocks"
    )


class WorkerAdapter:
    """The worker role of the connector (see module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        layout: KVLayout,
        *,
        model: str,
        instance_id: str,
        namespace: str,
        rank: int,
        world_size: int,
        num_blocks: int,
        transport: TransportFactory | None = None,
        async_transport: AsyncTransportFactory | None = None,
        start_heartbeat: bool = True,
    ) -> None:
        self.config = config
        self.layout = layout
        self.model = model
        self.instance_id = instance_id
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size
        self.num_blocks = num_blocks
        self.alignment = layout.required_alignment
        self._spans = [g.token_span for g in layout.cacheable_groups]
        self._single_group = len(layout.groups) == 1
        url = server_for_rank(config.server_urls, rank, world_size)
        # A server sees only its own ranks, numbered from 0: a lookup there counts a
        # chunk when ranks 0..ranks_on_server-1 all hold it.
        server_ranks = ranks_of_server(config.server_urls, world_size)[url]
        self.server_rank = server_ranks.index(rank)
        self.ranks_on_server = len(server_ranks)
        self.link = ServerLink(
            url,
            ControlClient(
                url,
                timeout_s=config.request_timeout_s,
                transport=transport(url) if transport else None,
            ),
            role=f"worker rank {rank}",
        )
        try:
            reply = negotiate_until(
                self.link.client,
                self._negotiate_request(),
                time.monotonic() + config.startup_timeout_s,
            )
            self.chunk_size = reply.chunk_size
            check_chunk_size(self.chunk_size, layout.spans)
        except ServerError as exc:
            self.link.client.close()
            raise StartupError(
                f"worker rank {rank}: chunk-size negotiation with {url} failed: {exc}"
            ) from exc
        except BaseException:
            self.link.client.close()
            raise
        self.link.mark_healthy(reply.boot_id)
        self.registration: RegisterRequest | None = None
        self.registered = False
        self.segments: list[ShmKVSegment] = []
        self._uses_cuda = False
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._warned: set[str] = set()
        self.heartbeat = Heartbeat(
            [self.link],
            interval_s=config.heartbeat_interval_s,
            timeout_s=config.heartbeat_timeout_s,
            recover=self._recover,
            name=f"mpcache-heartbeat-worker-{rank}",
            transport_factory=async_transport,
        )
        if start_heartbeat:
            self.heartbeat.start()
        logger.info("mpcache worker rank %d: chunk size %d with %s", rank, self.chunk_size, url)

    def _negotiate_request(self) -> NegotiateRequest:
        return NegotiateRequest(
            required_alignment=self.alignment,
            model=self.model[:512],
            role="worker",
            instance_id=f"{self.instance_id}/{self.rank}"[:256],
        )

    # ----------------------------------------------------------- registration

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Share the KV caches with the server; never raises into vLLM's startup
        for a server-side refusal (the worker runs degraded and keeps retrying)."""
        self.registration = self._build_registration(kv_caches)
        if self.registration is None:
            return
        try:
            reply = self.link.client.register(self.registration)
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
            return
        self.registered = True
        logger.info(
            "mpcache worker rank %d: registered %d layers (%d bytes per chunk)",
            self.rank,
            reply.num_layers,
            reply.chunk_bytes,
        )

    def _build_registration(self, kv_caches: Mapping[str, Any]) -> RegisterRequest | None:
        group_of = {
            name: g.group_id for g in self.layout.cacheable_groups for name in g.layer_names
        }
        segment_of_ptr: dict[int, ShmKVSegment] = {}
        layers: list[LayerInfo] = []
        for name, value in kv_caches.items():
            group_id = group_of.get(name)
            if group_id is None:
                continue  # scratch, transfer-disabled or runner-only layer
            tensors: Sequence[torch.Tensor] = (
                [value] if isinstance(value, torch.Tensor) else list(value)
            )
            descriptors = [self._describe(t, segment_of_ptr) for t in tensors]
            layers.append(LayerInfo(name=name, group_id=group_id, tensors=descriptors))
        if not layers:
            logger.warning(
                "mpcache worker rank %d: no KV cache layer belongs to a cacheable group; "
                "nothing to register",
                self.rank,
            )
            return None
        groups = [
            GroupInfo(group_id=g.group_id, kind=g.kind, token_span=g.token_span)
            for g in self.layout.cacheable_groups
        ]
        return RegisterRequest(
            instance_id=self.instance_id,
            rank=self.server_rank,
            world_size=self.ranks_on_server,
            chunk_size=self.chunk_size,
            namespace=self.namespace,
            groups=groups,
            layers=layers,
        )

    def _describe(
        self, tensor: torch.Tensor, segment_of_ptr: dict[int, ShmKVSegment]
    ) -> TensorDescriptor:
        view, block_dim = _block_view(tensor, self.num_blocks)
        if view.device.type == "cuda":
            self._uses_cuda = True
            return describe_cuda_tensor(view, block_dim)  # Note [mpcache CUDA IPC invariants]
        if view.device.type != "cpu":
            raise LayoutError(f"KV tensors on {view.device} are not supported")
        storage = view.untyped_storage()
        segment = segment_of_ptr.get(storage.data_ptr())
        if segment is None:
            segment = ShmKVSegment.adopt(storage, segment_name(self.rank, len(self.segments)))
            self.segments.append(segment)
            segment_of_ptr[storage.data_ptr()] = segment
        return ShmTensor(
            segment=segment.name,
            offset_bytes=view.storage_offset() * view.element_size(),
            shape=list(view.shape),
            stride=list(view.stride()),
            dtype=dtype_name(view.dtype),
            block_dim=block_dim,
        )

    def unregister(self) -> None:
        """Drop the server's registration (bounded); keeps the segments."""
        if not self.registered:
            return
        self.registered = False
        try:
            self.link.client.unregister(self.instance_id, self.server_rank)
        except ServerError as exc:
            logger.debug("mpcache unregister on %s failed: %s", self.link.url, exc)

    def reregister(self) -> None:
        """Register the same caches again (vLLM wake-up after sleep)."""
        if self.registration is None or self.registered:
            return
        try:
            self.link.client.register(self.registration)
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
            return
        self.registered = True

    async def _recover(self, link: ServerLink, client: AsyncControlClient) -> str:
        reply = await client.negotiate(self._negotiate_request())
        if reply.chunk_size != self.chunk_size:
            raise RecoveryError(
                f"after its restart the server answers chunk size {reply.chunk_size} for "
                f"alignment {self.alignment}, but this worker's KV cache is registered "
                f"with {self.chunk_size}; restart it with the same --chunk-size"
            )
        if self.registration is not None:
            await client.register(self.registration)
            self.registered = True
        return reply.boot_id

    # ------------------------------------------------------------------ health

    @property
    def available(self) -> bool:
        return self.link.healthy and self.registered

    def _call_failed(self, what: str, exc: ServerError, *, force: bool = False) -> None:
        if (
            force
            or isinstance(exc, ServerUnreachable)
            or (isinstance(exc, ServerRejected) and exc.status in (404, 409))
        ):
            self.link.mark_unhealthy(f"{what} failed: {exc}")
            self.heartbeat.wake()
        key = f"{what}:{type(exc).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "mpcache worker rank %d: %s on %s failed (reported once): %s",
                self.rank,
                what,
                self.link.url,
                exc,
            )

    def _sync_device(self) -> None:
        if self._uses_cuda:
            torch.cuda.current_stream().synchronize()  # Note [mpcache CUDA IPC invariants]

    # ------------------------------------------------------------------- loads

    def start_load(self, plan: StepPlan) -> None:
        """Load the step's chunks (one batched call); record results for vLLM."""
        loads = plan.loads
        if not loads:
            return
        self._finished_recving.update(op.request_id for op in loads)
        if not self.available:
            for op in loads:
                self._fail_load(op, op.touched_block_ids(self._spans))
            return
        body = RetrieveRequest(
            instance_id=self.instance_id,
            rank=self.server_rank,
            requests=[op.to_item(self.namespace) for op in loads],
        )
        self._sync_device()
        try:
            reply = self.link.client.retrieve(body)
        except ServerError as exc:
            self._call_failed("retrieve", exc)
            for op in loads:
                self._fail_load(op, op.touched_block_ids(self._spans))
            return
        results = {r.request_id: r for r in reply.results}
        for op in loads:
            result = results.get(op.request_id)
            if result is None:
                self._fail_load(op, op.touched_block_ids(self._spans))
                continue
            loaded_end = op.start_token + max(0, result.loaded_tokens)
            failed = set(result.failed_block_ids)
            if loaded_end < op.end_token:
                rest = TransferOp(
                    op.request_id, loaded_end, op.end_token, "", op.block_ids, op.cache_salt
                )
                failed |= rest.touched_block_ids(self._spans)
            failed.discard(0)
            if failed:
                self._fail_load(op, failed)

    def _fail_load(self, op: TransferOp, block_ids: set[int]) -> None:
        if not block_ids:
            return
        if self._single_group:
            self._load_errors.update(block_ids)
        else:
            # Block ids are per group, so vLLM takes only request-level failures.
            self._failed_recving.add(op.request_id)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads) since the last call."""
        finished, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return finished, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ stores

    def save(self, plan: StepPlan) -> None:
        """Store the step's finished chunks (one batched call); skipped if degraded."""
        stores = plan.stores
        if not stores or not self.available:
            return
        body = StoreRequest(
            instance_id=self.instance_id,
            rank=self.server_rank,
            requests=[op.to_item(self.namespace) for op in stores],
        )
        self._sync_device()
        try:
            reply = self.link.client.store(body)
        except ServerError as exc:
            self._call_failed("store", exc)
            return
        failed = sum(r.failed_chunks for r in reply.results)
        if failed:
            logger.debug("mpcache worker rank %d: %d chunk(s) not stored", self.rank, failed)

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the heartbeat, unregister, unlink this worker's segments."""
        self.heartbeat.stop()
        if self.link.healthy:
            self.unregister()
        for segment in self.segments:
            try:
                segment.unlink()
            except ConnectorError as exc:
                logger.warning("mpcache: %s", exc)
        self.link.client.close()
