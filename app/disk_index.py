"""The disk tier's in-memory index: which chunk files it holds, least recently used
first, within its capacity (pure: the caller deletes the files it evicts).

A lookup counts from it without touching the disk (``count_leading``); a retrieve
hit refreshes a file (``get``). Thread-safe: one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DiskIndex", "DiskRecord", "Ident"]

Ident = tuple[bytes, int, bytes]
"""(chunk key, rank, layout): one file (``app.disk_codec.file_name``)."""


@dataclass(frozen=True)
class DiskRecord:
    name: str
    """The file's path relative to the tier's directory."""
    present: int
    payload_bytes: int
    file_bytes: int
    """What the file takes on disk (header and padding included)."""


class DiskIndex:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lru: OrderedDict[Ident, DiskRecord] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._lru)

    def holds(self, ident: Ident, present: int) -> bool:
        """Whether a file of ``ident`` holds every slot of ``present`` (no refresh)."""
        with self._lock:
            record = self._lru.get(ident)
        return record is not None and not present & ~record.present

    def get(self, ident: Ident) -> DiskRecord | None:
        """The file of ``ident``, refreshed (most recently used)."""
        with self._lock:
            record = self._lru.get(ident)
            if record is not None:
                self._lru.move_to_end(ident)
            return record

    def make_room(self, file_bytes: int, keep: Ident) -> list[DiskRecord] | None:
        """Forget the least recently used files until ``file_bytes`` more fit (``keep``'s
        own file, about to be replaced, counts as freed and stays): the files to
        delete, or None if it can never fit."""
        if file_bytes > self.capacity_bytes:
            return None
        evicted: list[DiskRecord] = []
        with self._lock:
            replaced = self._lru.pop(keep, None)
            if replaced is not None:
                self._used -= replaced.file_bytes
            while self._used + file_bytes > self.capacity_bytes and self._lru:
                _, record = self._lru.popitem(last=False)
                self._used -= record.file_bytes
                evicted.append(record)
            if replaced is not None:
                self._lru[keep] = replaced
                self._used += replaced.file_bytes
        return evicted

    def add(self, ident: Ident, record: DiskRecord) -> list[DiskRecord]:
        """Index a file now complete (replacing ``ident``'s), most recently used; the
        least recently used others it pushed over capacity (to delete)."""
        evicted: list[DiskRecord] = []
        with self._lock:
            old = self._lru.pop(ident, None)
            if old is not None:
                self._used -= old.file_bytes
            self._lru[ident] = record
            self._used += record.file_bytes
            while self._used > self.capacity_bytes and len(self._lru) > 1:
                _, dropped = self._lru.popitem(last=False)
                self._used -= dropped.file_bytes
                evicted.append(dropped)
        return evicted

    def remove(self, ident: Ident, record: DiskRecord) -> bool:
        """Forget ``ident`` if it is still ``record`` (a file found corrupt or gone)."""
        with self._lock:
            if self._lru.get(ident) != record:
                return False
            del self._lru[ident]
            self._used -= record.file_bytes
            return True

    def clear(self) -> list[DiskRecord]:
        with self._lock:
            records = list(self._lru.values())
            self._lru.clear()
            self._used = 0
        return records

    def count_leading(self, keys: Sequence[bytes], world_size: int, layout: bytes) -> int:
        """How many leading chunk ``keys`` have a file of ``layout`` for every rank in
        ``range(world_size)`` (no refresh; stops at the first miss)."""
        lru = self._lru
        hits = 0
        with self._lock:  # one consistent view across the ranks
            for key in keys:
                if not all((key, rank, layout) in lru for rank in range(world_size)):
                    break
                hits += 1
        return hits
