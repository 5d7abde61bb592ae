"""The server's cache (L1): one shared-memory segment cut into fixed-size pages.

``Pool`` holds the entries (one chunk of one rank each, on contiguous pages) with
their visibility, LRU eviction and pins; ``PageAllocator`` is its pure page map and
``_Leases`` its record of leased keys. The rules are on ``Pool``.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import torch

from dataplane.key_index import KeyIndex
from dataplane.prefault import Prefaulter
from dataplane.segments import Segment

__all__ = [
    "MAX_EVICTION_SCAN",
    "PRESENT",
    "Entry",
    "EntryObserver",
    "PageAllocator",
    "Pool",
    "PoolStats",
]

logger = logging.getLogger(__name__)

PRESENT: Final = "present"

_STALE_DEADLINES: Final = 1024
"""Stale lease deadlines the pool keeps before it rebuilds their heap."""

MAX_EVICTION_SCAN: Final = 256
"""Most entries one eviction passes over that it cannot evict (pinned or leased).

Those move to the most recently used end (leased entries were just looked up,
pinned ones are being read: either way recently used), so with every entry leased a
store fails fast (no room) instead of walking the whole LRU, and a later eviction
starts past them. Evictable entries are never a reason to stop: when entries of
different sizes fragment the pool, the walk goes on until a large enough run forms.
"""

DropReason = Literal["evicted", "replaced", "closed"]


class PageAllocator:
    """First-fit allocator of contiguous page runs over ``num_pages`` pages (pure)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Free runs as parallel sorted lists: start page -> run length.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_pages]
        self.free_pages = num_pages

    def alloc(self, n: int) -> int | None:
        """Start page of a free run of ``n`` pages, or None if there is none."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                self.free_pages -= n
                return start
        return None

    def copy(self) -> PageAllocator:
        """An independent allocator in the same state (for planning)."""
        clone = PageAllocator(self.num_pages)
        clone._starts = list(self._starts)
        clone._lengths = list(self._lengths)
        clone.free_pages = self.free_pages
        return clone

    def runs_within(self, start: int, end: int) -> list[tuple[int, int]]:
        """Free runs ``(start, length)`` that begin in ``[start, end)``."""
        i = bisect.bisect_left(self._starts, start)
        j = bisect.bisect_left(self._starts, end)
        return list(zip(self._starts[i:j], self._lengths[i:j], strict=True))

    def free(self, start: int, n: int) -> tuple[int, int]:
        """Free ``[start, start + n)``; return the free run ``(start, length)`` now holding it."""
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + n) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start
        ):
            raise ValueError(f"double free of pages [{start}, {start + n})")
        self._starts.insert(i, start)
        self._lengths.insert(i, n)
        self.free_pages += n
        # Coalesce with the next run, then with the previous one.
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths[i]
            del self._starts[i], self._lengths[i]
            i -= 1
        return self._starts[i], self._lengths[i]

    def largest_run(self) -> int:
        return max(self._lengths, default=0)


@dataclass(eq=False)
class Entry:
    """One chunk of one rank in the pool. Mutable fields are guarded by the pool."""

    key: bytes
    rank: int
    layout: bytes
    present: int
    content_key: bytes | None
    first_page: int
    num_pages: int
    nbytes: int
    offset_bytes: int
    ready: bool = False
    live: bool = True
    pins: int = 0
    unit_keys: tuple[bytes, ...] = ()
    """The unit keys this entry answers (``_Units``): a whole chunk's first 1, 2, ...
    units short of the whole; a tail's units, the last being its own key."""
    note: object = None
    """What the caller of ``begin_store`` says about the entry, opaque to the pool; an
    ``EntryObserver`` reads it (the KV events: ``app.kv_events``)."""


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    pending: int
    leased_keys: int


DropHook = Callable[[Sequence[Entry], DropReason], None]


class EntryObserver(Protocol):
    """Told, under the pool's lock, when a whole chunk's entry becomes visible or stops
    being visible (tails are not told), in the order it happens. It must only record
    (no I/O, no lock of its own that waits, never a call back into the pool)."""

    def added(self, entry: Entry) -> None: ...

    def removed(self, entry: Entry) -> None: ...


