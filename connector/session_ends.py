"""The server sessions of finished requests, on their way to each server's ``/cache/end``.

vLLM's thread only queues ids (``put``); the heartbeat loop sends them (``send``),
one call per server and batch, every server on its own. A server whose call fails
for a reason that may pass (unreachable, timed out, 5xx), or that is unhealthy at
the time, keeps its ids for the next round, so one lost call does not leave a
session (its leases, and its part in forbidding a chunk-size resize) to the
server's session TTL. A refusal (4xx, a body the contract does not know) is not
retried. What is kept per server is bounded (``RETRY_CAP``): past it the oldest
ids are left to the TTL, which ends them anyway.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from connector.client import AsyncControlClient, ControlClient
from connector.errors import ServerError, ServerFailure, ServerUnreachable
from contract.wire_text import end_sessions

__all__ = ["BATCH", "RETRY_CAP", "SessionEnds"]

logger = logging.getLogger("mpcache.connector")

BATCH = 4096
"""Most ids one ``/cache/end`` call carries (the contract admits 65536)."""

RETRY_CAP = 65536
"""Most ids kept for one server whose calls fail; past it the oldest go to its TTL."""


def _batches(ids: Sequence[str]) -> Iterator[tuple[int, Sequence[str]]]:
    """``ids`` in calls of at most ``BATCH``, each with where it starts."""
    for start in range(0, len(ids), BATCH):
        yield start, ids[start : start + BATCH]


def _retryable(exc: ServerError) -> bool:
    return isinstance(exc, ServerUnreachable | ServerFailure)


class SessionEnds:
    """Ids queued by vLLM's thread, and per server the ids its last call kept."""

    def __init__(self, urls: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._new: list[str] = []  # vLLM's thread appends; the loop takes
        self._kept: dict[str, list[str]] = {url: [] for url in urls}  # the loop's own
        self.dropped = 0  # ids left to a server's TTL: refused, or past RETRY_CAP

    def put(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._new.extend(request_ids)

    def take(self, extra: Sequence[str] = ()) -> dict[str, list[str]]:
        """Per server, the ids it is owed now: those it kept, then the queued ones."""
        with self._lock:
            new, self._new = self._new, []
        new = list(extra) + new
        owed = {url: kept + new for url, kept in self._kept.items()}
        self._kept = {url: [] for url in self._kept}
        return {url: ids for url, ids in owed.items() if ids}

    def keep(self, url: str, ids: Sequence[str]) -> None:
        """``url`` did not get ``ids``: they go out with its next round, oldest first."""
        kept = list(ids) + self._kept[url]
        if len(kept) > RETRY_CAP:
            self.dropped += len(kept) - RETRY_CAP
            kept = kept[-RETRY_CAP:]
        self._kept[url] = kept

    async def send(
        self, clients: Mapping[str, AsyncControlClient], healthy: Callable[[str], bool]
    ) -> None:
        """One round on the heartbeat loop: every healthy server gets what it is owed,
        the servers side by side; what a server did not get is kept for it."""
        owed = self.take()
        await asyncio.gather(
            *(
                self._send_one(url, clients[url], ids, healthy(url))
                for url, ids in owed.items()
                if url in clients
            )
        )

    async def _send_one(
        self, url: str, client: AsyncControlClient, ids: list[str], healthy: bool
    ) -> None:
        if not healthy:
            self.keep(url, ids)
            return
        for start, batch in _batches(ids):
            try:
                await client.end_sessions(end_sessions(batch))
            except ServerError as exc:
                self._failed(url, ids[start:], exc)
                return

    def _failed(self, url: str, ids: Sequence[str], exc: ServerError) -> None:
        if _retryable(exc):
            logger.debug("mpcache end of %d sessions on %s failed, kept: %s", len(ids), url, exc)
            self.keep(url, ids)
            return
        self.dropped += len(ids)
        logger.debug("mpcache end of %d sessions on %s refused: %s", len(ids), url, exc)

    def flush(
        self,
        clients: Mapping[str, ControlClient],
        healthy: Callable[[str], bool],
        extra: Sequence[str] = (),
    ) -> None:
        """At shutdown, from vLLM's thread once the loop has stopped: one try per
        healthy server and batch, each call bounded by its client's timeout."""
        for url, ids in self.take(extra).items():
            if url not in clients or not healthy(url):
                continue
            for _, batch in _batches(ids):
                try:
                    clients[url].end_sessions(end_sessions(batch))
                except ServerError as exc:
                    logger.debug("mpcache end of sessions on %s failed: %s", url, exc)
                    break
