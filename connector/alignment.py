"""KV cache layout maths: effective token spans and the required chunk alignment.

Pure: no vLLM import, no I/O. Works on vLLM's real spec classes
(``vllm.v1.kv_cache_interface``) and on plain test doubles alike, by reading the
attributes vLLM defines rather than by ``isinstance``:

- ``group.kv_cache_spec`` and ``group.enable_kv_transfer`` (``KVCacheGroupSpec``;
  in vLLM 0.33 the transfer flag lives on the group, not on the spec);
- ``spec.block_size`` (tokens per physical block), ``spec.dcp_sharded`` and
  ``spec.prefix_cacheable`` (False for scratch specs: ``CircularBufferSpec``, the
  HiSparse specs, ``SlidingWindowMLASpec(bounded_replay=True)``);
- ``spec.kv_cache_specs`` on ``UniformTypeKVCacheSpecs``, which wraps per-layer specs.

docs/design.md s.2: a group's effective token span is ``block_size * dcp_size`` when the
spec is DCP-sharded, else ``block_size`` (recurrent state is replicated across DCP
ranks) -- the same rule as ``vllm.v1.core.kv_cache_utils.resolve_dcp_kv_block_size``.
``required_alignment`` is the lcm of the spans of the cacheable groups, and a
negotiated chunk size must be a multiple of every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from connector.errors import LayoutError
from contract.chunking import is_aligned, lcm_of_spans, smallest_multiple_at_least

__all__ = [
    "GroupKind",
    "GroupLayout",
    "KVLayout",
    "check_chunk_size",
    "effective_token_span",
    "group_kind",
    "layout_from_groups",
    "required_alignment",
    "resolve_chunk_size",
]

GroupKind = Literal["attention", "sliding_window", "recurrent"]
Exclusion = Literal["scratch", "transfer_disabled"]

_RECURRENT_BASES = frozenset({"MambaSpec"})
_WINDOWED_BASES = frozenset({"SlidingWindowSpec", "ChunkedLocalAttentionSpec"})


def _class_names(spec: object) -> frozenset[str]:
    return frozenset(cls.__name__ for cls in type(spec).__mro__)


def _layer_specs(spec: object) -> list[Any]:
    """The per-layer specs behind ``spec`` (unwraps ``UniformTypeKVCacheSpecs``)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return list(inner.values())
    return [spec]


def group_kind(spec: object) -> GroupKind:
    """Classify a spec (or a uniform wrapper) as attention, sliding window or recurrent."""
    kinds = {_leaf_kind(s) for s in _layer_specs(spec)}
    if len(kinds) == 1:
        return kinds.pop()
    # A uniform wrapper never mixes recurrent and attention layers; mixed attention
    # flavours share full-attention block accounting.
    return "recurrent" if kinds == {"recurrent"} else "attention"


def _leaf_kind(spec: object) -> GroupKind:
    names = _class_names(spec)
    if names & _RECURRENT_BASES or hasattr(spec, "mamba_type"):
        return "recurrent"
    if names & _WINDOWED_BASES:
        return "sliding_window"
    return "attention"


def _dcp_sharded(spec: object) -> bool:
    sharded = getattr(spec, "dcp_sharded", None)
    if sharded is None:
        # Doubles without the flag follow vLLM's defaults: AttentionSpec shards,
        # the KVCacheSpec base (and so MambaSpec) does not.
        return _leaf_kind(spec) != "recurrent"
    return bool(sharded)


def effective_token_span(spec: object, dcp_size: int = 1) -> int:
    """Tokens one block of ``spec`` covers under DCP of ``dcp_size`` ranks."""
    if dcp_size < 1:
        raise LayoutError(f"decode_context_parallel_size must be >= 1, got {dcp_size}")
    spans = set()
    for leaf in _layer_specs(spec):
        block_size = int(leaf.block_size)
        if block_size < 1:
            raise LayoutError(f"block_size must be >= 1, got {block_size} on {type(leaf).__name__}")
        spans.add(block_size * (dcp_size if _dcp_sharded(leaf) else 1))
    if len(spans) != 1:
        raise LayoutError(
            f"layers of one KV cache group disagree on their token span: {sorted(spans)}"
        )
    return spans.pop()


