"""The server's one chunk size: selection, bindings and reads, serialised.

``ChunkSizeAuthority`` is the only holder of the negotiated size. Negotiations are
serialised by a lock, so concurrent callers see one consistent answer; reads
(``snapshot``, ``state``) never select or freeze anything. Every cache operation
takes the size once, from ``final()``, and hands it down as an argument.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from app.bindings import BindingPipeline
from app.negotiation import ChunkSizeState, NegotiationPolicy, decide
from app.telemetry import Telemetry
from contract.errors import (
    BindingFailed,
    IncompatibleAlignment,
    InvalidRequest,
    MPCacheError,
    NotNegotiated,
    ResizeAfterSessions,
)
from contract.schemas import BindingStatus

__all__ = ["ChunkSizeAuthority", "ChunkSizeSnapshot", "FinalChunkSize"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinalChunkSize:
    """The chunk size once every binding succeeded: it never changes for this process."""

    chunk_size: int
    """Tokens per chunk."""


@dataclass(frozen=True)
class ChunkSizeSnapshot:
    state: ChunkSizeState
    bindings: dict[str, BindingStatus]


class ChunkSizeAuthority:
    def __init__(
        self,
        policy: NegotiationPolicy,
        pipeline: BindingPipeline,
        live_sessions: Callable[[], int],
        telemetry: Telemetry,
    ) -> None:
        self.policy = policy
        self._pipeline = pipeline
        self._live_sessions = live_sessions
        self._telemetry = telemetry
        self._state = ChunkSizeState()
        self._final: FinalChunkSize | None = None
        self._lock = threading.Lock()

    def final(self, *, before: str = "") -> FinalChunkSize:
        """The final chunk size, or ``NotNegotiated`` (409) until every binding succeeded:
        the one guard every operation passes, once per request. ``before`` names what
        the caller was about to do, for the message (e.g. "registering KV caches").

        Read without the lock: the value is set once, after the bindings, and never
        replaced, so a request never waits on a negotiation that runs its bindings."""
        final = self._final
        if final is None:
            if before:
                raise NotNegotiated(
                    f"this server has no final chunk size yet; negotiate (POST /negotiate) "
                    f"before {before}"
                )
            raise NotNegotiated("no chunk size is final yet; negotiate first (POST /negotiate)")
        return final

    @property
    def state(self) -> ChunkSizeState:
        """The current state, read without the lock (it is replaced, never mutated), so
        an async route may read it while a negotiation runs its bindings."""
        return self._state

    def snapshot(self) -> ChunkSizeSnapshot:
        with self._lock:
            return ChunkSizeSnapshot(self._state, self._pipeline.status())

    def negotiate(self, required_alignment: int, *, caller: str = "") -> int:
        """Select or confirm the chunk size for ``required_alignment``; return it.

        Every outcome is logged once, with ``caller`` (who asked, for the log only).
        """
        outcome = "ok"
        who = f" ({caller})" if caller else ""
        try:
            with self._lock:
                decision = decide(
                    self._state, required_alignment, self.policy, self._live_sessions()
                )
                if decision.kind == "reselect":
                    logger.info(
                        "re-selecting chunk size %s -> %d (alignments %s)",
                        self._state.selected,
                        decision.chunk_size,
                        decision.state.alignments,
                    )
                    self._pipeline.reset()
                self._state = decision.state
                if not self._state.final:
                    self._pipeline.run(decision.chunk_size)
                    self._final = FinalChunkSize(decision.chunk_size)
                    self._state = replace(self._state, final=True)
                    logger.info(
                        "chunk size %d is final (alignments %s, minimum %d; bound to %s); "
                        "it never changes for this server process",
                        decision.chunk_size,
                        list(self._state.alignments),
                        self.policy.min_chunk_size,
                        ", ".join(k for k, v in self._pipeline.status().items() if v == "done"),
                    )
                logger.info(
                    "negotiation: alignment %d -> chunk size %d%s",
                    required_alignment,
                    decision.chunk_size,
                    who,
                )
                return decision.chunk_size
        except MPCacheError as exc:
            outcome = _outcome(exc)
            if isinstance(exc, BindingFailed):
                self._telemetry.binding_failures.labels(str(exc.extras.get("binding"))).inc()
            logger.warning(
                "negotiation refused (%s): alignment %d%s: %s",
                outcome,
                required_alignment,
                who,
                exc.detail,
            )
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self._telemetry.negotiations.labels(outcome).inc()


def _outcome(exc: MPCacheError) -> str:
    """The ``outcome`` label of a refused negotiation."""
    if isinstance(exc, InvalidRequest):
        return "invalid"
    if isinstance(exc, IncompatibleAlignment):
        return "incompatible"
    if isinstance(exc, ResizeAfterSessions):
        return "resize_refused"
    if isinstance(exc, BindingFailed):
        return "binding_failed"
    return "error"
