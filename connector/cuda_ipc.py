"""CUDA KV tensors described for the server through torch's IPC contract.

Note [mpcache CUDA IPC]: the worker shares each CUDA KV tensor with
``torch.multiprocessing.reductions.reduce_tensor`` and the server rebuilds it with
``rebuild_cuda_tensor`` from the same fields (``app.schemas.CudaIpcTensor``). The
invariants of torch's "CUDA IPC and the caching allocator" note apply:

1. the worker keeps the tensor (and so its caching-allocator block) alive for as long
   as it is registered -- vLLM holds its KV cache for the process lifetime, and
   ``WorkerAdapter.shutdown`` unregisters before the process exits;
2. the server identifies the device by UUID, never by ordinal (CUDA_VISIBLE_DEVICES
   differs between processes);
3. ordering: the worker synchronises its current stream before a store (the KV the
   step wrote is complete) and before a load (the blocks' zeroing is complete); the
   server finishes its copies before it replies.

Every call site points here.
"""

from __future__ import annotations

import base64

import torch

from app.schemas import CudaIpcTensor

__all__ = ["describe_cuda_tensor", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _b64(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return base64.b64encode(str(value).encode()).decode("ascii")


def describe_cuda_tensor(tensor: torch.Tensor, block_dim: int) -> CudaIpcTensor:
    """A ``CudaIpcTensor`` for ``tensor`` (see Note [mpcache CUDA IPC])."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    (
        _tensor_cls,
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
    ) = args
    uuid = torch.cuda.get_device_properties(device).uuid
    return CudaIpcTensor(
        device_uuid=str(uuid),
        handle_b64=_b64(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle_b64=_b64(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle_b64=_b64(event_handle),
        event_sync_required=bool(event_sync_required),
        tensor_offset=int(tensor_offset),
        shape=[int(s) for s in size],
        stride=[int(s) for s in stride],
        dtype=dtype_name(dtype),
        block_dim=block_dim,
    )
