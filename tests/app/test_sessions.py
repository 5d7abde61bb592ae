"""Session manager: TTL, key caching, release of leases."""

from __future__ import annotations

import numpy as np
import pytest

from app.hashing import TokenHasher
from app.sessions import Session, SessionManager


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingHasher(TokenHasher):
    def __init__(self) -> None:
        super().__init__()
        self.hashed_chunks = 0

    def prefix_keys(self, namespace, cache_salt, tokens, *, chunk_size, known=()):  # type: ignore[no-untyped-def]
        keys = super().prefix_keys(
            namespace, cache_salt, tokens, chunk_size=chunk_size, known=known
        )
        self.hashed_chunks += len(keys) - min(len(known), len(keys))
        return keys


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def hasher() -> CountingHasher:
    h = CountingHasher()
    h.bind(4)
    return h


@pytest.fixture
def manager(hasher: CountingHasher, clock: Clock) -> SessionManager:
    m = SessionManager(hasher, ttl_s=10.0, clock=clock)
    m.bind(4)
    return m


def test_bind_is_refused_while_sessions_are_live(manager: SessionManager, clock: Clock) -> None:
    """Keys of live sessions were hashed with the size they were given: a size
    selected under them is refused (expired sessions do not count)."""
    manager.keys_for("r", "ns", None, np.arange(8, dtype=np.int32), chunk_size=4)
    with pytest.raises(RuntimeError, match="1 live session"):
        manager.bind(8)
    clock.now = 11.0
    manager.bind(8)


def test_growing_prompt_is_hashed_once(manager: SessionManager, hasher: CountingHasher) -> None:
    prompt = np.arange(12, dtype=np.int32)
    _, keys = manager.keys_for("r", "ns", None, prompt[:8], chunk_size=4)
    assert hasher.hashed_chunks == 2
    _, grown = manager.keys_for("r", "ns", None, prompt, chunk_size=4)
    assert grown[:2] == keys and len(grown) == 3
    assert hasher.hashed_chunks == 3
    manager.keys_for("r", "ns", None, prompt, chunk_size=4)
    assert hasher.hashed_chunks == 3


def test_changed_prompt_rehashes_from_divergence(
    manager: SessionManager, hasher: CountingHasher
) -> None:
    prompt = np.arange(12, dtype=np.int32)
    manager.keys_for("r", "ns", None, prompt, chunk_size=4)
    changed = prompt.copy()
    changed[5] = 999
    _, keys = manager.keys_for("r", "ns", None, changed, chunk_size=4)
    assert keys == hasher.prefix_keys("ns", None, changed, chunk_size=4)
    assert hasher.hashed_chunks == 3 + 2 + 3  # two re-hashed here, three by the check


def test_ttl_expiry_and_release(manager: SessionManager, clock: Clock) -> None:
    released: list[str] = []
    manager.on_release = lambda s: released.append(s.request_id)
    session, _ = manager.keys_for("a", "ns", None, np.arange(4, dtype=np.int32), chunk_size=4)
    session.holds_leases = True
    manager.keys_for("b", "ns", None, np.arange(4, dtype=np.int32), chunk_size=4)
    clock.now = 5.0
    manager.keys_for("b", "ns", None, np.arange(4, dtype=np.int32), chunk_size=4)
    clock.now = 11.0
    assert manager.live_count() == 1  # "a" idle for 11 s, "b" for 6 s
    assert released == ["a"]
    assert manager.end(["b", "missing"]) == 1
    assert manager.live_count() == 0


def test_namespace_change_starts_a_new_session(manager: SessionManager) -> None:
    first, _ = manager.keys_for("r", "ns", None, np.arange(4, dtype=np.int32), chunk_size=4)
    second, _ = manager.keys_for("r", "ns2", None, np.arange(4, dtype=np.int32), chunk_size=4)
    assert isinstance(second, Session) and second is not first
    assert manager.live_count() == 1


def test_keys_for_many_gives_what_keys_for_gives(manager: SessionManager) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50_000, size=n, dtype=np.int32) for n in (3, 4, 9, 16)]
    many = manager.keys_for_many(
        [(f"r{i}", "ns", None, p) for i, p in enumerate(prompts)]
        + [("r2", "ns", None, prompts[2])],  # the same request twice in one call
        chunk_size=4,
    )
    manager.end([f"r{i}" for i in range(4)])
    one = [manager.keys_for(f"r{i}", "ns", None, p, chunk_size=4)[1] for i, p in enumerate(prompts)]
    assert [keys for _, keys in many] == [*one, one[2]]
    assert [len(keys) for keys in one] == [0, 1, 2, 4]
    assert [session.request_id for session, _ in many] == ["r0", "r1", "r2", "r3", "r2"]
    assert many[2][0] is many[4][0]


def test_keys_for_many_stops_at_a_request_that_does_not_fit(
    hasher: CountingHasher, clock: Clock
) -> None:
    from contract.errors import SessionsFull

    manager = SessionManager(hasher, ttl_s=10.0, clock=clock, max_sessions=2)
    manager.bind(4)
    tokens = np.arange(8, dtype=np.int32)
    with pytest.raises(SessionsFull):
        manager.keys_for_many([(f"r{i}", "ns", None, tokens) for i in range(3)], chunk_size=4)
    # The requests before it have their sessions; a retry of those is served.
    assert manager.live_count() == 2
    assert len(manager.keys_for("r1", "ns", None, tokens, chunk_size=4)[1]) == 2


@pytest.mark.parametrize(
    ("request_id", "salt"),
    [
        pytest.param("r" * 256, None, id="ascii-id"),
        pytest.param("\U0001f600" * 256, "\U0001f600" * 256, id="widest-id-and-salt"),
    ],
)
def test_a_session_is_charged_for_its_strings(request_id: str, salt: str | None) -> None:
    """Was: 512 bytes for any empty session, though its strings alone cost up to 3 KB."""
    import sys

    from app.sessions import SESSION_OVERHEAD_BYTES, text_bytes

    manager = SessionManager(TokenHasher(), 600, max_bytes=1 << 20)
    session, _ = manager.keys_for(request_id, "n" * 512, salt, np.empty(0, "<i4"), chunk_size=16)
    strings = sys.getsizeof(request_id) + sys.getsizeof("n" * 512)
    strings += 0 if salt is None else sys.getsizeof(salt)
    assert session.charged_bytes == SESSION_OVERHEAD_BYTES + text_bytes(request_id, "n" * 512, salt)
    assert session.charged_bytes >= SESSION_OVERHEAD_BYTES + strings
