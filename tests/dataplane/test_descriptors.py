"""Descriptor checks (pure part) and zero-copy views."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from contract.errors import InvalidDescriptor
from contract.schemas import ShmTensor
from dataplane.descriptors import check_shm_name, parse_dtype, shm_view, tensor_geometry


def desc(**overrides: Any) -> ShmTensor:
    fields: dict[str, Any] = {
        "segment": "mpcache-w-1-abc",
        "offset_bytes": 128,
        "shape": [2, 10, 16, 4],
        "stride": [640, 64, 4, 1],
        "dtype": "bfloat16",
        "block_dim": 1,
    }
    fields.update(overrides)
    return ShmTensor(**fields)


def test_geometry_end_bytes() -> None:
    geo = tensor_geometry(desc())
    assert geo.itemsize == 2 and geo.dtype is torch.bfloat16
    assert geo.end_bytes == 128 + 2 * 640 * 2


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        pytest.param({"dtype": "complex32"}, "unknown-dtype", id="dtype"),
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


@pytest.mark.parametrize("name", ["torch.float16", "float16", "bfloat16", "float8_e4m3fn"])
def test_known_dtypes(name: str) -> None:
    assert isinstance(parse_dtype(name), torch.dtype)


@pytest.mark.parametrize(
    "name",
    [
        "mpcache-pool-1-a",
        "mpcache-x",
        "mpcache-w-../a",
        "mpcache-w-a/b",
        "mpcache-w-..",
        "mpcache-w-a b",
        "w",
    ],
)
def test_bad_names(name: str) -> None:
    with pytest.raises(InvalidDescriptor):
        check_shm_name(name)


def test_worker_segment_names_are_accepted() -> None:
    from connector.shm import segment_name as connector_segment_name
    from contract.shm_naming import pid_namespace, segment_name

    made_by_connector = connector_segment_name(3, 1)
    assert made_by_connector.startswith(f"mpcache-w-{pid_namespace()}-{os.getpid()}-r3_1_")
    for name in (segment_name("w"), made_by_connector, "mpcache-w-1-abc"):
        check_shm_name(name)


def test_shm_view_is_zero_copy() -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    geo = tensor_geometry(desc())
    view = shm_view(base, geo)
    assert view.shape == (2, 10, 16, 4)
    view[1, 2, 3, 0] = 1.0
    flat = base[128:].view(torch.bfloat16)
    assert flat[640 + 2 * 64 + 3 * 4].item() == 1.0
