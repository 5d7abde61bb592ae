"""Alignment maths (docs/design.md s.2) on vLLM 0.33's real spec classes and on doubles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import torch

from connector.alignment import (
    GroupLayout,
    check_chunk_size,
    effective_token_span,
    layout_from_groups,
    resolve_chunk_size,
)
from connector.errors import LayoutError
from tests.connector.conftest import require_vllm

# ----------------------------------------------------------------- real vLLM specs


@pytest.fixture(scope="module")
def kvi() -> ModuleType:
    require_vllm()
    from vllm.v1 import kv_cache_interface

    return kv_cache_interface


def _attn(k: ModuleType, block_size: int, **kw: Any) -> Any:
    return k.FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16, **kw
    )


def _swa(k: ModuleType, block_size: int, **kw: Any) -> Any:
    return k.SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float16,
        sliding_window=128,
        **kw,
    )


def _mla(k: ModuleType, block_size: int, **kw: Any) -> Any:
    return k.MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kw
    )


def _mamba(k: ModuleType, block_size: int) -> Any:
    return k.MambaSpec(
        block_size=block_size,
        shapes=((4, 8), (2, 8, 8)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )


def _ring(k: ModuleType, block_size: int) -> Any:
    return k.CircularBufferSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )


def _group(k: ModuleType, spec: Any, name: str, **kw: Any) -> Any:
    return k.KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec, **kw)


GroupsFactory = Callable[[ModuleType], list[Any]]

REAL_CASES = [
    pytest.param(
        lambda k: [
            _group(k, _attn(k, 16), "full"),
            _group(k, _swa(k, 16), "swa"),
            _group(k, _mamba(k, 544), "mamba"),
            _group(k, _ring(k, 8), "ring"),
        ],
        1,
        ("attention", "sliding_window", "recurrent", "attention"),
        (16, 16, 544, 8),
        (True, True, True, False),
        544,
        id="hybrid-full-swa-mamba_align-circular_scratch",
    ),
    pytest.param(
        lambda k: [_group(k, _mla(k, 64), "mla")],
        2,
        ("attention",),
        (128,),
        (True,),
        128,
        id="mla-dcp2",
    ),
    pytest.param(
        lambda k: [_group(k, _mla(k, 64), "mla")],
        4,
        ("attention",),
        (256,),
        (True,),
        256,
        id="mla-dcp4",
    ),
    pytest.param(
        lambda k: [
            _group(k, _attn(k, 16), "sharded"),
            _group(k, _attn(k, 48, dcp_sharded=False), "replicated"),
        ],
        4,
        ("attention", "attention"),
        (64, 48),
        (True, True),
        192,
        id="replicated-attention-under-dcp4",
    ),
    pytest.param(
        lambda k: [_group(k, _mamba(k, 64), "mamba"), _group(k, _attn(k, 16), "attn")],
        4,
        ("recurrent", "attention"),
        (64, 64),
        (True, True),
        64,
        id="mamba-not-dcp-scaled",
    ),
    pytest.param(
        lambda k: [_group(k, _attn(k, 32), "a"), _group(k, _attn(k, 48), "b")],
        1,
        ("attention", "attention"),
        (32, 48),
        (True, True),
        96,
        id="seed-spans-32-48",
    ),
    pytest.param(
        lambda k: [_group(k, _mamba(k, 544), "m0"), _group(k, _mamba(k, 640), "m1")],
        1,
        ("recurrent", "recurrent"),
        (544, 640),
        (True, True),
        10880,
        id="mamba-spans-544-640",
    ),
    pytest.param(
        lambda k: [
            _group(k, _attn(k, 16), "kept"),
            _group(k, _attn(k, 48), "replica", enable_kv_transfer=False),
        ],
        1,
        ("attention", "attention"),
        (16, 48),
        (True, False),
        16,
        id="transfer-disabled-group-excluded",
    ),
    pytest.param(
        lambda k: [
            _group(
                k,
                k.SlidingWindowMLASpec(
                    block_size=64,
                    num_kv_heads=1,
                    head_size=512,
                    dtype=torch.bfloat16,
                    sliding_window=128,
                    bounded_replay=True,
                ),
                "swa_mla_replay",
            ),
            _group(k, _mla(k, 256), "mla"),
        ],
        1,
        ("sliding_window", "attention"),
        (64, 256),
        (False, True),
        256,
        id="bounded-replay-swa-mla-is-scratch",
    ),
    pytest.param(
        lambda k: [
            _group(
                k,
                k.UniformTypeKVCacheSpecs(
                    block_size=32,
                    kv_cache_specs={"l0": _attn(k, 32), "l1": _attn(k, 32)},
                ),
                "uniform",
            ),
            _group(k, _mamba(k, 96), "mamba"),
        ],
        2,
        ("attention", "recurrent"),
        (64, 96),
        (True, True),
        192,
        id="uniform-type-wrapper-unwrapped-dcp2",
    ),
]


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("make_groups", "dcp", "kinds", "spans", "cacheable", "alignment"), REAL_CASES
)
def test_layout_from_real_specs(
    kvi: ModuleType,
    make_groups: GroupsFactory,
    dcp: int,
    kinds: tuple[str, ...],
    spans: tuple[int, ...],
    cacheable: tuple[bool, ...],
    alignment: int,
) -> None:
    groups = make_groups(kvi)
    layout = layout_from_groups(groups, dcp)
    assert tuple(g.kind for g in layout.groups) == kinds
    assert tuple(g.token_span for g in layout.groups) == spans
    assert tuple(g.cacheable for g in layout.groups) == cacheable
    assert layout.required_alignment == alignment
    check_chunk_size(resolve_chunk_size(alignment, 256), layout.spans)


@pytest.mark.vllm
@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_span_matches_vllm_resolve_dcp_kv_block_size(kvi: ModuleType, dcp: int) -> None:
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size

    for spec in (
        _attn(kvi, 16),
        _attn(kvi, 16, dcp_sharded=False),
        _mla(kvi, 64),
        _mamba(kvi, 544),
        _ring(kvi, 8),
    ):
        assert effective_token_span(spec, dcp) == resolve_dcp_kv_block_size(spec, dcp)


@pytest.mark.vllm
def test_real_kv_cache_config_groups(kvi: ModuleType) -> None:
    config = kvi.KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            _group(kvi, _attn(kvi, 16), "model.layers.0.self_attn"),
            _group(kvi, _ring(kvi, 8), "model.layers.1.ring"),
        ],
    )
    layout = layout_from_groups(config.kv_cache_groups, 1)
    cached_ids = tuple(g.group_id for g in layout.cacheable_groups)
    assert cached_ids == config.prefix_cacheable_group_ids
    assert layout.groups[0].layer_names == ("model.layers.0.self_attn",)
    assert layout.groups[1].excluded == "scratch"


# ------------------------------------------------------------------------ doubles


@dataclass(frozen=True)
class AttnDouble:
    block_size: int
    dcp_sharded: bool = True
    prefix_cacheable: bool = True


@dataclass(frozen=True)
class MambaSpec:  # named like vLLM's so the duck-typed classifier sees "recurrent"
    block_size: int


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int


@dataclass(frozen=True)
class UniformDouble:
    block_size: int
    kv_cache_specs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupDouble:
    kv_cache_spec: Any
    layer_names: list[str] = field(default_factory=list)
    enable_kv_transfer: bool = True


DOUBLE_CASES = [
    pytest.param([GroupDouble(AttnDouble(256))], 1, 256, id="single-256"),
    pytest.param([GroupDouble(AttnDouble(32)), GroupDouble(AttnDouble(48))], 1, 96, id="32-48"),
    pytest.param([GroupDouble(AttnDouble(16)), GroupDouble(MambaSpec(64))], 4, 64, id="dcp4-mamba"),
    pytest.param([GroupDouble(SlidingWindowSpec(16))], 2, 32, id="swa-no-flag-dcp2"),
    pytest.param(
        [GroupDouble(AttnDouble(16)), GroupDouble(AttnDouble(24, prefix_cacheable=False))],
        1,
        16,
        id="scratch-excluded",
    ),
    pytest.param(
        [GroupDouble(AttnDouble(16)), GroupDouble(AttnDouble(24), enable_kv_transfer=False)],
        1,
        16,
        id="no-transfer-excluded",
    ),
    pytest.param(
        [GroupDouble(UniformDouble(16, {"a": AttnDouble(16), "b": AttnDouble(16)}))],
        2,
        32,
        id="uniform-wrapper",
    ),
    pytest.param([GroupDouble(AttnDouble(16, dcp_sharded=False))], 8, 16, id="replicated"),
]


@pytest.mark.parametrize(("groups", "dcp", "alignment"), DOUBLE_CASES)
def test_layout_from_doubles(groups: list[GroupDouble], dcp: int, alignment: int) -> None:
    assert layout_from_groups(groups, dcp).required_alignment == alignment


def test_group_layout_is_frozen() -> None:
    layout = layout_from_groups([GroupDouble(AttnDouble(16), ["l0"])])
    g = layout.groups[0]
    assert g == GroupLayout(0, "attention", 16, 16, None, ("l0",))
    with pytest.raises(AttributeError):
        g.token_span = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("alignment", "minimum", "expected"),
    [
        pytest.param(256, 256, 256, id="256"),
        pytest.param(544, 256, 544, id="544"),
        pytest.param(544, 600, 1088, id="544-min600"),
        pytest.param(96, 256, 288, id="96"),
        pytest.param(1, 256, 256, id="1"),
    ],
)
def test_resolve_chunk_size_seed_examples(alignment: int, minimum: int, expected: int) -> None:
    assert resolve_chunk_size(alignment, minimum) == expected


@pytest.mark.parametrize(
    ("chunk", "spans", "ok"),
    [
        pytest.param(288, (32, 48), True, id="288-ok"),
        pytest.param(256, (32, 48), False, id="256-not-multiple-of-48"),
        pytest.param(1088, (544,), True, id="1088-ok"),
        pytest.param(640, (544, 640), False, id="640-vs-544"),
    ],
)
def test_check_chunk_size(chunk: int, spans: tuple[int, ...], ok: bool) -> None:
    if ok:
        check_chunk_size(chunk, spans)
        return
    with pytest.raises(LayoutError, match=rf"chunk size {chunk} is not a multiple"):
        check_chunk_size(chunk, spans)


def test_no_cacheable_group_is_a_clear_error() -> None:
    layout = layout_from_groups([GroupDouble(AttnDouble(16, prefix_cacheable=False))])
    with pytest.raises(LayoutError, match="no cacheable KV cache group"):
        _ = layout.required_alignment


def test_bad_dcp_and_block_size() -> None:
    with pytest.raises(LayoutError, match="decode_context_parallel_size"):
        effective_token_span(AttnDouble(16), 0)
    with pytest.raises(LayoutError, match="block_size"):
        effective_token_span(AttnDouble(0), 1)
