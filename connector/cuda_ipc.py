"""CUDA KV tensors described for the server.

The descriptor is built by ``dataplane.cuda_ipc.describe`` (the same module rebuilds
it on the server), so both ends of torch's reduce/rebuild contract live in one place:
see Note [mpcache CUDA IPC invariants] there. The worker's part of that note: keep the
tensor registered for as long as it lives, and synchronise the current stream before
a store or a load.
"""

from __future__ import annotations

import torch

from dataplane.cuda_ipc import describe as describe_cuda_tensor

__all__ = ["describe_cuda_tensor", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
