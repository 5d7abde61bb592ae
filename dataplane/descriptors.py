"""Tensor descriptors: validate everything, then map, then build zero-copy views.

A registration's descriptors are checked in full before any segment is mapped:

1. pure checks (``tensor_geometry``): dtype known, stride rank matches shape,
   ``block_dim`` valid, no aliasing stride, offset aligned to the dtype;
2. for ``shm``: the name carries the worker prefix and is a plain name (no ``/``,
   no ``..``), the segment exists, and every view lies inside it;
3. only then are segments mapped (``map_shm``), each once per registration.

Any failure raises ``InvalidDescriptor`` (422) naming the layer and tensor, with
a ``reason`` code, and leaves nothing mapped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from contract.dtypes import dtype_name, parse_dtype
from contract.errors import InvalidDescriptor, MPCacheError
from contract.schemas import CudaIpcTensor, ShmTensor
from contract.shm_naming import WORKER_PREFIX
from dataplane.segments import Segment

__all__ = [
    "ShmMapping",
    "TensorGeometry",
    "check_shm_name",
    "map_shm",
    "shm_view",
    "tensor_geometry",
]

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


def check_shm_name(name: str, where: str = "tensor") -> None:
    """Refuse any segment name that is not a plain ``mpcache-w-...`` name."""
    if (
        not name.startswith(WORKER_PREFIX)
        or "/" in name
        or ".." in name
        or _NAME_RE.fullmatch(name) is None
    ):
        raise InvalidDescriptor(
            f"{where}: segment name {name!r} is not allowed; worker segments are plain "
            f"names starting with {WORKER_PREFIX!r} (no '/' or '..')",
            reason="bad-segment-name",
            segment=name,
        )


@dataclass(frozen=True)
class TensorGeometry:
    """A validated tensor's place in its memory, in elements and bytes."""

    dtype: torch.dtype
    dtype_name: str
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    block_dim: int
    offset_bytes: int
    """Byte offset of element 0 from the start of its segment or storage."""

    @property
    def end_bytes(self) -> int:
        """One past the last byte any element of the view touches."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.offset_bytes + (last + 1) * self.itemsize


def tensor_geometry(desc: ShmTensor | CudaIpcTensor, where: str = "tensor") -> TensorGeometry:
    """Pure checks of one descriptor's shape, stride, dtype and block dimension."""
    dtype = parse_dtype(desc.dtype, where)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape, stride = tuple(desc.shape), tuple(desc.stride)
    if len(stride) != len(shape):
        raise InvalidDescriptor(
            f"{where}: stride has {len(stride)} entries but shape has {len(shape)}",
            reason="bad-geometry",
        )
    if not 0 <= desc.block_dim < len(shape):
        raise InvalidDescriptor(
            f"{where}: block_dim {desc.block_dim} is not a dimension of shape {list(shape)}",
            reason="bad-geometry",
        )
    if any(n > 1 and s == 0 for n, s in zip(shape, stride, strict=True)):
        raise InvalidDescriptor(
            f"{where}: a zero stride would alias elements (shape {list(shape)}, "
            f"stride {list(stride)})",
            reason="bad-geometry",
        )
    if isinstance(desc, ShmTensor):
        offset_bytes = desc.offset_bytes
    else:
        offset_bytes = desc.tensor_offset * itemsize
    if offset_bytes % itemsize:
        raise InvalidDescriptor(
            f"{where}: offset {offset_bytes} is not a multiple of the {desc.dtype} "
            f"element size {itemsize}",
            reason="misaligned",
        )
    if math.prod(shape) > 1 << 48:
        raise InvalidDescriptor(f"{where}: shape {list(shape)} is too large", reason="too-large")
    return TensorGeometry(
        dtype=dtype,
        dtype_name=dtype_name(dtype),
        itemsize=itemsize,
        shape=shape,
        stride=stride,
        block_dim=desc.block_dim,
        offset_bytes=offset_bytes,
    )


class ShmMapping:
    """The shm segments one registration maps, each attached once.

    ``close`` unmaps them all (attached segments are never unlinked).
    """

    def __init__(self, segments: dict[str, Segment]) -> None:
        self.segments = segments
        self.bases: dict[str, torch.Tensor] = {
            name: torch.frombuffer(seg.buffer, dtype=torch.uint8) for name, seg in segments.items()
        }

    def close(self) -> None:
        self.bases.clear()
        for seg in self.segments.values():
            seg.close()


def map_shm(checked: Iterable[tuple[str, ShmTensor, TensorGeometry]]) -> ShmMapping:
    """Check names and bounds of every shm descriptor, then map their segments.

    ``checked`` holds ``(where, descriptor, geometry)`` triples whose geometry
    ``tensor_geometry`` already validated. Nothing is mapped unless all pass.
    """
    need: dict[str, int] = {}
    items = list(checked)
    for where, desc, geo in items:
        check_shm_name(desc.segment, where)
        need[desc.segment] = max(need.get(desc.segment, 0), geo.end_bytes)
    sizes: dict[str, int] = {}
    for name in need:
        try:
            sizes[name] = Segment.probe(name)
        except MPCacheError as exc:
            where = next(w for w, d, _ in items if d.segment == name)
            raise InvalidDescriptor(
                f"{where}: {exc.detail}", reason="unknown-segment", segment=name
            ) from exc
    for where, desc, geo in items:
        if geo.end_bytes > sizes[desc.segment]:
            raise InvalidDescriptor(
                f"{where}: the view ends at byte {geo.end_bytes} but segment "
                f"{desc.segment!r} holds {sizes[desc.segment]} bytes",
                reason="out-of-bounds",
                segment=desc.segment,
            )
    segments: dict[str, Segment] = {}
    try:
        for name, min_size in need.items():
            segments[name] = Segment.attach(name, min_size_bytes=min_size)
    except MPCacheError as exc:
        for seg in segments.values():
            seg.close()
        raise InvalidDescriptor(exc.detail, reason="unmappable") from exc
    return ShmMapping(segments)


def shm_view(base: torch.Tensor, geo: TensorGeometry) -> torch.Tensor:
    """Zero-copy view of a validated tensor over its segment's uint8 ``base``."""
    usable = base.numel() - base.numel() % geo.itemsize
    typed = base[:usable].view(geo.dtype)
    return typed.as_strided(geo.shape, geo.stride, geo.offset_bytes // geo.itemsize)
