"""The server's store path: ``POST /cache/store``, whole chunks from a KV cache into L1."""

from __future__ import annotations

from collections.abc import Sequence

from app.blend import BlendMatcher
from app.hashing import TokenHasher
from app.kv_events import BlockNote, StoredItem
from app.l2 import L2Tier, WriteJob
from app.pool_pressure import PoolPressureLog
from app.telemetry import Telemetry
from app.transfers import CheckedItem, TransferCall, Transfers
from contract.chunk_keys import model_of
from contract.schemas import StoreRequest, StoreResponse, StoreResult
from dataplane.layout import slot_mask
from dataplane.pool import PRESENT, Entry, Pool
from dataplane.transfer import CopyPool, gather_chunk

__all__ = ["Store"]


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
    A committed chunk joins the CacheBlend index (when enabled) and, with an L2 tier,
    is queued for write-behind; its entry's note (``app.kv_events.BlockNote``) says
    which block of which prompt it is, for the KV events.
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

    def run(
        self, req: StoreRequest, *, received_at: float | None = None, token: str | None = None
    ) -> StoreResponse:
        """Store the batch; ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        with self._seconds.time():
            with self._transfers.call("store", req, received_at=received_at, token=token) as call:
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
        counts = {"stored": 0, "present": 0}
        failed = copied = 0
        timed_out = False
        ns, salt = it.item.namespace, it.item.cache_salt
        told = StoredItem(model_of(ns), salt, call.chunk_size, it.tokens, keys)
        for n, (chunk, units) in enumerate(todo):
            note = None if units else BlockNote(told, chunk, call.reg.world_size)
            outcome, nbytes = self._store_chunk(call, it, keys, chunk, units, note)
            copied += nbytes
            if outcome in counts:
                counts[outcome] += 1
                continue
            failed = len(todo) - n
            if outcome == "full":
                self._pressure.not_stored(failed)
            timed_out = outcome == "late"
            break
        self._telemetry.chunks_stored.inc(counts["stored"])
        self._telemetry.copied_bytes.labels("store").inc(copied)
        result = StoreResult(
            request_id=it.item.request_id,
            stored_chunks=counts["stored"],
            present_chunks=counts["present"],
            failed_chunks=failed,
        )
        return result, timed_out

    def _store_chunk(
        self,
        call: TransferCall,
        it: CheckedItem,
        keys: Sequence[bytes],
        chunk: int,
        units: int,
        note: BlockNote | None,
    ) -> tuple[str, int]:
        """Store one chunk (``units`` 0), or the tail of its first ``units`` units:
        ``(outcome, bytes copied)``, the outcome ``stored``, ``present``, ``full`` (no
        room) or ``late`` (the deadline passed)."""
        reg, size = call.reg, call.chunk_size
        if call.deadline.passed():
            return "late", 0
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
            return "present", 0
        if entry is None:
            return "full", 0
        assert isinstance(entry, Entry)
        copied = 0
        try:
            if mask:
                copied = gather_chunk(reg.plans, ids, self._pool.view(entry), self._copier)
        except BaseException:
            self._pool.abort(entry)
            raise
        if call.deadline.passed():
            # The client has given up and may have reused these blocks while they
            # were copied: the bytes may be torn, so they are never committed.
            self._pool.abort(entry)
            return "late", copied
        self._commit(call, it, None if units else keys[chunk], entry, mask, content_key)
        return "stored", copied

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
