"""Chunk-size negotiation rules (docs/design.md s.2): pure functions over frozen values.

No I/O, no locks: ``app.chunk_size.ChunkSizeAuthority`` owns the mutable state and
serialises callers; this module only decides.

- ``resolve_chunk_size``: the rule of ``contract.chunking`` (the smallest multiple of
  the alignment at or above the configured minimum), bounded by ``max_chunk_size``.
- ``decide``: given the current state, a new alignment and the number of live
  sessions, what happens: select a first size, keep the current one (it is a
  multiple of the new alignment), or re-select before the size is final.
  A final size never changes; a selected size never changes once sessions exist.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from contract.chunking import is_aligned, lcm_of_spans, smallest_multiple_at_least
from contract.errors import IncompatibleAlignment, InvalidRequest, ResizeAfterSessions

__all__ = [
    "ChunkSizeState",
    "Decision",
    "NegotiationPolicy",
    "decide",
    "resolve_chunk_size",
]


@dataclass(frozen=True)
class NegotiationPolicy:
    """The server's configured bounds, in tokens."""

    min_chunk_size: int
    max_chunk_size: int

    def __post_init__(self) -> None:
        if self.min_chunk_size < 1:
            raise ValueError(f"min_chunk_size must be >= 1, got {self.min_chunk_size}")
        if self.max_chunk_size < self.min_chunk_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must be >= "
                f"min_chunk_size ({self.min_chunk_size})"
            )


@dataclass(frozen=True)
class ChunkSizeState:
    """What the server has agreed so far. ``final`` once every binding succeeded."""

    selected: int | None = None
    final: bool = False
    alignments: tuple[int, ...] = ()

    def with_alignment(self, alignment: int) -> ChunkSizeState:
        if alignment in self.alignments:
            return self
        return replace(self, alignments=(*self.alignments, alignment))


@dataclass(frozen=True)
class Decision:
    kind: Literal["select", "keep", "reselect"]
    chunk_size: int
    state: ChunkSizeState


def resolve_chunk_size(required_alignment: int, policy: NegotiationPolicy) -> int:
    """Smallest multiple of ``required_alignment`` that is >= ``policy.min_chunk_size``."""
    if required_alignment < 1:
        raise InvalidRequest(
            f"required_alignment must be a positive integer, got {required_alignment}",
            required_alignment=required_alignment,
        )
    if required_alignment > policy.max_chunk_size:
        raise InvalidRequest(
            f"required_alignment {required_alignment} exceeds this server's "
            f"max_chunk_size {policy.max_chunk_size}; check the KV cache group block "
            "sizes the connector reported, or raise --max-chunk-size",
            required_alignment=required_alignment,
            max_chunk_size=policy.max_chunk_size,
        )
    size = smallest_multiple_at_least(required_alignment, policy.min_chunk_size)
    if size > policy.max_chunk_size:
        raise InvalidRequest(
            f"the smallest multiple of required_alignment {required_alignment} at or "
            f"above min_chunk_size {policy.min_chunk_size} is {size}, above this "
            f"server's max_chunk_size {policy.max_chunk_size}",
            required_alignment=required_alignment,
            max_chunk_size=policy.max_chunk_size,
        )
    return size


def decide(
    state: ChunkSizeState,
    required_alignment: int,
    policy: NegotiationPolicy,
    live_sessions: int,
) -> Decision:
    """Apply the server rules of docs/design.md s.2 to one negotiation request."""
    candidate = resolve_chunk_size(required_alignment, policy)
    if state.selected is None:
        return Decision(
            "select", candidate, ChunkSizeState(candidate, False, (required_alignment,))
        )
    current = state.selected
    if is_aligned(current, required_alignment):
        return Decision("keep", current, state.with_alignment(required_alignment))
    if state.final:
        raise IncompatibleAlignment(
            f"this server's chunk size is {current} tokens, which is not a multiple of "
            f"the required alignment {required_alignment}; one mpcache server has one "
            "immutable chunk size, so run a separate mpcache server for this model",
            chunk_size=current,
            required_alignment=required_alignment,
        )
    if live_sessions > 0:
        raise ResizeAfterSessions(
            f"the selected chunk size {current} is not a multiple of the required "
            f"alignment {required_alignment}, and it cannot change because "
            f"{live_sessions} session(s) have started; run a separate mpcache server "
            "for this model",
            chunk_size=current,
            required_alignment=required_alignment,
            live_sessions=live_sessions,
        )
    # Not final and nobody depends on it yet: pick a size every alignment seen so
    # far divides, so earlier callers (who were told to retry) stay compatible.
    combined = lcm_of_spans((*state.alignments, required_alignment))
    try:
        size = resolve_chunk_size(combined, policy)
    except InvalidRequest as exc:
        raise IncompatibleAlignment(
            f"no chunk size up to max_chunk_size {policy.max_chunk_size} is a multiple of "
            f"both the selected size {current} and the required alignment "
            f"{required_alignment}; run a separate mpcache server for this model",
            chunk_size=current,
            required_alignment=required_alignment,
        ) from exc
    return Decision(
        "reselect", size, ChunkSizeState(size, False, (*state.alignments, required_alignment))
    )
