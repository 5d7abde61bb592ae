"""Helpers for the data-plane tests (the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import itertools
import math
import mmap
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import torch
from fastapi.testclient import TestClient

from contract.fdpass import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    HANDSHAKE_MAGIC,
    decode_reply,
)
from contract.schemas import REGISTRATION_TOKEN_HEADER, MemfdTensor
from contract.shm_naming import SHM_DIR
from dataplane import blockcopy
from dataplane.blockcopy import BlockCopier
from dataplane.descriptors import tensor_geometry
from dataplane.layout import BlockTensorSpec, GroupSpec, chunk_layout
from dataplane.plans import TensorPlan, make_plan
from dataplane.prefault import populate
from tests.support import require_kernel

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "test-model|layout-v1|ws1"


# ----------------------------------------------------------------- worker KV caches


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    block_dim: int
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class LayerSpec:
    name: str
    group_id: int
    tensors: tuple[TensorSpec, ...]


def vllm_layer(name: str, group_id: int, num_blocks: int, block_size: int = 16) -> LayerSpec:
    """vLLM's CPU attention layout: ``[2, num_blocks, block_size, heads, head_dim]``."""
    return LayerSpec(name, group_id, (TensorSpec((2, num_blocks, block_size, 2, 8), 1),))


def mla_layer(name: str, group_id: int, num_blocks: int, block_size: int = 16) -> LayerSpec:
    """MLA-like layout: ``[num_blocks, block_size, dim]``."""
    return LayerSpec(name, group_id, (TensorSpec((num_blocks, block_size, 24), 0),))


def mamba_layer(name: str, group_id: int, num_blocks: int) -> LayerSpec:
    """Recurrent state: conv and SSM state tensors, one block per state."""
    return LayerSpec(
        name,
        group_id,
        (TensorSpec((num_blocks, 3, 16), 0, "float32"), TensorSpec((num_blocks, 4, 8), 0)),
    )


_labels = itertools.count()


def sealed_memfd(nbytes: int, label: str = "mpcache-test", *, seals: int | None = None) -> int:
    """A memfd of ``nbytes`` (pages allocated), sealed as a worker seals it."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(
            fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL if seals is None else seals
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class ShmKV:
    """One worker's KV caches, all inside one sealed memfd (the test owns it).

    Its descriptors carry the placeholder ticket ``fd:<fd>``; ``CacheClient`` passes
    the memfd over the registration socket and puts the real ticket in its place."""

    fd: int
    label: str
    size_bytes: int
    mm: mmap.mmap
    layers: list[LayerSpec]
    tensors: dict[tuple[str, int], torch.Tensor]
    descriptors: list[dict[str, Any]]
    base: torch.Tensor = field(repr=False)

    @property
    def name(self) -> str:
        """The memfd's label, as /proc/self/maps shows it (``shm_mappings``)."""
        return self.label

    @property
    def placeholder(self) -> str:
        return f"fd:{self.fd}"

    def block(self, layer: str, tensor: int, block_id: int) -> torch.Tensor:
        spec = next(s for s in self.layers if s.name == layer).tensors[tensor]
        return self.tensors[(layer, tensor)].select(spec.block_dim, block_id)

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in self.tensors.values():
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
            )

    def zero(self) -> None:
        self.base.zero_()

    def close(self) -> None:
        self.tensors.clear()
        del self.base
        with contextlib.suppress(BufferError):  # a view still lives: it goes with it
            self.mm.close()
        os.close(self.fd)


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int16": 2}


