"""Registered worker KV caches, keyed by ``(instance_id, rank)``.

``build_registration`` validates a ``RegisterRequest`` in full (groups, layers,
every descriptor) before it builds any view, then uses the redeemed memfds
(``dataplane.fdgate``: the memory was mapped when the worker passed it) and opens
each CUDA IPC handle (see Note [mpcache CUDA IPC invariants]). ``Registry`` holds
the live ones; its docstring has the ownership and liveness rules.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from contract.errors import Forbidden, InvalidRequest, NotFound, Unavailable
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    CudaIpcTensor,
    MemfdTensor,
    RegisterRequest,
    registration_token_problem,
)
from dataplane import cuda_ipc
from dataplane.descriptors import (
    MemfdMapping,
    Redeemed,
    TensorGeometry,
    map_memfds,
    memfd_view,
    tensor_geometry,
)
from dataplane.layout import BlockTensorSpec, ChunkLayout, GroupSpec, chunk_layout
from dataplane.plans import TensorPlan, make_plan

__all__ = ["Registration", "Registry", "build_registration", "memfd_tickets"]

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
    mapping: MemfdMapping | None
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    """The secret that uses, replaces or removes this registration."""
    users: int = 0
    retired: bool = False
    released: bool = field(default=False)
    cuda_device: int | None = None
    """This process's ordinal of the GPU the tensors are on; None: CPU tensors."""
    events: dict[str, torch.cuda.Event] = field(default_factory=dict, repr=False)
    """The worker's CUDA events opened for its calls (``dataplane.device_path``),
    by handle; closed with the registration."""

    @property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes

    @property
    def conn_id(self) -> int | None:
        """The registration-socket connection whose life bounds this one's (memfds)."""
        return None if self.mapping is None else self.mapping.conn_id

    def holds(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def release(self) -> None:
        """Drop every view, unmap every memfd, close CUDA IPC tensors."""
        if self.released:
            return
        self.released = True
        self.plans = ()
        self.events = {}
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


def memfd_tickets(req: RegisterRequest) -> set[str]:
    """The tickets ``req``'s memfd tensors name."""
    return {t.ticket for layer in req.layers for t in layer.tensors if isinstance(t, MemfdTensor)}


def build_registration(req: RegisterRequest, redeemed: Redeemed | None) -> Registration:
    """Validate ``req`` and map its tensors (nothing stays mapped if anything is invalid).

    ``redeemed`` holds the memories of ``memfd_tickets(req)`` (``FdGate.take``); the
    caller closes them if this raises. In order: the rank, the groups and layers,
    every descriptor (``_check_tensors``), the layout; only then the memfds are
    mapped and the CUDA handles opened (``_open``), and the plans built."""
    if req.rank >= req.world_size:
        raise InvalidRequest(
            f"rank {req.rank} is outside world_size {req.world_size}",
            rank=req.rank,
            world_size=req.world_size,
        )
    groups = [GroupSpec(g.group_id, g.kind, g.token_span) for g in req.groups]
    checked = _check_tensors(req, {g.group_id for g in groups})
    specs = [t.spec for t in checked]
    try:
        layout = chunk_layout(req.chunk_size, groups, specs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    plans, mapping = _open(checked, layout, redeemed)
    try:
        device = _one_device(plans)
    except InvalidRequest:
        if mapping is not None:
            plans = ()
            mapping.close()
        raise
    return Registration(
        instance_id=req.instance_id,
        rank=req.rank,
        world_size=req.world_size,
        namespace=req.namespace,
        layout=layout,
        plans=plans,
        group_num_blocks=_group_num_blocks(len(groups), specs, layout),
        mapping=mapping,
        cuda_device=device,
    )


def _one_device(plans: tuple[TensorPlan, ...]) -> int | None:
    """The GPU every tensor is on (None: all on the CPU); a registration is one
    worker's, whose KV cache is on one device, and its copies are ordered per GPU
    (``dataplane.device_path``)."""
    devices = {p.view.device for p in plans}
    if len(devices) > 1:
        raise InvalidRequest(
            "a registration's tensors must all be on one device (every CPU tensor, or "
            f"every tensor on one GPU); these are on {sorted(map(str, devices))}"
        )
    (device,) = devices
    return None if device.type == "cpu" else int(device.index or 0)


@dataclass(frozen=True)
class _Checked:
    """One descriptor that passed the pure checks, with what the layout needs of it."""

    where: str
    """``layer 'name' tensor i``: how messages name it."""
    desc: MemfdTensor | CudaIpcTensor
    geo: TensorGeometry
    spec: BlockTensorSpec


def _check_tensors(req: RegisterRequest, group_ids: set[int]) -> list[_Checked]:
    """The pure checks of every layer (its name unique, its group registered) and
    descriptor (``tensor_geometry``), in request order; every group has a layer."""
    names = [layer.name for layer in req.layers]
    if len(set(names)) != len(names):
        raise InvalidRequest("layer names must be unique within a registration")
    checked = []
    for layer in req.layers:
        if layer.group_id not in group_ids:
            raise InvalidRequest(
                f"layer {layer.name!r} names group {layer.group_id}, which is not among "
                f"the registered groups {sorted(group_ids)}"
            )
        for t_index, desc in enumerate(layer.tensors):
            where = f"layer {layer.name!r} tensor {t_index}"
            geo = tensor_geometry(desc, where)
            spec = BlockTensorSpec(
                layer.name, layer.group_id, geo.dtype_name, geo.itemsize, geo.shape, geo.block_dim
            )
            checked.append(_Checked(where, desc, geo, spec))
    empty = group_ids - {layer.group_id for layer in req.layers}
    if empty:
        raise InvalidRequest(f"groups {sorted(empty)} have no layers; register only cached groups")
    return checked


def _open(
    checked: list[_Checked], layout: ChunkLayout, redeemed: Redeemed | None
) -> tuple[tuple[TensorPlan, ...], MemfdMapping | None]:
    """Map the memfds (each view checked against its memory), open the CUDA IPC
    handles, and build each tensor's copy plan; on failure nothing stays mapped."""
    memfd = [(t.where, t.desc, t.geo) for t in checked if isinstance(t.desc, MemfdTensor)]
    if memfd and redeemed is None:
        raise InvalidRequest("memfd tensors need their tickets redeemed")
    mapping = map_memfds(memfd, redeemed) if memfd and redeemed is not None else None
    tensors: list[torch.Tensor] = []
    try:
        tensors = [_tensor(t, mapping) for t in checked]
        plans = tuple(
            make_plan(tensor, t.geo, region)
            for tensor, t, region in zip(tensors, checked, layout.regions, strict=True)
        )
    except BaseException:
        if mapping is not None:
            tensors = []  # the traceback keeps this frame: let the views go with the mapping
            mapping.close()
        raise
    return plans, mapping


def _tensor(checked: _Checked, mapping: MemfdMapping | None) -> torch.Tensor:
    """The zero-copy view of one checked descriptor, by its kind."""
    desc = checked.desc
    if isinstance(desc, MemfdTensor):
        assert mapping is not None
        return memfd_view(mapping.bases[desc.ticket], checked.geo)
    return cuda_ipc.rebuild(desc, checked.geo, checked.where)


def _group_num_blocks(
    num_groups: int, specs: list[BlockTensorSpec], layout: ChunkLayout
) -> tuple[int, ...]:
    """Per group (layout order): the blocks every tensor of the group can index."""
    return tuple(
        min(
            spec.num_blocks
            for spec, region in zip(specs, layout.regions, strict=True)
            if region.group_index == g_index
        )
        for g_index in range(num_groups)
    )


class Registry:
    """Thread-safe map of live registrations, at most one per ``(instance_id, rank)``.

    Ownership: each registration has a secret ``token`` (returned once by ``POST
    /register``); using it (``acquire``), replacing it (``add``) or removing it
    (``remove``) needs that token, compared in constant time. Liveness: a
    registration made from memfds belongs to the socket connection its tickets came
    from, and ``release_connection`` drops every registration of a closed connection
    (a dead worker). A replaced, removed or dropped registration releases its
    mappings as soon as no transfer is using it (``acquire`` counts users), so a copy
    in flight never loses its memory.
    """

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

    def namespaces(self) -> list[tuple[str, int, bytes]]:
        """Each ``(namespace, world size, layout signature)`` registered here, once."""
        with self._lock:
            found = {(r.namespace, r.world_size, r.layout.signature) for r in self._regs.values()}
        return sorted(found)

    def add(
        self,
        reg: Registration,
        *,
        token: str | None = None,
        alive: Callable[[int], bool] | None = None,
    ) -> bool:
        """Install ``reg``, replacing any earlier one for its key; True if replaced.

        Replacing needs the earlier registration's ``token`` (``Forbidden``
        otherwise). ``reg`` keeps ``token`` as its secret when one is given (a first
        registration's is checked: ``registration_token_problem``), so a client
        that retries a first registration or a refresh after losing the reply
        refreshes what it registered instead of being refused. ``alive`` says
        whether ``reg``'s socket connection is still open, checked under the lock
        that ``release_connection`` takes, so a registration whose worker died
        while it was being built is never installed.
        """
        key = (reg.instance_id, reg.rank)
        refusal: Exception | None = None
        release = False
        with self._lock:
            old = self._regs.get(key)
            weak = None if old is not None or token is None else registration_token_problem(token)
            if self._closed:
                refusal = Unavailable(
                    "the server is shutting down; register again after it restarts"
                )
            elif old is not None and not old.holds(token):
                refusal = _forbidden(reg.instance_id, reg.rank, "replace")
            elif weak is not None:
                refusal = InvalidRequest(f"header {REGISTRATION_TOKEN_HEADER}: {weak}")
            elif reg.conn_id is not None and alive is not None and not alive(reg.conn_id):
                refusal = InvalidRequest(
                    "the registration socket connection that passed this memory closed; "
                    "connect again and register with fresh tickets"
                )
            else:
                if token is not None:
                    reg.token = token
                self._regs[key] = reg
                release = old is not None and self._retire(old)
        if refusal is not None:
            reg.release()
            raise refusal
        if release and old is not None:
            old.release()
        return old is not None

    @staticmethod
    def _retire(reg: Registration) -> bool:
        """Mark ``reg`` replaced or removed; True if nobody uses it (release it now)."""
        reg.retired = True
        return reg.users == 0

    def remove(self, instance_id: str, rank: int, token: str | None) -> None:
        """Remove a registration (its ``token`` needed); ``NotFound``/``Forbidden``."""
        with self._lock:
            old = self._owned(instance_id, rank, token, "unregister")
            del self._regs[(instance_id, rank)]
            release = self._retire(old)
        if release:
            old.release()

    def release_connection(self, conn_id: int) -> int:
        """Drop every registration made over socket connection ``conn_id`` (closed:
        its worker exited or died); each unmaps once no copy uses it. How many."""
        with self._lock:
            keys = [k for k, reg in self._regs.items() if reg.conn_id == conn_id]
            dropped = [self._regs.pop(k) for k in keys]
            now = [reg for reg in dropped if self._retire(reg)]
        for reg in now:
            reg.release()
        for reg in dropped:
            logger.info(
                "released instance %r rank %d: its worker's registration socket closed",
                reg.instance_id,
                reg.rank,
            )
        return len(dropped)

    def _owned(self, instance_id: str, rank: int, token: str | None, action: str) -> Registration:
        """The registration of ``(instance_id, rank)`` if ``token`` is its own (lock held)."""
        reg = self._regs.get((instance_id, rank))
        if reg is None:
            raise NotFound(
                f"no KV cache is registered for instance {instance_id!r} rank {rank}; "
                "register it first (POST /register)",
                instance_id=instance_id,
                rank=rank,
            )
        if not reg.holds(token):
            raise _forbidden(instance_id, rank, action)
        return reg

    @contextmanager
    def acquire(self, instance_id: str, rank: int, token: str | None) -> Iterator[Registration]:
        """The live registration (its ``token`` needed), kept mapped until the
        ``with`` block ends."""
        with self._lock:
            reg = self._owned(instance_id, rank, token, "use")
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


def _forbidden(instance_id: str, rank: int, action: str) -> Forbidden:
    return Forbidden(
        f"instance {instance_id!r} rank {rank} is registered by another client; to "
        f"{action} it, send its registration token (returned by POST /register) in the "
        f"{REGISTRATION_TOKEN_HEADER} header",
        instance_id=instance_id,
        rank=rank,
    )
