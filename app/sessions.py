"""Per-request cache sessions with a TTL.

A session is the server's state for one vLLM request, opened by its first cache
operation (lookup/store/retrieve) and dropped by end-of-session or after
``ttl_s`` of inactivity. It caches the request's chunk keys so a growing prompt
is hashed once, and it carries the leases the data plane holds for it. The
number of live sessions is what forbids a chunk-size resize (docs/design.md s.2.2 rule 3).

Bounded memory. A client that looks up huge prompts and never ends them would
otherwise hold their token ids for ``ttl_s`` each, without limit. Sessions are
charged for what they keep (``session_bytes``): the token ids and keys, their
request id, namespace and salt as Python holds them (up to 4 bytes a character),
and the session's own objects; the total is capped at ``max_bytes`` and the count
at ``max_sessions``. The charge is measured: a server filled with sessions of the
longest ids, namespace and salt, or of token ids, grows by about ``max_bytes``
(tests/reliability/test_session_memory.py checks it; charging only token ids and
keys let such sessions cost several times their charge). A session that does
not fit first makes room from the least recently used sessions that have been
idle for ``evict_idle_s`` (the lease TTL: their leases have lapsed, so only a hash
memo is lost); if that is not enough the call is refused with 503
``SessionsFull``, and one request that alone exceeds ``max_bytes`` with 422.
Sessions are kept in least-recently-used order, so expiry and eviction touch only
the sessions they remove.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.hashing import TokenHasher
from contract.errors import InvalidRequest, SessionsFull
from contract.tokens import TOKEN_DTYPE

__all__ = ["Session", "SessionManager", "session_bytes", "text_bytes"]

KEY_BYTES = 80
"""What one cached chunk key costs in a session (a 16-byte ``bytes`` object as the
allocator rounds it, and its list slot)."""

SESSION_OVERHEAD_BYTES = 512
"""What a session costs besides its strings, ids and keys: the object, its slot in
the session table, its empty key list, an id array's header (about 410 bytes by
tracemalloc, and the allocator's rounding)."""


def text_bytes(request_id: str, namespace: str, cache_salt: str | None) -> int:
    """What a session's strings cost as Python holds them (1, 2 or 4 bytes a
    character, by the widest one, and a header). A request id that is not ASCII
    also keeps a UTF-8 copy once a reply has named it (CPython caches it on the
    string)."""
    salt = 0 if cache_salt is None else sys.getsizeof(cache_salt)
    utf8 = 0 if request_id.isascii() else len(request_id.encode(errors="surrogatepass")) + 1
    return sys.getsizeof(request_id) + utf8 + sys.getsizeof(namespace) + salt


def session_bytes(num_tokens: int, chunk_size: int, text: int = 0) -> int:
    """Memory a session charges for ``num_tokens`` token ids, their chunk keys, and
    ``text`` bytes of strings (``text_bytes``)."""
    return SESSION_OVERHEAD_BYTES + text + 4 * num_tokens + KEY_BYTES * (num_tokens // chunk_size)


_NO_TOKENS = np.empty(0, dtype="<i4")
_NO_TOKENS.flags.writeable = False


@dataclass(slots=True)
class Session:
    request_id: str
    namespace: str
    cache_salt: str | None
    last_used: float
    # A new session shares one empty, read-only array (an np.empty per session costs
    # several times more, on the lookup path); the first lookup replaces it.
    hashed_tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS)
    keys: list[bytes] = field(default_factory=list)
    # Some lookup leased chunks to this request (the pool keeps which, per request
    # id): its release must give them back.
    holds_leases: bool = False
    charged_bytes: int = 0
    text_bytes: int = 0
    """What its request id, namespace and salt cost (``text_bytes``)."""


ReleaseHook = Callable[[Session], None]


