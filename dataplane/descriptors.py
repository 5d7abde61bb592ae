"""Tensor descriptors: validate everything, then map, then build zero-copy views.

A registration's descriptors are checked in full before any view is built:

1. pure checks (``tensor_geometry``): dtype known, stride rank matches shape,
   ``block_dim`` valid, no aliasing stride, offset aligned to the dtype;
2. for ``memfd``: the tickets were redeemed (once, all from one connection of the
   registration socket: ``dataplane.fdgate``, which mapped the sealed memory when
   the worker passed it), and every view lies inside its memory (``map_memfds``).

Nothing is ever opened by name. Any failure raises ``InvalidDescriptor`` (422)
naming the layer and tensor, with a ``reason`` code, and leaves nothing mapped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from contract.dtypes import dtype_name, parse_dtype
from contract.errors import InvalidDescriptor
from contract.schemas import CudaIpcTensor, MemfdTensor
from dataplane.fdgate import SealedMemory
from dataplane.prefault import Prefaulter

__all__ = [
    "MemfdMapping",
    "Redeemed",
    "TensorGeometry",
    "map_memfds",
    "memfd_view",
    "tensor_geometry",
]


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
    """Byte offset of element 0 from the start of its memory or storage."""

    @property
    def end_bytes(self) -> int:
        """One past the last byte any element of the view touches."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.offset_bytes + (last + 1) * self.itemsize


def tensor_geometry(desc: MemfdTensor | CudaIpcTensor, where: str = "tensor") -> TensorGeometry:
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
    if isinstance(desc, MemfdTensor):
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
    if any(s >= 1 << 48 for s in stride) or offset_bytes >= 1 << 52:
        # torch's strides and offsets are int64: larger ones would overflow its maths.
        raise InvalidDescriptor(
            f"{where}: stride {list(stride)} or offset {offset_bytes} is too large",
            reason="too-large",
        )
    return TensorGeometry(
        dtype=dtype,
        dtype_name=dtype_name(dtype),
        itemsize=itemsize,
        shape=shape,
        stride=stride,
        block_dim=desc.block_dim,
        offset_bytes=offset_bytes,
    )


class MemfdMapping:
    """The sealed memories one registration maps, by ticket (``dataplane.fdgate``).

    ``start_prefault`` populates the server's page tables for them in the background
    (``dataplane.prefault``), so the first retrieve into a worker's fresh blocks does
    not fault page by page; ``close`` stops that and unmaps them all (the worker
    still holds its own mappings).
    """

    def __init__(self, conn_id: int, memories: dict[str, SealedMemory]) -> None:
        self.conn_id = conn_id
        self.memories = memories
        self.bases: dict[str, torch.Tensor] = {
            ticket: torch.frombuffer(mem.buffer, dtype=torch.uint8)
            for ticket, mem in memories.items()
        }
        self.prefault = Prefaulter("mpcache-memfd-prefault")

    def start_prefault(self) -> None:
        bases = list(self.bases.values())
        self.prefault.start([(b.data_ptr(), b.numel()) for b in bases], keep=bases)

    def close(self) -> None:
        self.prefault.stop()
        self.bases.clear()
        for mem in self.memories.values():
            mem.close()


Redeemed = tuple[int, dict[str, SealedMemory]]
"""What ``FdGate.take`` returns: the connection id, and each ticket's memory."""


def map_memfds(
    checked: Iterable[tuple[str, MemfdTensor, TensorGeometry]], redeemed: Redeemed
) -> MemfdMapping:
    """Check every view lies inside the memory its (redeemed) ticket names. Nothing
    stays mapped on failure.

    ``checked`` holds ``(where, descriptor, geometry)`` triples whose geometry
    ``tensor_geometry`` already validated.
    """
    items = list(checked)
    conn_id, memories = redeemed
    try:
        for where, desc, geo in items:
            size = memories[desc.ticket].size_bytes
            if geo.end_bytes > size:
                raise InvalidDescriptor(
                    f"{where}: the view ends at byte {geo.end_bytes} but its memfd holds "
                    f"{size} bytes",
                    reason="out-of-bounds",
                )
        return MemfdMapping(conn_id, memories)
    except BaseException:
        for mem in memories.values():
            mem.close()
        raise


def memfd_view(base: torch.Tensor, geo: TensorGeometry) -> torch.Tensor:
    """Zero-copy view of a validated tensor over its memory's uint8 ``base``."""
    usable = base.numel() - base.numel() % geo.itemsize
    typed = base[:usable].view(geo.dtype)
    return typed.as_strided(geo.shape, geo.stride, geo.offset_bytes // geo.itemsize)