@dataclass(slots=True)
class _Lease:
    """One holder's leases: the keys, all until one deadline (renewed by a lookup)."""

    deadline: float
    keys: set[bytes]


class _Leases:
    """Which keys the pool's holders lease, until when (used under the pool's lock).

    A holder is a request id. Its leases share one deadline, which each of its
    lookups renews, so a lease its session never released (a crashed client) lapses
    on its own. Per key ``counts`` says how many holders lease it, so a lookup
    leases its hits with a few calls into C, not a dict per key. A heap of
    ``(deadline, holder)`` finds the lapsed holders; renewals and releases leave
    stale items in it, skipped when popped.
    """

    __slots__ = ("counts", "deadlines", "held")

    def __init__(self) -> None:
        self.held: dict[str, _Lease] = {}
        self.counts: Counter[bytes] = Counter()
        self.deadlines: list[tuple[float, str]] = []

    def grant(self, holder: str, keys: Sequence[bytes], deadline: float) -> None:
        """Lease ``keys`` to ``holder`` until ``deadline``; its earlier leases are
        renewed to it."""
        lease = self.held.get(holder)
        if lease is None:
            lease = self.held[holder] = _Lease(deadline, set(keys))
            self.counts.update(lease.keys)
        else:
            fresh = set(keys)
            fresh -= lease.keys
            self.counts.update(fresh)
            lease.keys |= fresh
            lease.deadline = deadline
        deadlines = self.deadlines
        heapq.heappush(deadlines, (deadline, holder))
        if len(deadlines) > 2 * len(self.held) + _STALE_DEADLINES:
            # Renewals leave stale entries until their deadline: drop them now and
            # then, so a long lease TTL with frequent renewals cannot grow the heap.
            self.deadlines = [(lease.deadline, h) for h, lease in self.held.items()]
            heapq.heapify(self.deadlines)

    def lapse(self, now: float) -> None:
        """Release the leases whose deadline has passed."""
        deadlines, held = self.deadlines, self.held
        while deadlines and deadlines[0][0] <= now:
            _, holder = heapq.heappop(deadlines)
            lease = held.get(holder)
            if lease is not None and lease.deadline <= now:
                self.release(holder)

    def release(self, holder: str) -> None:
        """Drop ``holder``'s leases."""
        lease = self.held.pop(holder, None)
        if lease is None:
            return
        counts = self.counts
        for key in lease.keys:
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                counts.pop(key)  # dict's own (Counter's __delitem__ is Python code)

    def clear(self) -> None:
        self.held.clear()
        self.counts.clear()
        self.deadlines.clear()


class _Units:
    """Which visible entries answer each ``(unit key, rank)``, and the key index kept
    in step with what is visible (used under the pool's lock).

    A unit key names the first units of one chunk (``app.hashing``): an entry answers
    it when it holds those tokens' blocks, so a hit can end inside a chunk. A whole
    chunk answers the unit keys of its first 1, 2, ... units; a *tail* (a prompt's
    last units, short of a chunk) is stored under its longest unit key and answers
    that and the shorter ones. Every entry registers all of its keys, so the keys a
    prompt's chunk has in the index are always a leading run.
    """

    __slots__ = ("holders", "index", "observer")

    def __init__(self) -> None:
        self.holders: dict[tuple[bytes, int], list[Entry]] = {}
        self.index: KeyIndex | None = None
        """Told when a ``(unit key, rank)`` gains its first entry or loses its last."""
        self.observer: EntryObserver | None = None
        """Told when a whole chunk's entry is added or removed."""

    def add(self, entry: Entry) -> list[Entry]:
        """Register a visible ``entry``'s keys; return the tails it makes redundant
        (same rank and layout, and it holds every slot they hold)."""
        if not _is_tail(entry):
            if self.index is not None:
                self.index.set(entry.key, entry.rank, True)  # a whole chunk's own key
            if self.observer is not None:
                self.observer.added(entry)
        covered = []
        for key in entry.unit_keys:
            found = self.holders.setdefault((key, entry.rank), [])
            if not found and self.index is not None:
                self.index.set(key, entry.rank, True)
            covered += [
                old
                for old in found
                if old.key == key
                and old is not entry
                and old.layout == entry.layout
                and not old.present & ~entry.present
            ]
            found.append(entry)
        return covered

    def remove(self, entry: Entry) -> None:
        """Forget an entry that is no longer visible."""
        if not _is_tail(entry):
            if self.index is not None:
                self.index.set(entry.key, entry.rank, False)
            if self.observer is not None:
                self.observer.removed(entry)
        for key in entry.unit_keys:
            found = self.holders.get((key, entry.rank))
            if found is not None and entry in found:
                found.remove(entry)
                if not found:
                    del self.holders[(key, entry.rank)]
                    if self.index is not None:
                        self.index.set(key, entry.rank, False)

    def find(self, key: bytes, rank: int, layout: bytes, needed: int) -> Entry | None:
        """An entry answering ``key`` with this layout and every slot in ``needed``."""
        for entry in self.holders.get((key, rank), ()):
            if entry.layout == layout and not needed & ~entry.present:
                return entry
        return None

    def longest(self, keys: Sequence[bytes], world_size: int) -> tuple[int, list[Entry]]:
        """How many of ``keys`` (a chunk's unit keys, shortest first) every rank has,
        and the entries answering the longest of them."""
        holders = self.holders
        for count in range(len(keys), 0, -1):
            key = keys[count - 1]
            found = [holders.get((key, rank)) for rank in range(world_size)]
            if all(found):
                return count, [entry for entries in found if entries for entry in entries]
        return 0, []


