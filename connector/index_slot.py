"""The scheduler's key index: opened on the lookup thread, probed on vLLM's.

``IndexSlot`` holds the ``connector.key_index.KeyIndexReader`` of the one lookup
server (when it is on this host and publishes one). ``setup`` opens it on the lookup
thread; ``answer``, on vLLM's thread, probes it within a per-step budget (``refill``
starts each step's), so a burst of new requests costs vLLM's thread at most that,
the rest asking the server as before. After a server restart (another ``boot_id``)
the old index is dropped on vLLM's thread, the one that probes it, and a new one
opened on the lookup thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from connector.client import ControlClient
from connector.errors import ServerRejected
from connector.servers import ServerLink
from contract.key_index import IndexBusy

if TYPE_CHECKING:  # imported when opened: it needs xxhash, which vLLM may lack
    from connector.key_index import KeyIndexReader

__all__ = ["IndexSlot"]

logger = logging.getLogger("mpcache.connector")

BUDGET_S = 0.0005
"""vLLM's thread's time for index answers per step; past it, lookups go by HTTP.
bench/scheduler_burst_bench.py measures a step of a burst against GET /health."""
_RETRY_S = 5.0
"""After an index could not be opened, how long before the next try."""


class IndexSlot:
    """See the module docstring; ``answer`` and ``refill`` on vLLM's thread only."""

    def __init__(
        self,
        client: ControlClient,
        link: ServerLink,
        *,
        namespace: str,
        chunk_size: int,
        world_size: int,
        unit_tokens: int | None,
        enabled: bool,
        submit: Callable[[Callable[[], None]], object],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._client = client
        self._link = link
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._world_size = world_size
        self._unit = unit_tokens
        self._enabled = enabled
        self._submit = submit  # runs a call on the lookup thread
        self._clock = clock
        self._reader: KeyIndexReader | None = None
        self._fresh: KeyIndexReader | None = None  # opened on the lookup thread, not adopted
        self._opening = False
        self._retry_at = 0.0
        self._budget_s = BUDGET_S
        if enabled:
            self._request_open()

    def _request_open(self) -> None:
        if self._opening or self._clock() < self._retry_at:
            return
        self._opening = True
        try:
            self._submit(self.setup)
        except RuntimeError:  # the lookup thread has shut down
            self._opening = False

    def setup(self) -> None:
        """(On the lookup thread.) Open the server's index, or say why not; never raises."""
        try:
            from connector.key_index import KeyIndexReader  # needs xxhash

            reader = KeyIndexReader.open(
                self._client,
                namespace=self._namespace,
                chunk_size=self._chunk_size,
                world_size=self._world_size,
                boot_id=self._link.boot_id,
            )
        except Exception as exc:
            self._retry_at = self._clock() + _RETRY_S
            if isinstance(exc, ServerRejected) and exc.status in (404, 405):
                self._retry_at = math.inf  # a server that publishes no index
            logger.info("mpcache scheduler: no key index (%s); lookups ask the server", exc)
        else:
            self._fresh = reader
            logger.info("mpcache scheduler: lookups answered from %s's key index", self._link.url)
        finally:
            self._opening = False

    def refill(self) -> None:
        """A new step: a new budget."""
        self._budget_s = BUDGET_S

    def answer(
        self, packed: Callable[[], bytes], num_tokens: int, cache_salt: str | None
    ) -> int | None:
        """(On vLLM's thread.) The tokens the index says the server holds of the
        prompt (``packed()`` gives its first ``num_tokens`` ids as int32), or None
        where the index cannot answer: none open, the step's budget spent, or a miss
        that may still be a hit on the server (its index is not authoritative)."""
        reader = self._current()
        if reader is None or self._budget_s <= 0:
            return None
        begin = self._clock()
        try:
            hit = reader.hit_tokens(packed(), num_tokens, cache_salt, self._unit)
            authoritative = reader.authoritative
        except ValueError:  # unmapped under us: treat as no index
            self._drop()
            return None
        except IndexBusy:  # the server was rewriting a slot the answer needs
            return None
        finally:
            self._budget_s -= self._clock() - begin
        return hit if hit or authoritative else None

    def _current(self) -> KeyIndexReader | None:
        """The reader to probe, adopting a fresh one and dropping one of another boot."""
        if self._fresh is not None:
            self._drop()
            self._reader, self._fresh = self._fresh, None
        reader = self._reader
        if reader is not None and reader.boot_id != self._link.boot_id:
            self._drop()  # the server restarted: its old index is gone
            reader = None
        if reader is None and self._enabled:
            self._request_open()
        return reader

    def _drop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def close(self) -> None:
        """(Once the lookup thread has stopped.)"""
        self._drop()
        fresh, self._fresh = self._fresh, None
        if fresh is not None:
            fresh.close()
