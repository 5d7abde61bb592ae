"""The server's store path: ``POST /cache/store``, whole chunks from a KV cache into L1."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from app.blend import BlendMatcher
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.kv_events import BlockNote, StoredItem
from app.l2 import L2Tier, WriteJob
from app.pool_pressure import PoolPressureLog
from app.telemetry import Telemetry
from app.transfers import CheckedItem, TransferCall, Transfers
from contract.chunk_keys import model_of
from contract.schemas import StoreRequest, StoreResponse, StoreResult
from dataplane.device_path import CopyWindow
from dataplane.layout import slot_mask
from dataplane.pool import PRESENT, Entry, Pool
from dataplane.transfer import CopyPool, gather_chunk

__all__ = ["Store"]

_KEPT = ("stored", "present")


class _Outcomes:
    """Each chunk's outcome, in the item's order: ``stored``, ``present``, ``full``
    (no room) or ``late`` (the deadline passed). A chunk whose GPU copy is still
    queued reads ``stored`` until its copy has run and it is committed, or ``late``
    then (``CopyWindow``)."""

    def __init__(self) -> None:
        self.each: list[str] = []

    def begin(self) -> int:
        self.each.append("stored")
        return len(self.each) - 1

    def first_failure(self) -> int | None:
        return next((n for n, o in enumerate(self.each) if o not in _KEPT), None)

    def failed_before(self, n: int) -> bool:
        first = self.first_failure()
        return first is not None and first < n


class Store:
    """Copies whole chunks in ``[start_token, end_token)`` of each item into the pool,
    then, with ``unit_tokens``, the whole units past them (a tail: one entry under its
    unit key, ``dataplane.pool``; whole chunks also answer their own units' keys).

    Per chunk all-or-nothing; a chunk already cached is reported ``present`` and not
    copied. When the pool has no room the chunk and the rest of that item fail (a
    later chunk is useless without its prefix). The deadline (``app.transfers``) is
    checked before copying each chunk and again after, before commit: a chunk whose
    copy ended late is aborted, never made visible (the client may have reused those
    blocks while it was copied); what is left once it has passed is reported failed.
    A GPU registration's chunks commit once their copies have run on the server's
    stream, each while the next one's copy is queued (``CopyWindow``); a chunk whose
    predecessor failed is aborted, never committed.
    A committed chunk joins the CacheBlend index (when enabled) and, with a disk or
    an L2 tier, is queued for write-behind; its entry's note
    (``app.kv_events.BlockNote``) says which block of which prompt it is, for the KV
    events.
    """

    def __init__(
        self,
        *,
        transfers: Transfers,
        pool: Pool,
        copier: CopyPool,
        hasher: TokenHasher,
        blend: BlendMatcher,
        telemetry: Telemetry,
        pressure: PoolPressureLog,
        l2: L2Tier | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self._transfers = transfers
        self._pool = pool
        self._copier = copier
        self._hasher = hasher
        self._blend = blend
        self._telemetry = telemetry
        self._seconds = telemetry.op_seconds.labels("store")
        self._pressure = pressure
        self._l2 = l2
        self._disk = disk

    def run(
        self, req: StoreRequest, *, received_at: float | None = None, token: str | None = None
    ) -> StoreResponse:
        """Store the batch; ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        with self._seconds.time():
            with (
                self._transfers.call("store", req, received_at=received_at, token=token) as call,
                contextlib.nullcontext() if self._disk is None else self._disk.copying(),
            ):
                results = [self._store_item(call, it) for it in call.items]
            late = sum(r.failed_chunks for r, timed_out in results if timed_out)
            self._transfers.note_late("store", req, results, f"{late} chunk(s) not stored")
            return StoreResponse(results=[r for r, _ in results])

    def _store_item(self, call: TransferCall, it: CheckedItem) -> tuple[StoreResult, bool]:
        """The item's result, and whether the deadline cut it short."""
        keys, chunks = self._transfers.keys(call, it)
        tail, units = it.tail(call.chunk_size)
        todo = [(chunk, 0) for chunk in chunks]
        if units and tail <= len(keys):
            todo.append((tail, units))
        outcomes = _Outcomes()
        window = CopyWindow(call.reg.cuda_device)
        copied = 0
        ns, salt = it.item.namespace, it.item.cache_salt
        told = StoredItem(model_of(ns), salt, call.chunk_size, it.tokens, keys)
        try:
            for chunk, units in todo:
                note = None if units else BlockNote(told, chunk, call.reg.world_size)
                copied += self._store_chunk(call, it, keys, chunk, units, window, outcomes, note)
                if outcomes.first_failure() is not None:
                    break
            window.drain()
        except BaseException:
            window.abandon()
            raise
        first = outcomes.first_failure()
        kept = outcomes.each if first is None else outcomes.each[:first]
        failed = 0 if first is None else len(todo) - first
        if first is not None and outcomes.each[first] == "full":
            self._pressure.not_stored(failed)
        stored = kept.count("stored")
        self._telemetry.chunks_stored.inc(stored)
        self._telemetry.copied_bytes.labels("store").inc(copied)
        result = StoreResult(
            request_id=it.item.request_id,
            stored_chunks=stored,
            present_chunks=kept.count("present"),
            failed_chunks=failed,
        )
        return result, first is not None and outcomes.each[first] == "late"

    def _store_chunk(
        self,
        call: TransferCall,
        it: CheckedItem,
        keys: Sequence[bytes],
        chunk: int,
        units: int,
        window: CopyWindow,
        outcomes: _Outcomes,
        note: BlockNote | None,
    ) -> int:
        """Store one chunk (``units`` 0), or the tail of its first ``units`` units; its
        outcome goes to ``outcomes`` (``_Outcomes``), and ``note`` tells the pool what
        a committed whole chunk announces (KV events). Returns the bytes copied."""
        reg, size = call.reg, call.chunk_size
        n = outcomes.begin()
        if call.deadline.passed():
            outcomes.each[n] = "late"
            return 0
        ids = it.tail_ids(reg, chunk, units) if units else it.chunk_ids(reg, chunk)
        mask = slot_mask(ids)
        unit_keys = self._unit_keys(call, it, keys, chunk, units)
        content_key = None
        if self._blend.enabled and not units:
            chunk_tokens = it.tokens[chunk * size : (chunk + 1) * size]
            content_key = self._hasher.content_keys(
                it.item.namespace, it.item.cache_salt, chunk_tokens, chunk_size=size
            )[0]
        entry = self._pool.begin_store(
            unit_keys[-1] if units else keys[chunk],
            reg.rank,
            # A chunk with no data (every block null) is recorded, not copied.
            nbytes=reg.chunk_bytes if mask else 1,
            layout=reg.layout.signature,
            present=mask,
            content_key=content_key,
            unit_keys=unit_keys,
            note=note,
        )
        if entry == PRESENT:
            outcomes.each[n] = "present"
            return 0
        if entry is None:
            outcomes.each[n] = "full"
            return 0
        assert isinstance(entry, Entry)
        copied = 0
        try:
            if mask:
                view = self._pool.view(entry)
                copied = gather_chunk(
                    reg.plans, ids, view, self._copier, wait=window.device is None
                )
        except BaseException:
            self._pool.abort(entry)
            raise

        def done() -> None:  # the chunk's copies have run
            if outcomes.failed_before(n) or call.deadline.passed():
                # The client has given up and may have reused these blocks while they
                # were copied (or a chunk before this one failed): the bytes may be
                # torn or useless, so they are never committed.
                self._pool.abort(entry)
                outcomes.each[n] = "late"
                return
            self._commit(call, it, None if units else keys[chunk], entry, mask, content_key)

        window.add(done, undo=lambda: self._pool.abort(entry))
        return copied

    def _unit_keys(
        self, call: TransferCall, it: CheckedItem, keys: Sequence[bytes], chunk: int, units: int
    ) -> list[bytes]:
        """The unit keys the chunk's entry answers (``dataplane.pool``): a tail's
        ``units``, a whole chunk's all but the last (its own key stands for that one);
        none without ``unit_tokens``."""
        unit, size = it.item.unit_tokens, call.chunk_size
        if unit is None or unit >= size:
            return []
        count = units or size // unit - 1
        start = chunk * size
        return self._hasher.unit_keys(
            it.item.namespace,
            it.item.cache_salt,
            keys[chunk - 1] if chunk else None,
            it.tokens[start : start + count * unit],
            unit,
            count,
            chunk_size=size,
        )

    def _commit(
        self,
        call: TransferCall,
        it: CheckedItem,
        chunk_key: bytes | None,
        entry: Entry,
        mask: int,
        content_key: bytes | None,
    ) -> None:
        """Make a copied chunk visible; index it for CacheBlend, queue it for L2 (a
        whole chunk's ``chunk_key``; tails stay in L1)."""
        self._pool.commit(entry)
        if content_key is not None:
            self._blend.add(content_key)
        if self._disk is not None and chunk_key is not None:
            self._disk.enqueue(entry)  # pinned until its file is written
        l2 = self._l2
        if l2 is not None and chunk_key is not None:
            reg = call.reg
            layout = reg.layout.signature
            ns, size = it.item.namespace, call.chunk_size
            l2.enqueue(
                WriteJob(
                    key=l2.key(ns, size, layout, reg.world_size, reg.rank, chunk_key),
                    chunk_key=chunk_key,
                    rank=reg.rank,
                    layout=layout,
                    present=mask,
                    nbytes=entry.nbytes,
                )
            )