class Pool:
    """The L1 cache over one owned ``Segment``: ``create`` makes the segment, ``close``
    unmaps and unlinks it (the server's only segment; docs/design.md s.5).

    Layout: entry ``(chunk key, rank)`` occupies ``ceil(nbytes / page_size)``
    contiguous pages from ``offset_bytes``, so every copy into or out of it works on
    one contiguous byte range (``view``); what the bytes hold is the registration's
    ``dataplane.layout.ChunkLayout``.

    Visibility (all-or-nothing): ``begin_store`` reserves pages for a *pending* entry
    that no reader can see; the caller copies the bytes in without holding the
    pool's lock, then ``commit`` makes the entry visible in one step (or ``abort``
    frees it). A second store of a key that is pending or cached is told it is
    ``PRESENT``. Pinned entries (a retrieve is copying out of them) that are
    replaced or evicted stay readable until unpinned, so no reader sees a torn chunk.

    Eviction (``_evict_for``): least recently used first, never an entry that is
    pinned or leased (a lookup promised it to a request: ``_Leases``), planned
    before it starts, its cost bounded by ``MAX_EVICTION_SCAN``.

    Thread-safe: one lock guards the index; copies run outside it. Lock order: a
    caller may hold its own lock when it calls in (the session manager's does), and
    the pool never calls out under its own: ``on_drop`` runs after it is released.
    """

    def __init__(
        self,
        segment: Segment,
        page_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_drop: DropHook | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        num_pages = segment.size_bytes // page_size
        if num_pages < 1:
            raise ValueError(f"a pool of {segment.size_bytes} bytes has no {page_size}-byte page")
        self.segment = segment
        self.page_size = page_size
        self.capacity_bytes = num_pages * page_size
        self._bytes: torch.Tensor | None = torch.frombuffer(
            segment.buffer, dtype=torch.uint8, count=self.capacity_bytes
        )
        self.address = int(self._bytes.data_ptr())  # its first byte: pinned for DMA by the GPU path
        self._alloc = PageAllocator(num_pages)
        # The visible entries, least recently used first: one mapping is both the
        # index and the LRU order, so a hit costs one probe (``move_to_end``).
        self._index: OrderedDict[tuple[bytes, int], Entry] = OrderedDict()
        self._pending: dict[tuple[bytes, int], Entry] = {}
        self._leases = _Leases()
        self._units = _Units()
        self._clock = clock
        self._lock = threading.Lock()
        self.on_drop = on_drop
        self.prefault = Prefaulter("mpcache-pool-prefault")

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, name: str, size_bytes: int, page_size: int, **kwargs: object) -> Pool:
        """Create the pool's segment (owned: unlinked by ``close``) and the pool on it."""
        size_bytes = size_bytes // page_size * page_size
        segment = Segment.create(name, size_bytes)
        try:
            return cls(segment, page_size, **kwargs)  # type: ignore[arg-type]
        except BaseException:
            segment.close()
            raise

    def start_prefault(self) -> None:
        """Populate the pool's page tables in a background thread (stopped by ``close``)."""
        view = self._bytes  # kept by the thread: the mapping outlives it
        if view is not None:
            self.prefault.start([(view.data_ptr(), view.numel())], keep=view)

    def close(self) -> None:
        """Drop every entry, unmap and unlink the pool's segment. Idempotent."""
        self.prefault.stop()
        with self._lock:
            if self._bytes is None:
                return
            dropped = list(self._index.values())
            self._index.clear()
            self._pending.clear()
            self._leases.clear()
            self._units.holders.clear()
            self._bytes = None
        self.segment.close()
        self._notify(dropped, "closed")

    def attach_index(
        self, index: KeyIndex | None = None, observer: EntryObserver | None = None
    ) -> None:
        """From now on, keep ``index`` in step with what is visible, and tell ``observer``
        which whole chunks come and go (the pool is empty when the server attaches them)."""
        with self._lock:
            if self._index:
                raise RuntimeError("attach the key index to an empty pool")
            if index is not None:
                self._units.index = index
            if observer is not None:
                self._units.observer = observer

    def whole_entries(self, then: Callable[[], None]) -> list[Entry]:
        """The visible whole-chunk entries; ``then`` runs under the same hold of the lock."""
        with self._lock:
            then()
            return [e for e in self._index.values() if not _is_tail(e)]

    # ------------------------------------------------------------------ reads

    def stats(self) -> PoolStats:
        with self._lock:
            self._leases.lapse(self._clock())  # leased_keys counts live leases only
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=(self._alloc.num_pages - self._alloc.free_pages) * self.page_size,
                entries=len(self._index),
                pending=len(self._pending),
                leased_keys=len(self._leases.counts),
            )

    def view(self, entry: Entry) -> torch.Tensor:
        """The entry's bytes as a uint8 tensor (valid while it is pending or pinned)."""
        base = self._bytes
        if base is None:
            raise RuntimeError("the pool is closed")
        return base[entry.offset_bytes : entry.offset_bytes + entry.nbytes]

    def lookup(
        self,
        keys: Sequence[bytes],
        world_size: int,
        *,
        holder: str | None = None,
        lease_ttl_s: float = 0.0,
    ) -> int:
        """Number of leading ``keys`` cached for every rank in ``range(world_size)``.

        Hits are marked recently used; with a ``holder`` they are also leased for
        ``lease_ttl_s`` seconds (until then they are not evicted).
        """
        return self.lookup_many([(keys, world_size, holder)], lease_ttl_s=lease_ttl_s)[0]

    def lookup_many(
        self,
        requests: Sequence[tuple[Sequence[bytes], int, str | None]],
        *,
        lease_ttl_s: float = 0.0,
    ) -> list[int]:
        """``lookup`` of each ``(keys, world_size, holder)``, under one hold of the
        lock and one reading of the clock (a lookup call's items, as they arrive)."""
        index, leases = self._index, self._leases
        touch = index.move_to_end  # KeyError: not cached (the index is the LRU order)
        out: list[int] = []
        with self._lock:
            now = self._clock()
            leases.lapse(now)
            for keys, world_size, holder in requests:
                hits = 0
                try:
                    if world_size == 1:  # the common case, without the per-rank loop
                        for key in keys:
                            touch((key, 0))
                            hits += 1
                    else:
                        for key in keys:
                            if any((key, rank) not in index for rank in range(world_size)):
                                break
                            for rank in range(world_size):
                                touch((key, rank))
                            hits += 1
                except KeyError:
                    pass
                out.append(hits)
                if holder is not None and lease_ttl_s > 0 and hits:
                    leases.grant(holder, keys[:hits], now + lease_ttl_s)
        return out

    def lookup_units_many(
        self,
        requests: Sequence[tuple[Sequence[bytes], int, str | None]],
        *,
        lease_ttl_s: float = 0.0,
    ) -> list[int]:
        """For each ``(unit keys of one chunk, world_size, holder)``: how many leading
        units every rank has (``_Units``); the entries answering are marked recently
        used and, with a holder, leased as ``lookup_many`` leases chunks."""
        out: list[int] = []
        with self._lock:
            now = self._clock()
            for keys, world_size, holder in requests:
                count, entries = self._units.longest(keys, world_size)
                out.append(count)
                for entry in entries:
                    self._index.move_to_end((entry.key, entry.rank))
                if holder is not None and lease_ttl_s > 0 and entries:
                    self._leases.grant(holder, [e.key for e in entries], now + lease_ttl_s)
        return out

    def pin_unit(self, key: bytes, rank: int, layout: bytes, needed: int) -> Entry | None:
        """``pin`` of an entry answering the unit key ``key`` (``_Units``)."""
        with self._lock:
            entry = self._units.find(key, rank, layout, needed)
            if entry is None:
                return None
            entry.pins += 1
            self._index.move_to_end((entry.key, rank))
            return entry

    def release_leases(self, holder: str) -> None:
        with self._lock:
            self._leases.release(holder)

    def pin(self, key: bytes, rank: int, layout: bytes, needed: int) -> Entry | None:
        """Pin a visible entry with this layout holding every slot in ``needed``.

        A pinned entry is never evicted or overwritten; ``unpin`` it when done.
        """
        with self._lock:
            entry = self._index.get((key, rank))
            if entry is None or entry.layout != layout or needed & ~entry.present:
                return None
            entry.pins += 1
            self._index.move_to_end((key, rank))
            return entry

    def unpin(self, entry: Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0 and not entry.live:
                self._alloc.free(entry.first_page, entry.num_pages)

    # ------------------------------------------------------------------ stores

    def begin_store(
        self,
        key: bytes,
        rank: int,
        *,
        nbytes: int,
        layout: bytes,
        present: int,
        content_key: bytes | None = None,
        unit_keys: Sequence[bytes] = (),
        note: object = None,
    ) -> Entry | Literal["present"] | None:
        """Reserve a pending entry, or say the chunk is ``PRESENT``, or None if no room.

        A cached entry of the same layout is replaced only when the new store holds
        every slot it holds and more (a strict superset, e.g. a sliding-window block
        it lacked), so a replacement never loses a slot; otherwise the first writer
        wins. ``unit_keys``: the unit keys the entry will answer (``_Units``); a tail,
        whose key is the last of them, is ``PRESENT`` when an entry already answers
        it with every slot it would hold. ``note``: the entry's ``Entry.note``.
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        num_pages = -(-nbytes // self.page_size)
        ident = (key, rank)
        evicted: list[Entry] = []
        entry: Entry | None = None
        with self._lock:
            if self._bytes is None:
                return None
            if ident in self._pending:
                return PRESENT
            if unit_keys and unit_keys[-1] == key and self._units.find(key, rank, layout, present):
                return PRESENT
            current = self._index.get(ident)
            if current is not None and (
                current.layout != layout
                or present == current.present
                or current.present & ~present  # would lose a slot the cached entry has
            ):
                self._index.move_to_end(ident)
                return PRESENT
            first_page = self._alloc.alloc(num_pages)
            if first_page is None and num_pages <= self._alloc.num_pages:
                first_page = self._evict_for(num_pages, evicted)
            if first_page is not None:
                entry = Entry(
                    key=key,
                    rank=rank,
                    layout=layout,
                    present=present,
                    content_key=content_key,
                    first_page=first_page,
                    num_pages=num_pages,
                    nbytes=nbytes,
                    offset_bytes=first_page * self.page_size,
                    unit_keys=tuple(unit_keys),
                    note=note,
                )
                self._pending[ident] = entry
        self._notify(evicted, "evicted")
        return entry

    def commit(self, entry: Entry) -> None:
        """Make a pending entry visible (its bytes must be fully written)."""
        ident = (entry.key, entry.rank)
        replaced: list[Entry] = []
        with self._lock:
            if self._pending.get(ident) is not entry:
                raise RuntimeError("commit of an entry that is not pending")
            del self._pending[ident]
            old = self._index.get(ident)
            if old is not None:
                self._detach(old)
                replaced.append(old)
            entry.ready = True
            self._index[ident] = entry
            for tail in self._units.add(entry):  # tails this entry now answers for
                self._detach(tail)
                replaced.append(tail)
        self._notify(replaced, "replaced")

    def abort(self, entry: Entry) -> None:
        """Forget a pending entry whose bytes could not be written."""
        with self._lock:
            if self._pending.get((entry.key, entry.rank)) is entry:
                del self._pending[(entry.key, entry.rank)]
                entry.live = False
                if self._bytes is not None:
                    self._alloc.free(entry.first_page, entry.num_pages)

    # ------------------------------------------------------------------ internals

    def _leased(self, key: bytes, now: float) -> bool:
        leases = self._leases
        if key not in leases.counts:
            return False
        leases.lapse(now)
        return key in leases.counts

    def _detach(self, entry: Entry) -> None:
        ident = (entry.key, entry.rank)
        self._index.pop(ident, None)
        self._units.remove(entry)
        entry.live = False
        if entry.pins == 0:
            self._alloc.free(entry.first_page, entry.num_pages)

    def _evict_for(self, num_pages: int, evicted: list[Entry]) -> int | None:
        """Evict entries so that ``num_pages`` contiguous pages are free; or evict nothing.

        The eviction is planned before anything is evicted: ``_free_run_for`` finds
        the run the oldest evictable entries free, ``_fewest_victims`` the window of
        it that evicts the fewest of them. If no run ever forms (e.g. a pinned or
        leased page splits every window), nothing is evicted and None is returned.
        """
        planned = self._free_run_for(num_pages)
        if planned is None:
            return None
        freed, (run_start, run_end) = planned
        free_starts = [s for s, _ in self._alloc.runs_within(run_start, run_end)]
        for entry in _fewest_victims(freed, free_starts, run_start, run_end, num_pages):
            self._detach(entry)
            evicted.append(entry)
        # Every other free run is shorter than num_pages (first fit failed), so this
        # lands in the run just freed.
        return self._alloc.alloc(num_pages)

    def _free_run_for(self, num_pages: int) -> tuple[list[Entry], tuple[int, int]] | None:
        """(Under the lock, evicting nothing) the evictable entries, oldest first,
        whose pages freed in a copy of the page map first form a free run of
        ``num_pages``, and that run ``(start, end)``; None if none forms.

        Entries not pinned nor leased are freed one at a time, passing over at most
        ``MAX_EVICTION_SCAN`` held ones, which then move to the recent end (the next
        eviction starts past them). Of all windows that could be freed, those in the
        run found have the oldest newest victim.
        """
        now = self._clock()
        scratch = self._alloc.copy()
        freed: list[Entry] = []
        held: list[tuple[bytes, int]] = []
        run: tuple[int, int] | None = None
        for ident, entry in self._index.items():
            if entry.pins or self._leased(entry.key, now):
                held.append(ident)
                if len(held) == MAX_EVICTION_SCAN:
                    break
                continue
            freed.append(entry)
            run_start, run_len = scratch.free(entry.first_page, entry.num_pages)
            if run_len >= num_pages:
                run = run_start, run_start + run_len
                break
        for ident in held:
            self._index.move_to_end(ident)
        return None if run is None else (freed, run)

    def _notify(self, entries: Sequence[Entry], reason: DropReason) -> None:
        if entries and self.on_drop is not None:
            try:
                self.on_drop(entries, reason)
            except Exception:
                logger.exception("pool drop hook failed (%s)", reason)


def _is_tail(entry: Entry) -> bool:
    """A tail is stored under its longest unit key (``_Units``)."""
    return bool(entry.unit_keys) and entry.key == entry.unit_keys[-1]


def _fewest_victims(
    freed: list[Entry], free_starts: list[int], run_start: int, run_end: int, num_pages: int
) -> list[Entry]:
    """The entries of ``freed`` under the window of ``num_pages`` pages in the free
    run ``[run_start, run_end)`` that holds the fewest of them (``free_starts``: the
    starts of the pages already free in the run)."""
    inside = [e for e in freed if run_start <= e.first_page < run_end]
    # A window can slide left to the start of the first piece it touches without
    # touching more entries, so windows starting at a piece are enough to try.
    starts = {e.first_page for e in inside}
    starts.update(free_starts)
    best: list[Entry] | None = None
    for start in sorted(starts):
        if start + num_pages > run_end:
            break
        victims = [
            e
            for e in inside
            if e.first_page < start + num_pages and start < e.first_page + e.num_pages
        ]
        if best is None or len(victims) < len(best):
            best = victims
    assert best is not None  # the run's first piece starts a window that fits
    return best
