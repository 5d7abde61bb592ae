"""Tensor dtype names on the wire: ``"bfloat16"`` and friends (``torch.`` optional).

The connector names a tensor's dtype with ``dtype_name``; the server accepts only
the names in ``DTYPES``, which are the schema's ``DTYPE_NAMES`` (the request model
refuses others; ``parse_dtype`` raises ``InvalidDescriptor`` for them too).
"""

from __future__ import annotations

import torch

from contract.errors import InvalidDescriptor
from contract.schemas import DTYPE_NAMES

__all__ = ["DTYPES", "dtype_name", "parse_dtype"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""Dtype names a descriptor may use (``torch.`` prefix accepted)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str = "tensor") -> torch.dtype:
    key = name.removeprefix("torch.")
    dtype = DTYPES.get(key)
    if dtype is None:
        raise InvalidDescriptor(
            f"{where}: unknown dtype {name!r}; use one of {sorted(DTYPES)}",
            reason="unknown-dtype",
            dtype=name,
        )
    return dtype
