"""Tensor dtype names on the wire: ``"bfloat16"`` and friends (``torch.`` optional).

The connector names a tensor's dtype with ``dtype_name``; the server accepts only
the names in ``DTYPES`` (``parse_dtype`` raises ``InvalidDescriptor`` for others).
"""

from __future__ import annotations

import torch

from contract.errors import InvalidDescriptor

__all__ = ["DTYPES", "dtype_name", "parse_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
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
