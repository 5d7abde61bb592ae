"""The scheduler's lookup path: how many prompt tokens the cache holds, never waited for.

``Lookups`` is the protocol on vLLM's thread (first answer ``None``, one batch per
step, late answers, the memo); ``LookupSender`` sends each batch on the lookup
thread, packing and framing it in one place whatever the body carries (token ids,
or marks of ids written into a lookup area, ``connector.lookup_area``), and asks
every server that holds some rank's chunks. Neither calls back into the adapter,
which hands them its links, the clients' transport, config, clock and a call-failed
callback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from connector.client import ControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.errors import ProtocolError, ServerError, ServerRejected
from connector.failures import FailureLog
from connector.index_slot import IndexSlot
from connector.lookup_area import LookupArea
from connector.request_state import PendingLookup, RequestState, RequestTable
from connector.servers import ServerLink, blocking_client, ranks_of_server
from contract.frames import SEND_PIECE_BYTES, lookup_frame_marks, lookup_frame_parts
from contract.schemas import (
    LookupFrameHeader,
    LookupFrameItem,
    LookupResponse,
)
from contract.wire_text import end_sessions, wire_salt, wire_text

__all__ = ["CallFailed", "LookupSender", "Lookups"]

logger = logging.getLogger("mpcache.connector")

CallFailed = Callable[[ServerLink, str, ServerError], None]
"""``(link, what, error)``: a call to that server failed (the adapter judges it)."""

_LATE_S = 1.0
"""Grace past ``lookup_timeout_s`` before a lookup that has not landed answers 0."""

_AREA_RETRY_S = 30.0
"""After a lookup area could not be registered, lookups send ids in the body for
this long before the next try."""


class _AreaGone:
    """The server no longer knows the lookup area (it restarted): send the ids."""


_AREA_GONE = _AreaGone()


class Lookups:
    """The scheduler's lookups, as vLLM's thread sees them.

    Lookups never wait on vLLM's scheduler thread (vLLM asks for every waiting
    request, every step). The first ask of a request starts its lookup and answers
    ``None`` ("ask again later"; vLLM skips the request this step). ``send``, which
    the adapter calls at the end of each ``schedule()``, hands every lookup the step
    started to the ``LookupSender`` as one batch. A later step finds the answer and
    returns it. Every lookup ends in an answer: the server's, or 0 when the call
    fails, when it has not landed ``lookup_timeout_s`` + ``_LATE_S`` after it started
    (nothing can hold a request back for longer), or at once in degraded mode. A
    request that finishes while its lookup is in flight is forgotten at once; when
    the lookup lands, its server session is ended again (the end sent with the next
    step may have reached the server first).

    An answer is memoised while vLLM retries the request's admission (waiting for
    blocks), but for at most ``lookup_max_age_s``: the server's lease on the hit
    chunks (``--lease-ttl-s``) is renewed by each lookup, so an older answer is
    looked up again, asynchronously like the first, before vLLM acts on it.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        links: Mapping[str, ServerLink],
        requests: RequestTable,
        *,
        world_size: int,
        namespace: str,
        chunk_size: int,
        unit_tokens: int,
        call_failed: CallFailed,
        failures: FailureLog,
        clock: Callable[[], float],
        transport: TransportFactory | None = None,
    ) -> None:
        # Servers that hold some rank's chunks, and how many ranks each holds.
        ranks = {
            url: len(owned)
            for url, owned in ranks_of_server(config.server_urls, world_size).items()
            if owned
        }
        self._links = tuple(links[url] for url in ranks)
        self._requests = requests
        # A hit may end at any multiple of the unit (the required alignment).
        self._unit = unit_tokens
        self._clock = clock
        self._failures = failures
        self._max_age_s = config.lookup_max_age_s
        self._late_after_s = config.lookup_timeout_s + _LATE_S
        self._unsent: list[PendingLookup] = []  # lookups started this step
        self._sender = LookupSender(
            config,
            {url: (links[url], n) for url, n in ranks.items()},
            namespace=namespace,
            chunk_size=chunk_size,
            unit_tokens=unit_tokens if unit_tokens < chunk_size else None,
            call_failed=call_failed,
            failures=failures,
            clock=clock,
            transport=transport,
        )

    @property
    def available(self) -> bool:
        """True when every server holding chunks of some rank is healthy."""
        return all(link.healthy for link in self._links)

    def in_flight(self, request: Any, num_computed_tokens: int) -> bool:
        """True when ``request``'s lookup is in flight and ``hit_tokens`` would answer
        ``None`` again: the short way for the asks vLLM repeats every step, on its own
        thread, each holding the GIL the lookup thread needs (bench/
        scheduler_burst_bench.py measures a burst of them).

        A request does not run while its lookup is in flight (vLLM skips it on
        ``None``), so its tokens, and the lookup's end, have not changed."""
        st = self._requests.get(request.request_id)
        if st is None:
            return False
        pending = st.lookup
        if pending is None or pending.done or st.request is not request:
            return False
        if num_computed_tokens >= pending.end:  # vLLM's own cache now covers it
            return False
        if self._clock() - pending.started_at >= self._late_after_s:
            return False
        return self.available

    def hit_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """The tokens from 0 the cache holds for ``request`` (whole alignment units,
        never its last prompt token: vLLM must compute that one to sample), 0 where a
        lookup cannot help, or ``None`` while its lookup is in flight."""
        if not self.available:
            self._drop(request.request_id)
            return 0
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0  # vLLM would ignore the answer
        tokens = request.all_token_ids
        unit = self._unit
        lookup_end = (len(tokens) - 1) // unit * unit
        if lookup_end <= num_computed_tokens:
            return 0
        st = self._requests.state(request)
        now = self._clock()
        if st.lookup_end != lookup_end or now - st.lookup_at >= self._max_age_s:
            hit = self._indexed(st, lookup_end, now)
            if hit is None:
                hit = self._poll(st, lookup_end, now)
            if hit is None:
                return None
            st.hit_tokens = hit
            st.lookup_end = lookup_end
        st.local_tokens = num_computed_tokens
        return st.hit_tokens

    def indexed(self, request: Any, tokens: int) -> bool:
        """Whether the server's key index shows the cache holding ``request``'s first
        ``tokens`` tokens (all but its last prompt token at most): a probe on vLLM's
        thread that neither calls the server nor sets the request's lookup memo.
        False where the index cannot say."""
        end = min(tokens, (len(request.all_token_ids) - 1) // self._unit * self._unit)
        if end <= 0:
            return False
        hit = self._probe(self._requests.state(request), end)
        return hit is not None and hit >= end

    def _probe(self, st: RequestState, end: int) -> int | None:
        """The key index's answer for ``st``'s first ``end`` tokens (``IndexSlot``)."""
        request = st.request
        return self._sender.index.answer(
            lambda: st.encoder.packed(request.all_token_ids, end),
            end,
            wire_salt(getattr(request, "cache_salt", None)),
        )

    def _indexed(self, st: RequestState, lookup_end: int, now: float) -> int | None:
        """The answer of the server's key index, when it has one (``IndexSlot``): at
        once, in the step vLLM first asks. A lookup already in flight is abandoned."""
        hit = self._probe(st, lookup_end)
        if hit is None:
            return None
        if st.lookup is not None:
            st.lookup.abandoned = True
            st.lookup = None
        st.lookup_at = now
        return hit // self._unit * self._unit

    def _poll(self, st: RequestState, lookup_end: int, now: float) -> int | None:
        """The landed answer of ``st``'s lookup up to ``lookup_end``; else start that
        lookup (or let it run) and return None."""
        pending = st.lookup
        if pending is None or pending.end != lookup_end:
            if pending is not None:
                pending.abandoned = True
            request = st.request
            st.lookup = PendingLookup(
                request_id=request.request_id,
                cache_salt=wire_salt(getattr(request, "cache_salt", None)),
                tokens=request.all_token_ids,
                encoder=st.encoder,
                end=lookup_end,
                started_at=now,
            )
            self._unsent.append(st.lookup)
            return None
        if not pending.done:
            if now - pending.started_at < self._late_after_s:
                return None
            pending.abandoned = True
            st.lookup = None
            st.lookup_at = pending.started_at
            self._failures(
                "late lookup",
                "mpcache: a lookup has not landed %.1fs after it started; answering 0",
                now - pending.started_at,
                exc=None,
            )
            return 0
        st.lookup = None
        st.lookup_at = pending.started_at
        return max(0, pending.hit_tokens // self._unit * self._unit)

    def _drop(self, request_id: str) -> None:
        st = self._requests.get(request_id)
        if st is not None and st.lookup is not None:
            st.lookup.abandoned = True
            st.lookup = None

    @staticmethod
    def finished(st: RequestState) -> None:
        """``st``'s request finished: its lookup's answer is ignored, and its session
        ended once more when that lookup lands."""
        if st.lookup is not None:
            st.lookup.abandoned = st.lookup.finished = True

    def send(self) -> None:
        """Send the lookups this step started, as one batch (on the lookup thread)."""
        batch = [p for p in self._unsent if not p.abandoned]
        self._unsent.clear()
        self._sender.index.refill()
        if batch:
            self._sender.submit(batch)

    def close(self) -> None:
        self._sender.close()


class LookupSender:
    """The lookup thread: one batched call per server for each step's lookups.

    It has blocking clients of its own rather than sharing the heartbeat's asyncio
    loop: a lookup answers sooner through them than through the loop and httpx's
    async stack (bench/connector_bench.py measures the answer time). With several
    servers (one per node) a batch asks them all at once, and a lookup's answer is
    the least any of them holds.

    With one server, if ``config.lookup_area``, the batch's ids go through a lookup
    area registered with it (``_AreaSlot``), else in the body. Tokens are packed here,
    once per request (``TokenEncoder``; the store and load plans reuse the bytes).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        servers: Mapping[str, tuple[ServerLink, int]],
        *,
        namespace: str,
        chunk_size: int,
        unit_tokens: int | None,
        call_failed: CallFailed,
        failures: FailureLog,
        clock: Callable[[], float],
        transport: TransportFactory | None = None,
    ) -> None:
        self._namespace = namespace
        self._unit = unit_tokens  # None: the server answers whole chunks
        self._call_failed = call_failed
        self._failures = failures
        self._links = {url: link for url, (link, _) in servers.items()}
        self._ranks = {url: ranks for url, (_, ranks) in servers.items()}
        self._clients = {
            url: blocking_client(url, config, transport, timeout_s=config.lookup_timeout_s)
            for url in servers
        }
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpcache-lookup")
        # One server (this host's, if its registration socket is reachable): lookups
        # write their ids into a lookup area instead of the body.
        ((first_url, first_client), *_) = self._clients.items()
        use_area = len(servers) == 1 and config.lookup_area
        self._area = _AreaSlot(first_url, first_client, enabled=use_area, clock=clock)
        if use_area:
            self._thread.submit(self._area.setup)
        self.index = IndexSlot(
            first_client,
            self._links[first_url],
            namespace=namespace,
            chunk_size=chunk_size,
            world_size=self._ranks[first_url],
            unit_tokens=unit_tokens,
            enabled=len(servers) == 1 and config.key_index,
            submit=self._thread.submit,
        )
        self._fan_out = ThreadPoolExecutor(len(servers), thread_name_prefix="mpcache-lookup-server")

    def submit(self, batch: list[PendingLookup]) -> None:
        """Send ``batch`` on the lookup thread; answer it 0 at once once shut down."""
        try:
            self._thread.submit(self._send, batch)
        except RuntimeError:  # shut down: answer at once
            for p in batch:
                p.answer(0)

    def close(self) -> None:
        # A batch in flight ends within lookup_timeout_s; queued ones are dropped.
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._fan_out.shutdown(wait=True)
        self._area.close()  # the lookup thread has stopped: nothing writes it now
        self.index.close()
        for client in self._clients.values():
            client.close()

    def _send(self, batch: list[PendingLookup]) -> None:
        """On the lookup thread: pack, send, and answer every lookup of ``batch``."""
        hits = [p.end for p in batch]
        try:
            for reply in self._replies(batch):
                if not isinstance(reply, LookupResponse):  # the call failed
                    hits = [0] * len(batch)
                    break
                hits = [min(h, r.hit_tokens) for h, r in zip(hits, reply.results, strict=True)]
        except Exception as exc:  # never leave a request waiting for an answer
            hits = [0] * len(batch)
            self._failures("lookup batch", "mpcache: a lookup batch failed", exc=exc)
        finally:
            for p, hit in zip(batch, hits, strict=True):
                p.answer(hit)
        finished = [p.request_id for p in batch if p.finished]
        if finished:  # finished while in flight: the lookup may have reopened a session
            body = end_sessions(finished)
            for url, client in self._clients.items():
                try:
                    client.end_sessions(body)
                except ServerError as exc:
                    logger.debug("mpcache end of sessions on %s failed: %s", url, exc)

    def _replies(self, batch: Sequence[PendingLookup]) -> list[LookupResponse | _AreaGone | None]:
        """Every lookup server's answer to ``batch`` (not a ``LookupResponse``: that
        server's call failed)."""
        if len(self._ranks) > 1:  # one server per node: pack once, ask them all at once
            packed = list(_packed(batch))
            return list(
                self._fan_out.map(lambda url: self._ask(url, batch, packed, None), self._ranks)
            )
        (url,) = self._ranks
        # Packed as the body is sent: the server hashes item i while item i + 1 is
        # packed here.
        area = self._area.ready(4 * sum(p.end for p in batch))
        reply = self._ask(url, batch, _packed(batch), area)
        if reply is _AREA_GONE:  # the server restarted: ids in the body again
            reply = self._ask(url, batch, _packed(batch), None)
        return [reply]

    def _ask(
        self,
        url: str,
        batch: Sequence[PendingLookup],
        packed: Iterable[bytes],
        area: LookupArea | None,
    ) -> LookupResponse | _AreaGone | None:
        """One server's answer to the batch; None if the call failed; ``_AREA_GONE``
        if the server no longer knows ``area``."""
        frame = self._frame(url, batch, packed, area)
        try:
            reply = self._clients[url].lookup(frame)
            if len(reply.results) != len(batch):
                raise ProtocolError(
                    f"{url}: {len(reply.results)} lookup results for {len(batch)} requests",
                    url=url,
                )
        except Exception as exc:
            if area is not None:  # whatever failed, the server may still read it
                self._area.forget()
                if isinstance(exc, ServerRejected) and exc.status == 404:
                    return _AREA_GONE  # the server forgot the area (it restarted)
            if not isinstance(exc, ServerError):
                raise
            self._call_failed(self._links[url], "lookup", exc)
            return None
        return reply

    def _frame(
        self,
        url: str,
        batch: Sequence[PendingLookup],
        packed: Iterable[bytes],
        area: LookupArea | None,
    ) -> Iterator[bytes]:
        """The binary lookup body of ``batch`` for ``url`` (``contract.frames``), in
        pieces as ``packed`` yields each request's ids: the ids themselves, or with
        ``area`` a mark per request once its ids are written there."""
        # Validated, not model_construct'ed: pydantic's model_construct runs in Python,
        # validation in its Rust core, which is the quicker for a batch's items.
        header = LookupFrameHeader(
            requests=[
                LookupFrameItem(
                    request_id=wire_text(p.request_id),
                    namespace=self._namespace,
                    cache_salt=p.cache_salt,
                    world_size=self._ranks[url],
                    num_tokens=p.end,
                    unit_tokens=self._unit,
                )
                for p in batch
            ],
            area=None if area is None else area.area_id,
        )
        if area is None:
            return lookup_frame_parts(header, packed, piece_bytes=SEND_PIECE_BYTES)
        return lookup_frame_marks(header, packed, area.write, piece_bytes=SEND_PIECE_BYTES)


def _packed(batch: Sequence[PendingLookup]) -> Iterator[bytes]:
    """Each lookup's ids as int32 bytes, packed as they are asked for."""
    return (p.encoder.packed(p.tokens, p.end) for p in batch)


class _AreaSlot:
    """The lookup area the lookup thread writes, and when to register the next one.

    Used on the lookup thread only (``close`` once that thread has stopped). After a
    registration fails, lookups send their ids in the body for ``_AREA_RETRY_S``, or
    for good where the server has no lookup areas (404/405). After a failed call
    through the area (the server may still read it) it is closed, never written
    again, and the next batch registers a new one.
    """

    def __init__(
        self, url: str, client: ControlClient, *, enabled: bool, clock: Callable[[], float]
    ) -> None:
        self._url = url
        self._client = client
        self._enabled = enabled
        self._clock = clock
        self._area: LookupArea | None = None
        self._retry_at = 0.0

    def setup(self) -> None:
        """Create and register a lookup area, or say why not. Never raises: without
        an area, lookups send the ids in the body."""
        self._retry_at = self._clock() + _AREA_RETRY_S
        area: LookupArea | None = None
        try:
            area = LookupArea()
            area_id = area.register(self._client)
        except Exception as exc:  # any failure leaves the body form
            if area is not None:
                area.close()
            if isinstance(exc, ServerRejected) and exc.status in (404, 405):
                self._retry_at = math.inf  # a server without lookup areas
            logger.info(
                "mpcache scheduler: lookups send token ids in the body (no lookup area "
                "with %s: %s)",
                self._url,
                exc,
            )
            return
        self._area = area
        logger.info("mpcache scheduler: lookups write token ids into lookup area %s", area_id)

    def ready(self, nbytes: int) -> LookupArea | None:
        """The registered area if ``nbytes`` of ids fit it (registering one first
        when there is none and its next try is due)."""
        if self._area is None and self._enabled and self._clock() >= self._retry_at:
            self.setup()
        area = self._area
        return area if area is not None and nbytes <= area.nbytes else None

    def forget(self) -> None:
        """After a failed lookup through the area: never write it again; the next
        batch registers a new one."""
        self.close()
        self._retry_at = 0.0

    def close(self) -> None:
        """Close the area; the server drops it when its socket connection closes."""
        if self._area is not None:
            self._area.close()
            self._area = None
