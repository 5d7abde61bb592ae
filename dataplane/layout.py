"""Chunk layout maths: pure functions over frozen values (no segment, no device).

A registered KV cache is a set of *block tensors*: tensors with one dimension
(``block_dim``) that indexes vLLM blocks, e.g. ``[2, num_blocks, block_size,
heads, head_dim]`` with ``block_dim=1`` or MLA's ``[num_blocks, block_size, dim]``
with ``block_dim=0``. ``chunk_layout`` says where one chunk of them sits in a pool
entry (``ChunkLayout``, whose docstring draws it); ``chunk_block_ids`` and
``slot_mask`` cut a request's block ids into chunks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "REGION_ALIGN_BYTES",
    "BlockTensorSpec",
    "ChunkLayout",
    "GroupSpec",
    "Region",
    "chunk_block_ids",
    "chunk_layout",
    "slot_mask",
]

REGION_ALIGN_BYTES = 64


@dataclass(frozen=True)
class GroupSpec:
    """A KV cache group as registered: ``token_span`` tokens per block."""

    group_id: int
    kind: str
    token_span: int


@dataclass(frozen=True)
class BlockTensorSpec:
    """Geometry of one registered tensor (strides do not matter to the layout)."""

    layer: str
    group_id: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    block_dim: int

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this tensor."""
        return math.prod(self.shape) // self.num_blocks * self.itemsize


@dataclass(frozen=True)
class Region:
    """Where one block tensor's blocks of a chunk sit inside a pool entry."""

    tensor_index: int
    group_index: int
    offset_bytes: int
    nbytes: int
    shape: tuple[int, ...]
    """The tensor's shape with ``block_dim`` cut to the group's blocks per chunk."""


@dataclass(frozen=True)
class ChunkLayout:
    """The bytes of a pool entry: one chunk of one rank of a registration.

    A group with token span ``span`` has ``chunk_size // span`` blocks in each
    chunk. The entry is one *region* per block tensor, in registration order, each
    64-byte aligned (``REGION_ALIGN_BYTES``) and laid out as the tensor's own shape
    with ``block_dim`` cut to the group's blocks per chunk (C order, contiguous)::

        entry = region(layer 0, tensor 0) | pad | region(layer 0, tensor 1) | ...
        region = tensor[..., blocks of this chunk, ...]   (shape[block_dim] -> n_g)

    Two registrations share entries only if their ``signature`` agree (same groups,
    chunk size, tensor geometry and dtype per layer): a retrieve from an entry of
    another layout is a miss, never garbage. An entry also records which of its
    blocks hold data: ``present`` is a bitmask over the chunk's *slots* (group 0's
    blocks first, then group 1's, ...; ``slot_offsets``); a null block id on store
    leaves its slot empty.
    """

    chunk_size: int
    groups: tuple[GroupSpec, ...]
    blocks_per_chunk: tuple[int, ...]
    """Per group (same order as ``groups``): blocks of that group in one chunk."""
    tensors: tuple[BlockTensorSpec, ...]
    regions: tuple[Region, ...]
    chunk_bytes: int
    signature: bytes

    @property
    def num_slots(self) -> int:
        return sum(self.blocks_per_chunk)

    @property
    def slot_offsets(self) -> tuple[int, ...]:
        """First slot of each group in the ``present`` bitmask."""
        return tuple(int(x) for x in np.cumsum((0, *self.blocks_per_chunk[:-1])))

    def group_index(self, group_id: int) -> int:
        for i, group in enumerate(self.groups):
            if group.group_id == group_id:
                return i
        raise KeyError(group_id)


def chunk_layout(
    chunk_size: int, groups: Sequence[GroupSpec], tensors: Sequence[BlockTensorSpec]
) -> ChunkLayout:
    """The entry layout for one registration; raises ValueError on inconsistent input."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not groups:
        raise ValueError("a registration needs at least one group")
    ids = [g.group_id for g in groups]
    if len(set(ids)) != len(ids):
        raise ValueError(f"group ids must be unique, got {ids}")
    per_chunk = []
    for g in groups:
        if g.token_span < 1 or chunk_size % g.token_span:
            raise ValueError(
                f"group {g.group_id}: token span {g.token_span} does not divide the chunk "
                f"size {chunk_size}; negotiate with the lcm of every group's span"
            )
        per_chunk.append(chunk_size // g.token_span)
    index_of = {gid: i for i, gid in enumerate(ids)}
    regions = []
    offset = 0
    for t_index, t in enumerate(tensors):
        if t.group_id not in index_of:
            raise ValueError(f"layer {t.layer!r} names unknown group {t.group_id}")
        if not 0 <= t.block_dim < len(t.shape):
            raise ValueError(f"layer {t.layer!r}: block_dim {t.block_dim} out of range")
        g_index = index_of[t.group_id]
        n = per_chunk[g_index]
        shape = list(t.shape)
        shape[t.block_dim] = n
        nbytes = t.block_bytes * n
        regions.append(Region(t_index, g_index, offset, nbytes, tuple(shape)))
        offset += -(-nbytes // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
    return ChunkLayout(
        chunk_size=chunk_size,
        groups=tuple(groups),
        blocks_per_chunk=tuple(per_chunk),
        tensors=tuple(tensors),
        regions=tuple(regions),
        chunk_bytes=offset,
        signature=_signature(chunk_size, groups, tensors),
    )


def _signature(
    chunk_size: int, groups: Sequence[GroupSpec], tensors: Sequence[BlockTensorSpec]
) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"mpcache-layout/v1;{chunk_size};".encode())
    for g in groups:
        h.update(f"g{g.group_id},{g.kind},{g.token_span};".encode())
    for t in tensors:
        # num_blocks differs between instances of one model; everything else must agree.
        shape = list(t.shape)
        shape[t.block_dim] = -1
        h.update(f"t{t.layer},{t.group_id},{t.dtype},{shape};".encode())
    return h.digest()


def chunk_block_ids(block_ids: np.ndarray, chunk_index: int, blocks_per_chunk: int) -> np.ndarray:
    """A group's block ids for one chunk; positions past the list's end read as null (0)."""
    start = chunk_index * blocks_per_chunk
    ids = block_ids[start : start + blocks_per_chunk]
    if len(ids) < blocks_per_chunk:
        ids = np.concatenate([ids, np.zeros(blocks_per_chunk - len(ids), dtype=np.int64)])
    return ids


def slot_mask(per_group_ids: Sequence[np.ndarray]) -> int:
    """Bitmask of the slots whose block id is not null, groups in order."""
    mask = 0
    shift = 0
    for ids in per_group_ids:
        for j in np.flatnonzero(ids):
            mask |= 1 << (shift + int(j))
        shift += len(ids)
    return mask
