"""The GPU path's server half: the pool pinned for DMA, the server's own CUDA stream
per GPU, and each call's copies ordered after the worker's writes.

Rules 5 and 7 of Note [mpcache CUDA IPC invariants] (``contract.cuda_ipc``) are
kept here:

- ``PoolPinning`` page-locks the pool (``cudaHostRegister``) once a CUDA
  registration exists, and unregisters it at shutdown, before the pool is unmapped;
- ``DevicePath.ordered`` wraps one store or retrieve call of a CUDA registration:
  it makes the server's stream for that GPU wait for the worker's event, makes that
  stream current for the call's copies (``dataplane.transfer`` queues them on the
  current stream), and synchronises that stream, never the device, before the
  reply. For a CPU registration it does nothing, and refuses an event handle (422);
- ``CopyWindow`` keeps a call's chunks whose copies are queued but not yet waited
  for, so one chunk's copy overlaps the next chunk's kernel launches, and runs each
  chunk's commit (store) or count (retrieve) only once its copies have run.

Why the pool is registered rather than copied through pinned staging buffers: the
pool is a ``MAP_SHARED`` tmpfs mapping whose pages are all allocated when it is
created (``posix_fallocate``) and that is never truncated, remapped or punched
while the server runs, which is what ``cudaHostRegister`` needs of memory it pins;
registered, every chunk moves in one DMA between GPU memory and its pool pages,
where staging would add a host copy of every byte and memory for the buffers.

Nothing here initialises CUDA until a CUDA registration arrives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import torch

from contract.errors import InvalidRequest
from contract.shm_naming import fmt_bytes
from dataplane.cuda_ipc import open_event
from dataplane.registry import Registration

__all__ = [
    "HOST_REGISTER_PORTABLE",
    "MAX_OPEN_EVENTS",
    "WINDOW_CHUNKS",
    "CopyWindow",
    "Cudart",
    "DevicePath",
    "PoolPinning",
]

logger = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: every CUDA context treats the memory as pinned, so
one registration serves every GPU the server copies for."""

MAX_OPEN_EVENTS = 8
"""Most worker events one registration keeps open (a worker sends one, or a few in
turn); the oldest is closed past it."""

WINDOW_CHUNKS = 2
"""Chunks of one call whose GPU copies may be queued and not yet waited for: with
two, one chunk's copy to or from the pool runs while the next one's kernels are
launched. More would only stretch how long a call may copy after its deadline."""

PinState = Literal["off", "pinning", "pinned", "failed", "disabled"]


