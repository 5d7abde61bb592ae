"""What the scheduler adapter knows of each request, shared by its lookups and plans.

``connector.lookups`` fills the lookup fields (on vLLM's thread; a lookup's answer
lands on the lookup thread, in its ``PendingLookup``), ``connector.planning`` the
block and store fields. A record lives from the request's first lookup or
allocation until ``request_finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.tokens import PackRange, TokenEncoder

__all__ = ["PendingLookup", "RequestState", "RequestTable"]


@dataclass(eq=False)
class PendingLookup:
    """One request's lookup of ``tokens[:end]``: started on vLLM's thread, answered on
    the lookup thread (``hit_tokens`` is written before ``done``)."""

    request_id: str
    cache_salt: str | None
    tokens: Sequence[int]
    encoder: TokenEncoder
    end: int
    started_at: float
    hit_tokens: int = 0
    done: bool = False
    # Nobody waits for the answer any more (superseded, late, degraded): not sent if
    # still unsent, its answer ignored.
    abandoned: bool = False
    # The request finished before the answer landed: end its session once it lands.
    finished: bool = False

    def answer(self, hit_tokens: int) -> None:
        self.hit_tokens = hit_tokens
        self.done = True


@dataclass
class RequestState:
    request: Any
    encoder: TokenEncoder
    block_ids: list[list[int]] = field(default_factory=list)
    # Lookup memo for this admission: the answer is reused while vLLM retries,
    # until it is lookup_max_age_s old (clock time the lookup started in lookup_at).
    lookup_end: int = -1
    lookup_at: float = 0.0
    hit_tokens: int = 0
    lookup: PendingLookup | None = None  # in flight
    local_tokens: int = 0
    # Whole chunks the cache is known to hold from token 0.
    stored_upto: int = 0
    # (local, end) of a load vLLM accepted, until the plan carries it.
    pending_load: tuple[int, int] | None = None
    # Store planning failed once: block ids may be stale, so never store again.
    no_store: bool = False


class RequestTable(dict[str, RequestState]):
    """Request id to its state. A dict, so the per-request lookups on vLLM's thread
    (every waiting request, every step) cost one C-level ``get``."""

    def __init__(self, packer: PackRange) -> None:
        super().__init__()
        self.packer = packer
        """What each request's ``TokenEncoder`` packs with (``connector.tokenpack``)."""

    def state(self, request: Any) -> RequestState:
        """``request``'s state, made fresh when vLLM hands a new ``Request`` object
        under a known id (the old one's lookup is then abandoned)."""
        st = self.get(request.request_id)
        if st is None or st.request is not request:
            if st is not None and st.lookup is not None:
                st.lookup.abandoned = True
            st = RequestState(request=request, encoder=TokenEncoder(self.packer))
            self[request.request_id] = st
        return st
