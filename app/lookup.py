"""The server's lookup path: ``POST /cache/lookup``, from its body to its reply.

``Lookups`` serves one call: a JSON body, or the binary form of ``contract.frames``
served item by item as it arrives, with the L2 extension asked off the event loop.
``LookupBatch`` is the call's own work (sessions, pool leases, L2, counters), with
the collaborators ``LookupContext`` hands it; neither calls back into the service
that built them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.bodies import INLINE_BODY_BYTES, decode_json, is_json, read_json, span_tokens
from app.chunk_size import ChunkSizeAuthority
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.l2 import KeyBudget, L2Tier
from app.lookup_areas import LookupAreas
from app.sessions import SessionManager
from app.telemetry import Telemetry
from app.units import check_unit, probe_units
from contract.errors import UnsupportedMediaType
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, LookupFrameReader
from contract.schemas import (
    LookupFrameHeader,
    LookupRequest,
    LookupResponse,
    LookupResult,
    LookupTarget,
)
from dataplane.pool import Pool
from dataplane.registry import Registry

__all__ = ["INLINE_LOOKUP_TOKENS", "LookupBatch", "LookupContext", "Lookups"]

INLINE_LOOKUP_TOKENS = 1 << 18
"""A JSON lookup of at most this many tokens in all, or one item of a binary lookup
(1 MiB of int32), is served on the event loop; more, in the thread pool, so that
``/health`` never waits long behind its hashing (``bench/dataplane_bench.py``
measures a lookup of this order)."""

Items = list[tuple[LookupTarget, np.ndarray]]


@dataclass(frozen=True)
class LookupContext:
    """What every lookup call of this server works with."""

    sessions: SessionManager
    hasher: TokenHasher
    """For the unit keys of the first chunk not cached whole."""
    pool: Pool
    registry: Registry
    """For the chunk layout of L2's keys (a lookup names no registration)."""
    telemetry: Telemetry
    lease_ttl_s: float
    l2: L2Tier | None = None
    disk: DiskTier | None = None


