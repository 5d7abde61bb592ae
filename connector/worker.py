"""Worker-side adapter: KV cache registration and the step's batched loads/stores.

Runs in each vLLM worker process. At start it negotiates with its own server
(chosen by rank, ``connector.servers.server_for_rank``), then
``register_kv_caches`` shares the KV cache with that server:

- CPU tensors: their storages move into sealed memfds in place (``connector.shm``),
  so vLLM and the server use the same pages. Each registration passes the
  descriptors over the server's registration socket (``GET /register`` names it)
  for one-time tickets, then registers with those; the socket stays connected for
  the worker's life, so a dead worker's registration is released by the server;
- CUDA tensors: IPC handles (``contract.cuda_ipc``, Note [mpcache CUDA IPC invariants]).

The registration's secret (``registration_token``) is the worker's own, chosen once
and sent with its first registration too, so a registration whose reply was lost
(the server was slow) is refreshed by the retry rather than refused as another
client's. It goes with every store, retrieve, unregister and re-registration.

Each step makes at most one ``/cache/retrieve`` (``start_load_kv``) and one
``/cache/store`` (``wait_for_save``) call, batching every request of the step.
Loads follow vLLM's async-load protocol: every load is reported finished in the
same step; a failed one is reported through ``take_load_errors`` (single-group
layouts: the exact blocks) or ``take_transfer_results`` (multi-group layouts: the
request) so vLLM recomputes it. While the server is unhealthy or the caches are not
registered, stores are skipped and loads are reported failed; nothing raises.
If anything unexpected escapes a load (a CUDA error, a bad reply), every load of
the step is reported failed before the error propagates, never finished with
unwritten blocks.

Timeouts (the rule for every call that hands blocks to the server): a store or
retrieve waits ``request_timeout_s`` (``T``) for its reply, counted by httpx from
when the request has been sent; once it gives up, vLLM reuses the blocks. So the
call carries ``timeout_s = server_budget_s(T) = 0.75 * T`` and the server, counting
from receipt, commits no further chunk and writes no further block once that budget
has passed (``contract.schemas`` ``_TransferBatch.timeout_s``). The server stops at about
``send + transit + 0.75 * T``, before the client gives up at ``send + T``, as long as
the one-way transit plus the chunk copy in flight at the deadline take less than
``0.25 * T`` (0.5 s with the default ``T`` of 2 s). A call without this budget, or a
client timeout shorter than the one the budget was computed from, breaks the rule.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from connector.alignment import KVLayout, check_chunk_size
from connector.client import AsyncControlClient, ControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.errors import LayoutError, SegmentError, ServerError, StartupError
from connector.heartbeat import AsyncTransportFactory, Heartbeat
from connector.metadata import StepPlan, TransferOp
from connector.servers import (
    ServerLink,
    negotiate_request,
    negotiate_until,
    ranks_of_server,
    renegotiate,
    server_for_rank,
)
from connector.shm import MemfdKVSegment, RegistrationChannel, memfd_name
from contract.cuda_ipc import describe as describe_cuda_tensor
from contract.dtypes import dtype_name
from contract.schemas import (
    GroupInfo,
    LayerInfo,
    MemfdTensor,
    NegotiateRequest,
    RegisterRequest,
    RegisterResponse,
    RetrieveRequest,
    StoreRequest,
    TensorDescriptor,
)

__all__ = ["SERVER_BUDGET_FRACTION", "WorkerAdapter", "server_budget_s"]

logger = logging.getLogger("mpcache.connector")

SERVER_BUDGET_FRACTION = 0.75
"""Share of a store/retrieve call's client timeout the server may spend on it."""

_MAX_SERVER_BUDGET_S = 3600.0  # the schema's bound on timeout_s


def server_budget_s(client_timeout_s: float) -> float:
    """The ``timeout_s`` to send with a call the client waits ``client_timeout_s`` for.

    Strictly less than the client's timeout, leaving a quarter of it for transit and
    the chunk in flight (see the module docstring).
    """
    return min(SERVER_BUDGET_FRACTION * client_timeout_s, _MAX_SERVER_BUDGET_S)


