"""The server's retrieve path: ``POST /cache/retrieve``, cached chunks into a KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from app.disk_reads import ReadAhead
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.kv_events import BlockNote, StoredItem
from app.l2 import L2Tier
from app.l2_reads import Owner, Promoter, Want
from app.telemetry import Telemetry
from app.transfers import CheckedItem, TransferCall, Transfers
from contract.chunk_keys import model_of
from contract.schemas import RetrieveRequest, RetrieveResponse, RetrieveResult
from dataplane.device_path import CopyWindow
from dataplane.layout import slot_mask
from dataplane.pool import Entry, Pool
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


_Take = Callable[[], Entry | None]
"""A chunk read ahead from the disk tier (``ReadAhead.take``): its entry, pinned, or None."""
_Found = Entry | _Take | None
_Pinned = list[tuple[_Part, Entry | _Take]]


class Retrieve:
    """Loads each item's chunks from ``start_token`` into the caller's blocks.

    Chunks load while each one is cached with the caller's layout *and* holds every
    block the caller needs (its non-null block ids); with ``unit_tokens``, the whole
    units past the last whole chunk load from any entry answering their unit key
    (``dataplane.pool``), all or nothing. ``loaded_tokens`` counts what loaded; every
    non-null block of what did not, to ``end_token``'s last whole unit, is listed in
    ``failed_block_ids``. A chunk L1 lacks is read from the disk tier, else fetched
    from the L2 tier (if any), checked, and promoted into L1 before it is served;
    without L2, the disk reads run ahead of the copies (``app.disk_reads``), each
    chunk's taken right before it is copied, and the first that cannot be served ends
    the item there. The deadline
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
        self._promoter = None if l2 is None else Promoter(l2, pool)
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
        reads = None if self._disk is None else self._read_ahead(call)
        pinned: _Pinned = []
        try:
            pinned = [] if timed_out else self._pin(call, it, keys, parts, reads)
            loaded, cut = self._load(call, it, pinned)
        finally:
            for _, got in pinned:
                if isinstance(got, Entry):  # what _load took, or held from the start
                    self._pool.unpin(got)
            if reads is not None:
                reads.close()  # what was read ahead and not taken
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

    def _read_ahead(self, call: TransferCall) -> ReadAhead:
        assert self._disk is not None
        reg = call.reg
        return ReadAhead(
            self._disk,
            self._pool,
            rank=reg.rank,
            layout=reg.layout.signature,
            chunk_bytes=reg.chunk_bytes,
        )

    def _pin(
        self,
        call: TransferCall,
        it: CheckedItem,
        keys: Sequence[bytes],
        parts: list[_Part],
        reads: ReadAhead | None,
    ) -> _Pinned:
        """Pin the leading parts that can be served (whole chunks from L1, else read
        ahead from disk or promoted from L2, all of the item's at once; a chunk's first
        units from any L1 entry answering their unit key); stop at the first that
        cannot (a chunk read ahead may still turn out not to be: ``_load`` stops there)."""
        reg = call.reg
        layout = reg.layout.signature
        below = self._disk is not None or self._promoter is not None
        found: list[_Found] = []
        for part in parts:
            if part.units:
                break  # the units load only after every whole chunk before them
            entry = self._pool.pin(keys[part.chunk], reg.rank, layout, slot_mask(part.ids))
            found.append(entry)
            if entry is None and not below:
                break  # no tier can fill this gap: nothing past it is served
        pinned: _Pinned = []
        try:
            self._promote(call, it, keys, parts, found, reads)
            for part, got in zip(parts, found, strict=False):
                if got is None:
                    break
                pinned.append((part, got))
            if len(pinned) == len(found) < len(parts):  # a tail's units, after every chunk
                part = parts[len(found)]
                unit_key = self._unit_key(call, it, keys, part)
                entry = self._pool.pin_unit(unit_key, reg.rank, layout, slot_mask(part.ids))
                if entry is not None:
                    pinned.append((part, entry))
        except BaseException:
            for got in found:
                if isinstance(got, Entry):
                    self._pool.unpin(got)  # the caller unpins only what this returns
            raise
        for got in found[len(pinned) :]:
            if isinstance(got, Entry):
                self._pool.unpin(got)  # past a chunk that cannot be served
        return pinned

    def _promote(
        self,
        call: TransferCall,
        it: CheckedItem,
        keys: Sequence[bytes],
        parts: list[_Part],
        found: list[_Found],
        reads: ReadAhead | None,
    ) -> None:
        """Fill ``found``'s gaps (chunks L1 lacks) from the disk tier, then what is
        still missing from L2, in one pipeline; a chunk L2 gave is queued for disk."""
        missing = [n for n, entry in enumerate(found) if entry is None]
        if not missing or call.deadline.passed():
            return
        reg, told = call.reg, self._told(call, it, keys)
        wants = {
            n: Want(
                keys[parts[n].chunk],
                slot_mask(parts[n].ids),
                BlockNote(told, parts[n].chunk, reg.world_size),
            )
            for n in missing
        }
        disk = self._disk
        if reads is not None:
            missing = self._from_disk(reads, call, missing, wants, found)
        if self._promoter is None or not missing or call.deadline.passed():
            return
        promoted = self._promoter.promote(
            Owner.of(reg), call.chunk_size, [wants[n] for n in missing], call.deadline.passed
        )
        for n, entry in zip(missing, promoted, strict=True):
            found[n] = entry
            if entry is not None and disk is not None:
                disk.enqueue(entry)

    def _from_disk(
        self,
        reads: ReadAhead,
        call: TransferCall,
        missing: list[int],
        wants: dict[int, Want],
        found: list[_Found],
    ) -> list[int]:
        """Fill ``found``'s gaps from the disk tier, in order: each one read ahead,
        taken when ``_load`` reaches it. With an L2 tier, they are taken here, up to
        the first miss (or the deadline), so that L2 fills the gaps from there; return
        the gaps still open."""
        for n in missing:
            reads.add(n, wants[n])
        if self._promoter is None:
            for n in missing:
                found[n] = partial(reads.take, n)
            return []
        for n in missing:
            if call.deadline.passed():
                break
            found[n] = reads.take(n)
            if found[n] is None:
                break  # what follows a miss is not served: L2 fills from here
        reads.close()  # what was read past the first miss
        return [n for n in missing if found[n] is None]

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
            for n, (part, got) in enumerate(pinned):
                if call.deadline.passed():
                    # The client has given up and may reuse its blocks: write no more.
                    cut = True
                    break
                entry = got if isinstance(got, Entry) else got()  # read ahead: wait for it
                if entry is None:
                    break  # not on disk after all (or refused): the item ends here
                pinned[n] = (part, entry)  # unpinned by the caller
                if call.deadline.passed():  # while it was read
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
