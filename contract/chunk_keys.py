"""How chunk keys are derived: the definition both the server and the connector use.

The server keys its pool with these (``app.hashing.TokenHasher``, which adds a memo
and a C loop); the connector computes the same keys to read the server's key index
(``contract.key_index``) without asking it. ``H`` is XXH3-128 keyed with the server's
secret 64-bit key (why that is safe: ``app.hashing``), over little-endian int32
token bytes:

- ``namespace_seed``: binds namespace (model and layout), cache salt and chunk size;
- ``chain_keys``: ``key_i = H(key_{i-1} || tokens of chunk i)``, ``key_{-1}`` the seed;
- ``unit_keys``: ``H(key_{i-1} || UNIT_TAG || tokens of the first j units of chunk i)``
  for j = 1, 2, ...: a hit that ends inside a chunk (docs/design.md s.5.2).
"""

from __future__ import annotations

import xxhash

__all__ = ["DOMAIN", "KEY_BYTES", "UNIT_TAG", "chain_keys", "namespace_seed", "unit_keys"]

KEY_BYTES = 16
DOMAIN = b"mpcache/v2/xxh3-128/"
UNIT_TAG = b"u/\x00"
"""Between the previous key and a unit run's tokens: 3 bytes, so a unit key's input is
never as long as a chunk key's (16 + 4k bytes against 19 + 4k) and the two kinds
cannot collide by construction."""


def namespace_seed(
    secret: int, kind: bytes, namespace: str, cache_salt: str | None, chunk_size: int
) -> bytes:
    """The key before chunk 0 (``kind`` ``b"prefix"``; CacheBlend's is ``b"content"``)."""
    ns = namespace.encode()
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    parts = (
        DOMAIN,
        kind,
        len(ns).to_bytes(4, "little"),
        ns,
        salt,
        chunk_size.to_bytes(8, "little"),
    )
    return xxhash.xxh3_128_digest(b"".join(parts), secret)


def chain_keys(
    secret: int, prev: bytes, raw: memoryview | bytes, chunk_bytes: int, first: int, count: int
) -> list[bytes]:
    """Keys of chunks ``first .. first + count - 1`` of the token bytes ``raw``, the key
    before chunk ``first`` being ``prev``."""
    digest = xxhash.xxh3_128_digest
    keys = []
    for offset in range(first * chunk_bytes, (first + count) * chunk_bytes, chunk_bytes):
        prev = digest(prev + raw[offset : offset + chunk_bytes], secret)
        keys.append(prev)
    return keys


def unit_keys(
    secret: int, prev: bytes, raw: memoryview | bytes, unit_bytes: int, count: int
) -> list[bytes]:
    """Keys of the first 1 .. ``count`` units of one chunk's token bytes ``raw``, whose
    previous key is ``prev``; one running hash gives every key."""
    state = xxhash.xxh3_128(prev + UNIT_TAG, seed=secret)
    keys = []
    for offset in range(0, count * unit_bytes, unit_bytes):
        state.update(raw[offset : offset + unit_bytes])
        keys.append(state.digest())
    return keys
