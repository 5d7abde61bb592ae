"""GPU KV caches shared by CUDA IPC, through torch's reduce/rebuild contract.

The producer's half (``describe``) and the note every call site points to (below,
Note [mpcache CUDA IPC invariants]) live here, in the contract, because the
connector and the server both follow them; the consumer's half (``rebuild``) is
``dataplane.cuda_ipc``.
"""

# Note [mpcache CUDA IPC invariants]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every call site that shares or opens a GPU tensor points here. We follow torch's
# "Note [CUDA IPC and the caching allocator]" (torch/multiprocessing/reductions.py)
# and add what a long-lived server needs:
#
# 1. What travels. ``describe`` (producer, the vLLM worker; this module) turns a
#    tensor into the fields of ``reduce_tensor``: the IPC handle of the *whole*
#    cudaMalloc block, the storage's offset and size inside it, the tensor's
#    offset/shape/stride, and the ref-counter and event handles.
#    ``dataplane.cuda_ipc.rebuild`` (consumer, the server) passes them, unchanged,
#    to ``rebuild_cuda_tensor``. We never open handles ourselves.
# 2. Which GPU. Devices are named by UUID, never by ordinal: the two processes may
#    see different ``CUDA_VISIBLE_DEVICES``. The server's
#    ``dataplane.cuda_ipc.device_index_for_uuid`` maps the UUID to its own ordinal.
# 3. Lifetime. The producer must keep the tensor (its storage) alive for as long as
#    the registration exists; the consumer's rebuilt tensor holds a reference count
#    on it (torch's shared ref counter), released when the server drops the tensor
#    on unregister or shutdown. A handle is opened at most once per process (torch
#    caches it), so re-registering the same cache is cheap and safe.
# 4. Bounds. Handles are opaque and can't be checked; the tensor view is checked
#    against ``storage_size_bytes`` before it is rebuilt, and rebuilt tensors are
#    never resized (torch's invariant 2).
# 5. Ordering. The producer's writes must be complete (its stream synchronised)
#    before it asks the server to store; the server synchronises its own copies
#    before replying to a retrieve, so the worker reads finished data.
# 6. Nothing here runs at import time and nothing initialises CUDA until a
#    ``cuda_ipc`` descriptor is registered.

from __future__ import annotations

import base64
from typing import Any

import torch

from contract.dtypes import dtype_name
from contract.schemas import CudaIpcTensor

__all__ = ["describe", "device_uuid", "normalise_uuid"]


def normalise_uuid(uuid: str) -> str:
    """``GPU-58a4...`` (nvidia-smi) and ``58a4...`` (torch) name the same device."""
    text = uuid.strip().lower()
    return text.removeprefix("gpu-")


def device_uuid(index: int) -> str:
    return normalise_uuid(str(torch.cuda.get_device_properties(index).uuid))


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
        dtype=dtype_name(dtype),
        block_dim=block_dim,
    )
