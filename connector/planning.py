"""Each engine step's loads and stores, planned from what the scheduler knows of its
requests (``connector.request_state``) and shipped to the workers as a ``StepPlan``.

Reads vLLM's ``KVCacheBlocks`` and ``SchedulerOutput`` by their attributes (duck
typing, no vLLM import), so it is tested with plain doubles too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from connector.alignment import KVLayout
from connector.failures import FailureLog
from connector.metadata import TransferOp
from connector.request_state import RequestState, RequestTable
from contract.schemas import NULL_BLOCK_ID
from contract.wire_text import wire_salt

__all__ = ["StepPlanner"]


class StepPlanner:
    """Turns request state into one step's loads and stores.

    Per request it tracks the block ids of every KV cache group and how far the cache
    already holds its tokens (``stored_upto``):

    - loads: for requests whose lookup hit beyond vLLM's own prefix cache,
      ``[floor(local), hit)``, where a hit ends at any alignment unit (``unit``, the
      required alignment: a block boundary of every group); blocks vLLM already holds
      (its local hit) are masked with the null block so the server never writes a
      block other requests may be reading;
    - stores: the whole chunks the step has finished computing (prompt and output
      tokens alike, as vLLM's own prefix cache keeps full blocks of both), and once
      the prompt's prefill is done, its last whole units short of a chunk (the
      tail), so a later prompt that shares all of it, a multi-turn chat's next turn
      say, loads all but its last partial unit. A recurrent-state group's blocks
      hold its state at their ends, and every unit ends on one of its blocks, so a
      load that ends on a unit restores the state exactly there.

    Loads use vLLM's asynchronous-load protocol (the adapter answers
    ``load_async=True``): the worker loads during the step and reports the request in
    ``finished_recving`` (or failed), which works for single- and multi-group layouts.
    vLLM waits for that report, so a load it accepted always reaches the plan: as a
    ``TransferOp``, or in the failed loads when planning it failed. Store planning is
    guarded per request: one request's failure costs that request its stores (for
    good: its block ids may be stale), never the step's loads.
    """

    def __init__(
        self, layout: KVLayout, chunk_size: int, requests: RequestTable, failures: FailureLog
    ) -> None:
        self._chunk_size = chunk_size
        self._unit = layout.required_alignment
        # Sent with every op only below the chunk (a server then keeps tails).
        self._unit_tokens = self._unit if self._unit < chunk_size else None
        self._requests = requests
        self._failures = failures
        # Block ids travel for the cacheable groups only, in registration order.
        self._group_ids = [g.group_id for g in layout.cacheable_groups]
        self._spans = [g.token_span for g in layout.cacheable_groups]
        self._loads: dict[str, None] = {}  # ordered set of request ids

    # ------------------------------------------------------------- allocation

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated ``request``'s blocks, ``num_external_tokens`` of them to load."""
        st = self._requests.state(request)
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if st.lookup_end < 0:
            return  # a second call after an async load, or no lookup this admission
        st.stored_upto = max(st.stored_upto, st.hit_tokens)
        if num_external_tokens > 0:
            st.pending_load = (st.local_tokens, st.local_tokens + num_external_tokens)
            self._loads[request.request_id] = None
        st.lookup_end = -1

    def forget(self, request_id: str) -> None:
        """The request finished: a load it was waiting for is not planned."""
        self._loads.pop(request_id, None)

    # ---------------------------------------------------------------- the step

    def plan(
        self, scheduler_output: Any, *, store: bool
    ) -> tuple[list[TransferOp], list[TransferOp], list[str]]:
        """(loads, stores, loads that could not be planned) for this step; stores only
        if ``store``. Loads are planned first and always returned."""
        loads, failed_loads = self._plan_loads()
        stores: list[TransferOp] = []
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        self._plan_new(scheduler_output.scheduled_new_reqs, scheduled, stores, store)
        self._plan_cached(scheduler_output.scheduled_cached_reqs, scheduled, stores, store)
        return loads, stores, failed_loads

    def _plan_loads(self) -> tuple[list[TransferOp], list[str]]:
        """(loads, loads that could not be planned) for every load vLLM accepted."""
        loads: list[TransferOp] = []
        failed: list[str] = []
        for request_id in self._loads:
            st = self._requests.get(request_id)
            if st is None or st.pending_load is None:
                continue
            pending, st.pending_load = st.pending_load, None
            try:
                op = self._load_op(st, *pending)
            except Exception as exc:
                self._failures(
                    "load planning",
                    "mpcache: planning the load of %s failed; vLLM recomputes it",
                    request_id,
                    exc=exc,
                )
                failed.append(request_id)
                continue
            if op is not None:
                loads.append(op)
            else:
                failed.append(request_id)  # nothing to load, yet vLLM waits for a report
        self._loads.clear()
        return loads, failed

    def _plan_new(
        self, new_reqs: Any, scheduled: Mapping[str, int], stores: list[TransferOp], store: bool
    ) -> None:
        """Stores of the requests scheduled for the first time (their blocks are new)."""
        for new in new_reqs:
            st = self._requests.get(new.req_id)
            if st is None or st.no_store:
                continue
            try:
                st.block_ids = [list(ids) for ids in new.block_ids]
                if store:
                    computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                    self._add_store(stores, st, computed)
            except Exception as exc:
                self._store_planning_failed(st, exc)

    def _plan_cached(
        self, cached: Any, scheduled: Mapping[str, int], stores: list[TransferOp], store: bool
    ) -> None:
        """Stores of the requests scheduled again (new blocks appended, or all new when
        the request resumed after preemption)."""
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, request_id in enumerate(cached.req_ids):
            st = self._requests.get(request_id)
            if st is None or st.no_store:
                continue
            try:
                new_ids: Sequence[list[int]] | None = cached.new_block_ids[i]
                if new_ids is not None:
                    if request_id in resumed or not st.block_ids:
                        st.block_ids = [list(ids) for ids in new_ids]
                    else:
                        for g, ids in enumerate(new_ids):
                            st.block_ids[g].extend(ids)
                if store:
                    computed = cached.num_computed_tokens[i] + scheduled.get(request_id, 0)
                    self._add_store(stores, st, computed)
            except Exception as exc:
                self._store_planning_failed(st, exc)

    # ------------------------------------------------------------- one request

    def _blocks_upto(self, st: RequestState, end: int) -> list[list[int]]:
        out: list[list[int]] = []
        for group_id, span in zip(self._group_ids, self._spans, strict=True):
            ids = st.block_ids[group_id] if group_id < len(st.block_ids) else []
            out.append(ids[: -(-end // span)])
        return out

    def _load_op(self, st: RequestState, local: int, end: int) -> TransferOp | None:
        chunk = self._chunk_size
        start = local // chunk * chunk
        load_end = min(-(-end // chunk) * chunk, st.hit_tokens)
        if load_end <= start:
            return None
        block_ids = self._blocks_upto(st, load_end)
        for ids, span in zip(block_ids, self._spans, strict=True):
            for j in range(len(ids)):
                # vLLM's own blocks (local hit) and blocks vLLM computes itself are
                # never written: another request may be reading them.
                if (j + 1) * span <= local or j * span >= end:
                    ids[j] = NULL_BLOCK_ID
        return TransferOp(
            request_id=st.request.request_id,
            start_token=start,
            end_token=load_end,
            tokens_b64=st.encoder.encode(st.request.all_token_ids, load_end),
            block_ids=block_ids,
            cache_salt=wire_salt(getattr(st.request, "cache_salt", None)),
            unit_tokens=self._unit_tokens,
        )

    def _store_op(self, st: RequestState, computed: int) -> TransferOp | None:
        """The store of what ``computed`` tokens add to what is stored: whole chunks,
        and the prompt's tail once its prefill is done (class docstring)."""
        chunk = self._chunk_size
        tokens = st.request.all_token_ids
        # KV exists for the tokens the step computes that are the request's own
        # (speculative tokens beyond them may still be rejected).
        limit = min(computed, len(tokens))
        end = limit // chunk * chunk
        prompt = int(st.request.num_prompt_tokens)
        if limit >= prompt:
            end = max(end, prompt // self._unit * self._unit)
        if end <= st.stored_upto:
            return None
        op = TransferOp(
            request_id=st.request.request_id,
            start_token=st.stored_upto // chunk * chunk,  # a tail's chunk again, whole
            end_token=end,
            tokens_b64=st.encoder.encode(tokens, end),
            block_ids=self._blocks_upto(st, end),
            cache_salt=wire_salt(getattr(st.request, "cache_salt", None)),
            unit_tokens=self._unit_tokens,
        )
        st.stored_upto = end
        return op

    def _add_store(self, stores: list[TransferOp], st: RequestState, computed: int) -> None:
        op = self._store_op(st, computed)
        if op is not None:
            stores.append(op)

    def _store_planning_failed(self, st: RequestState, exc: Exception) -> None:
        st.no_store = True
        self._failures(
            "store planning",
            "mpcache: planning the store of %s failed; that request is not stored",
            st.request.request_id,
            exc=exc,
        )
