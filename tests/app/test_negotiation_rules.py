"""The pure negotiation rules (app.negotiation), table-driven."""

from __future__ import annotations

import pytest

from app.negotiation import ChunkSizeState, NegotiationPolicy, decide, resolve_chunk_size
from contract.errors import IncompatibleAlignment, InvalidRequest, ResizeAfterSessions

POLICY = NegotiationPolicy(min_chunk_size=256, max_chunk_size=65536)


@pytest.mark.parametrize(
    ("alignment", "min_chunk_size", "expected"),
    [
        pytest.param(256, 256, 256, id="seed-256"),
        pytest.param(544, 256, 544, id="seed-544"),
        pytest.param(544, 600, 1088, id="seed-544-min-600"),
        pytest.param(96, 256, 288, id="seed-spans-32-48"),
        pytest.param(1, 256, 256, id="alignment-1"),
        pytest.param(16, 256, 256, id="divides-min"),
        pytest.param(300, 256, 300, id="above-min"),
        pytest.param(255, 256, 510, id="just-below-min"),
        pytest.param(10880, 256, 10880, id="mamba-544-640-lcm"),
    ],
)
def test_resolve_chunk_size(alignment: int, min_chunk_size: int, expected: int) -> None:
    policy = NegotiationPolicy(min_chunk_size, 65536)
    size = resolve_chunk_size(alignment, policy)
    assert size == expected
    assert size % alignment == 0 and size >= min_chunk_size
    assert size - alignment < min_chunk_size  # smallest such multiple


@pytest.mark.parametrize(
    ("alignment", "max_chunk_size", "match"),
    [
        pytest.param(0, 65536, "positive integer", id="zero"),
        pytest.param(-96, 65536, "positive integer", id="negative"),
        pytest.param(10**30, 65536, "max_chunk_size 65536", id="huge"),
        pytest.param(
            200, 300, "is 400, above this server.s max_chunk_size 300", id="rounds-past-max"
        ),
    ],
)
def test_resolve_rejects(alignment: int, max_chunk_size: int, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        resolve_chunk_size(alignment, NegotiationPolicy(256, max_chunk_size))


def test_policy_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError, match="max_chunk_size"):
        NegotiationPolicy(512, 256)


FINAL_288 = ChunkSizeState(288, True, (96,))
PENDING_288 = ChunkSizeState(288, False, (96,))


@pytest.mark.parametrize(
    ("state", "alignment", "sessions", "kind", "size"),
    [
        pytest.param(ChunkSizeState(), 96, 0, "select", 288, id="first-selects"),
        pytest.param(FINAL_288, 48, 0, "keep", 288, id="compatible-second-model"),
        pytest.param(FINAL_288, 96, 5, "keep", 288, id="same-alignment-with-sessions"),
        pytest.param(FINAL_288, 288, 0, "keep", 288, id="alignment-equal-size"),
        pytest.param(PENDING_288, 48, 3, "keep", 288, id="pending-no-resize-needed"),
        pytest.param(PENDING_288, 64, 0, "reselect", 384, id="pending-resize-keeps-old-callers"),
    ],
)
def test_decide(state: ChunkSizeState, alignment: int, sessions: int, kind: str, size: int) -> None:
    decision = decide(state, alignment, POLICY, sessions)
    assert (decision.kind, decision.chunk_size) == (kind, size)
    assert alignment in decision.state.alignments
    assert all(decision.chunk_size % a == 0 for a in decision.state.alignments)


def test_decide_final_incompatible_names_both_numbers() -> None:
    with pytest.raises(IncompatibleAlignment) as info:
        decide(FINAL_288, 64, POLICY, 0)
    assert "288" in info.value.detail and "64" in info.value.detail
    assert "separate mpcache server" in info.value.detail


def test_decide_refuses_resize_once_sessions_started() -> None:
    with pytest.raises(ResizeAfterSessions, match="2 session"):
        decide(PENDING_288, 64, POLICY, 2)


def test_decide_records_each_alignment_once() -> None:
    state = decide(FINAL_288, 48, POLICY, 0).state
    state = decide(state, 48, POLICY, 0).state
    assert state.alignments == (96, 48)
