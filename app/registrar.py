"""Worker registrations: ``POST /register`` and ``DELETE /register/...``."""

from __future__ import annotations

import logging

from app.chunk_size import ChunkSizeAuthority
from app.telemetry import Telemetry
from contract.errors import ChunkSizeMismatch, InvalidDescriptor
from contract.schemas import RegisterRequest, RegisterResponse
from dataplane.descriptors import Redeemed
from dataplane.device_path import DevicePath
from dataplane.fdgate import FdGate
from dataplane.registry import Registry, build_registration, memfd_tickets

__all__ = ["Registrar"]

logger = logging.getLogger(__name__)


class Registrar:
    """Registers workers' KV caches in the registry, at the final chunk size.

    A registration is its registrant's: ``register`` returns a secret token, and
    store, retrieve, unregister and a replacing register of that ``(instance_id,
    rank)`` need it (403 otherwise; ``dataplane.registry``). Its memfds come from
    the registration socket (``dataplane.fdgate``), whose connection's close
    releases it.
    """

    def __init__(
        self,
        *,
        chunk_size: ChunkSizeAuthority,
        registry: Registry,
        telemetry: Telemetry,
        gate: FdGate | None = None,
        device: DevicePath | None = None,
    ) -> None:
        self._chunk_size = chunk_size
        self._registry = registry
        self._gate = gate
        self._device = device
        self._register_seconds = telemetry.op_seconds.labels("register")
        self._unregister_seconds = telemetry.op_seconds.labels("unregister")

    def register(self, req: RegisterRequest, *, token: str | None = None) -> RegisterResponse:
        """Register ``req``; ``token`` is needed to replace an existing registration.

        Its tickets are used up whatever the outcome: a refused registration leaves
        nothing mapped. A given ``token`` becomes the registration's secret."""
        with self._register_seconds.time():
            redeemed = self._redeem(req)
            try:
                return self._register(req, token, redeemed)
            except BaseException:
                for memory in (redeemed or (0, {}))[1].values():
                    memory.close()
                raise

    def unregister(self, instance_id: str, rank: int, token: str | None) -> None:
        with self._unregister_seconds.time():
            self._registry.remove(instance_id, rank, token)

    def _redeem(self, req: RegisterRequest) -> Redeemed | None:
        tickets = memfd_tickets(req)
        if not tickets:
            return None
        if self._gate is None:
            raise InvalidDescriptor(
                "this server takes no memfd tickets (no registration socket)",
                reason="unknown-ticket",
            )
        return self._gate.take(tickets)

    def _register(
        self, req: RegisterRequest, token: str | None, redeemed: Redeemed | None
    ) -> RegisterResponse:
        size = self._chunk_size.final(before="registering KV caches").chunk_size
        if req.chunk_size != size:
            raise ChunkSizeMismatch(
                f"the registration carries chunk size {req.chunk_size} but this server's "
                f"chunk size is {size}; re-negotiate and register with {size}",
                chunk_size=size,
                requested_chunk_size=req.chunk_size,
            )
        reg = build_registration(req, redeemed)
        gate = self._gate
        refreshed = self._registry.add(
            reg, token=token, alive=gate.alive if gate is not None else None
        )
        if reg.mapping is not None:
            reg.mapping.start_prefault()  # a CPU worker's: its first retrieves do not fault
        if self._device is not None:
            self._device.registered(reg)  # a GPU's: the pool starts pinning for DMA
        peer = gate.peer(reg.conn_id) if gate is not None and reg.conn_id is not None else None
        logger.info(
            "%s instance %r rank %d: %d tensors, %d bytes per chunk%s",
            "refreshed" if refreshed else "registered",
            req.instance_id,
            req.rank,
            len(reg.layout.tensors),
            reg.chunk_bytes,
            f" (worker pid {peer.pid})" if peer is not None else "",
        )
        return RegisterResponse(
            instance_id=req.instance_id,
            rank=req.rank,
            chunk_size=size,
            num_layers=len(req.layers),
            chunk_bytes=reg.chunk_bytes,
            refreshed=refreshed,
            registration_token=reg.token,
        )