def _block_view(tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
    """``tensor`` (or a view of it) and the dimension that indexes vLLM blocks.

    vLLM's known layouts are tried before any size matching, so a dimension that
    happens to equal ``num_blocks`` (2 KV planes, the head count) is not mistaken
    for the block dimension:

    1. ``[2, num_blocks, block_size, heads, head_size]`` (5 dims, K/V first): dim 1,
       even when ``num_blocks == 2``;
    2. blocks first: vLLM 0.33's ``[blocks, heads, slots, bytes]`` per-layer views,
       ``[num_blocks, 2, ...]``, MLA and Mamba state: dim 0;
    3. ``[2, num_blocks, ...]`` at any other rank: dim 1;
    4. kernel-block split (vLLM ``group_kernel_blocks``): dim 0 holds
       ``num_blocks * r`` kernel blocks, manager block ``b`` being rows
       ``[b*r, (b+1)*r)``: viewed as ``[num_blocks, r, ...]``, dim 0.
    """
    shape = tuple(tensor.shape)
    if len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return tensor, 1
    if shape and shape[0] == num_blocks:
        return tensor, 0
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return tensor, 1
    if shape and num_blocks > 0 and shape[0] % num_blocks == 0:
        return tensor.view(num_blocks, -1, *shape[1:]), 0
    raise LayoutError(
        f"no dimension of a KV tensor of shape {shape} indexes the {num_blocks} KV "
        "cache blocks in a layout mpcache knows ([num_blocks, ...], "
        "[2, num_blocks, ...] or kernel blocks [num_blocks * r, ...])"
    )


_SEGMENT_TICKET = "segment:{}"
"""Placeholder ticket of the i-th memfd in the kept registration; a fresh ticket
replaces it at each registration (tickets are good for one)."""


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
                api_token=config.api_token,
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
        """The registration to send, with placeholder tickets (``_with_tickets``)."""
        self.registered = False
        self.registration_token = secrets.token_urlsafe(32)
        self.segments: list[MemfdKVSegment] = []
        self.channel = RegistrationChannel(config.request_timeout_s)
        self._uses_cuda = False
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.heartbeat = Heartbeat(
            [self.link],
            interval_s=config.heartbeat_interval_s,
            timeout_s=config.heartbeat_timeout_s,
            recover=self._recover,
            name=f"mpcache-heartbeat-worker-{rank}",
            transport_factory=async_transport,
            api_token=config.api_token,
        )
        if start_heartbeat:
            self.heartbeat.start()
        logger.info("mpcache worker rank %d: chunk size %d with %s", rank, self.chunk_size, url)

    def _negotiate_request(self) -> NegotiateRequest:
        return negotiate_request(
            self.alignment,
            model=self.model,
            role="worker",
            instance_id=f"{self.instance_id}/{self.rank}",
        )

    # ----------------------------------------------------------- registration

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Share the KV caches with the server; never raises into vLLM's startup
        for a server-side refusal (the worker runs degraded and keeps retrying)."""
        self.registration = self._build_registration(kv_caches)
        if self.registration is None:
            return
        try:
            reply = self._register()
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
            return
        except SegmentError as exc:
            logger.warning("mpcache worker rank %d: registration failed: %s", self.rank, exc)
            self.link.mark_unhealthy(f"register: {exc}")
            self.heartbeat.wake()
            return
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
        segment_of_ptr: dict[int, int] = {}
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

    def _describe(self, tensor: torch.Tensor, segment_of_ptr: dict[int, int]) -> TensorDescriptor:
        view, block_dim = _block_view(tensor, self.num_blocks)
        if view.device.type == "cuda":
            self._uses_cuda = True
            return describe_cuda_tensor(view, block_dim)  # Note [mpcache CUDA IPC invariants]
        if view.device.type != "cpu":
            raise LayoutError(f"KV tensors on {view.device} are not supported")
        storage = view.untyped_storage()
        index = segment_of_ptr.get(storage.data_ptr())
        if index is None:
            index = len(self.segments)
            self.segments.append(
                MemfdKVSegment.adopt(storage, memfd_name(self.rank, len(self.segments)))
            )
            segment_of_ptr[storage.data_ptr()] = index
        return MemfdTensor(
            ticket=_SEGMENT_TICKET.format(index),
            offset_bytes=view.storage_offset() * view.element_size(),
            shape=list(view.shape),
            stride=list(view.stride()),
            dtype=dtype_name(view.dtype),
            block_dim=block_dim,
        )

    def _with_tickets(self, tickets: Sequence[str]) -> RegisterRequest:
        """The kept registration with fresh tickets in place of its placeholders."""
        reg = self.registration
        assert reg is not None
        by_placeholder = {_SEGMENT_TICKET.format(i): t for i, t in enumerate(tickets)}
        layers = [
            layer.model_copy(
                update={
                    "tensors": [
                        t.model_copy(update={"ticket": by_placeholder[t.ticket]})
                        if isinstance(t, MemfdTensor)
                        else t
                        for t in layer.tensors
                    ]
                }
            )
            for layer in reg.layers
        ]
        return reg.model_copy(update={"layers": layers})

    def _tickets(self, socket_path: str) -> list[str]:
        """Pass every memfd to the server; their fresh tickets (``SegmentError``)."""
        if not self.segments:
            return []
        return self.channel.handshake(socket_path, [seg.fd for seg in self.segments])

    def _register(self) -> RegisterResponse:
        """One registration: memfds over the socket, then ``POST /register``."""
        tickets = self._tickets(self.link.client.registration_info().socket_path)
        reply = self.link.client.register(
            self._with_tickets(tickets), registration_token=self.registration_token
        )
        self.registration_token = reply.registration_token
        self.registered = True
        return reply

    def unregister(self) -> None:
        """Drop the server's registration (bounded); keeps the memfds."""
        if not self.registered:
            return
        self.registered = False
        try:
            self.link.client.unregister(
                self.instance_id, self.server_rank, registration_token=self.registration_token
            )
        except ServerError as exc:
            logger.debug("mpcache unregister on %s failed: %s", self.link.url, exc)

    def reregister(self) -> None:
        """Register the same caches again (vLLM wake-up after sleep)."""
        if self.registration is None or self.registered:
            return
        try:
            self._register()
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
        except SegmentError as exc:
            logger.warning("mpcache worker rank %d: registration failed: %s", self.rank, exc)

    async def _recover(self, link: ServerLink, client: AsyncControlClient) -> str:
        reply = await renegotiate(
            client,
            self._negotiate_request(),
            self.chunk_size,
            holder="this worker's registered KV cache",
        )
        if self.registration is not None:
            info = await client.registration_info()
            tickets = await asyncio.to_thread(self._tickets, info.socket_path)
            registered = await client.register(
                self._with_tickets(tickets), registration_token=self.registration_token
            )
            self.registration_token = registered.registration_token
            self.registered = True
        return reply.boot_id

    # ------------------------------------------------------------------ health

    @property
    def available(self) -> bool:
        return self.link.healthy and self.registered

    def _call_failed(self, what: str, exc: ServerError, *, force: bool = False) -> None:
        if self.link.call_failed(what, exc, force=force):
            self.heartbeat.wake()

    def _sync_device(self) -> None:
        if self._uses_cuda:
            torch.cuda.current_stream().synchronize()  # Note [mpcache CUDA IPC invariants]

    # ------------------------------------------------------------------- loads

    def start_load(self, plan: StepPlan) -> None:
        """Load the step's chunks (one batched call); record results for vLLM.

        Every load is reported finished this step. One that may have left blocks
        unwritten is reported failed too, including when an unexpected error
        escapes (it is re-raised after every load of the step is marked failed).
        """
        if plan.failed_loads:
            # Loads the scheduler accepted but could not plan: request-level failures.
            self._finished_recving.update(plan.failed_loads)
            self._failed_recving.update(plan.failed_loads)
        loads = plan.loads
        if not loads:
            return
        self._finished_recving.update(op.request_id for op in loads)
        try:
            self._load(loads)
        except BaseException:
            for op in loads:
                self._fail_load(op, op.nonnull_block_ids())
            raise

    def _load(self, loads: Sequence[TransferOp]) -> None:
        if not self.available:
            for op in loads:
                self._fail_load(op, op.touched_block_ids(self._spans))
            return
        timeout_s = self.config.request_timeout_s
        body = RetrieveRequest(
            instance_id=self.instance_id,
            rank=self.server_rank,
            requests=[op.to_item(self.namespace) for op in loads],
            timeout_s=server_budget_s(timeout_s),
        )
        self._sync_device()
        try:
            reply = self.link.client.retrieve(
                body, timeout_s=timeout_s, registration_token=self.registration_token
            )
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
        """(finished loads, failed loads) since the last call; failed ones are in both."""
        finished, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return finished, failed

    def take_finished_loads(self) -> set[str]:
        """Finished loads for a caller that cannot take request-level failures.

        vLLM's older ``get_finished`` reports finished ids only. A load that failed
        by blocks is still reported through ``take_load_errors``, so it is returned
        here; one that failed as a request (``failed_recving``) would read as a
        success, so it stays queued for the next ``take_transfer_results``.
        """
        finished = self._finished_recving - self._failed_recving
        self._finished_recving = set(self._failed_recving)
        return finished

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ stores

    def save(self, plan: StepPlan) -> None:
        """Store the step's finished chunks (one batched call); skipped if degraded."""
        stores = plan.stores
        if not stores or not self.available:
            return
        timeout_s = self.config.request_timeout_s
        body = StoreRequest(
            instance_id=self.instance_id,
            rank=self.server_rank,
            requests=[op.to_item(self.namespace) for op in stores],
            timeout_s=server_budget_s(timeout_s),
        )
        self._sync_device()
        try:
            reply = self.link.client.store(
                body, timeout_s=timeout_s, registration_token=self.registration_token
            )
        except ServerError as exc:
            self._call_failed("store", exc)
            return
        failed = sum(r.failed_chunks for r in reply.results)
        if failed:
            logger.debug("mpcache worker rank %d: %d chunk(s) not stored", self.rank, failed)

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the heartbeat, unregister, disconnect, close this worker's memfds."""
        self.heartbeat.stop()
        if self.link.healthy:
            self.unregister()
        self.channel.close()
        for segment in self.segments:
            segment.close()
        self.link.client.close()
