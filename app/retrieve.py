"""The server's retrieve path: ``POST /cache/retrieve``, cached chunks into a KV cache."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.kv_events import BlockNote, StoredItem
from app.l2 import CorruptValue, L2Tier, decode_value
from app.telemetry import Telemetry
from app.transfers import CheckedItem, TransferCall, Transfers
from contract.chunk_keys import model_of
from contract.schemas import RetrieveRequest, RetrieveResponse, RetrieveResult
from dataplane.device_path import CopyWindow
from dataplane.layout import slot_mask
from dataplane.pool import Entry, Pool
from dataplane.registry import Registration
from dataplane.transfer import CopyPool, scatter_chunk

__all__ = ["Retrieve"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Part:
    """What one copy loads: a whole chunk (``units`` 0), or its first ``units`` units."""

    chunk: int
    units: int
    ids: list[np.ndarray]
    """Per group, the chunk's block ids (cut to its units, ``CheckedItem.tail_ids``)."""


_Pinned = list[tuple[_Part, Entry]]


class Retrieve:
    """Loads each item's chunks from ``start_token`` into the caller's blocks.

    Chunks load while each one is cached with the caller's layout *and* holds every
    block the caller needs (its non-null block ids); with ``unit_tokens``, the whole
    units past the last whole chunk load from any entry answering their unit key
    (``dataplane.pool``), all or nothing. ``loaded_tokens`` counts what loaded; every
    non-null block of what did not, to ``end_token``'s last whole unit, is listed in
    ``failed_block_ids``. A chunk L1 lacks is read from the disk tier, else fetched
    from the L2 tier (if any), checked, and promoted into L1 before it is served. The deadline
    (``app.transfers``) is checked before writing each chunk: once it has passed no
    more is written (the client may reuse its blocks), and the rest is reported
    failed.
    """

    def __init__(
        self,
        *,
        transfers: Transfers,
        pool: Pool,
        copier: CopyPool,
        hasher: TokenHasher,
        telemetry: Telemetry,
        l2: L2Tier | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self._transfers = transfers
        self._hasher = hasher
        self._pool = pool
        self._copier = copier
        self._telemetry = telemetry
        self._seconds = telemetry.op_seconds.labels("retrieve")
        self._l2 = l2
        self._disk = disk

    def run(
        self, req: RetrieveRequest, *, received_at: float | None = None, token: str | None = None
    ) -> RetrieveResponse:
        """Retrieve the batch; ``received_at`` (monotonic) starts ``req.timeout_s``;
        ``token`` is the registration's."""
        with self._seconds.time():
            with self._transfers.call(
                "retrieve", req, received_at=received_at, token=token
            ) as call:
                results = [self._retrieve_item(call, it) for it in call.items]
            late = sum(len(r.failed_block_ids) for r, timed_out in results if timed_out)
            self._transfers.note_late("retrieve", req, results, f"{late} block(s) not loaded")
            return RetrieveResponse(results=[r for r, _ in results])

    def _retrieve_item(self, call: TransferCall, it: CheckedItem) -> tuple[RetrieveResult, bool]:
        """The item's result, and whether the deadline cut it short."""
        keys, chunks = self._transfers.keys(call, it)
        parts = [_Part(chunk, 0, it.chunk_ids(call.reg, chunk)) for chunk in chunks]
        tail, units = it.tail(call.chunk_size)
        if units and tail <= len(keys):
            parts.append(_Part(tail, units, it.tail_ids(call.reg, tail, units)))
        timed_out = call.deadline.passed()
        pinned = [] if timed_out else self._pin(call, it, keys, parts)
        try:
            loaded, cut = self._load(call, it, pinned)
        finally:
            for _, entry in pinned:
                self._pool.unpin(entry)
        unit = it.item.unit_tokens or 0
        result = RetrieveResult(
            request_id=it.item.request_id,
            loaded_tokens=sum(
                part.units * unit if part.units else call.chunk_size for part, _ in pinned[:loaded]
            ),
            failed_block_ids=_blocks_of(part.ids for part in parts[loaded:]),
        )
        self._telemetry.tokens_loaded.inc(result.loaded_tokens)
        return result, timed_out or cut

    def _pin(
        self, call: TransferCall, it: CheckedItem, keys: Sequence[bytes], parts: list[_Part]
    ) -> _Pinned:
        """Pin the leading parts that can be served (whole chunks from L1, else promoted
        from L2; a chunk's first units from any L1 entry answering their unit key);
        stop at the first that cannot."""
        reg = call.reg
        layout = reg.layout.signature
        pinned: _Pinned = []
        for part in parts:
            needed = slot_mask(part.ids)
            entry: Entry | None
            if part.units:
                unit_key = self._unit_key(call, it, keys, part)
                entry = self._pool.pin_unit(unit_key, reg.rank, layout, needed)
            else:
                entry = self._pool.pin(keys[part.chunk], reg.rank, layout, needed)
                if entry is None and not call.deadline.passed():
                    note = BlockNote(self._told(call, it, keys), part.chunk, reg.world_size)
                    entry = self._promote(reg, call.chunk_size, keys[part.chunk], needed, note)
            if entry is None:
                break
            pinned.append((part, entry))
        return pinned

    @staticmethod
    def _told(call: TransferCall, it: CheckedItem, keys: Sequence[bytes]) -> StoredItem:
        """What a promoted chunk's note says of its prompt (``app.kv_events``)."""
        ns, salt = it.item.namespace, it.item.cache_salt
        return StoredItem(model_of(ns), salt, call.chunk_size, it.tokens, keys)

    def _unit_key(
        self, call: TransferCall, it: CheckedItem, keys: Sequence[bytes], part: _Part
    ) -> bytes:
        """The unit key of ``part``'s units (``app.hashing``)."""
        unit, size = it.item.unit_tokens or call.chunk_size, call.chunk_size
        start = part.chunk * size
        return self._hasher.unit_keys(
            it.item.namespace,
            it.item.cache_salt,
            keys[part.chunk - 1] if part.chunk else None,
            it.tokens[start : start + part.units * unit],
            unit,
            part.units,
            chunk_size=size,
        )[-1]

    def _load(self, call: TransferCall, it: CheckedItem, pinned: _Pinned) -> tuple[int, bool]:
        """Write the pinned parts into the caller's blocks, in order: how many were
        written, and whether the deadline stopped it. A GPU registration's chunks
        count once their copies have run on the server's stream, each while the next
        one's is queued (``CopyWindow``); every copy has run when this returns, so
        the entries may be unpinned."""
        done: list[int] = []
        copied = 0
        cut = False
        window = CopyWindow(call.reg.cuda_device)
        try:
            for n, (part, entry) in enumerate(pinned):
                if call.deadline.passed():
                    # The client has given up and may reuse its blocks: write no more.
                    cut = True
                    break
                view = self._pool.view(entry)
                copied += scatter_chunk(
                    call.reg.plans, part.ids, view, self._copier, wait=window.device is None
                )
                window.add(partial(done.append, n))
            window.drain()
        except Exception:
            window.abandon()
            logger.exception("retrieve of %r failed at a chunk", it.item.request_id)
        loaded = len(done)
        self._telemetry.copied_bytes.labels("retrieve").inc(copied)
        self._telemetry.chunks_loaded.inc(loaded)
        return loaded, cut

    def _promote(
        self, reg: Registration, chunk_size: int, chunk_key: bytes, needed: int, note: BlockNote
    ) -> Entry | None:
        """Read a chunk L1 lacks from the disk tier, else fetch it from L2 (and write it
        behind to disk), check it, commit it to L1; return it pinned."""
        disk = self._disk
        if disk is not None:
            found = disk.promote(
                chunk_key,
                reg.rank,
                reg.layout.signature,
                chunk_bytes=reg.chunk_bytes,
                needed=needed,
                note=note,
            )
            if found is not None:
                return found
        l2 = self._l2
        if l2 is None or not l2.up:
            return None
        layout = reg.layout.signature
        key = l2.key(reg.namespace, chunk_size, layout, reg.world_size, reg.rank, chunk_key)
        raw = l2.fetch(key)
        if raw is None:
            return None
        try:
            value = decode_value(
                raw, chunk_key=chunk_key, rank=reg.rank, layout=layout, max_bytes=l2.max_value_bytes
            )
            expected = reg.chunk_bytes if value.present else 1
            if len(value.payload) != expected:
                raise CorruptValue(f"{len(value.payload)} payload bytes, expected {expected}")
        except CorruptValue as exc:
            l2.discard(key, str(exc))
            return None
        if needed & ~value.present:
            return None  # L2's copy lacks a block the caller needs: a miss
        entry = self._pool.begin_store(
            chunk_key, reg.rank, nbytes=expected, layout=layout, present=value.present, note=note
        )
        if isinstance(entry, Entry):
            try:
                self._pool.view(entry).numpy()[:] = np.frombuffer(value.payload, dtype=np.uint8)
            except BaseException:
                self._pool.abort(entry)
                raise
            self._pool.commit(entry)
            l2.served()
            if disk is not None:
                disk.enqueue(entry)
        return self._pool.pin(chunk_key, reg.rank, layout, needed)


def _blocks_of(parts: Iterable[list[np.ndarray]]) -> list[int]:
    """Every non-null block id of ``parts``, once each, in order (the failed ones)."""
    failed: list[int] = []
    seen: set[int] = set()
    for ids in parts:
        for group_ids in ids:
            for block in group_ids[group_ids != 0].tolist():
                if block not in seen:
                    seen.add(block)
                    failed.append(block)
    return failed
