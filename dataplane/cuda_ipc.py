"""GPU KV caches shared by CUDA IPC, through torch's reduce/rebuild contract.

Note [mpcache CUDA IPC invariants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every call site that shares or opens a GPU tensor points here. We follow torch's
"Note [CUDA IPC and the caching allocator]" (torch/multiprocessing/reductions.py)
and add what a long-lived server needs:

1. What travels. ``describe`` (producer, the vLLM worker) turns a tensor into the
   fields of ``reduce_tensor``: the IPC handle of the *whole* cudaMalloc block, the
   storage's offset and size inside it, the tensor's offset/shape/stride, and the
   ref-counter and event handles. ``rebuild`` (consumer, the server) passes them,
   unchanged, to ``rebuild_cuda_tensor``. We never open handles ourselves.
2. Which GPU. Devices are named by UUID, never by ordinal: the two processes may
   see different ``CUDA_VISIBLE_DEVICES``. ``device_index_for_uuid`` maps the UUID
   to this process's ordinal.
3. Lifetime. The producer must keep the tensor (its storage) alive for as long as
   the registration exists; the consumer's rebuilt tensor holds a reference count
   on it (torch's shared ref counter), released when the server drops the tensor
   on unregister or shutdown. A handle is opened at most once per process (torch
   caches it), so re-registering the same cache is cheap and safe.
4. Bounds. Handles are opaque and can't be checked; the tensor view is checked
   against ``storage_size_bytes`` before it is rebuilt, and rebuilt tensors are
   never resized (torch's invariant 2).
5. Ordering. The producer's writes must be complete (its stream synchronised)
   before it asks the server to store; the server synchronises its own copies
   before replying to a retrieve, so the worker reads finished data.
6. Nothing here runs at import time and nothing initialises CUDA until a
   ``cuda_ipc`` descriptor is registered.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

from app.errors import InvalidDescriptor
from app.schemas import CudaIpcTensor
from dataplane.descriptors import TensorGeometry

__all__ = ["cuda_available", "describe", "device_index_for_uuid", "normalise_uuid", "rebuild"]


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def normalise_uuid(uuid: str) -> str:
    """``GPU-58a4...`` (nvidia-smi) and ``58a4...`` (torch) name the same device."""
    text = uuid.strip().lower()
    return text.removeprefix("gpu-")


def device_uuid(index: int) -> str:
    return normalise_uuid(str(torch.cuda.get_device_properties(index).uuid))


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


def describe(tensor: torch.Tensor, block_dim: int) -> CudaIpcTensor:
    """Producer side: the ``CudaIpcTensor`` descriptor of a CUDA tensor (rule 1)."""
    if not tensor.is_cuda:
        raise ValueError("describe() needs a CUDA tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    fields: tuple[Any, ...] = args
    (
        _cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = fields
    return CudaIpcTensor(
        device_uuid=device_uuid(int(device)),
        handle_b64=base64.b64encode(handle).decode(),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle_b64=base64.b64encode(ref_counter_handle).decode(),
        ref_counter_offset=int(ref_counter_offset),
        event_handle_b64=base64.b64encode(event_handle or b"").decode(),
        event_sync_required=bool(event_sync_required),
        tensor_offset=int(tensor_offset),
        shape=list(size),
        stride=list(stride),
        dtype=str(dtype).removeprefix("torch."),
        block_dim=block_dim,
    )
