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
# 5. Ordering, without a device-wide sync. A store reads, and a retrieve overwrites,
#    blocks the producer's kernels use on its own stream. The producer records an
#    interprocess event (``torch.cuda.Event(interprocess=True)``) on its current
#    stream once the work the call must follow is enqueued, and sends the event's
#    IPC handle with the call (``event_ipc_b64``; ``connector.device_order``). The
#    server opens it once per registration (``dataplane.cuda_ipc.open_event``), makes
#    its own stream for that GPU wait for it (``cudaStreamWaitEvent``: a wait on the
#    GPU, the producer's step does not stop), copies on that stream, and waits for
#    its own copies (an event after each chunk, then the stream), never the device,
#    before it commits a stored chunk or replies (``dataplane.device_path``), so the
#    worker reads finished data. The producer may
#    re-record the same event for a later call: a wait that sees the later record
#    waits for more work, never for less. A call without a handle leaves the
#    ordering to the producer, which must have synchronised its stream first (the
#    fallback where interprocess events cannot be made).
# 6. Nothing here runs at import time and nothing initialises CUDA until a
#    ``cuda_ipc`` descriptor is registered.
# 7. DMA. Once a ``cuda_ipc`` registration exists the server page-locks its pool
#    (``cudaHostRegister``, portable to every GPU) so the copies of rule 5 are DMA
#    straight between GPU memory and pool pages; it unregisters it before the pool
#    is unmapped. Until that is done, or where it fails (logged with its reason),
#    the same copies go through pageable memory: slower, equally correct
#    (``dataplane.device_path.PoolPinning``).

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
