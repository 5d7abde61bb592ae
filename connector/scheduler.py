"""Scheduler-side adapter: vLLM's scheduler-role connector calls, handed to their homes.

Runs in vLLM's engine-core process and never imports vLLM: it reads the attributes
of vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` (duck typing), so it
is tested with plain doubles as well as with the real scheduler. Lookups live in
``connector.lookups`` (never waited for on vLLM's thread), load and store planning
in ``connector.planning``; this module negotiates, keeps the servers' health, and
ends the server sessions of finished requests.

Degraded mode (any lookup server unhealthy): lookups report 0 and no stores are
planned; nothing here raises into vLLM, and every HTTP call has a short timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from connector import tokenpack
from connector.alignment import KVLayout
from connector.client import AsyncControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.errors import ServerError
from connector.failures import FailureLog
from connector.heartbeat import AsyncTransportFactory, Heartbeat
from connector.lookups import Lookups
from connector.metadata import StepPlan
from connector.planning import StepPlanner
from connector.request_state import RequestTable
from connector.servers import (
    ServerLink,
    close_links,
    join,
    negotiate_request,
    open_links,
    renegotiate,
)
from connector.session_ends import SessionEnds
from contract.schemas import NegotiateRequest

__all__ = ["SchedulerAdapter"]

logger = logging.getLogger("mpcache.connector")

END_EVERY_S = 0.25
"""How often the heartbeat loop ends the sessions of requests vLLM has finished with
(one batched ``/cache/end`` per server). A step only queues them: a call handed over
from the step woke that thread, which took the engine's GIL from the step that
scheduled the next load, and reached the server while it copied that load."""


class _Landing:
    """Finished requests whose stores are still on their way to the server, by their
    first chunk of tokens.

    A prompt that starts like one of them (the same prompt again, a chat's next turn)
    is asked about again next step instead of now, so its lookup sees the chunks
    those stores bring rather than miss them by a few milliseconds: until the stores
    are done (``landed``), the server's key index shows what they store (the adapter
    asks it, with ``awaited_by``'s answer), or, should a report never come,
    ``bound_s`` has passed.
    """

    def __init__(self, chunk_size: int, bound_s: float, clock: Callable[[], float]) -> None:
        self._chunk_size = chunk_size
        self._bound_s = bound_s
        self._clock = clock
        # id: (first chunk, deadline, tokens its stores hold from 0 once landed)
        self._prefix: dict[str, tuple[tuple[int, ...], float, int]] = {}
        self._waiting: dict[tuple[int, ...], set[str]] = {}  # first chunk: ids

    def add(self, request: Any, stored_upto: int) -> None:
        tokens = request.all_token_ids
        if len(tokens) < self._chunk_size:
            return
        first = tuple(tokens[: self._chunk_size])
        self._prefix[request.request_id] = (first, self._clock() + self._bound_s, stored_upto)
        self._waiting.setdefault(first, set()).add(request.request_id)

    def landed(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            entry = self._prefix.pop(rid, None)
            if entry is None:
                continue
            ids = self._waiting[entry[0]]
            ids.discard(rid)
            if not ids:
                del self._waiting[entry[0]]

    def awaited_by(self, request: Any) -> int:
        """0 when ``request`` need not wait for stores that may serve it; else the most
        tokens from 0 those stores hold once landed."""
        if not self._waiting:
            return 0
        tokens = request.all_token_ids
        if len(tokens) <= self._chunk_size:
            return 0
        ids = self._waiting.get(tuple(tokens[: self._chunk_size]))
        if not ids:
            return 0
        now = self._clock()
        late = [rid for rid in ids if self._prefix[rid][1] <= now]
        self.landed(late)
        return max((self._prefix[rid][2] for rid in ids), default=0)


class SchedulerAdapter:
    """The scheduler role of the connector (see module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        layout: KVLayout,
        *,
        model: str,
        instance_id: str,
        namespace: str,
        world_size: int = 1,
        transport: TransportFactory | None = None,
        async_transport: AsyncTransportFactory | None = None,
        start_heartbeat: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.layout = layout
        self.model = model
        self.instance_id = instance_id
        self.namespace = namespace
        self.world_size = world_size
        self.alignment = layout.required_alignment
        self.links = open_links(config.server_urls, config, transport, role="scheduler")
        try:
            self.chunk_size = join(
                self.links,
                self._negotiate_request(),
                timeout_s=config.startup_timeout_s,
                spans=layout.spans,
            )
        except BaseException:
            close_links(self.links)
            raise
        self._ended: list[str] = []  # sessions to end, queued for the heartbeat by the next plan
        self._ends = SessionEnds(self.links)  # sessions the heartbeat loop ends next
        # Requests a plan carried stores for, until vLLM frees their blocks.
        self._storing: set[str] = set()
        self._landing = _Landing(self.chunk_size, config.request_timeout_s, clock)
        self._failures = FailureLog(logger)
        self.heartbeat = Heartbeat.for_adapter(
            list(self.links.values()),
            config,
            recover=self._recover,
            name="mpcache-heartbeat-scheduler",
            transport_factory=async_transport,
        )
        self.heartbeat.every(END_EVERY_S, self._end_queued)
        # Loaded (compiled once per machine) here, at startup: never on vLLM's thread.
        packer = tokenpack.load()
        self._requests = RequestTable(packer)
        self._lookups = Lookups(
            config,
            self.links,
            self._requests,
            world_size=world_size,
            namespace=namespace,
            chunk_size=self.chunk_size,
            unit_tokens=self.alignment,
            call_failed=self._call_failed,
            failures=self._failures,
            clock=clock,
            transport=transport,
        )
        self._planner = StepPlanner(layout, self.chunk_size, self._requests, self._failures)
        if start_heartbeat:
            self.heartbeat.start()
        logger.info(
            "mpcache scheduler: chunk size %d (alignment %d; %s) with %s; token packing: %s",
            self.chunk_size,
            self.alignment,
            layout.describe(),
            ", ".join(self.links),
            packer.mode,
        )

    # ------------------------------------------------------------ negotiation

    def _negotiate_request(self) -> NegotiateRequest:
        return negotiate_request(
            self.alignment, model=self.model, role="scheduler", instance_id=self.instance_id
        )

    async def _recover(self, link: ServerLink, client: AsyncControlClient) -> str:
        reply = await renegotiate(
            client, self._negotiate_request(), self.chunk_size, holder="this engine"
        )
        return reply.boot_id

    # ---------------------------------------------------------------- health

    @property
    def available(self) -> bool:
        """True when every server holding chunks of some rank is healthy."""
        return self._lookups.available

    def _call_failed(self, link: ServerLink, what: str, exc: ServerError) -> None:
        """A call failed: suspect the server, let the heartbeat judge."""
        if link.call_failed(what, exc):
            self.heartbeat.wake()

    # ---------------------------------------------------------------- lookups

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the cache can load (whole chunks), or
        ``None`` while the request's lookup is in flight (vLLM asks again next step).

        The last prompt token is never counted (vLLM must compute it to sample). The
        answer for a request is memoised until vLLM allocates for it, so repeated
        calls are cheap and consistent, but looked up again once it is
        ``lookup_max_age_s`` old: that renews the server's lease on the hit chunks
        and refreshes the hit count. Never blocks: see ``connector.lookups.Lookups``.
        """
        lookups = self._lookups
        landing = self._landing.awaited_by(request)
        if landing and not lookups.indexed(request, landing):
            return None, False
        if lookups.in_flight(request, num_computed_tokens):
            return None, False
        hit = lookups.hit_tokens(request, num_computed_tokens)
        if hit is None:
            return None, False
        need = max(0, hit - num_computed_tokens)
        return need, need > 0

    def send_lookups(self) -> None:
        """Send the lookups this step started: one batched call per server, on the
        lookup thread.

        ``build_connector_meta`` calls it, at the end of vLLM's ``schedule()``.
        """
        self._lookups.send()

    # ------------------------------------------------------- allocation, plans

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._planner.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """This step's loads and stores (``connector.planning.StepPlanner``) and the
        preempted requests whose stores may be in flight; sends the lookups the step
        started, queues the sessions of requests freed since the last plan for the
        heartbeat to end, and resets the per-step state. Loads are always returned,
        whatever store planning met."""
        self._lookups.send()
        loads, stores, failed_loads = self._planner.plan(scheduler_output, store=self.available)
        if self._ended:
            self._ends.put(self._ended)
            self._ended.clear()
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        plan = StepPlan(
            loads=tuple(loads),
            stores=tuple(stores),
            failed_loads=tuple(failed_loads),
            preempted=tuple(rid for rid in preempted if rid in self._storing),
        )
        # Only now, with the plan made: the workers see exactly these stores.
        self._storing.update(op.request_id for op in plan.stores)
        return plan

    # --------------------------------------------------------------- finishing

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; True when vLLM must keep its blocks for now.

        A request some plan carried stores for keeps its blocks until every worker
        reports that no store reads them (``finished_sending``, then
        ``transfers_finished``); its server sessions end after that. Any other
        request's blocks are freed at once and its sessions are ended after the next plan.
        """
        request_id = request.request_id
        st = self._requests.pop(request_id, None)
        if st is not None:
            self._lookups.finished(st)
        self._planner.forget(request_id)
        if request_id in self._storing:
            self._landing.add(request, st.stored_upto if st is not None else 0)
            return True, None
        self._ended.append(request_id)
        return False, None

    def transfers_finished(self, finished_sending: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (their stores are done): their sessions
        end with the heartbeat loop's next ``_end_queued``, not with a next step that
        may never come."""
        ended = [rid for rid in finished_sending if rid in self._storing]
        if not ended:
            return
        self._storing.difference_update(ended)
        self._landing.landed(ended)
        self._ends.put(ended)

    def _healthy(self, url: str) -> bool:
        return self.links[url].healthy

    async def _end_queued(self, clients: Mapping[str, AsyncControlClient]) -> None:
        """The heartbeat loop's round of ``/cache/end`` (``connector.session_ends``)."""
        await self._ends.send(clients, self._healthy)

    def shutdown(self) -> None:
        """Stop the heartbeat, end the sessions still queued (bounded), close clients."""
        self.heartbeat.stop()
        clients = {url: link.client for url, link in self.links.items()}
        self._ends.flush(clients, self._healthy, extra=self._ended)
        self._ended.clear()
        self._lookups.close()
        close_links(self.links)
