"""Stable identities: the cache namespace of a model's KV layout (pure)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

from connector.alignment import KVLayout
from contract.chunk_keys import namespace_model

__all__ = ["layout_digest", "namespace_for"]


def _spec_facts(spec: Any) -> str:
    facts = [type(spec).__name__, f"bs={getattr(spec, 'block_size', '?')}"]
    for attr in ("dtype", "num_kv_heads", "head_size", "head_size_v", "shapes", "dtypes"):
        value = getattr(spec, attr, None)
        if value is not None:
            facts.append(f"{attr}={value}")
    with contextlib.suppress(AttributeError, NotImplementedError, TypeError, AssertionError):
        facts.append(f"page={spec.page_size_bytes}")
    return ",".join(facts)


def layout_digest(layout: KVLayout, specs: Sequence[Any] = ()) -> str:
    """A digest of the KV layout: groups, spans, layers and (if given) spec facts."""
    h = hashlib.sha256()
    h.update(f"dcp={layout.dcp_size}".encode())
    for i, g in enumerate(layout.groups):
        h.update(
            f"|{g.group_id}:{g.kind}:{g.block_size}:{g.token_span}:{g.excluded}:"
            f"{','.join(g.layer_names)}".encode()
        )
        if i < len(specs):
            h.update(_spec_facts(specs[i]).encode())
    return h.hexdigest()[:24]


def namespace_for(model: str, layout: KVLayout, world_size: int, specs: Sequence[Any] = ()) -> str:
    """``<model>@<layout digest>/ws<N>``: chunks are shared only by identical layouts.

    A namespace is printable ASCII (``contract.schemas.NAME_PATTERN``): a model name
    that is not, or is long (a local path), is replaced by its digest
    (``contract.chunk_keys.namespace_model``, which the server's block hashes use)."""
    return f"{namespace_model(model)}@{layout_digest(layout, specs)}/ws{world_size}"
