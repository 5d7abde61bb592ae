"""A worker's KV cache registration: what it shares with its server, and how.

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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from connector.alignment import KVLayout
from connector.client import AsyncControlClient
from connector.errors import LayoutError, ServerError
from connector.servers import ServerLink
from connector.shm import MemfdKVSegment, RegistrationChannel, memfd_name
from contract.cuda_ipc import describe as describe_cuda_tensor
from contract.dtypes import dtype_name
from contract.schemas import (
    GroupInfo,
    LayerInfo,
    MemfdTensor,
    RegisterRequest,
    RegisterResponse,
    TensorDescriptor,
)

__all__ = ["KVRegistration", "block_view"]

logger = logging.getLogger("mpcache.connector")

_SEGMENT_TICKET = "segment-{}"
"""Placeholder ticket (URL-safe, as tickets are) of the i-th memfd in the kept
registration; a fresh ticket replaces it at each registration (tickets are good for
one)."""


def block_view(tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
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


class KVRegistration:
    """One worker's KV caches as its server knows them (see module docstring).

    Owns the worker's memfds (``segments``, closed by ``close``) and its end of the
    registration socket. ``request`` is kept with placeholder tickets
    (``_with_tickets``), so every registration, the first and each one after a
    server restart or a wake-up, sends the same caches with fresh tickets.
    """

    def __init__(
        self,
        link: ServerLink,
        layout: KVLayout,
        *,
        instance_id: str,
        namespace: str,
        chunk_size: int,
        rank: int,
        server_rank: int,
        ranks_on_server: int,
        num_blocks: int,
        timeout_s: float,
    ) -> None:
        self._link = link
        self._layout = layout
        self._instance_id = instance_id
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._rank = rank
        self._server_rank = server_rank
        self._ranks_on_server = ranks_on_server
        self._num_blocks = num_blocks
        self.request: RegisterRequest | None = None
        """The registration to send, with placeholder tickets (``_with_tickets``)."""
        self.registered = False
        self.token = secrets.token_urlsafe(32)
        self.ops_path: str | None = None
        """The ops socket the latest registration's server named (None: none)."""
        self.segments: list[MemfdKVSegment] = []
        self.channel = RegistrationChannel(timeout_s)
        self.uses_cuda = False
        self.cuda_device: torch.device | None = None
        """The GPU the KV caches are on, once described (None: CPU)."""

    # ------------------------------------------------------------------ build

    def build(self, kv_caches: Mapping[str, Any]) -> RegisterRequest | None:
        """Describe ``kv_caches`` (moving CPU storages into memfds) and keep that as
        the registration; None (logged) when no layer belongs to a cacheable group."""
        self.request = self._describe_caches(kv_caches)
        return self.request

    def _describe_caches(self, kv_caches: Mapping[str, Any]) -> RegisterRequest | None:
        group_of = {
            name: g.group_id for g in self._layout.cacheable_groups for name in g.layer_names
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
                self._rank,
            )
            return None
        groups = [
            GroupInfo(group_id=g.group_id, kind=g.kind, token_span=g.token_span)
            for g in self._layout.cacheable_groups
        ]
        return RegisterRequest(
            instance_id=self._instance_id,
            rank=self._server_rank,
            world_size=self._ranks_on_server,
            chunk_size=self._chunk_size,
            namespace=self._namespace,
            groups=groups,
            layers=layers,
        )

    def _describe(self, tensor: torch.Tensor, segment_of_ptr: dict[int, int]) -> TensorDescriptor:
        view, block_dim = block_view(tensor, self._num_blocks)
        if view.device.type == "cuda":
            self.uses_cuda = True
            self.cuda_device = view.device
            return describe_cuda_tensor(view, block_dim)  # Note [mpcache CUDA IPC invariants]
        if view.device.type != "cpu":
            raise LayoutError(f"KV tensors on {view.device} are not supported")
        storage = view.untyped_storage()
        index = segment_of_ptr.get(storage.data_ptr())
        if index is None:
            index = len(self.segments)
            self.segments.append(
                MemfdKVSegment.adopt(storage, memfd_name(self._rank, len(self.segments)))
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

    # --------------------------------------------------------------- register

    def register(self) -> RegisterResponse:
        """One registration: memfds over the socket, then ``POST /register``
        (``SegmentError``, ``ServerError`` when it fails)."""
        client = self._link.client
        info = client.registration_info()
        tickets = self._tickets(info.socket_path)
        reply = client.register(self._with_tickets(tickets), registration_token=self.token)
        self.token = reply.registration_token
        self.ops_path = info.ops_socket_path
        self.registered = True
        return reply

    async def register_async(self, client: AsyncControlClient) -> None:
        """``register`` from the heartbeat's loop (re-joining a restarted server); the
        socket handshake runs in a worker thread, off the loop."""
        info = await client.registration_info()
        tickets = await asyncio.to_thread(self._tickets, info.socket_path)
        registered = await client.register(
            self._with_tickets(tickets), registration_token=self.token
        )
        self.token = registered.registration_token
        self.ops_path = info.ops_socket_path
        self.registered = True

    def unregister(self) -> None:
        """Drop the server's registration (bounded); keeps the memfds."""
        if not self.registered:
            return
        self.registered = False
        try:
            self._link.client.unregister(
                self._instance_id, self._server_rank, registration_token=self.token
            )
        except ServerError as exc:
            logger.debug("mpcache unregister on %s failed: %s", self._link.url, exc)

    def close(self) -> None:
        """Disconnect from the registration socket and close the memfds."""
        self.channel.close()
        for segment in self.segments:
            segment.close()

    def _with_tickets(self, tickets: Sequence[str]) -> RegisterRequest:
        """The kept registration with fresh tickets in place of its placeholders."""
        reg = self.request
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