class LookupBatch:
    """One lookup call, served item by item (``Lookups.begin``).

    Per item: the number of leading tokens cached, each chunk present for every rank
    in ``range(world_size)``, stopping at the first miss; with ``unit_tokens``, then
    the whole units of that chunk an entry holds for every rank (``app.units``,
    ``dataplane.pool``), so a hit may end inside a chunk. Its session
    opens (``app.sessions``) and its hits are leased to the request (released at end
    of session, on session expiry, or after ``lease_ttl_s``), so the retrieve that
    follows finds them. ``add_many`` answers its items at once, with one hold of the
    sessions' lock and one of the pool's, so a binary lookup is served while the
    rest of its body still arrives. With a disk tier, the chunks that follow L1's
    hits and are on disk for every rank count too (its index is in memory). With an
    L2 tier, ``check_l2`` then extends each item's hits by the chunks that follow
    them and that L2 holds for every rank (blocking I/O: run it off the event loop).
    ``finish`` returns the reply, counts the chunks and observes the call's duration,
    from the batch's creation.
    """

    def __init__(self, context: LookupContext, chunk_size: int) -> None:
        self._context = context
        self._size = chunk_size
        self._results: list[LookupResult] = []
        self._hits = self._misses = 0
        self._l2_hits = self._disk_hits = 0
        self._l2_budget = KeyBudget()  # the L2 keys this call may still ask
        # (result index, target, L1 hits, keys past them) of items L2 may extend
        self._l2_candidates: list[tuple[int, LookupTarget, int, list[bytes]]] = []
        self._started = time.perf_counter()

    def add(self, item: LookupTarget, tokens: np.ndarray) -> None:
        self.add_many([(item, tokens)])

    def add_many(self, items: Sequence[tuple[LookupTarget, np.ndarray]]) -> None:
        """Answer ``items`` in order (``add`` of each, with one hold of each lock, and
        one more of the pool's for the units past the chunks)."""
        context, size = self._context, self._size
        for item, _ in items:
            check_unit(item.unit_tokens, size, item.request_id)
        opened = context.sessions.keys_for_many(
            [(item.request_id, item.namespace, item.cache_salt, tokens) for item, tokens in items],
            chunk_size=size,
        )
        ttl = context.lease_ttl_s
        hits_of = context.pool.lookup_many(
            [
                (keys, item.world_size, item.request_id)
                for (item, _), (_, keys) in zip(items, opened, strict=True)
            ],
            lease_ttl_s=ttl,
        )
        units_of = self._units(items, opened, hits_of)
        l2 = context.l2 is not None and context.l2.up
        results = self._results
        found = looked_up = 0
        for (item, _), (session, keys), hits, units in zip(
            items, opened, hits_of, units_of, strict=True
        ):
            if (hits or units) and ttl > 0:
                session.holds_leases = True
            if context.disk is not None and hits < len(keys):
                extra = self._disk_leading(context.disk, item, keys[hits:])
                if extra:  # whole chunks from disk reach past any units of L1's next chunk
                    hits, units = hits + extra, 0
                    self._disk_hits += extra
            if l2 and hits < len(keys):
                self._l2_candidates.append((len(results), item, hits, keys[hits:]))
            hit_tokens = hits * size + units * (item.unit_tokens or 0)
            # Built validated: model_construct runs in Python and costs more per
            # result than pydantic-core's validation does.
            results.append(LookupResult(request_id=item.request_id, hit_tokens=hit_tokens))
            found += hits + (units > 0)
            looked_up += len(keys) + (units > 0)
        self._hits += found
        self._misses += looked_up - found

    def _units(
        self,
        items: Sequence[tuple[LookupTarget, np.ndarray]],
        opened: Sequence[tuple[object, list[bytes]]],
        hits_of: Sequence[int],
    ) -> list[int]:
        """Per item, the whole units of its first chunk not cached whole that the pool
        holds for every rank (leased like chunks); 0 without ``unit_tokens``."""
        context, size = self._context, self._size
        probes: list[tuple[int, list[bytes], int, str]] = []
        for index, ((item, tokens), (_, keys), hits) in enumerate(
            zip(items, opened, hits_of, strict=True)
        ):
            unit = item.unit_tokens
            count = probe_units(len(tokens), hits, size, unit)
            if not count or unit is None:
                continue
            start = hits * size
            unit_keys = context.hasher.unit_keys(
                item.namespace,
                item.cache_salt,
                keys[hits - 1] if hits else None,
                tokens[start : start + count * unit],
                unit,
                count,
                chunk_size=size,
            )
            probes.append((index, unit_keys, item.world_size, item.request_id))
        units = [0] * len(items)
        if probes:
            counts = context.pool.lookup_units_many(
                [(keys, ws, holder) for _, keys, ws, holder in probes],
                lease_ttl_s=context.lease_ttl_s,
            )
            for (index, *_), count in zip(probes, counts, strict=True):
                units[index] = count
        return units

    @property
    def needs_l2(self) -> bool:
        """True when ``check_l2`` has Redis calls to make (run it off the event loop)."""
        return bool(self._l2_candidates)

    def check_l2(self) -> None:
        """Extend each item's L1 hits by the chunks that follow them in L2 (blocking I/O)."""
        candidates, self._l2_candidates = self._l2_candidates, []
        for index, item, hits, rest in candidates:
            extra = self._l2_leading(item, rest)
            if extra:
                # Whole chunks from L2 reach past any units of L1's next chunk.
                old = self._results[index]
                self._results[index] = LookupResult(
                    request_id=old.request_id, hit_tokens=(hits + extra) * self._size
                )
                self._hits += extra
                self._misses -= extra
                self._l2_hits += extra

    def _l2_leading(self, item: LookupTarget, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` L2 holds for every rank, in order (blocking I/O); the
        call asks at most ``app.l2.MAX_LOOKUP_KEYS`` keys over all its items."""
        l2 = self._context.l2
        if l2 is None:
            return 0
        # A lookup names no registration: the chunk layout is that of the
        # namespace's registrations here (none: nothing could be served anyway).
        layout = self._context.registry.layout_for(item.namespace, item.world_size)
        if layout is None:
            return 0
        return l2.count_leading(
            item.namespace, self._size, layout, item.world_size, keys, self._l2_budget
        )

    def _disk_leading(self, disk: DiskTier, item: LookupTarget, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` the disk tier holds for every rank, in order (no I/O)."""
        layout = self._context.registry.layout_for(item.namespace, item.world_size)
        return 0 if layout is None else disk.count_leading(keys, item.world_size, layout)

    def finish(self) -> LookupResponse:
        telemetry = self._context.telemetry
        telemetry.chunks_disk_hit.inc(self._disk_hits)
        telemetry.chunks_hit.inc(self._hits)
        telemetry.chunks_l2_hit.inc(self._l2_hits)
        telemetry.chunks_missed.inc(self._misses)
        telemetry.op_seconds.labels("lookup").observe(time.perf_counter() - self._started)
        return LookupResponse(results=self._results)


def _malformed(where: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", where), "msg": message, "type": "value_error"}])


def _decoded(req: LookupRequest) -> Items:
    """The items of a JSON lookup with their token ids (a bad token field is a 422)."""
    return [(item, span_tokens(item, item.request_id)) for item in req.requests]


class Lookups:
    """Serves ``POST /cache/lookup`` (``serve``); every call needs a final chunk size.

    Where each part runs: the body is read on the event loop (a JSON body over
    ``app.bodies.INLINE_BODY_BYTES`` is decoded in the helper process); hashing and
    the pool's answers run there too, cheap, except for more than
    ``INLINE_LOOKUP_TOKENS`` tokens at once (a JSON lookup, or one item of a binary
    one), which move to the thread pool; L2 is asked about L1's misses from the
    thread pool, and awaited.
    """

    def __init__(
        self, context: LookupContext, *, chunk_size: ChunkSizeAuthority, areas: LookupAreas
    ) -> None:
        self._context = context
        self._chunk_size = chunk_size
        self._areas = areas

    def begin(self) -> LookupBatch:
        """A lookup served item by item, as its items arrive (409 before a final size)."""
        return LookupBatch(self._context, self._chunk_size.final().chunk_size)

    async def serve(self, request: Request) -> LookupResponse:
        """The reply to a lookup in either form (415 for any other media type)."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type == LOOKUP_FRAME_MEDIA_TYPE:
            return await self._serve_frame(request)
        if is_json(media_type):
            return await self._serve_json(request)
        raise UnsupportedMediaType(
            f"a lookup body is application/json or {LOOKUP_FRAME_MEDIA_TYPE} (the binary "
            f"form of contract/frames.py), not {media_type or 'untyped'}",
            media_type=media_type,
        )

    async def _serve_frame(self, request: Request) -> LookupResponse:
        """Serve a binary lookup as its body arrives: each item is looked up as soon as
        its tokens are in, while the sender packs the next. A fault (a bad length, a
        negative token id) refuses the call where it is found; the items before it have
        been served (sessions opened, hits leased: the connector's session end, or the
        lease's expiry, releases them)."""
        batch = self.begin()  # 409 before the body is read
        # A large header is parsed off the event loop, as a large JSON body is.
        reader = LookupFrameReader(self._areas.tokens, inline_header_bytes=INLINE_BODY_BYTES)
        try:
            async for chunk in request.stream():
                inline: Items = []  # answered together, in order, before a large item
                completed = reader.feed(chunk)
                if reader.raw_header is not None:
                    header = await decode_json(request, LookupFrameHeader, reader.raw_header)
                    completed = reader.set_header(header)
                for item, tokens in completed:
                    if len(tokens) <= INLINE_LOOKUP_TOKENS:
                        inline.append((item, tokens))
                        continue
                    batch.add_many(inline)
                    inline = []
                    await run_in_threadpool(batch.add, item, tokens)
                batch.add_many(inline)
            reader.close()
        except ValidationError as exc:
            errors = [{**e, "loc": ("header", *e["loc"])} for e in exc.errors()]
            raise RequestValidationError(errors) from exc
        except ValueError as exc:
            raise _malformed("frame", str(exc)) from exc
        return await _finish(batch)

    async def _serve_json(self, request: Request) -> LookupResponse:
        req = await read_json(request, LookupRequest)
        if sum(item.num_tokens() for item in req.requests) > INLINE_LOOKUP_TOKENS:
            return await run_in_threadpool(self._serve_large_json, req)
        batch = self.begin()
        batch.add_many(_decoded(req))
        return await _finish(batch)

    def _serve_large_json(self, req: LookupRequest) -> LookupResponse:
        """(In the thread pool.) Every item is decoded before any is served."""
        items = _decoded(req)
        batch = self.begin()
        batch.add_many(items)
        if batch.needs_l2:
            batch.check_l2()
        return batch.finish()


async def _finish(batch: LookupBatch) -> LookupResponse:
    """The reply, once L2 (if any) was asked, from the thread pool, about L1's misses."""
    if batch.needs_l2:
        await run_in_threadpool(batch.check_l2)
    return batch.finish()