def _prefix_cacheable(spec: object) -> bool:
    return all(bool(getattr(leaf, "prefix_cacheable", True)) for leaf in _layer_specs(spec))


@dataclass(frozen=True)
class GroupLayout:
    """One vLLM KV cache group as the connector sees it.

    ``block_size`` is the physical block size in tokens; ``token_span`` the tokens
    one block covers under DCP. ``excluded`` says why a non-cacheable group is left
    out (``None`` when it is cached).
    """

    group_id: int
    kind: GroupKind
    block_size: int
    token_span: int
    excluded: Exclusion | None = None
    layer_names: tuple[str, ...] = ()

    @property
    def cacheable(self) -> bool:
        return self.excluded is None


@dataclass(frozen=True)
class KVLayout:
    """Every group of a KV cache config, with DCP resolved."""

    groups: tuple[GroupLayout, ...]
    dcp_size: int = 1

    @property
    def cacheable_groups(self) -> tuple[GroupLayout, ...]:
        return tuple(g for g in self.groups if g.cacheable)

    @property
    def spans(self) -> tuple[int, ...]:
        """Token spans of the cacheable groups, in group order."""
        return tuple(g.token_span for g in self.cacheable_groups)

    @property
    def required_alignment(self) -> int:
        return required_alignment(self.spans)

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            tail = f" (excluded: {g.excluded})" if g.excluded else ""
            parts.append(f"group {g.group_id} {g.kind} span={g.token_span}{tail}")
        return "; ".join(parts)


def layout_from_groups(groups: Sequence[Any], dcp_size: int = 1) -> KVLayout:
    """Build the layout from ``KVCacheConfig.kv_cache_groups`` (or doubles of them)."""
    layouts = []
    for group_id, group in enumerate(groups):
        spec = group.kv_cache_spec
        excluded: Exclusion | None = None
        if not bool(getattr(group, "enable_kv_transfer", True)):
            excluded = "transfer_disabled"
        elif not _prefix_cacheable(spec):
            excluded = "scratch"
        layouts.append(
            GroupLayout(
                group_id=group_id,
                kind=group_kind(spec),
                block_size=int(spec.block_size),
                token_span=effective_token_span(spec, dcp_size),
                excluded=excluded,
                layer_names=tuple(getattr(group, "layer_names", ())),
            )
        )
    return KVLayout(groups=tuple(layouts), dcp_size=dcp_size)


def required_alignment(spans: Iterable[int]) -> int:
    """lcm of the token spans of the cacheable groups (``contract.chunking``)."""
    values = list(spans)
    if not values:
        raise LayoutError(
            "no cacheable KV cache group: every group is scratch or has KV transfer "
            "disabled, so there is nothing for mpcache to store"
        )
    try:
        return lcm_of_spans(values)
    except ValueError as exc:
        raise LayoutError(str(exc)) from exc


def resolve_chunk_size(alignment: int, min_chunk_size: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``min_chunk_size`` (seed rule)."""
    try:
        return smallest_multiple_at_least(alignment, min_chunk_size)
    except ValueError as exc:
        raise LayoutError(str(exc)) from exc


def check_chunk_size(chunk_size: int, spans: Iterable[int]) -> None:
    """Raise ``LayoutError`` unless ``chunk_size`` is a multiple of every span."""
    values = list(spans)
    if chunk_size < 1:
        raise LayoutError(f"chunk size must be >= 1, got {chunk_size}")
    bad = sorted({s for s in values if not is_aligned(chunk_size, s)})
    if bad:
        raise LayoutError(
            f"chunk size {chunk_size} is not a multiple of the token span(s) {bad} of "
            f"this model's KV cache groups (required alignment "
            f"{required_alignment(values)}); the server's chunk size does not fit this "
            "model: use a separate mpcache server for it"
        )
