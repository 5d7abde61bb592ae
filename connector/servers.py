"""One adapter's view of its mpcache server(s): negotiation and health state.

``ServerLink`` pairs a server's blocking client with the health this adapter
believes it has. The set-up both adapters share lives here too: a link per server
URL (``open_links``), negotiating with every server and agreeing on one size
(``join``), and the rules behind them: the negotiation body (``negotiate_request``),
the exact-size check when re-joining a restarted server (``renegotiate``) and which
failed calls make a server suspect (``ServerLink.call_failed``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from connector.alignment import check_chunk_size
from connector.client import AsyncControlClient, ControlClient, TransportFactory
from connector.config import ConnectorConfig
from connector.errors import (
    ConnectorError,
    RecoveryError,
    ServerError,
    ServerRejected,
    ServerUnreachable,
    StartupError,
)
from contract.schemas import NegotiateRequest, NegotiateResponse

__all__ = [
    "AgreeFn",
    "ServerLink",
    "agree_chunk_size",
    "blocking_client",
    "close_links",
    "join",
    "negotiate_request",
    "negotiate_until",
    "open_links",
    "ranks_of_server",
    "renegotiate",
    "server_for_rank",
]

logger = logging.getLogger("mpcache.connector")

_MAX_FAILURES_REMEMBERED = 16
"""Distinct recovery failures remembered; past it they are all logged afresh."""


class ServerLink:
    """A server URL, its blocking client, and this adapter's view of its health.

    Shared by vLLM's thread (reads ``healthy``; marks the server suspect when a call
    fails, ``call_failed``) and the heartbeat thread (pings, recovers, marks healthy),
    so transitions take a lock and each one is logged once.
    """

    def __init__(self, url: str, client: ControlClient, *, role: str) -> None:
        self.url = url
        self.client = client
        self.role = role
        self._lock = threading.Lock()
        self._healthy = False
        self._boot_id: str | None = None
        self._failures: set[str] = set()  # recovery failures logged since last healthy
        self._warned: set[str] = set()

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def boot_id(self) -> str | None:
        return self._boot_id

    def mark_healthy(self, boot_id: str, *, recovered: bool = False) -> None:
        with self._lock:
            was = self._healthy
            self._healthy = True
            self._boot_id = boot_id
            self._failures.clear()
        if not was and recovered:
            logger.warning(
                "mpcache %s: server %s is healthy again (boot_id %s); cache enabled",
                self.role,
                self.url,
                boot_id,
            )

    def mark_unhealthy(self, reason: str) -> None:
        """Enter degraded mode for this server (logged on the transition only)."""
        with self._lock:
            was = self._healthy
            self._healthy = False
        if was:
            logger.warning(
                "mpcache %s: server %s unhealthy (%s); degraded mode: lookups 0, "
                "stores skipped, loads recomputed",
                self.role,
                self.url,
                reason,
            )

    def call_failed(self, what: str, exc: ServerError, *, force: bool = False) -> bool:
        """A call on vLLM's thread failed; True when the server is now suspect.

        Unreachable, or 404/409 (the server forgot us or changed: a restart), or
        ``force``: the server is marked unhealthy and the caller should wake the
        heartbeat, which judges and recovers it. Anything else (a 5xx, a 422) fails
        that call only; it is logged once per kind of call and error.
        """
        if (
            force
            or isinstance(exc, ServerUnreachable)
            or (isinstance(exc, ServerRejected) and exc.status in (404, 409))
        ):
            self.mark_unhealthy(f"{what} failed: {exc}")
            return True
        key = f"{what}:{type(exc).__name__}"
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            logger.warning(
                "mpcache %s: %s on %s failed (reported once): %s", self.role, what, self.url, exc
            )
        return False

    def note_recovery_failure(self, reason: str) -> None:
        """Record a failed recovery; each reason is logged once until the server is
        healthy again, not on every ping, nor again after a transient error (a
        timeout) came between two of its pings."""
        with self._lock:
            repeat = reason in self._failures
            if len(self._failures) >= _MAX_FAILURES_REMEMBERED:
                self._failures.clear()
            self._failures.add(reason)
        if not repeat:
            logger.error(
                "mpcache %s: cannot re-join server %s: %s; staying degraded, retrying "
                "after the next successful heartbeat",
                self.role,
                self.url,
                reason,
            )


def negotiate_request(
    alignment: int, *, model: str, role: Literal["scheduler", "worker"], instance_id: str
) -> NegotiateRequest:
    """The negotiation body of an adapter (bookkeeping fields cut to the schema's
    bounds, control characters replaced: they are for the server's log)."""
    return NegotiateRequest(
        required_alignment=alignment,
        model=_loggable(model, 512),
        role=role,
        instance_id=_loggable(instance_id, 256),
    )


def _loggable(text: str, max_chars: int) -> str:
    """``text`` in at most ``max_chars``, with ``?`` for each control character."""
    return "".join("?" if ord(c) < 0x20 or c == "\x7f" else c for c in text[:max_chars])


async def renegotiate(
    client: AsyncControlClient, request: NegotiateRequest, chunk_size: int, *, holder: str
) -> NegotiateResponse:
    """Re-negotiate with a restarted server (docs/design.md s.3, steps 1-2).

    Raises ``RecoveryError`` unless the server answers exactly ``chunk_size``, the size
    ``holder`` (e.g. "this engine") already runs with.
    """
    reply = await client.negotiate(request)
    if reply.chunk_size != chunk_size:
        raise RecoveryError(
            f"after its restart the server answers chunk size {reply.chunk_size} for "
            f"alignment {request.required_alignment}, but {holder} runs with {chunk_size}; "
            "restart it with the same --chunk-size"
        )
    return reply


def negotiate_until(
    client: ControlClient,
    request: NegotiateRequest,
    deadline_s: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> NegotiateResponse:
    """Negotiate, retrying unreachable/5xx answers until ``deadline_s`` (monotonic).

    A 4xx is final: the server understood and refused (e.g. incompatible alignment).
    """
    delay = 0.05
    while True:
        try:
            return client.negotiate(request)
        except ServerRejected:
            raise
        except ServerError as exc:
            retry_after = getattr(exc, "retry_after_s", None) or delay
            if clock() + retry_after > deadline_s:
                raise
            sleep(retry_after)
            delay = min(delay * 2, 1.0)


def agree_chunk_size(answers: Mapping[str, int | ConnectorError]) -> int:
    """The one chunk size every server returned, else ``StartupError`` naming each."""
    sizes = {v for v in answers.values() if isinstance(v, int)}
    failed = any(not isinstance(v, int) for v in answers.values())
    if len(sizes) == 1 and not failed:
        return sizes.pop()
    lines = []
    for url, answer in answers.items():
        what = f"chunk size {answer}" if isinstance(answer, int) else f"error: {answer}"
        lines.append(f"  {url} -> {what}")
    if failed:
        head = "chunk-size negotiation failed"
    else:
        head = "mpcache servers disagree on the chunk size; every server must return the same size"
    raise StartupError(
        f"{head} (give every server the same --chunk-size, or use one server per model):\n"
        + "\n".join(lines)
    )


AgreeFn = Callable[[Mapping[str, int | ConnectorError]], int]
"""The one size to run with, from each server's answer (``agree_chunk_size``)."""


def blocking_client(
    url: str, config: ConnectorConfig, transport: TransportFactory | None, *, timeout_s: float
) -> ControlClient:
    """A blocking client of the server at ``url`` with the adapter's API token."""
    return ControlClient(
        url,
        timeout_s=timeout_s,
        transport=transport(url) if transport else None,
        api_token=config.api_token,
    )


def open_links(
    urls: Iterable[str],
    config: ConnectorConfig,
    transport: TransportFactory | None,
    *,
    role: str,
) -> dict[str, ServerLink]:
    """A link per server URL, its client bounded by ``request_timeout_s``; each is
    unhealthy until ``join`` (or the heartbeat) marks it healthy."""
    return {
        url: ServerLink(
            url,
            blocking_client(url, config, transport, timeout_s=config.request_timeout_s),
            role=role,
        )
        for url in urls
    }


def close_links(links: Mapping[str, ServerLink]) -> None:
    for link in links.values():
        link.client.close()


def join(
    links: Mapping[str, ServerLink],
    request: NegotiateRequest,
    *,
    timeout_s: float,
    spans: Iterable[int],
    agree: AgreeFn = agree_chunk_size,
) -> int:
    """Negotiate with every server (retrying for up to ``timeout_s``), agree on one
    chunk size, check it fits the layout's ``spans``, then mark the servers healthy.

    docs/design.md s.2, connector rules 1-2: a server's refusal or failure reaches
    ``agree`` as its answer, which raises (``StartupError``) unless every server gave
    the same size; a size that fits no layout raises ``LayoutError``. The caller
    closes the links when this raises.
    """
    deadline = time.monotonic() + timeout_s
    answers: dict[str, int | ConnectorError] = {}
    boots: dict[str, str] = {}
    for url, link in links.items():
        try:
            reply = negotiate_until(link.client, request, deadline)
        except ServerError as exc:
            answers[url] = exc
            continue
        answers[url] = reply.chunk_size
        boots[url] = reply.boot_id
    size = agree(answers)
    check_chunk_size(size, spans)
    for url, boot_id in boots.items():
        links[url].mark_healthy(boot_id)
    return size


def ranks_of_server(urls: Sequence[str], world_size: int) -> dict[str, list[int]]:
    """Contiguous blocks of ranks per server (one server per node, in node order)."""
    per_server = -(-world_size // len(urls))
    owned: dict[str, list[int]] = {url: [] for url in urls}
    for rank in range(world_size):
        owned[urls[rank // per_server]].append(rank)
    return owned


def server_for_rank(urls: Sequence[str], rank: int, world_size: int) -> str:
    """The server a worker of ``rank`` uses (see ``ranks_of_server``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return urls[rank // -(-world_size // len(urls))]
