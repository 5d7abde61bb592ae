"""Descriptor checks (pure part) and zero-copy views."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from contract.errors import InvalidDescriptor
from contract.schemas import MemfdTensor
from dataplane.descriptors import memfd_view, parse_dtype, tensor_geometry


def desc(**overrides: Any) -> MemfdTensor:
    fields: dict[str, Any] = {
        "ticket": "t",
        "offset_bytes": 128,
        "shape": [2, 10, 16, 4],
        "stride": [640, 64, 4, 1],
        "dtype": "bfloat16",
        "block_dim": 1,
    }
    fields.update(overrides)
    return MemfdTensor(**fields)


def test_geometry_end_bytes() -> None:
    geo = tensor_geometry(desc())
    assert geo.itemsize == 2 and geo.dtype is torch.bfloat16
    assert geo.end_bytes == 128 + 2 * 640 * 2


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        pytest.param({"stride": [1]}, "bad-geometry", id="stride-rank"),
        pytest.param({"block_dim": 4}, "bad-geometry", id="block-dim"),
        pytest.param({"stride": [640, 0, 4, 1]}, "bad-geometry", id="zero-stride"),
        pytest.param({"offset_bytes": 3}, "misaligned", id="misaligned"),
        pytest.param({"shape": [1 << 20] * 4, "stride": [1] * 4}, "too-large", id="huge"),
    ],
)
def test_geometry_refusals(overrides: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidDescriptor) as info:
        tensor_geometry(desc(**overrides), "layer 'x' tensor 0")
    assert info.value.extras["reason"] == reason
    assert info.value.detail.startswith("layer 'x' tensor 0")


def test_an_unknown_dtype_is_refused_by_the_schema_and_by_parse_dtype() -> None:
    with pytest.raises(ValidationError, match="unknown dtype"):
        desc(dtype="complex32")
    with pytest.raises(InvalidDescriptor) as info:
        parse_dtype("complex32", "layer 'x' tensor 0")
    assert info.value.extras["reason"] == "unknown-dtype"


@pytest.mark.parametrize("name", ["torch.float16", "float16", "bfloat16", "float8_e4m3fn"])
def test_known_dtypes(name: str) -> None:
    assert isinstance(parse_dtype(name), torch.dtype)


def test_strides_torch_cannot_hold_are_refused_not_overflowed() -> None:
    # The schema bounds strides; the geometry check holds for a model built directly.
    fields = {**desc().model_dump(), "shape": [1, 10, 16, 4], "stride": [2**63, 64, 4, 1]}
    huge = MemfdTensor.model_construct(**fields)
    with pytest.raises(InvalidDescriptor) as info:
        tensor_geometry(huge)
    assert info.value.extras["reason"] == "too-large"


def test_memfd_view_is_zero_copy() -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    geo = tensor_geometry(desc())
    view = memfd_view(base, geo)
    assert view.shape == (2, 10, 16, 4)
    view[1, 2, 3, 0] = 1.0
    flat = base[128:].view(torch.bfloat16)
    assert flat[640 + 2 * 64 + 3 * 4].item() == 1.0
