"""The chunk-size rule both sides apply (docs/design.md s.2).

    required_alignment = lcm(effective token span of every cacheable KV cache group)
    final_chunk_size   = smallest multiple of required_alignment >= min_chunk_size

Pure integer maths on positive ints; callers turn ``ValueError`` into their own
errors (the server's 4xx in ``app.negotiation``, the connector's ``LayoutError`` in
``connector.alignment``), each with the advice its reader needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["is_aligned", "lcm_of_spans", "smallest_multiple_at_least"]


def lcm_of_spans(spans: Iterable[int]) -> int:
    """lcm of token spans (each >= 1; at least one)."""
    values = list(spans)
    if not values:
        raise ValueError("no token spans given")
    if any(v < 1 for v in values):
        raise ValueError(f"token spans must be >= 1, got {values}")
    return math.lcm(*values)


def smallest_multiple_at_least(alignment: int, minimum: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``minimum`` (both >= 1)."""
    if alignment < 1 or minimum < 1:
        raise ValueError(f"alignment and minimum must be >= 1, got {alignment} and {minimum}")
    return -(-minimum // alignment) * alignment


def is_aligned(chunk_size: int, alignment: int) -> bool:
    """True when ``chunk_size`` is a (positive) multiple of ``alignment``."""
    return chunk_size >= 1 and alignment >= 1 and chunk_size % alignment == 0