class Cudart(Protocol):
    """The libcudart calls pinning makes (``torch.cuda.cudart()``; a fake in tests)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...
    def cudaHostUnregister(self, ptr: int) -> Any: ...
    def cudaGetErrorString(self, error: Any) -> str: ...


def _torch_cudart() -> Cudart:
    cudart: Cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return cudart


def _on_own_thread(call: Callable[[], Any], name: str) -> Any:
    """``call()`` on a thread of its own, waited for; its result (or its error).

    A failed libcudart call leaves the calling thread's last CUDA error set, and
    torch's binding does not clear it: torch's next kernel-launch check on that
    thread would report it. A thread that does nothing else leaves no such trace.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class PoolPinning:
    """Page-locks the pool's mapping for DMA: one ``cudaHostRegister`` of all of it.

    ``start`` (idempotent; the first CUDA registration calls it) registers it in a
    background thread: pinning touches every page, so on a large pool it takes a
    while, and copies go through pageable memory until it is done (correct, slower).
    ``state`` says where it stands; a failure is logged once with CUDA's reason and
    leaves the pool pageable. ``close`` waits for a registration in progress and
    unregisters; the caller closes this before it unmaps the pool, once no copy
    runs. ``enabled`` False (``--no-pin-pool``) never pins.
    """

    def __init__(
        self,
        address: int,
        size_bytes: int,
        *,
        enabled: bool = True,
        cudart: Callable[[], Cudart] | None = None,
    ) -> None:
        self.address = address
        self.size_bytes = size_bytes
        self.state: PinState = "off" if enabled else "disabled"
        self.reason: str | None = None
        """Why pinning failed (CUDA's error), for the log and tests."""
        self._cudart = cudart or _torch_cudart  # torch.cuda.cudart(), called when pinning
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self.state != "off":
                return
            self.state = "pinning"
            self._thread = threading.Thread(
                target=self._register, name="mpcache-pin-pool", daemon=True
            )
            self._thread.start()

    def wait(self, timeout_s: float | None = None) -> PinState:
        """Wait for a registration in progress (up to ``timeout_s``); the state."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.state

    def _register(self) -> None:
        begin = time.monotonic()
        try:
            cudart = self._cudart()
            error = cudart.cudaHostRegister(self.address, self.size_bytes, HOST_REGISTER_PORTABLE)
            reason = None if int(error) == 0 else _error_text(cudart, error)
        except Exception as exc:  # no libcudart, a CUDA init failure: pageable then
            reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.state = "pinned" if reason is None else "failed"
            self.reason = reason
        if reason is None:
            logger.info(
                "pool pinned for DMA (cudaHostRegister of %s) in %.2fs",
                fmt_bytes(self.size_bytes),
                time.monotonic() - begin,
            )
        else:
            logger.warning(
                "pool not pinned (cudaHostRegister of %s failed: %s); GPU copies go "
                "through pageable memory, at a lower bandwidth",
                fmt_bytes(self.size_bytes),
                reason,
            )

    def close(self) -> None:
        """Unregister the pool (after any registration in progress ends). Idempotent."""
        self.wait()
        with self._lock:
            pinned = self.state == "pinned"
            if pinned:
                self.state = "off"
        if not pinned:
            return
        try:
            cudart = self._cudart()
            error = _on_own_thread(
                lambda: cudart.cudaHostUnregister(self.address), "mpcache-unpin-pool"
            )
        except Exception as exc:
            logger.warning("pool unpinning failed: %s: %s", type(exc).__name__, exc)
            return
        if int(error) != 0:
            logger.warning("pool unpinning failed: %s", _error_text(cudart, error))


def _error_text(cudart: Cudart, error: Any) -> str:
    try:
        text = str(cudart.cudaGetErrorString(error))
    except Exception:
        text = "unknown error"
    return f"{text} (cudaError {int(error)})"


class DevicePath:
    """The server's CUDA streams (one per GPU, made on first use) and the ordering of
    each call's copies (see the module docstring). Owned by the runtime; ``close``
    before the pool. ``pinning`` None: the pool is never pinned (tests, benches)."""

    def __init__(self, pinning: PoolPinning | None = None) -> None:
        self.pinning = pinning
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def registered(self, reg: Registration) -> None:
        """A registration was installed: start pinning the pool if it is a GPU's."""
        if reg.cuda_device is not None and self.pinning is not None:
            self.pinning.start()

    def stream(self, device: int) -> torch.cuda.Stream:
        """The server's own stream on ``device``."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                    device=device
                )
            return stream

    @contextlib.contextmanager
    def ordered(self, reg: Registration, event_ipc_b64: str | None) -> Iterator[None]:
        """Run the body's copies ordered after ``event_ipc_b64`` on the server's
        stream for ``reg``'s GPU, and synchronise that stream when it ends; nothing
        for a CPU registration, which must send no event (``InvalidRequest``)."""
        device = reg.cuda_device
        if device is None:
            if event_ipc_b64 is not None:
                raise InvalidRequest(
                    f"event_ipc_b64 was sent, but instance {reg.instance_id!r} rank "
                    f"{reg.rank} registered CPU tensors: a CUDA event orders copies of GPU "
                    "tensors only; send it only with a cuda_ipc registration",
                    instance_id=reg.instance_id,
                    rank=reg.rank,
                )
            yield
            return
        self.registered(reg)
        stream = self.stream(device)
        event = None if event_ipc_b64 is None else self._event(reg, device, event_ipc_b64)
        with torch.cuda.stream(stream):
            if event is not None:
                stream.wait_event(event)  # on the GPU: this thread does not wait
            try:
                yield
            finally:
                stream.synchronize()  # the server's stream, never the device

    def _event(self, reg: Registration, device: int, handle_b64: str) -> torch.cuda.Event:
        """The worker's event named by ``handle_b64``, opened once per registration."""
        with self._lock:
            event = reg.events.get(handle_b64)
            if event is None:
                event = open_event(handle_b64, device)
                if len(reg.events) >= MAX_OPEN_EVENTS:
                    del reg.events[next(iter(reg.events))]
                reg.events[handle_b64] = event
            return event

    def close(self) -> None:
        """Wait for the copies on every stream, then unpin the pool. Never raises: the
        pool is unmapped after it whatever happened (a CUDA error is logged)."""
        with self._lock:
            streams = list(self._streams.values())
        try:
            for stream in streams:
                stream.synchronize()
        except RuntimeError as exc:  # a sticky CUDA error: the device is gone anyway
            logger.warning("GPU copies could not be waited for at shutdown: %s", exc)
        if self.pinning is not None:
            self.pinning.close()


class _Marker(Protocol):
    def synchronize(self) -> None: ...


def _record_marker(device: int) -> _Marker:
    """A CUDA event recorded on ``device``'s current stream (the server's)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


class CopyWindow:
    """One call's chunks whose GPU copies are queued on the server's stream and not
    yet waited for, oldest first, at most ``depth`` (``WINDOW_CHUNKS``).

    ``add(done, undo)`` follows a chunk's copies queued with ``wait=False``
    (``dataplane.transfer``): it records an event after them and, past ``depth``,
    waits for the oldest chunk's event (that event, not the stream or the device)
    and runs its ``done`` (a store commits the entry; a retrieve counts the chunk).
    ``drain`` waits for every chunk left, in order; the caller drains before its
    reply and before it unpins any entry read. If a wait fails (a CUDA error), the
    chunks not done are ``undo``-ne (a store aborts their entries) and the error
    propagates. ``device`` None (CPU copies, done when they return): ``done`` runs
    at once.
    """

    def __init__(
        self,
        device: int | None,
        depth: int = WINDOW_CHUNKS,
        *,
        marker: Callable[[int], _Marker] | None = None,
    ) -> None:
        self.device = device
        self.depth = max(1, depth)
        self._marker = marker or _record_marker
        self._queued: deque[tuple[_Marker, Callable[[], None], Callable[[], None]]] = deque()

    def add(self, done: Callable[[], None], undo: Callable[[], None] = lambda: None) -> None:
        if self.device is None:
            done()
            return
        self._queued.append((self._marker(self.device), done, undo))
        while len(self._queued) > self.depth - 1:
            self._settle_oldest()

    def drain(self) -> None:
        while self._queued:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        marker, done, _ = self._queued[0]
        try:
            marker.synchronize()
        except BaseException:
            self.abandon()
            raise
        self._queued.popleft()
        done()

    def abandon(self) -> None:
        """Undo every chunk not done (the caller's copy failed, or a wait did), each
        once its copies have stopped, so no copy still runs into memory it frees."""
        while self._queued:
            marker, _, undo = self._queued.popleft()
            with contextlib.suppress(Exception):  # the error that brought us here wins
                marker.synchronize()
            undo()