class SessionManager:
    """Owns every live session; thread-safe. It keeps no chunk size: every call is
    given the negotiated one (``app.chunk_size.ChunkSizeAuthority.final``)."""

    def __init__(
        self,
        hasher: TokenHasher,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_bytes: int = 256 << 20,
        max_sessions: int = 65536,
        evict_idle_s: float = 30.0,
    ) -> None:
        self._hasher = hasher
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_bytes = max_bytes
        self._max_sessions = max_sessions
        self._evict_idle_s = evict_idle_s
        # Least recently used first: expiry and eviction stop at the first keeper.
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.on_release: ReleaseHook | None = None
        """Called for every session that ends or expires (e.g. to drop its leases)."""

    def bind(self, chunk_size: int) -> None:
        """The ``session_manager`` binding: refuse a size selected while sessions are
        live (their keys were hashed with another size; docs/design.md s.2.2 rule 3)."""
        with self._lock:
            self._expire_locked(self._clock())
            if self._sessions:
                raise RuntimeError(
                    f"cannot bind chunk size {chunk_size} to the session manager with "
                    f"{len(self._sessions)} live session(s)"
                )

    def live_count(self) -> int:
        self.expire()
        with self._lock:
            return len(self._sessions)

    def keys_for(
        self,
        request_id: str,
        namespace: str,
        cache_salt: str | None,
        tokens: np.ndarray,
        *,
        chunk_size: int,
    ) -> tuple[Session, list[bytes]]:
        """Open (or touch) the request's session and return its chunk keys.

        Keys of a prefix already hashed for this session are reused; a session whose
        namespace, salt or earlier tokens differ starts over.
        """
        return self.keys_for_many(
            [(request_id, namespace, cache_salt, tokens)], chunk_size=chunk_size
        )[0]

    def keys_for_many(
        self, requests: Sequence[tuple[str, str, str | None, np.ndarray]], *, chunk_size: int
    ) -> list[tuple[Session, list[bytes]]]:
        """``keys_for`` of each ``(request_id, namespace, cache_salt, tokens)``: the
        sessions opened under one hold of the lock, hashed outside it, and their keys
        kept under a second hold (a lookup call's items, as they arrive).

        A request that cannot be given its session (``SessionsFull``,
        ``InvalidRequest``) raises; the sessions of the requests before it are open.
        """
        size = chunk_size
        now = self._clock()
        opened: list[tuple[Session, list[bytes], np.ndarray]] = []
        with self._lock:
            for request_id, namespace, cache_salt, tokens in requests:
                opened.append(self._open(request_id, namespace, cache_salt, len(tokens), size, now))
        out: list[tuple[Session, list[bytes]]] = []
        for (session, known, seen), (_, namespace, cache_salt, tokens) in zip(
            opened, requests, strict=True
        ):
            usable = min(len(seen), len(tokens)) // size * size
            if usable and not np.array_equal(seen[:usable], tokens[:usable]):
                # Same request id, different prompt: find how many whole chunks still agree.
                agree = int(np.argmin(seen[:usable] == tokens[:usable]))
                usable = agree // size * size
            keys = self._hasher.prefix_keys(
                namespace, cache_salt, tokens, chunk_size=size, known=known[: usable // size]
            )
            out.append((session, keys))
        with self._lock:
            for (session, keys), (request_id, _, _, tokens) in zip(out, requests, strict=True):
                self._keep(session, request_id, keys, tokens, size)
        return out

    def _open(
        self,
        request_id: str,
        namespace: str,
        cache_salt: str | None,
        num_tokens: int,
        size: int,
        now: float,
    ) -> tuple[Session, list[bytes], np.ndarray]:
        """(Under the lock) the request's session, opened or touched and charged for
        ``num_tokens`` (chunks of ``size``), with its known keys and the tokens they
        were hashed from."""
        session = self._sessions.get(request_id)
        if session is None or (session.namespace, session.cache_salt) != (namespace, cache_salt):
            if session is not None:
                self._drop(session)
            session = Session(request_id, namespace, cache_salt, now, _NO_TOKENS, [])
            session.text_bytes = text_bytes(request_id, namespace, cache_salt)
        need = session_bytes(max(num_tokens, len(session.hashed_tokens)), size, session.text_bytes)
        self._make_room(session, need, now)
        if request_id not in self._sessions:
            self._sessions[request_id] = session
        self._sessions.move_to_end(request_id)
        self._bytes += need - session.charged_bytes
        session.charged_bytes = need
        session.last_used = now
        return session, session.keys, session.hashed_tokens

    def _keep(
        self, session: Session, request_id: str, keys: list[bytes], tokens: np.ndarray, size: int
    ) -> None:
        """(Under the lock) remember ``keys`` and the tokens they hash, and charge the
        session for what it keeps."""
        if len(keys) >= len(session.keys):
            session.keys = keys
            hashed = tokens[: len(keys) * size]
            if not len(hashed):
                session.hashed_tokens = _NO_TOKENS  # no array per session for nothing
            elif type(hashed) is np.ndarray and hashed.dtype == TOKEN_DTYPE:
                session.hashed_tokens = hashed.copy()  # the caller's buffer may be reused
            else:
                session.hashed_tokens = np.array(hashed, dtype=TOKEN_DTYPE)
        if self._sessions.get(request_id) is session:
            kept = session_bytes(len(session.hashed_tokens), size, session.text_bytes)
            self._bytes += kept - session.charged_bytes
            session.charged_bytes = kept

    def _make_room(self, session: Session, need: int, now: float) -> None:
        """Expire and evict (under the lock) until ``session`` fits with ``need`` bytes;
        ``SessionsFull`` if sessions used within ``evict_idle_s`` hold the rest."""
        if need > self._max_bytes:
            raise InvalidRequest(
                f"request {session.request_id!r}: its {need} bytes of token ids, keys and ids "
                f"exceed the server's whole session memory ({self._max_bytes} bytes); "
                "raise --session-memory (MPCACHE_SESSION_MEMORY) or send a shorter prompt",
                request_id=session.request_id,
            )

        if self._fits(session, need):
            return
        self._expire_locked(now)
        idle_before = now - self._evict_idle_s
        while not self._fits(session, need):
            oldest = next(iter(self._sessions.values()), None)
            if oldest is None or oldest is session or oldest.last_used > idle_before:
                break
            self._drop(oldest)
        if not self._fits(session, need):
            raise SessionsFull(
                f"{len(self._sessions)} live sessions hold {self._bytes} bytes of session "
                f"memory (limits: {self._max_sessions} sessions, {self._max_bytes} "
                f"bytes), all used in the last {self._evict_idle_s:g} s; end finished "
                "requests (POST /cache/end), retry later, or raise --session-memory / "
                "--max-sessions",
                sessions=len(self._sessions),
                session_bytes=self._bytes,
            )

    def _fits(self, session: Session, need: int) -> bool:
        """``session`` holding ``need`` bytes fits the limits (under the lock). Read
        afresh each time: expiry may have dropped ``session`` itself."""
        live = self._sessions.get(session.request_id) is session
        have = session.charged_bytes if live else 0
        count = len(self._sessions) + (0 if live else 1)
        return self._bytes - have + need <= self._max_bytes and count <= self._max_sessions

    def end(self, request_ids: Iterable[str]) -> int:
        ended = 0
        with self._lock:
            for rid in request_ids:
                session = self._sessions.get(rid)
                if session is not None:
                    self._drop(session)
                    ended += 1
        return ended

    def expire(self) -> int:
        with self._lock:
            return self._expire_locked(self._clock())

    def _expire_locked(self, now: float) -> int:
        deadline = now - self._ttl_s
        expired = 0
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used >= deadline:
                break
            self._drop(oldest)
            expired += 1
        return expired

    def close(self) -> None:
        with self._lock:
            for session in self._sessions.values():
                self._release(session)
            self._sessions.clear()
            self._bytes = 0

    def _drop(self, session: Session) -> None:
        """Remove a live session (under the lock) and release it."""
        if self._sessions.get(session.request_id) is session:
            del self._sessions[session.request_id]
            self._bytes -= session.charged_bytes
            session.charged_bytes = 0
        self._release(session)

    def _release(self, session: Session) -> None:
        if self.on_release is not None and session.holds_leases:
            self.on_release(session)
        session.holds_leases = False
