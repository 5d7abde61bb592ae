"""The server's half of CUDA IPC: open a worker's GPU tensor (``rebuild``) and the
event a call's copies wait for (``open_event``).

Every rule it follows is Note [mpcache CUDA IPC invariants] in ``contract.cuda_ipc``
(the producer's half, ``describe``, lives there too). Nothing here runs at import
time; CUDA is initialised only when a ``cuda_ipc`` descriptor is registered.
"""

from __future__ import annotations

import base64
import binascii

import torch

from contract.cuda_ipc import device_uuid, normalise_uuid
from contract.errors import InvalidDescriptor
from contract.schemas import EVENT_HANDLE_BYTES, CudaIpcTensor
from dataplane.descriptors import TensorGeometry

__all__ = ["cuda_available", "device_index_for_uuid", "open_event", "rebuild"]


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def device_index_for_uuid(uuid: str) -> int:
    """This process's ordinal of the GPU with ``uuid`` (see the note, rule 2)."""
    if not cuda_available():
        raise InvalidDescriptor(
            "a cuda_ipc descriptor was sent but this server sees no CUDA device; "
            "register CPU (shm) tensors or run the server on the GPU node",
            reason="no-cuda",
        )
    wanted = normalise_uuid(uuid)
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == wanted:
            return index
    raise InvalidDescriptor(
        f"no visible GPU has UUID {uuid!r}; check CUDA_VISIBLE_DEVICES of the server",
        reason="unknown-device",
        device_uuid=uuid,
    )


def _b64(field: str, text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidDescriptor(
            f"{where}: {field} is not valid base64", reason="bad-handle"
        ) from exc


def rebuild(desc: CudaIpcTensor, geo: TensorGeometry, where: str = "tensor") -> torch.Tensor:
    """Open a producer's tensor in this process (see the note, rules 1-4)."""
    view_bytes = geo.end_bytes
    if view_bytes > desc.storage_size_bytes:
        raise InvalidDescriptor(
            f"{where}: the view ends at byte {view_bytes} of a storage of "
            f"{desc.storage_size_bytes} bytes",
            reason="out-of-bounds",
        )
    device = device_index_for_uuid(desc.device_uuid)
    handle = _b64("handle_b64", desc.handle_b64, where)
    ref_handle = _b64("ref_counter_handle_b64", desc.ref_counter_handle_b64, where)
    event_handle = _b64("event_handle_b64", desc.event_handle_b64, where)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            torch.Size(geo.shape),
            geo.stride,
            desc.tensor_offset,
            torch.storage.TypedStorage,
            geo.dtype,
            device,
            handle,
            desc.storage_size_bytes,
            desc.storage_offset_bytes,
            False,
            ref_handle,
            desc.ref_counter_offset,
            event_handle,
            desc.event_sync_required,
        )
    except RuntimeError as exc:  # torch reports CUDA failures as RuntimeError
        raise InvalidDescriptor(
            f"{where}: cannot open the CUDA IPC handle: {exc}", reason="bad-handle"
        ) from exc
    return tensor


def open_event(handle_b64: str, device: int) -> torch.cuda.Event:
    """Open a worker's interprocess CUDA event on ``device`` (see the note, rule 5).

    The schema admits only base64 of one whole handle; the length is checked again
    here, where the bytes are handed to CUDA."""
    handle = _b64("event_ipc_b64", handle_b64, "the call's event")
    if len(handle) != EVENT_HANDLE_BYTES:
        raise InvalidDescriptor(
            f"event_ipc_b64 holds {len(handle)} bytes, not a {EVENT_HANDLE_BYTES}-byte "
            "cudaIpcEventHandle_t",
            reason="bad-handle",
        )
    try:
        event: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(  # type: ignore[no-untyped-call]
            device, handle
        )
        return event
    except RuntimeError as exc:  # torch reports CUDA failures as RuntimeError
        raise InvalidDescriptor(
            f"cannot open the call's CUDA event (event_ipc_b64): {exc}", reason="bad-handle"
        ) from exc
