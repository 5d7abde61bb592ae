"""Worker-side adapter: KV cache registration and the step's batched loads/stores.

Runs in each vLLM worker process. At start it negotiates with its own server
(chosen by rank, ``connector.servers.server_for_rank``), then
``register_kv_caches`` shares the KV cache with that server
(``connector.registration``).

No step waits for the cache. Each step hands at most one retrieve
(``start_load_kv``) and one store (``wait_for_save``) call, batching every request
of the step, to a lane of its own (``connector.lanes``) and returns. The calls go
over the server's ops socket where the worker can reach it, else over HTTP
(``connector.transfer_calls``).
Loads follow vLLM's async-load protocol: a load is reported finished in the step
its call returns, or a later one; a failed one is reported with it, through
``take_load_errors`` (single-group layouts: the exact blocks) or
``take_transfer_results`` (multi-group layouts: the request), so vLLM recomputes
it. Stores follow vLLM's delayed free: a finished request's blocks stay vLLM's
until ``take_finished_stores`` reports that no store reads them, and a preempted
request's queued stores are revoked before vLLM rewrites its blocks
(``handle_preemptions``). While the server is unhealthy or the caches are not
registered, stores are skipped and loads are reported failed; nothing raises.
Every call that hands blocks to the server carries a budget shorter than its
client's timeout (``server_budget_s``), so every lane job ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from connector.alignment import KVLayout
from connector.client import AsyncControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.device_order import DeviceOrder
from connector.errors import ConnectorError, SegmentError, ServerError, StartupError
from connector.heartbeat import AsyncTransportFactory, Heartbeat
from connector.lanes import Job, Lane, LoadLedger, LoadOutcome, StoreLedger
from connector.metadata import StepPlan, TransferOp
from connector.registration import KVRegistration
from connector.servers import (
    ServerLink,
    close_links,
    join,
    negotiate_request,
    open_links,
    ranks_of_server,
    renegotiate,
    server_for_rank,
)
from connector.shm import MemfdKVSegment
from connector.transfer_calls import TransferCalls
from contract.schemas import NegotiateRequest, RegisterRequest, RetrieveRequest, StoreRequest
from contract.wire_text import wire_text

__all__ = [
    "MAX_QUEUED_LOADS",
    "MAX_QUEUED_STORES",
    "SERVER_BUDGET_FRACTION",
    "WorkerAdapter",
    "server_budget_s",
]

logger = logging.getLogger("mpcache.connector")

SERVER_BUDGET_FRACTION = 0.75
"""Share of a store/retrieve call's client timeout the server may spend on it."""

_MAX_SERVER_BUDGET_S = 3600.0  # the schema's bound on timeout_s

MAX_QUEUED_STORES = 4
"""Store calls that may wait behind the running one; a step beyond them is not stored."""

MAX_QUEUED_LOADS = 1 << 16
"""Far more retrieve calls than vLLM has requests waiting: it only caps memory (a step
beyond it has its loads reported failed, so vLLM recomputes them)."""


def _ids(ops: Iterable[TransferOp]) -> frozenset[str]:
    return frozenset(op.request_id for op in ops)


def server_budget_s(client_timeout_s: float) -> float:
    """The ``timeout_s`` to send with a call the client waits ``client_timeout_s`` for.

    The rule for every call that hands blocks to the server: a store or retrieve
    waits ``request_timeout_s`` (``T``) for its reply, counted by httpx from when the
    request has been sent; once it gives up, vLLM reuses the blocks. So the call
    carries ``timeout_s = server_budget_s(T) = 0.75 * T`` and the server, counting
    from receipt, commits no further chunk and writes no further block once that
    budget has passed (``contract.schemas`` ``_TransferBatch.timeout_s``). The server
    stops at about ``send + transit + 0.75 * T``, before the client gives up at
    ``send + T``, as long as the one-way transit plus the chunk copy in flight at the
    deadline take less than ``0.25 * T`` (0.5 s with the default ``T`` of 2 s). A
    call without this budget, or a client timeout shorter than the one the budget
    was computed from, breaks the rule.
    """
    return min(SERVER_BUDGET_FRACTION * client_timeout_s, _MAX_SERVER_BUDGET_S)


