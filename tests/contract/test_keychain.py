"""The C loop for chunk keys (contract/keychain.py): the Python loop's keys, or the
Python loop itself.

Keys decide which cached KV a request loads: the loop the server runs must give
exactly the keys the Python chain gives (other servers sharing an L2 seed, and
this server without a compiler, compute them that way).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from app.hashing import TokenHasher
from app.settings import Settings
from app.state import build_runtime
from contract import keychain
from contract.keychain import KeyChain
from tests.support import require_kernel

SEED = 0x5EED_0F_C0FFEE


@pytest.fixture(scope="module")
def chain() -> KeyChain:
    """The kernel; skips without a C compiler (fails under CI, whose machines have one)."""
    return require_kernel(keychain.load, "key chain kernel")


def _pair(chain: KeyChain, size: int) -> tuple[TokenHasher, TokenHasher]:
    native, python = TokenHasher(SEED, chain=chain), TokenHasher(SEED)
    native.bind(size)
    python.bind(size)
    return native, python


@pytest.mark.parametrize("size", [1, 16, 256, 1000])
@pytest.mark.parametrize("length", [0, 5, 256, 4095, 4096, 9001])
def test_the_c_loop_gives_the_python_loops_keys(chain: KeyChain, size: int, length: int) -> None:
    native, python = _pair(chain, size)
    tokens = np.random.default_rng(length + size).integers(0, 2**31 - 1, length, dtype="<i4")
    keys = python.prefix_keys("ns", "salt", tokens, chunk_size=size)
    assert len(keys) == length // size
    assert native.prefix_keys("ns", "salt", tokens, chunk_size=size) == keys
    # A session's cached prefix: only the chunks after it are hashed.
    for known in (0, 1, len(keys) // 2, len(keys)):
        assert native.prefix_keys("ns", "salt", tokens, chunk_size=size, known=keys[:known]) == keys


@pytest.mark.parametrize(
    "form",
    [
        lambda a: a.tolist(),  # a JSON list
        lambda a: a.astype(">i4"),  # other byte order
        lambda a: np.repeat(a, 2)[::2],  # not contiguous
        lambda a: a.astype(np.int64),
    ],
    ids=["list", "big-endian", "strided", "int64"],
)
def test_every_token_form_gets_the_same_keys(chain: KeyChain, form: object) -> None:
    native, python = _pair(chain, 16)
    tokens = np.arange(1000, 1000 + 700, dtype="<i4")
    keys = python.prefix_keys("ns", None, tokens, chunk_size=16)
    assert native.prefix_keys("ns", None, form(tokens), chunk_size=16) == keys  # type: ignore[operator]


def test_threads_hashing_at_once_get_their_own_keys(chain: KeyChain) -> None:
    """The server hashes on its event loop and in its thread pool at the same time."""
    native, python = _pair(chain, 64)
    prompts = [np.full(64 * 20, i, dtype="<i4") for i in range(8)]
    expected = [python.prefix_keys("ns", None, p, chunk_size=64) for p in prompts]
    results: dict[int, list[list[bytes]]] = {i: [] for i in range(len(prompts))}

    def work(i: int) -> None:
        for _ in range(200):
            results[i].append(native.prefix_keys("ns", None, prompts[i], chunk_size=64))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in results.items():
        assert all(keys == expected[i] for keys in got)


def test_chunks_past_the_end_or_a_short_key_are_refused(chain: KeyChain) -> None:
    tokens = np.zeros(100, dtype="<i4")
    with pytest.raises(ValueError, match="past the end"):
        chain.keys(bytes(16), tokens, 64, 6, 2, SEED)  # 8 chunks of 16 ids in 100
    with pytest.raises(ValueError, match="16-byte key"):
        chain.keys(bytes(8), tokens, 64, 0, 1, SEED)


def test_without_a_compiler_the_server_hashes_in_python_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler-mpcache")
    with pytest.raises(keychain.KernelUnavailable, match="no-such-compiler-mpcache"):
        keychain.load()
    caplog.set_level(logging.WARNING, logger="app.state")
    runtime = build_runtime(Settings(pool_size="16MiB", copy_threads=1))
    try:
        assert "chunk keys in Python" in runtime.key_chain
        assert "no-such-compiler-mpcache" in caplog.text
        runtime.hasher.bind(16)
        assert len(runtime.hasher.prefix_keys("ns", None, list(range(100)), chunk_size=16)) == 6
    finally:
        runtime.close()


def test_the_server_hashes_with_the_c_loop_where_it_loads(chain: KeyChain) -> None:
    runtime = build_runtime(Settings(pool_size="16MiB", copy_threads=1))
    try:
        assert runtime.key_chain == f"chunk keys by the C loop ({chain.path})"
    finally:
        runtime.close()


def test_a_kernel_that_hashes_otherwise_is_not_used(
    chain: KeyChain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked at load against the Python chain: keys that differ would make every
    lookup miss, and an L2 tier shared with other servers serve nothing."""

    def other_keys(first: bytes, raw: bytes, chunk_bytes: int, seed: int) -> list[bytes]:
        return [bytes(16)] * (len(raw) // chunk_bytes)

    monkeypatch.setattr(keychain, "_python_chain", other_keys)
    with pytest.raises(keychain.KernelUnavailable, match="hashed otherwise"):
        keychain.load()
