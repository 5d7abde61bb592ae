"""Helpers for the data-plane tests (the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contract.shm_naming import SHM_DIR, segment_name
from dataplane.segments import Segment

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


@dataclass
class ShmKV:
    """One worker's KV caches, all inside one shm segment (the test owns it)."""

    segment: Segment
    layers: list[LayerSpec]
    tensors: dict[tuple[str, int], torch.Tensor]
    descriptors: list[dict[str, Any]]
    base: torch.Tensor = field(repr=False)

    @property
    def name(self) -> str:
        return self.segment.name

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
        self.segment.close()


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int16": 2}


def build_kv(layers: Sequence[LayerSpec]) -> ShmKV:
    placements = []
    offset = 0
    for layer in layers:
        for t_index, spec in enumerate(layer.tensors):
            nbytes = math.prod(spec.shape) * _ITEMSIZE[spec.dtype]
            placements.append((layer, t_index, spec, offset))
            offset += -(-nbytes // 256) * 256 + 256  # leave gaps: offsets must be honoured
    segment = Segment.create(segment_name("w"), offset)
    try:
        base = torch.frombuffer(segment.buffer, dtype=torch.uint8)
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
                    "transport": "shm",
                    "segment": segment.name,
                    "offset_bytes": off,
                    "shape": list(spec.shape),
                    "stride": list(t.stride()),
                    "dtype": spec.dtype,
                    "block_dim": spec.block_dim,
                }
            )
    except BaseException:
        segment.close()
        raise
    return ShmKV(segment, list(layers), tensors, list(descriptors.values()), base)


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


def shm_mappings(name: str) -> int:
    """How many mappings of the shm segment ``name`` this process holds."""
    path = f"{SHM_DIR}/{name}"
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(path))


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
