"""The server's store path: ``POST /cache/store``, whole chunks from a KV cache into L1."""

from __future__ import annotations

from app.blend import BlendMatcher
from app.hashing import TokenHasher
from app.l2 import L2Tier, WriteJob
from app.pool_pressure import PoolPressureLog
from app.telemetry import Telemetry
from app.transfers import CheckedItem, TransferCall, Transfers
from contract.schemas import StoreRequest, StoreResponse, StoreResult
from dataplane.layout import slot_mask
from dataplane.pool import PRESENT, Entry, Pool
from dataplane.transfer import CopyPool, gather_chunk

__all__ = ["Store"]


class Store:
    """Copies whole chunks in ``[start_token, end_token)`` of each item into the pool.

    Per chunk all-or-nothing; a chunk already cached is reported ``present`` and not
    copied. When the pool has no room the chunk and the rest of that item fail (a
    later chunk is useless without its prefix). The deadline (``app.transfers``) is
    checked before copying each chunk and again after, before commit: a chunk whose
    copy ended late is aborted, never made visible (the client may have reused those
    blocks while it was copied); what is left once it has passed is reported failed.
    A committed chunk joins the CacheBlend index (when enabled) and, with an L2 tier,
    is queued for write-behind.
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
        reg, size, deadline = call.reg, call.chunk_size, call.deadline
        keys, chunks = self._transfers.keys(call, it)
        stored = present = failed = 0
        copied = 0
        timed_out = False
        for chunk in chunks:
            if deadline.passed():
                timed_out = True
                failed = chunks.stop - chunk
                break
            ids = it.chunk_ids(reg, chunk)
            mask = slot_mask(ids)
            content_key = None
            if self._blend.enabled:
                chunk_tokens = it.tokens[chunk * size : (chunk + 1) * size]
                content_key = self._hasher.content_keys(
                    it.item.namespace, it.item.cache_salt, chunk_tokens, chunk_size=size
                )[0]
            entry = self._pool.begin_store(
                keys[chunk],
                reg.rank,
                # A chunk with no data (every block null) is recorded, not copied.
                nbytes=reg.chunk_bytes if mask else 1,
                layout=reg.layout.signature,
                present=mask,
                content_key=content_key,
            )
            if entry == PRESENT:
                present += 1
                continue
            if entry is None:
                failed = chunks.stop - chunk
                self._pressure.not_stored(failed)
                break
            assert isinstance(entry, Entry)
            try:
                if mask:
                    copied += gather_chunk(reg.plans, ids, self._pool.view(entry), self._copier)
            except BaseException:
                self._pool.abort(entry)
                raise
            if deadline.passed():
                # The client has given up and may have reused these blocks while they
                # were copied: the bytes may be torn, so they are never committed.
                self._pool.abort(entry)
                timed_out = True
                failed = chunks.stop - chunk
                break
            self._commit(call, it, keys[chunk], entry, mask, content_key)
            stored += 1
        self._telemetry.chunks_stored.inc(stored)
        self._telemetry.copied_bytes.labels("store").inc(copied)
        result = StoreResult(
            request_id=it.item.request_id,
            stored_chunks=stored,
            present_chunks=present,
            failed_chunks=failed,
        )
        return result, timed_out

    def _commit(
        self,
        call: TransferCall,
        it: CheckedItem,
        chunk_key: bytes,
        entry: Entry,
        mask: int,
        content_key: bytes | None,
    ) -> None:
        """Make a copied chunk visible; index it for CacheBlend, queue it for L2."""
        self._pool.commit(entry)
        if content_key is not None:
            self._blend.add(content_key)
        l2 = self._l2
        if l2 is not None:
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
