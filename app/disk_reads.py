"""Read-ahead for a retrieve from the disk tier (``app.retrieve``).

A retrieve copies its chunks into the caller's KV cache one after the other; the
chunks it reads from disk (``DiskTier.promote``: read, checked, committed, pinned)
are read on the tier's reader threads (``DiskTier.promote_later``), in order, at
most ``READ_AHEAD`` beyond the one being taken, so chunk i+1's read overlaps chunk
i's copy: the retrieve costs about max(read, copy) rather than read + copy.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future

from app.disk_tier import DiskTier
from app.l2_reads import Want
from dataplane.pool import Entry, Pool

__all__ = ["READ_AHEAD", "ReadAhead"]

logger = logging.getLogger(__name__)

READ_AHEAD = 2
"""Promotions submitted beyond the one a retrieve waits for."""


class ReadAhead:
    """One item's promotions from the disk tier, each ``add``-ed in order and
    ``take``-n in the same order; at most ``ahead`` are submitted past the one taken.
    A take that gives None (not on disk, refused, no room in the pool) ends the
    item: nothing more is submitted. ``close`` (always, also on an error) cancels
    what has not started, waits for what has and unpins what it read."""

    def __init__(
        self,
        disk: DiskTier,
        pool: Pool,
        *,
        rank: int,
        layout: bytes,
        chunk_bytes: int,
        ahead: int = READ_AHEAD,
    ) -> None:
        self._disk = disk
        self._pool = pool
        self._rank = rank
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._ahead = max(1, ahead)
        self._waiting: collections.deque[tuple[int, Want]] = collections.deque()
        self._submitted: collections.deque[tuple[int, Future[Entry | None]]] = collections.deque()

    def add(self, n: int, want: Want) -> None:
        """Queue the promotion of ``want`` (the item's part ``n``)."""
        self._waiting.append((n, want))
        self._submit()

    def take(self, n: int) -> Entry | None:
        """Wait for part ``n``'s promotion (the next one added): its entry, pinned
        (the caller unpins it), or None."""
        if not self._submitted:
            self._submit(1)
        m, future = self._submitted.popleft()
        assert m == n, f"read-ahead taken out of order: {n}, not {m}"
        self._submit()  # the next ones read while this one is copied
        entry = None
        try:
            entry = future.result()
        finally:
            if entry is None:
                self._waiting.clear()  # the item ends here: read no more of it
        return entry

    def close(self) -> None:
        """Drop what was not taken: cancel it, or wait for it and unpin it."""
        self._waiting.clear()
        while self._submitted:
            _, future = self._submitted.popleft()
            if future.cancel():
                continue
            try:
                entry = future.result()
            except Exception:
                logger.exception("disk tier: a chunk read ahead failed")
                continue
            if entry is not None:
                self._pool.unpin(entry)

    def _submit(self, limit: int | None = None) -> None:
        limit = self._ahead if limit is None else limit
        while self._waiting and len(self._submitted) < limit:
            n, want = self._waiting.popleft()
            future = self._disk.promote_later(
                want.chunk_key,
                self._rank,
                self._layout,
                chunk_bytes=self._chunk_bytes,
                needed=want.needed,
                note=want.note,
            )
            self._submitted.append((n, future))