def build_kv(layers: Sequence[LayerSpec]) -> ShmKV:
    placements = []
    offset = 0
    for layer in layers:
        for t_index, spec in enumerate(layer.tensors):
            nbytes = math.prod(spec.shape) * _ITEMSIZE[spec.dtype]
            placements.append((layer, t_index, spec, offset))
            offset += -(-nbytes // 256) * 256 + 256  # leave gaps: offsets must be honoured
    label = f"mpcache-test-kv-{os.getpid()}-{next(_labels)}"
    fd = sealed_memfd(offset, label)
    try:
        mm = mmap.mmap(fd, offset)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        base.zero_()
        tensors = {}
        descriptors: dict[str, dict[str, Any]] = {}
        for layer, t_index, spec, off in placements:
            dtype = getattr(torch, spec.dtype)
            numel = math.prod(spec.shape)
            nbytes = numel * _ITEMSIZE[spec.dtype]
            t = base[off : off + nbytes].view(dtype).view(spec.shape)
            tensors[(layer.name, t_index)] = t
            entry = descriptors.setdefault(
                layer.name, {"name": layer.name, "group_id": layer.group_id, "tensors": []}
            )
            entry["tensors"].append(
                {
                    "transport": "memfd",
                    "ticket": f"fd:{fd}",
                    "offset_bytes": off,
                    "shape": list(spec.shape),
                    "stride": list(t.stride()),
                    "dtype": spec.dtype,
                    "block_dim": spec.block_dim,
                }
            )
    except BaseException:
        os.close(fd)
        raise
    return ShmKV(fd, label, offset, mm, list(layers), tensors, list(descriptors.values()), base)


class WorkerSocket:
    """A client of the registration socket, as a worker uses it (``contract.fdpass``)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)

    def send(self, fds: Sequence[int], data: bytes = HANDSHAKE_MAGIC) -> bytes:
        """One handshake; the raw reply line."""
        socket.send_fds(self.sock, [data], list(fds))
        reply = b""
        while not reply.endswith(b"\n"):
            part = self.sock.recv(65536)
            if not part:
                raise ConnectionError("the server closed the registration socket")
            reply += part
        return reply

    def tickets(self, fds: Sequence[int]) -> list[str]:
        return decode_reply(self.send(fds))

    def close(self) -> None:
        self.sock.close()


def with_tickets(body: dict[str, Any], worker: WorkerSocket) -> dict[str, Any]:
    """``body`` with its placeholder tickets (``fd:<fd>``) replaced by real ones: the
    memfds go over ``worker``'s connection in one handshake."""
    placeholders = sorted(
        {
            t["ticket"]
            for layer in body.get("layers", [])
            if isinstance(layer, dict)
            for t in layer.get("tensors", [])
            if isinstance(t, dict) and str(t.get("ticket", "")).startswith("fd:")
        }
    )
    if not placeholders:
        return body
    fds = [int(p[3:]) for p in placeholders]
    tickets = dict(zip(placeholders, worker.tickets(fds), strict=True))
    body = copy.deepcopy(body)
    for layer in body["layers"]:
        for t in layer["tensors"]:
            if t.get("ticket") in tickets:
                t["ticket"] = tickets[t["ticket"]]
    return body


class CacheClient(TestClient):
    """A ``TestClient`` that acts as a worker does, so tests can speak in bodies:

    - ``POST /register`` whose descriptors carry placeholder tickets ``fd:<fd>``:
      the memfds go over the registration socket first (one connection per
      client, ``worker``) and the real tickets replace the placeholders;
    - a successful registration's token is kept and sent (unless the call sets the
      header itself, or ``auto_token`` is off) with later store, retrieve, DELETE
      and replacing register calls of that ``(instance_id, rank)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokens: dict[tuple[str, int], str] = {}
        self.auto_token = True
        self._worker: WorkerSocket | None = None

    @property
    def worker(self) -> WorkerSocket:
        if self._worker is None:
            path = self.get("/register").json()["socket_path"]
            self._worker = WorkerSocket(path)
        return self._worker

    def close_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        path = str(url)
        body = kwargs.get("json")
        key: tuple[str, int] | None = None
        if method == "POST" and path == "/register" and isinstance(body, dict):
            kwargs["json"] = body = with_tickets(body, self.worker)
        if isinstance(body, dict) and path in ("/register", "/cache/store", "/cache/retrieve"):
            if isinstance(body.get("instance_id"), str) and isinstance(body.get("rank"), int):
                key = (body["instance_id"], body["rank"])
        elif method == "DELETE" and path.startswith("/register/"):
            instance, _, rank = path[len("/register/") :].rpartition("/")
            if rank.isdigit():
                key = (unquote(instance), int(rank))
        headers = dict(kwargs.get("headers") or {})
        if self.auto_token and key in self.tokens and REGISTRATION_TOKEN_HEADER not in headers:
            headers[REGISTRATION_TOKEN_HEADER] = self.tokens[key]
            kwargs["headers"] = headers
        reply = super().request(method, url, **kwargs)
        if path == "/register" and method == "POST" and reply.status_code == 200 and key:
            self.tokens[key] = reply.json()["registration_token"]
        if method == "DELETE" and reply.status_code == 204 and key:
            self.tokens.pop(key, None)
        return reply


def register_body(
    kv: ShmKV,
    instance_id: str,
    groups: Sequence[tuple[int, str, int]],
    *,
    chunk_size: int,
    rank: int = 0,
    world_size: int = 1,
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "rank": rank,
        "world_size": world_size,
        "chunk_size": chunk_size,
        "namespace": namespace,
        "groups": [{"group_id": g, "kind": k, "token_span": s} for g, k, s in groups],
        "layers": kv.descriptors,
    }


def transfer_item(
    request_id: str,
    tokens: np.ndarray,
    block_ids: Sequence[Sequence[int]],
    *,
    start_token: int = 0,
    end_token: int | None = None,
    namespace: str = NAMESPACE,
    b64: bool = True,
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "request_id": request_id,
        "namespace": namespace,
        "start_token": start_token,
        "end_token": len(tokens) if end_token is None else end_token,
        "block_ids": [list(map(int, ids)) for ids in block_ids],
    }
    item.update(token_field(tokens, b64=b64))
    return item


def token_field(tokens: np.ndarray, *, b64: bool = True) -> dict[str, Any]:
    import base64

    if b64:
        raw = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        return {"tokens_b64": base64.b64encode(raw).decode()}
    return {"tokens": [int(t) for t in tokens]}


def random_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, size=n, dtype=np.int64).astype(np.int32)


# ----------------------------------------------------------------- in-process server


def shm_mappings(label: str) -> int:
    """How many mappings of the memfd labelled ``label`` this process holds (the
    test's own, and the in-process server's)."""
    needle = f"/memfd:{label} (deleted)"
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(needle))


def kernel_populates() -> bool:
    """Whether this kernel takes ``MADV_POPULATE_WRITE`` (Linux >= 5.14)."""
    with mmap.mmap(-1, mmap.PAGESIZE) as anon:
        page = torch.frombuffer(anon, dtype=torch.uint8)
        done = populate(page.data_ptr(), mmap.PAGESIZE)
        del page
    return done


def shm_residency(label: str) -> list[tuple[int, int]]:
    """``(Size, Rss)`` in KiB of each mapping of the memfd labelled ``label`` this
    process holds: Rss counts the pages its page tables map."""
    needle = f"/memfd:{label} (deleted)"
    found: list[list[int]] = []
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            key, _, rest = line.partition(":")
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(needle)
                if inside:
                    found.append([])
            elif inside and key in ("Size", "Rss"):
                found[-1].append(int(rest.split()[0]))
    return [(size, rss) for size, rss in found]


@contextmanager
def no_new_segments() -> Iterator[None]:
    """Assert the block leaves no new mpcache segment in /dev/shm."""
    before = {n for n in os.listdir(SHM_DIR) if n.startswith("mpcache-")}
    yield
    after = {n for n in os.listdir(SHM_DIR) if n.startswith("mpcache-")}
    assert after <= before, f"segments left behind: {sorted(after - before)}"


# ----------------------------------------------------------------- request helpers


def post_ok(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST and return the JSON reply, failing the test on any non-200."""
    reply = client.post(path, json=body)
    assert reply.status_code == 200, f"{path}: {reply.status_code} {reply.text}"
    result: dict[str, Any] = reply.json()
    return result


def store(client: Any, instance: str, *items: dict[str, Any], rank: int = 0) -> list[Any]:
    body = {"instance_id": instance, "rank": rank, "requests": list(items)}
    return list(post_ok(client, "/cache/store", body)["results"])


def retrieve(client: Any, instance: str, *items: dict[str, Any], rank: int = 0) -> list[Any]:
    body = {"instance_id": instance, "rank": rank, "requests": list(items)}
    return list(post_ok(client, "/cache/retrieve", body)["results"])


def lookup(
    client: Any,
    tokens: np.ndarray,
    request_id: str = "lookup",
    *,
    world_size: int = 1,
    namespace: str = NAMESPACE,
) -> int:
    item = {
        "request_id": request_id,
        "namespace": namespace,
        "world_size": world_size,
        **token_field(tokens),
    }
    return int(post_ok(client, "/cache/lookup", {"requests": [item]})["results"][0]["hit_tokens"])


def metric(client: Any, name: str, **labels: str) -> float:
    """The value of one sample on ``/metrics`` (e.g. ``mpcache_chunks_stored_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels} on /metrics")


KVFactory = Callable[[Sequence[LayerSpec]], ShmKV]
"""The ``shm_kv`` fixture: builds worker KV caches in shm for the given layers."""


def register_over(http: Any, body: dict[str, Any]) -> tuple[str, WorkerSocket]:
    """Register ``body`` (placeholder tickets) with any HTTP client (``httpx.Client``,
    a ``TestClient``): the memfds go over a new socket connection, which the caller
    keeps open while the registration should live and closes after. Returns the
    registration token and that connection."""
    worker = WorkerSocket(http.get("/register").json()["socket_path"])
    try:
        reply = http.post("/register", json=with_tickets(body, worker))
        reply.raise_for_status()
    except BaseException:
        worker.close()
        raise
    return str(reply.json()["registration_token"]), worker


def streaming_kernel() -> BlockCopier:
    """The streaming block kernel; skips without a C compiler (fails under CI,
    whose machines have one: a kernel that stopped building must not go unseen)."""
    return require_kernel(blockcopy.load, "streaming block kernel")


def attention_plans(
    tensors: Sequence[torch.Tensor], chunk_tokens: int, block_tokens: int
) -> tuple[list[TensorPlan], int]:
    """Copy plans of bfloat16 ``tensors`` in vLLM's KV layout (blocks on dim 1), one
    attention group of ``block_tokens``-token blocks, and a chunk's bytes."""
    geos = [
        tensor_geometry(
            MemfdTensor(
                ticket="t",
                offset_bytes=0,
                shape=list(t.shape),
                stride=list(t.stride()),
                dtype="bfloat16",
                block_dim=1,
            )
        )
        for t in tensors
    ]
    specs = [
        BlockTensorSpec(f"l{i}", 0, g.dtype_name, g.itemsize, g.shape, 1)
        for i, g in enumerate(geos)
    ]
    layout = chunk_layout(chunk_tokens, [GroupSpec(0, "attention", block_tokens)], specs)
    plans = [make_plan(t, g, r) for t, g, r in zip(tensors, geos, layout.regions, strict=True)]
    return plans, layout.chunk_bytes
