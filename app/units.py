"""Alignment units below the chunk: the pure rules (docs/design.md s.5).

The chunk is the unit of negotiation, hashing and storage; the *alignment unit* (the
connector's required alignment, ``unit_tokens`` on each item) is a block boundary of
every KV cache group, so a hit, a load or a stored prompt's tail may end at any
multiple of it. These functions say where, from numbers alone.
"""

from __future__ import annotations

from contract.errors import InvalidRequest

__all__ = ["check_unit", "probe_units", "tail_units"]


def check_unit(unit: int | None, chunk_size: int, request_id: str) -> None:
    """Refuse (422) a unit that does not divide the chunk size."""
    if unit is not None and chunk_size % unit:
        raise InvalidRequest(
            f"request {request_id!r}: unit_tokens {unit} does not divide the chunk size "
            f"{chunk_size}",
            request_id=request_id,
        )


def probe_units(num_tokens: int, hits: int, chunk_size: int, unit: int | None) -> int:
    """How many units of chunk ``hits`` (the first chunk not cached whole) a lookup of
    ``num_tokens`` tokens asks about: every whole unit of it the tokens reach, short of
    the whole chunk (that one was asked about by its chunk key)."""
    if unit is None or unit >= chunk_size:
        return 0
    reach = (num_tokens - hits * chunk_size) // unit
    return max(0, min(chunk_size // unit - 1, reach))


def tail_units(start: int, end: int, chunk_size: int, unit: int | None) -> int:
    """Whole units of ``[start, end)`` after its last whole chunk (``start`` is a chunk
    boundary): the tail a store keeps, or the part of a chunk a retrieve loads."""
    if unit is None or end <= start:
        return 0
    return (end - start) % chunk_size // unit
