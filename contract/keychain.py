"""A prompt's chunk keys in one C call (``keychain.c``): for the server's hasher
(``app.hashing``) and the connector's key-index reader (``connector.key_index``).

The prefix chain ``key_i = XXH3-128(key_{i-1} || chunk i)`` is most of the server's
own work in a lookup: in Python each chunk costs a slice, a concatenation, a call
and an append around a short hash. ``keychain.c`` runs that loop in C,
calling python-xxhash's own ``XXH3_128bits_withSeed`` (found by address in its
extension module), so the keys are those of the Python loop, byte for byte, without
the interpreter's work per chunk (``bench/hash_bench.py`` times both loops).

``load`` builds it with ``contract.kernels`` (compiled once per source, cached) and
checks it against the Python chain on a probe before anyone uses it;
``KernelUnavailable`` says why not (no compiler, an xxhash build that does not
export the function, a kernel that hashed otherwise). The server then hashes in
Python, as before. The kernel runs with the GIL held (``ctypes.PyDLL``): it reads
the token buffer and builds the list of keys.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract import chunk_keys
from contract.kernels import KernelUnavailable, build

__all__ = ["KernelUnavailable", "KeyChain", "load"]

SOURCE = Path(__file__).with_name("keychain.c")

_Fn = Callable[[int, int, bytes, np.ndarray, int, int, int], list[bytes]]


@dataclass(frozen=True)
class KeyChain:
    """The loaded kernel: ``keys`` continues a chain from ``first``."""

    path: Path
    _fn: _Fn
    _xxh3: int  # the address of XXH3_128bits_withSeed

    def keys(
        self, first: bytes, tokens: np.ndarray, chunk_bytes: int, start: int, n: int, seed: int
    ) -> list[bytes]:
        """Keys of chunks ``start .. start + n - 1`` of ``tokens`` (C-contiguous),
        the chain going on from ``first`` (16 bytes), hashed with ``seed``."""
        if len(first) != 16:  # the kernel reads 16 bytes from it
            raise ValueError(f"a chain goes on from a 16-byte key, not {len(first)} bytes")
        return self._fn(self._xxh3, seed, first, tokens, chunk_bytes, start, n)


def _python_chain(first: bytes, raw: bytes, chunk_bytes: int, seed: int) -> list[bytes]:
    """The same chain, as ``contract.chunk_keys`` defines it (the kernel's check)."""
    return chunk_keys.chain_keys(seed, first, raw, chunk_bytes, 0, len(raw) // chunk_bytes)


def load() -> KeyChain:
    """The checked kernel (``KernelUnavailable`` says why not)."""
    if sys.implementation.name != "cpython":
        raise KernelUnavailable(
            f"the kernel calls CPython's C API; this is {sys.implementation.name}"
        )
    target = build(SOURCE)
    try:
        fn = ctypes.PyDLL(str(target)).mpcache_key_chain
        extension = importlib.import_module("xxhash._xxhash").__file__
        xxh3 = ctypes.cast(ctypes.CDLL(extension).XXH3_128bits_withSeed, ctypes.c_void_p).value
    except (OSError, AttributeError, ImportError, TypeError) as exc:
        raise KernelUnavailable(f"cannot load the key chain kernel: {exc}") from exc
    if not xxh3:
        raise KernelUnavailable("xxhash exports no XXH3_128bits_withSeed")
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.py_object,
        ctypes.c_ssize_t,
        ctypes.c_ssize_t,
        ctypes.c_ssize_t,
    ]
    fn.restype = ctypes.py_object
    chain = KeyChain(target, fn, xxh3)
    # A kernel that hashed otherwise (an xxhash whose struct or symbol differs)
    # would make every key differ from other servers' and from the Python path's.
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**31 - 1, size=5 * 64, dtype="<i4")
    first, seed = bytes(range(16)), int(rng.integers(0, 2**63))
    expected = _python_chain(first, tokens.tobytes(), 256, seed)  # 5 chunks of 64 ids
    try:
        agrees = (
            chain.keys(first, tokens, 256, 0, 5, seed) == expected
            and chain.keys(expected[1], tokens, 256, 2, 3, seed) == expected[2:]
        )
    except Exception as exc:  # any failure means: not this kernel
        raise KernelUnavailable(f"the key chain kernel failed its check: {exc!r}") from exc
    if not agrees:
        raise KernelUnavailable("the key chain kernel hashed otherwise than xxhash")
    return chain
