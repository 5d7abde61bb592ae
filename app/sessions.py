"""Per-request cache sessions with a TTL.

A session is the server's state for one vLLM request, opened by its first cache
operation (lookup/store/retrieve) and dropped by end-of-session or after
``ttl_s`` of inactivity. It caches the request's chunk keys so a growing prompt
is hashed once, and it carries the leases the data plane holds for it. The
number of live sessions is what forbids a chunk-size resize (docs/design.md s.2.2 rule 3).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from app.hashing import TokenHasher
from contract.errors import NotNegotiated

__all__ = ["Session", "SessionManager"]


@dataclass
class Session:
    request_id: str
    namespace: str
    cache_salt: str | None
    last_used: float
    hashed_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype="<i4"))
    keys: list[bytes] = field(default_factory=list)
    leases: set[bytes] = field(default_factory=set)


ReleaseHook = Callable[[Session], None]


class SessionManager:
    """Owns every live session; thread-safe."""

    def __init__(
        self,
        hasher: TokenHasher,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hasher = hasher
        self._ttl_s = ttl_s
        self._clock = clock
        self._chunk_size: int | None = None
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.on_release: ReleaseHook | None = None
        """Called for every session that ends or expires (e.g. to drop its leases)."""

    @property
    def bound(self) -> bool:
        return self._chunk_size is not None

    def bind(self, chunk_size: int) -> None:
        if self._hasher.chunk_size != chunk_size:
            raise RuntimeError(
                f"session manager asked to bind {chunk_size} but the token hasher is "
                f"bound to {self._hasher.chunk_size}"
            )
        with self._lock:
            if self._sessions and self._chunk_size not in (None, chunk_size):
                raise RuntimeError("cannot rebind the session manager with live sessions")
            self._chunk_size = chunk_size

    def live_count(self) -> int:
        self.expire()
        with self._lock:
            return len(self._sessions)

    def keys_for(
        self, request_id: str, namespace: str, cache_salt: str | None, tokens: np.ndarray
    ) -> tuple[Session, list[bytes]]:
        """Open (or touch) the request's session and return its chunk keys.

        Keys of a prefix already hashed for this session are reused; a session whose
        namespace, salt or earlier tokens differ starts over.
        """
        if self._chunk_size is None:
            raise NotNegotiated("no chunk size is bound yet; negotiate first (POST /negotiate)")
        size = self._chunk_size
        now = self._clock()
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None or (session.namespace, session.cache_salt) != (
                namespace,
                cache_salt,
            ):
                if session is not None:
                    self._release(session)
                session = Session(request_id, namespace, cache_salt, now)
                self._sessions[request_id] = session
            session.last_used = now
            known = session.keys
            seen = session.hashed_tokens
        usable = min(len(seen), len(tokens)) // size * size
        if usable and not np.array_equal(seen[:usable], tokens[:usable]):
            # Same request id, different prompt: find how many whole chunks still agree.
            agree = int(np.argmin(seen[:usable] == tokens[:usable]))
            usable = agree // size * size
        keys = self._hasher.prefix_keys(
            namespace, cache_salt, tokens, known=known[: usable // size]
        )
        with self._lock:
            if len(keys) >= len(session.keys):
                session.keys = keys
                session.hashed_tokens = np.array(tokens[: len(keys) * size], dtype="<i4")
        return session, keys

    def get(self, request_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(request_id)

    def end(self, request_ids: Iterable[str]) -> int:
        ended = 0
        with self._lock:
            for rid in request_ids:
                session = self._sessions.pop(rid, None)
                if session is not None:
                    self._release(session)
                    ended += 1
        return ended

    def expire(self) -> int:
        deadline = self._clock() - self._ttl_s
        with self._lock:
            stale = [rid for rid, s in self._sessions.items() if s.last_used < deadline]
            for rid in stale:
                self._release(self._sessions.pop(rid))
        return len(stale)

    def close(self) -> None:
        with self._lock:
            for session in self._sessions.values():
                self._release(session)
            self._sessions.clear()

    def _release(self, session: Session) -> None:
        if self.on_release is not None and session.leases:
            self.on_release(session)
        session.leases.clear()
