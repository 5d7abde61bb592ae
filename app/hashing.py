"""Token hasher: chunk keys as a prefix hash chain over whole chunks (docs/design.md s.5.2).

``key_0 = H(namespace-seed, tokens of chunk 0)``, ``key_i = H(key_{i-1}, tokens of
chunk i)``. ``H`` is BLAKE2b with a 128-bit digest over the little-endian int32
token bytes, so keys are the same in every process (no PYTHONHASHSEED) and a key
names its whole prefix. The seed binds model identity/layout (``namespace``),
``cache_salt`` and the chunk size, so chunks of different namespaces, salts or
chunk sizes never collide. A partial trailing chunk gets no key.

``content_key`` is the position-independent hash of one chunk's tokens (CacheBlend).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from contract.errors import NotNegotiated

__all__ = ["KEY_BYTES", "TokenHasher"]

KEY_BYTES = 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _seed(kind: bytes, namespace: str, cache_salt: str | None, chunk_size: int) -> bytes:
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return _h(
        b"mpcache/v1/",
        kind,
        len(namespace.encode()).to_bytes(4, "little"),
        namespace.encode(),
        salt,
        chunk_size.to_bytes(8, "little"),
    )


def _as_tokens(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(tokens), dtype="<i4")


class TokenHasher:
    """Computes chunk keys for one chunk size; usable once ``bind`` has run."""

    def __init__(self) -> None:
        self._chunk_size: int | None = None

    @property
    def chunk_size(self) -> int:
        if self._chunk_size is None:
            raise NotNegotiated("the token hasher has no chunk size yet; negotiate first")
        return self._chunk_size

    def bind(self, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._chunk_size = chunk_size

    def prefix_keys(
        self,
        namespace: str,
        cache_salt: str | None,
        tokens: np.ndarray | Sequence[int],
        *,
        known: Sequence[bytes] = (),
    ) -> list[bytes]:
        """Keys of every whole chunk of ``tokens``.

        ``known`` are keys already computed for a prefix of the same tokens (a
        session's cache); they are reused, and only later chunks are hashed.
        """
        size = self.chunk_size
        arr = _as_tokens(tokens)
        num_chunks = len(arr) // size
        keys = list(known[:num_chunks])
        prev = keys[-1] if keys else _seed(b"prefix", namespace, cache_salt, size)
        raw = arr[: num_chunks * size].tobytes()
        step = size * 4
        for i in range(len(keys), num_chunks):
            prev = _h(prev, raw[i * step : (i + 1) * step])
            keys.append(prev)
        return keys

    def content_keys(
        self, namespace: str, cache_salt: str | None, tokens: np.ndarray | Sequence[int]
    ) -> list[bytes]:
        """Position-independent key of each whole chunk (same tokens, same key)."""
        size = self.chunk_size
        arr = _as_tokens(tokens)
        seed = _seed(b"content", namespace, cache_salt, size)
        raw = arr[: (len(arr) // size) * size].tobytes()
        step = size * 4
        return [_h(seed, raw[i : i + step]) for i in range(0, len(raw), step)]
