"""The worker's half of ordering the server's GPU copies after vLLM's writes.

Note [mpcache CUDA IPC invariants], rule 5 (``contract.cuda_ipc``): before each
store or retrieve call the worker adapter asks ``DeviceOrder.handle()`` for the
``event_ipc_b64`` to send. For a KV cache on a GPU it records one interprocess
CUDA event on vLLM's current stream (what vLLM enqueued so far: the step's writes
of the blocks a store reads, the reads of blocks a retrieve overwrites) and returns
the event's IPC handle; the server makes its own stream wait for it, so vLLM's
step never waits for its device. For CPU caches it returns None and does nothing.

One event serves every call: it is re-recorded each time, and a server wait that
sees a later record only waits for more (rule 5). Where an interprocess event
cannot be made (the platform has no CUDA IPC events), ``handle`` falls back to
synchronising vLLM's stream, as every call did before, and returns None; the reason
is logged once.
"""

from __future__ import annotations

import base64
import logging
from typing import Protocol

import torch

__all__ = ["DeviceOrder", "HasCudaDevice"]

logger = logging.getLogger("mpcache.connector")


class HasCudaDevice(Protocol):
    """What ``DeviceOrder`` reads of the worker's registration
    (``connector.registration.KVRegistration``)."""

    @property
    def cuda_device(self) -> torch.device | None: ...


class DeviceOrder:
    """The event handle each store or retrieve call of one worker sends (see the
    module docstring). ``registration`` says, once the KV caches are described,
    which GPU they are on (None: CPU)."""

    def __init__(self, registration: HasCudaDevice) -> None:
        self._registration = registration
        self._event: torch.cuda.Event | None = None
        self._handle_b64: str | None = None
        self._fallback: str | None = None
        """Why no interprocess event could be made (then every call synchronises)."""

    @property
    def fallback(self) -> str | None:
        return self._fallback

    def handle(self) -> str | None:
        """The ``event_ipc_b64`` for the call about to be sent (recorded now, on
        vLLM's current stream), or None: CPU caches, or the fallback (vLLM's stream
        synchronised instead). CUDA errors propagate (the caller fails the call)."""
        device = self._registration.cuda_device
        if device is None:
            return None
        stream = torch.cuda.current_stream(device)
        if self._fallback is None and self._event is None:
            self._make_event(device)
        if self._event is None:
            stream.synchronize()  # Note [mpcache CUDA IPC invariants], rule 5: fallback
            return None
        self._event.record(stream)
        return self._handle_b64

    def _make_event(self, device: torch.device) -> None:
        try:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                handle = bytes(event.ipc_handle())  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # torch reports CUDA failures as RuntimeError
            self._fallback = str(exc)
            logger.warning(
                "mpcache: no interprocess CUDA event on %s (%s); each store and retrieve "
                "synchronises vLLM's stream instead",
                device,
                exc,
            )
            return
        self._event = event
        self._handle_b64 = base64.b64encode(handle).decode()
