"""What store and retrieve share: admission and shutdown, deadlines, item checks.

``Transfers.call`` is the prelude of both paths (``app.store``, ``app.retrieve``):
the final chunk size, the call's deadline, admission (refused once shutdown began),
the caller's registration held, every item checked before anything is copied, and
for a GPU registration the copies ordered after the worker's event on the server's
stream (``dataplane.device_path``).
``CheckedItem`` gives each item's chunk range and per-chunk block ids.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from app.bodies import span_tokens
from app.chunk_size import ChunkSizeAuthority
from app.sessions import SessionManager
from app.telemetry import Telemetry
from app.units import check_unit, tail_units
from contract.errors import InvalidRequest, Unavailable
from contract.schemas import RetrieveRequest, StoreRequest, TransferItem
from dataplane.device_path import DevicePath
from dataplane.layout import chunk_block_ids
from dataplane.registry import Registration, Registry

__all__ = ["CheckedItem", "Deadline", "TransferCall", "Transfers", "check_items"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deadline:
    """When a call's copies stop: ``timeout_s`` after the request's receipt (stamped on
    the event loop, ``app.deps``), or at once when shutdown began."""

    at: float | None
    """On ``clock``; None: no ``timeout_s``, only shutdown stops the call."""
    clock: Callable[[], float]
    stopping: threading.Event

    def passed(self) -> bool:
        if self.stopping.is_set():  # shutting down: as if the deadline had passed
            return True
        return self.at is not None and self.clock() >= self.at


@dataclass(frozen=True)
class CheckedItem:
    """A store/retrieve item that passed ``check_items``."""

    item: TransferItem
    tokens: np.ndarray
    block_ids: tuple[np.ndarray, ...]

    def chunks(self, keys: Sequence[bytes], chunk_size: int) -> range:
        """The whole chunks in ``[start_token, end_token)``, clamped to the tokens given
        (a partial trailing chunk is left out)."""
        end = min(self.item.end_token, len(self.tokens))
        return range(self.item.start_token // chunk_size, min(end // chunk_size, len(keys)))

    def chunk_ids(self, reg: Registration, chunk: int) -> list[np.ndarray]:
        """Each registered group's block ids of ``chunk`` (positions past the end of a
        block-id list read as null)."""
        return [
            chunk_block_ids(ids, chunk, n)
            for ids, n in zip(self.block_ids, reg.layout.blocks_per_chunk, strict=True)
        ]

    def tail(self, chunk_size: int) -> tuple[int, int]:
        """``(chunk, units)``: the whole units (``unit_tokens``) of ``[start_token,
        end_token)``, clamped to the tokens given, past its whole chunks, in chunk
        ``chunk``; ``units`` is 0 without a unit or without such units."""
        end = min(self.item.end_token, len(self.tokens))
        start = self.item.start_token
        if end <= start:
            return start // chunk_size, 0
        return end // chunk_size, tail_units(start, end, chunk_size, self.item.unit_tokens)

    def tail_ids(self, reg: Registration, chunk: int, units: int) -> list[np.ndarray]:
        """``chunk_ids`` of a chunk cut to its first ``units`` units: the blocks past
        them read as null (a tail holds, and a partial load writes, no more)."""
        size = reg.layout.chunk_size
        tokens = units * (self.item.unit_tokens or size)
        cut = []
        for ids, n in zip(self.chunk_ids(reg, chunk), reg.layout.blocks_per_chunk, strict=True):
            ids = ids.copy()
            ids[tokens * n // size :] = 0
            cut.append(ids)
        return cut


def _check_unit(reg: Registration, item: TransferItem, chunk_size: int) -> None:
    """Refuse (422) a unit that does not divide the chunk size or that some registered
    group's token span does not divide (a unit must end on every group's blocks)."""
    check_unit(item.unit_tokens, chunk_size, item.request_id)
    spans = [chunk_size // n for n in reg.layout.blocks_per_chunk]
    if item.unit_tokens is not None and any(item.unit_tokens % span for span in spans):
        raise InvalidRequest(
            f"request {item.request_id!r}: unit_tokens {item.unit_tokens} is not a multiple "
            f"of every registered group's token span {spans}",
            request_id=item.request_id,
        )


def check_items(
    reg: Registration, items: Sequence[TransferItem], chunk_size: int
) -> list[CheckedItem]:
    """Every item, checked against its registration, or ``InvalidRequest`` (422) for
    the whole call before anything is copied: items must use the registration's
    namespace, start on a chunk boundary, carry one block-id list per registered
    group (in registration order) and only block ids the registered tensors hold."""
    checked = []
    num_groups = len(reg.layout.groups)
    for item in items:
        rid = item.request_id
        if item.namespace != reg.namespace:
            raise InvalidRequest(
                f"request {rid!r}: namespace {item.namespace!r} differs from the "
                f"registration's {reg.namespace!r}",
                request_id=rid,
            )
        if item.start_token % chunk_size:
            raise InvalidRequest(
                f"request {rid!r}: start_token {item.start_token} is not a multiple "
                f"of the chunk size {chunk_size}",
                request_id=rid,
            )
        if item.end_token < item.start_token:
            raise InvalidRequest(
                f"request {rid!r}: end_token {item.end_token} is before start_token "
                f"{item.start_token}",
                request_id=rid,
            )
        _check_unit(reg, item, chunk_size)
        if len(item.block_ids) != num_groups:
            raise InvalidRequest(
                f"request {rid!r}: {len(item.block_ids)} block-id lists for "
                f"{num_groups} registered groups",
                request_id=rid,
            )
        arrays = []
        for g, ids in enumerate(item.block_ids):
            arr = np.asarray(ids, dtype=np.int64)
            limit = reg.group_num_blocks[g]
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
                raise InvalidRequest(
                    f"request {rid!r}: group {reg.layout.groups[g].group_id} block ids "
                    f"must lie in [0, {limit})",
                    request_id=rid,
                )
            arrays.append(arr)
        checked.append(CheckedItem(item, span_tokens(item, rid), tuple(arrays)))
    return checked


@dataclass(frozen=True)
class TransferCall:
    """One admitted store or retrieve call (``Transfers.call``)."""

    reg: Registration
    """Held for the call: it is not unmapped while the call copies."""
    chunk_size: int
    deadline: Deadline
    items: list[CheckedItem]


class Transfers:
    """Store and retrieve calls: admission, shutdown, deadlines and their log.

    Shutdown (``stop``): calls still running stop at their next chunk as if their
    deadline had passed (a late chunk is aborted, never committed), new ones are
    refused with 503, and the caller waits, bounded, until none is left, before the
    pool and the registrations are released.
    """

    def __init__(
        self,
        *,
        chunk_size: ChunkSizeAuthority,
        sessions: SessionManager,
        registry: Registry,
        telemetry: Telemetry,
        device: DevicePath | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._chunk_size = chunk_size
        self._sessions = sessions
        self._registry = registry
        self._telemetry = telemetry
        self._device = device or DevicePath()
        self._clock = clock  # deadlines: the clock ``received_at`` stamps are taken on
        self._stopping = threading.Event()
        self._in_flight = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def call(
        self,
        op: str,
        req: StoreRequest | RetrieveRequest,
        *,
        received_at: float | None,
        token: str | None,
    ) -> Iterator[TransferCall]:
        """Admit the call and hold its registration (``token`` is the registration's)
        while it runs; ``received_at`` (monotonic) starts ``req.timeout_s``."""
        size = self._chunk_size.final().chunk_size
        deadline = self.deadline(req.timeout_s, received_at)
        with self.admit(op), self._registry.acquire(req.instance_id, req.rank, token) as reg:
            items = check_items(reg, req.requests, size)
            with self._device.ordered(reg, req.event_ipc_b64):
                yield TransferCall(reg, size, deadline, items)

    def keys(self, call: TransferCall, it: CheckedItem) -> tuple[list[bytes], range]:
        """The item's chunk keys (its session opened or touched) and its chunk range."""
        item = it.item
        _, keys = self._sessions.keys_for(
            item.request_id, item.namespace, item.cache_salt, it.tokens, chunk_size=call.chunk_size
        )
        return keys, it.chunks(keys, call.chunk_size)

    def deadline(self, timeout_s: float | None, received_at: float | None) -> Deadline:
        if timeout_s is None:
            return Deadline(None, self._clock, self._stopping)
        start = self._clock() if received_at is None else received_at
        return Deadline(start + timeout_s, self._clock, self._stopping)

    @contextlib.contextmanager
    def admit(self, op: str) -> Iterator[None]:
        """Count a store or retrieve in flight; refuse one once shutdown began."""
        with self._idle:
            if self._stopping.is_set():
                raise Unavailable(f"the server is shutting down; {op} refused")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.notify_all()

    def stop(self, timeout_s: float) -> int:
        """Stop store and retrieve (see the class docstring); wait up to ``timeout_s``
        for those in flight. Returns how many are still running (0: all stopped)."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            return self._in_flight

    def note_late(
        self,
        op: str,
        req: StoreRequest | RetrieveRequest,
        results: Sequence[tuple[object, bool]],
        what: str,
    ) -> None:
        """Count and log a batch that its deadline cut short (no-op otherwise)."""
        if not any(timed_out for _, timed_out in results):
            return
        if self._stopping.is_set():
            logger.warning(
                "%s for %r rank %d stopped by shutdown: %s", op, req.instance_id, req.rank, what
            )
            return
        self._telemetry.transfer_timeouts.labels(op).inc()
        logger.warning(
            "%s for %r rank %d passed its %.3gs deadline: %s",
            op,
            req.instance_id,
            req.rank,
            req.timeout_s,
            what,
        )
