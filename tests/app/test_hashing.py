"""Token hasher: a deterministic, namespaced prefix chain over whole chunks."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from app.hashing import KEY_BYTES, TokenHasher
from tests.support import ROOT

SEED = 0x5EED_0F_C0FFEE


def hasher(size: int = 4, seed: int = SEED) -> TokenHasher:
    h = TokenHasher(seed)
    h.bind(size)  # the server's binding: it checks the size, keeps none
    return h


def test_the_binding_refuses_a_size_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        TokenHasher().bind(0)


def test_whole_chunks_only_and_prefix_property() -> None:
    h = hasher(4)
    tokens = list(range(11))
    keys = h.prefix_keys("ns", None, tokens, chunk_size=4)
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)
    assert h.prefix_keys("ns", None, tokens[:8], chunk_size=4) == keys
    assert h.prefix_keys("ns", None, tokens[:3], chunk_size=4) == []
    # Changing an early token changes every later key (it names the whole prefix).
    other = h.prefix_keys("ns", None, [99, *tokens[1:]], chunk_size=4)
    assert other[0] != keys[0] and other[1] != keys[1]
    # Changing a later chunk keeps the earlier key.
    tail = h.prefix_keys("ns", None, [*tokens[:4], 99, *tokens[5:]], chunk_size=4)
    assert tail[0] == keys[0] and tail[1] != keys[1]


@pytest.mark.parametrize(
    ("namespace", "salt", "size"),
    [
        pytest.param("other-model", None, 4, id="namespace"),
        pytest.param("ns", "tenant-a", 4, id="salt"),
        pytest.param("ns", "", 4, id="empty-salt-is-not-none"),
        pytest.param("ns", None, 2, id="chunk-size"),
    ],
)
def test_keys_are_namespaced(namespace: str, salt: str | None, size: int) -> None:
    tokens = list(range(8))
    base = hasher(4).prefix_keys("ns", None, tokens, chunk_size=4)
    assert hasher(size).prefix_keys(namespace, salt, tokens, chunk_size=size)[0] != base[0]


def test_known_prefix_is_reused_not_rehashed() -> None:
    h = hasher(4)
    tokens = np.arange(40, dtype=np.int32)
    full = h.prefix_keys("ns", None, tokens, chunk_size=4)
    assert h.prefix_keys("ns", None, tokens, chunk_size=4, known=full[:3]) == full
    bogus = [b"\x00" * KEY_BYTES] * 3
    # Known keys are trusted: callers only pass keys of the same prefix.
    assert h.prefix_keys("ns", None, tokens, chunk_size=4, known=bogus)[:3] == bogus


def test_json_list_and_int32_array_agree() -> None:
    h = hasher(4)
    assert h.prefix_keys("ns", None, [1, 2, 3, 4], chunk_size=4) == h.prefix_keys(
        "ns", None, np.array([1, 2, 3, 4], dtype=np.int64), chunk_size=4
    )


def test_content_keys_are_position_independent() -> None:
    h = hasher(4)
    a = h.content_keys("ns", None, [1, 2, 3, 4, 5, 6, 7, 8], chunk_size=4)
    b = h.content_keys("ns", None, [5, 6, 7, 8, 1, 2, 3, 4, 9], chunk_size=4)
    assert a == [b[1], b[0]]
    assert h.prefix_keys("ns", None, [1, 2, 3, 4], chunk_size=4)[0] not in a


def test_deterministic_across_processes() -> None:
    """Same secret seed, same keys, in any process (no PYTHONHASHSEED, no state)."""
    code = (
        "from app.hashing import TokenHasher\n"
        f"h = TokenHasher({SEED}); h.bind(4)\n"
        "t = list(range(12))\n"
        "print(','.join(k.hex() for k in h.prefix_keys('ns', 's', t, chunk_size=4)))\n"
        "print(','.join(k.hex() for k in h.content_keys('ns', 's', t, chunk_size=4)))\n"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(out.stdout.strip())
    h = hasher(4)
    tokens = list(range(12))
    prefix = ",".join(k.hex() for k in h.prefix_keys("ns", "s", tokens, chunk_size=4))
    content = ",".join(k.hex() for k in h.content_keys("ns", "s", tokens, chunk_size=4))
    assert outputs == {f"{prefix}\n{content}"}


def test_keys_depend_on_the_secret_seed() -> None:
    tokens = list(range(8))
    assert hasher(4, seed=1).prefix_keys("ns", None, tokens, chunk_size=4) != hasher(
        4, seed=2
    ).prefix_keys("ns", None, tokens, chunk_size=4)
    # Without a seed each hasher draws its own: two servers never share keys by accident.
    a, b = TokenHasher(), TokenHasher()
    a.bind(4)
    b.bind(4)
    assert a.prefix_keys("ns", None, tokens, chunk_size=4) != b.prefix_keys(
        "ns", None, tokens, chunk_size=4
    )


@pytest.mark.parametrize(
    "seed", [pytest.param(-1, id="negative"), pytest.param(2**64, id="over-64-bits")]
)
def test_seed_must_be_64_bits(seed: int) -> None:
    with pytest.raises(ValueError, match="64-bit"):
        TokenHasher(seed)


def test_each_key_is_the_keyed_hash_of_the_previous_key_and_the_chunk_bytes() -> None:
    """The chain as docs/design.md s.5.2 defines it, computed independently: keys
    shared through L2 by servers of one seed must not change with how the bytes
    are sliced, and neither may the keys of a prompt whose array is a view."""
    import xxhash

    h = hasher(4)
    tokens = np.arange(100, 124, dtype="<i4")
    keys = h.prefix_keys("ns", None, tokens[2:], chunk_size=4)  # a view that starts mid-buffer
    raw = tokens[2:].tobytes()
    assert len(keys) == 5
    for i in range(1, 5):
        assert keys[i] == xxhash.xxh3_128_digest(keys[i - 1] + raw[16 * i : 16 * i + 16], SEED)
    # The first key hashes the same first chunk after a seed of the namespace.
    other_ns = h.prefix_keys("other", None, tokens[2:], chunk_size=4)
    assert other_ns[0] != keys[0] and len(other_ns[0]) == KEY_BYTES
