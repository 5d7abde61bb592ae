"""Registered worker KV caches, keyed by ``(instance_id, rank)``.

``build_registration`` validates a ``RegisterRequest`` in full (groups, layers,
every descriptor) before it maps anything, then maps each shm segment once and
opens each CUDA IPC handle (see Note [mpcache CUDA IPC invariants]).

``Registry`` holds at most one registration per ``(instance_id, rank)``: a repeat
replaces it (idempotent refresh, e.g. after a server or worker restart). A
replaced or unregistered registration releases its mappings as soon as no
transfer is using it (``acquire`` counts users), so a copy in flight never loses
its memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from contract.errors import InvalidRequest, NotFound, Unavailable
from contract.schemas import CudaIpcTensor, RegisterRequest, ShmTensor
from dataplane import cuda_ipc
from dataplane.descriptors import ShmMapping, TensorGeometry, map_shm, shm_view, tensor_geometry
from dataplane.layout import BlockTensorSpec, ChunkLayout, GroupSpec, chunk_layout
from dataplane.transfer import TensorPlan, make_plan

__all__ = ["Registration", "Registry", "build_registration"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Registration:
    instance_id: str
    rank: int
    world_size: int
    namespace: str
    layout: ChunkLayout
    plans: tuple[TensorPlan, ...]
    group_num_blocks: tuple[int, ...]
    """Per group (layout order): blocks every tensor of the group can index."""
    mapping: ShmMapping | None
    users: int = 0
    retired: bool = False
    released: bool = field(default=False)

    @property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes

    def release(self) -> None:
        """Drop every view, unmap every segment, close CUDA IPC tensors."""
        if self.released:
            return
        self.released = True
        self.plans = ()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


def build_registration(req: RegisterRequest) -> Registration:
    """Validate ``req`` and map its tensors (nothing is mapped if anything is invalid)."""
    if req.rank >= req.world_size:
        raise InvalidRequest(
            f"rank {req.rank} is outside world_size {req.world_size}",
            rank=req.rank,
            world_size=req.world_size,
        )
    groups = [GroupSpec(g.group_id, g.kind, g.token_span) for g in req.groups]
    group_ids = {g.group_id for g in groups}
    names = [layer.name for layer in req.layers]
    if len(set(names)) != len(names):
        raise InvalidRequest("layer names must be unique within a registration")
    specs: list[BlockTensorSpec] = []
    checked: list[tuple[str, ShmTensor | CudaIpcTensor, TensorGeometry]] = []
    for layer in req.layers:
        if layer.group_id not in group_ids:
            raise InvalidRequest(
                f"layer {layer.name!r} names group {layer.group_id}, which is not among "
                f"the registered groups {sorted(group_ids)}"
            )
        for t_index, desc in enumerate(layer.tensors):
            where = f"layer {layer.name!r} tensor {t_index}"
            geo = tensor_geometry(desc, where)
            checked.append((where, desc, geo))
            specs.append(
                BlockTensorSpec(
                    layer.name,
                    layer.group_id,
                    geo.dtype_name,
                    geo.itemsize,
                    geo.shape,
                    geo.block_dim,
                )
            )
    empty = group_ids - {layer.group_id for layer in req.layers}
    if empty:
        raise InvalidRequest(f"groups {sorted(empty)} have no layers; register only cached groups")
    try:
        layout = chunk_layout(req.chunk_size, groups, specs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc

    shm = [(w, d, g) for w, d, g in checked if isinstance(d, ShmTensor)]
    mapping = map_shm(shm) if shm else None
    try:
        tensors: list[torch.Tensor] = []
        for where, desc, geo in checked:
            if isinstance(desc, ShmTensor):
                assert mapping is not None
                tensors.append(shm_view(mapping.bases[desc.segment], geo))
            else:
                tensors.append(cuda_ipc.rebuild(desc, geo, where))
        plans = tuple(
            make_plan(tensor, geo, region)
            for tensor, (_, _, geo), region in zip(tensors, checked, layout.regions, strict=True)
        )
    except BaseException:
        if mapping is not None:
            tensors = []
            mapping.close()
        raise
    num_blocks = []
    for g_index in range(len(groups)):
        counts = [
            spec.num_blocks
            for spec, region in zip(specs, layout.regions, strict=True)
            if region.group_index == g_index
        ]
        num_blocks.append(min(counts))
    return Registration(
        instance_id=req.instance_id,
        rank=req.rank,
        world_size=req.world_size,
        namespace=req.namespace,
        layout=layout,
        plans=plans,
        group_num_blocks=tuple(num_blocks),
        mapping=mapping,
    )


class Registry:
    """Thread-safe map of live registrations (see the module docstring)."""

    def __init__(self) -> None:
        self._regs: dict[tuple[str, int], Registration] = {}
        self._lock = threading.Lock()
        self._closed = False

    def count(self) -> int:
        with self._lock:
            return len(self._regs)

    def layout_for(self, namespace: str, world_size: int) -> bytes | None:
        """The layout signature of a registration of ``namespace`` with ``world_size``
        ranks (None if none): what a lookup, which names no registration, needs to
        name a chunk outside L1."""
        with self._lock:
            for reg in self._regs.values():
                if reg.namespace == namespace and reg.world_size == world_size:
                    return reg.layout.signature
        return None

    def add(self, reg: Registration) -> bool:
        """Install ``reg``, replacing any earlier one for its key; True if replaced."""
        with self._lock:
            closed = self._closed
            old = None if closed else self._regs.get((reg.instance_id, reg.rank))
            if not closed:
                self._regs[(reg.instance_id, reg.rank)] = reg
            release = old is not None and self._retire(old)
        if closed:
            reg.release()
            raise Unavailable("the server is shutting down; register again after it restarts")
        if release and old is not None:
            old.release()
        return old is not None

    @staticmethod
    def _retire(reg: Registration) -> bool:
        """Mark ``reg`` replaced or removed; True if nobody uses it (release it now)."""
        reg.retired = True
        return reg.users == 0

    def remove(self, instance_id: str, rank: int) -> bool:
        with self._lock:
            old = self._regs.pop((instance_id, rank), None)
            release = old is not None and self._retire(old)
        if release and old is not None:
            old.release()
        return old is not None

    @contextmanager
    def acquire(self, instance_id: str, rank: int) -> Iterator[Registration]:
        """The live registration, kept mapped until the ``with`` block ends."""
        with self._lock:
            reg = self._regs.get((instance_id, rank))
            if reg is None:
                raise NotFound(
                    f"no KV cache is registered for instance {instance_id!r} rank {rank}; "
                    "register it first (POST /register)",
                    instance_id=instance_id,
                    rank=rank,
                )
            reg.users += 1
        try:
            yield reg
        finally:
            with self._lock:
                reg.users -= 1
                release = reg.retired and reg.users == 0
            if release:
                reg.release()

    def close(self) -> None:
        """Release every registration (call once no transfer is running)."""
        with self._lock:
            self._closed = True
            regs = list(self._regs.values())
            self._regs.clear()
        for reg in regs:
            reg.retired = True
            reg.release()