class WorkerAdapter:
    """The worker role of the connector (see module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        layout: KVLayout,
        *,
        model: str,
        instance_id: str,
        namespace: str,
        rank: int,
        world_size: int,
        num_blocks: int,
        transport: TransportFactory | None = None,
        async_transport: AsyncTransportFactory | None = None,
        start_heartbeat: bool = True,
    ) -> None:
        self.config = config
        self.layout = layout
        self.model = model
        self.instance_id = instance_id
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size
        self.num_blocks = num_blocks
        self.alignment = layout.required_alignment
        self._spans = [g.token_span for g in layout.cacheable_groups]
        self._single_group = len(layout.groups) == 1
        url = server_for_rank(config.server_urls, rank, world_size)
        # A server sees only its own ranks, numbered from 0: a lookup there counts a
        # chunk when ranks 0..ranks_on_server-1 all hold it.
        server_ranks = ranks_of_server(config.server_urls, world_size)[url]
        self.server_rank = server_ranks.index(rank)
        self.ranks_on_server = len(server_ranks)
        links = open_links([url], config, transport, role=f"worker rank {rank}")
        self.link = links[url]
        try:
            self.chunk_size = join(
                links,
                self._negotiate_request(),
                timeout_s=config.startup_timeout_s,
                spans=layout.spans,
                agree=self._own_size,
            )
        except BaseException:
            close_links(links)
            raise
        self._registration = KVRegistration(
            self.link,
            layout,
            instance_id=instance_id,
            namespace=namespace,
            chunk_size=self.chunk_size,
            rank=rank,
            server_rank=self.server_rank,
            ranks_on_server=self.ranks_on_server,
            num_blocks=num_blocks,
            timeout_s=config.request_timeout_s,
        )
        self._device_order = DeviceOrder(self._registration)
        registration = self._registration
        self._transfers = TransferCalls(
            self.link.client,
            ops_path=lambda: registration.ops_path,
            boot_id=lambda: self.link.boot_id,
            enabled=config.ops_socket,
            api_token=config.api_token,
        )
        self._load_ledger = LoadLedger()
        self._store_ledger = StoreLedger()
        self._load_lane = Lane(f"mpcache-load-{rank}", max_queued=MAX_QUEUED_LOADS)
        self._store_lane = Lane(f"mpcache-store-{rank}", max_queued=MAX_QUEUED_STORES)
        # The longest a call can take: httpx bounds connect, write, pool and read apiece.
        self._call_bound_s = 4 * config.request_timeout_s + 1.0
        self.stores_wait = any(g.kind != "attention" for g in layout.cacheable_groups)
        """Whether ``save`` waits for its call (see ``save``)."""
        self.heartbeat = Heartbeat.for_adapter(
            [self.link],
            config,
            recover=self._recover,
            name=f"mpcache-heartbeat-worker-{rank}",
            transport_factory=async_transport,
        )
        if start_heartbeat:
            self.heartbeat.start()
        logger.info("mpcache worker rank %d: chunk size %d with %s", rank, self.chunk_size, url)

    def _negotiate_request(self) -> NegotiateRequest:
        return negotiate_request(
            self.alignment,
            model=self.model,
            role="worker",
            instance_id=f"{self.instance_id}/{self.rank}",
        )

    def _own_size(self, answers: Mapping[str, int | ConnectorError]) -> int:
        """The size this worker's one server answered (``servers.join``'s ``agree``)."""
        ((url, answer),) = answers.items()
        if isinstance(answer, int):
            return answer
        raise StartupError(
            f"worker rank {self.rank}: chunk-size negotiation with {url} failed: {answer}"
        ) from answer

    # ----------------------------------------------------------- registration

    @property
    def registration(self) -> RegisterRequest | None:
        """The registration to send, with placeholder tickets."""
        return self._registration.request

    @property
    def registered(self) -> bool:
        return self._registration.registered

    @property
    def registration_token(self) -> str:
        return self._registration.token

    @property
    def segments(self) -> list[MemfdKVSegment]:
        """The memfds this worker's CPU KV caches live in (``connector.shm``)."""
        return self._registration.segments

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Share the KV caches with the server; never raises into vLLM's startup
        for a server-side refusal (the worker runs degraded and keeps retrying)."""
        if self._registration.build(kv_caches) is None:
            return
        try:
            reply = self._registration.register()
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
            return
        except SegmentError as exc:
            logger.warning("mpcache worker rank %d: registration failed: %s", self.rank, exc)
            self.link.mark_unhealthy(f"register: {exc}")
            self.heartbeat.wake()
            return
        logger.info(
            "mpcache worker rank %d: registered %d layers (%d bytes per chunk)",
            self.rank,
            reply.num_layers,
            reply.chunk_bytes,
        )

    def unregister(self) -> None:
        """Drop the server's registration (bounded); keeps the memfds."""
        self._registration.unregister()

    def reregister(self) -> None:
        """Register the same caches again (vLLM wake-up after sleep)."""
        if self.registration is None or self.registered:
            return
        try:
            self._registration.register()
        except ServerError as exc:
            self._call_failed("register", exc, force=True)
        except SegmentError as exc:
            logger.warning("mpcache worker rank %d: registration failed: %s", self.rank, exc)

    async def _recover(self, link: ServerLink, client: AsyncControlClient) -> str:
        reply = await renegotiate(
            client,
            self._negotiate_request(),
            self.chunk_size,
            holder="this worker's registered KV cache",
        )
        if self.registration is not None:
            await self._registration.register_async(client)
        return reply.boot_id

    # ------------------------------------------------------------------ health

    @property
    def available(self) -> bool:
        return self.link.healthy and self.registered

    def _call_failed(self, what: str, exc: ServerError, *, force: bool = False) -> None:
        if self.link.call_failed(what, exc, force=force):
            self.heartbeat.wake()

    def _device_event(self) -> str | None:
        """The event handle this call sends (Note [mpcache CUDA IPC invariants], rule 5)."""
        return self._device_order.handle()

    # ------------------------------------------------------------------- loads

    def start_load(self, plan: StepPlan) -> None:
        """Hand the step's loads to the load lane (one batched call) and return.

        A load is reported finished (``take_transfer_results``) once its call has
        returned, in this step or a later one; one that may have left blocks
        unwritten is reported failed with it. Loads the scheduler could not plan,
        and every load while the server is unavailable, fail at once. If anything
        unexpected escapes before the job is queued, every load of the step is
        reported failed before the error propagates.
        """
        outcome = LoadOutcome()
        if plan.failed_loads:
            # Loads the scheduler accepted but could not plan: request-level failures.
            outcome.finished.update(plan.failed_loads)
            outcome.failed.update(plan.failed_loads)
        loads = plan.loads
        try:
            if loads and not self._submit_loads(loads):
                outcome.finished.update(op.request_id for op in loads)
                for op in loads:
                    self._fail_load(outcome, op, op.touched_block_ids(self._spans))
        except BaseException:
            outcome.finished.update(op.request_id for op in loads)
            for op in loads:
                self._fail_load(outcome, op, op.nonnull_block_ids())
            raise
        finally:
            if outcome.finished:
                self._load_ledger.publish(outcome)

    def _submit_loads(self, loads: Sequence[TransferOp]) -> bool:
        """Queue the step's retrieve; False when it cannot run (degraded)."""
        if not self.available:
            return False
        event = self._device_event()  # on vLLM's thread: orders the call after its writes
        job = Job(lambda job: self._run_load(loads, event), _ids(loads))
        return self._load_lane.submit(job)

    def _body(self, ops: Sequence[TransferOp], event: str | None) -> dict[str, Any]:
        """A store's or retrieve's fields (built on the lane, off vLLM's thread)."""
        return {
            "instance_id": self.instance_id,
            "rank": self.server_rank,
            "requests": [op.to_item(self.namespace) for op in ops],
            "timeout_s": server_budget_s(self.config.request_timeout_s),
            "event_ipc_b64": event,
        }

    def _run_load(self, loads: Sequence[TransferOp], event: str | None) -> None:
        """The load lane's job: the retrieve call, then its outcome, published whole."""
        outcome = LoadOutcome(finished={op.request_id for op in loads})
        try:
            self._load(loads, RetrieveRequest(**self._body(loads, event)), outcome)
        except BaseException:
            for op in loads:
                self._fail_load(outcome, op, op.nonnull_block_ids())
            raise
        finally:
            self._load_ledger.publish(outcome)

    def _load(self, loads: Sequence[TransferOp], body: RetrieveRequest, out: LoadOutcome) -> None:
        try:
            reply = self._transfers.retrieve(
                body,
                timeout_s=self.config.request_timeout_s,
                registration_token=self.registration_token,
            )
        except ServerError as exc:
            self._call_failed("retrieve", exc)
            for op in loads:
                self._fail_load(out, op, op.touched_block_ids(self._spans))
            return
        results = {r.request_id: r for r in reply.results}
        for op in loads:
            result = results.get(wire_text(op.request_id))
            if result is None:
                self._fail_load(out, op, op.touched_block_ids(self._spans))
                continue
            loaded_end = op.start_token + max(0, result.loaded_tokens)
            failed = set(result.failed_block_ids)
            if loaded_end < op.end_token:
                rest = TransferOp(
                    op.request_id, loaded_end, op.end_token, "", op.block_ids, op.cache_salt
                )
                failed |= rest.touched_block_ids(self._spans)
            failed.discard(0)
            if failed:
                self._fail_load(out, op, failed)

    def _fail_load(self, out: LoadOutcome, op: TransferOp, block_ids: set[int]) -> None:
        if not block_ids:
            return
        if self._single_group:
            out.error_blocks.update(block_ids)
        else:
            # Block ids are per group, so vLLM takes only request-level failures.
            out.failed.add(op.request_id)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads) since the last call; failed ones are in both.
        The blocks that failed with them come from the next ``take_load_errors``."""
        return self._load_ledger.take()

    def take_finished_loads(self) -> set[str]:
        """Finished loads for a caller that cannot take request-level failures.

        vLLM's older ``get_finished`` reports finished ids only. A load that failed
        by blocks is still reported through ``take_load_errors``, so it is returned
        here; one that failed as a request (``failed_recving``) would read as a
        success, so it stays queued for the next ``take_transfer_results``.
        """
        return self._load_ledger.take_finished()

    def take_load_errors(self) -> set[int]:
        return self._load_ledger.take_errors()

    # ------------------------------------------------------------------ stores

    def save(self, plan: StepPlan) -> None:
        """Hand the step's finished chunks to the store lane (one batched call).

        Returns at once, except for a layout whose blocks vLLM rewrites or frees
        while the request runs (sliding-window and recurrent groups): there it waits
        for the call, as before (``stores_wait``). Skipped while degraded, and
        when the lane already has ``MAX_QUEUED_STORES`` calls waiting (a best-effort
        cache drops a store rather than hold vLLM's blocks longer).
        """
        stores = plan.stores
        if not stores:
            return
        ids = _ids(stores)
        self._store_ledger.planned(ids)  # first: finish reports depend on it
        if not self.available:
            return
        event = self._device_event()  # on vLLM's thread: orders the call after its writes
        self._store_ledger.begin(ids)
        job = Job(lambda job: self._run_store(job, stores, event), ids)
        if not self._store_lane.submit(job):
            self._store_ledger.end(ids)
            logger.debug("mpcache worker rank %d: store lane full; step not stored", self.rank)
            return
        if self.stores_wait:
            job.done.wait(self._call_bound_s)

    def _run_store(self, job: Job, stores: Sequence[TransferOp], event: str | None) -> None:
        """The store lane's job: the store call, without the requests revoked since."""
        try:
            with self._store_lane.lock:
                revoked = set(job.revoked)
            sent = [op for op in stores if op.request_id not in revoked]
            if sent:
                self._store(StoreRequest(**self._body(sent, event)))
        finally:
            self._store_ledger.end(job.request_ids)

    def _store(self, body: StoreRequest) -> None:
        try:
            reply = self._transfers.store(
                body,
                timeout_s=self.config.request_timeout_s,
                registration_token=self.registration_token,
            )
        except ServerError as exc:
            self._call_failed("store", exc)
            return
        failed = sum(r.failed_chunks for r in reply.results)
        if failed:
            logger.debug("mpcache worker rank %d: %d chunk(s) not stored", self.rank, failed)

    def take_finished_stores(self, finished_req_ids: Collection[str]) -> set[str]:
        """Finished requests whose blocks no store reads any more (vLLM frees them:
        the scheduler delayed exactly the requests a plan carried stores for)."""
        return self._store_ledger.finished(finished_req_ids)

    def handle_preemptions(self, plan: StepPlan) -> None:
        """vLLM freed the blocks of ``plan.preempted`` and may rewrite them this step:
        their queued stores are revoked, and a store call already running for them
        is waited for (bounded by the call's own client timeout)."""
        preempted = self._store_ledger.in_flight(plan.preempted)
        if not preempted:
            return
        for job in self._store_lane.revoke(preempted):
            if not job.done.wait(self._call_bound_s):
                logger.warning(
                    "mpcache worker rank %d: a store of preempted requests outlived its "
                    "timeout (the server's budget has ended it)",
                    self.rank,
                )

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for every transfer handed over so far."""
        deadline = time.monotonic() + timeout_s
        loads = self._load_lane.wait_idle(timeout_s)
        return self._store_lane.wait_idle(max(0.0, deadline - time.monotonic())) and loads

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Let the transfers handed over finish (bounded), stop the heartbeat,
        unregister, disconnect, close this worker's memfds."""
        for lane in (self._load_lane, self._store_lane):
            lane.close(self._call_bound_s)
        self.heartbeat.stop()
        if self.link.healthy:
            self.unregister()
        self._registration.close()
        self._transfers.close()
        self.link.client.close()
