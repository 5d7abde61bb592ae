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

Routers cannot compute those keys (the secret never leaves the server's hosts), so the
KV events and ``POST /cluster/lookup`` name chunks by a second, public chain, the
**block hashes**: 64-bit unsigned integers anyone can derive from a prompt's tokens
(``block_hashes``; docs/cluster.md "KV events" shows it step by step). With ``G`` =
XXH3-64, unkeyed (seed 0), and ``m`` = ``namespace_model(model)``:

- ``block_seed``: ``G(BLOCK_DOMAIN || len(m) as 4 bytes LE || m || salt || chunk size
  as 8 bytes LE)``, ``salt`` being ``0x00`` without a cache salt, else ``0x01`` and its
  UTF-8 bytes;
- ``hash_i = G(hash_{i-1} as 8 bytes LE || tokens of chunk i)``, ``hash_{-1}`` the
  seed, over whole chunks of ``chunk size`` tokens (little-endian int32 bytes).

A block hash names a prefix for routing only: nothing is ever served by it (the pool
serves by the keyed chunk keys), so a collision, found by chance (2^-64 a pair) or on
purpose, can at worst send a request to a server that lacks its prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = [
    "BLOCK_DOMAIN",
    "DOMAIN",
    "KEY_BYTES",
    "UNIT_TAG",
    "block_hashes",
    "block_seed",
    "chain_block_hashes",
    "chain_keys",
    "model_of",
    "namespace_model",
    "namespace_seed",
    "unit_keys",
]

KEY_BYTES = 16
DOMAIN = b"mpcache/v2/xxh3-128/"
BLOCK_DOMAIN = b"mpcache/v1/block-hash/"
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


# ------------------------------------------------------------------ block hashes


def namespace_model(model: str) -> str:
    """The model part of the namespaces the connector builds for ``model``
    (``connector.identity``): the name itself when it is printable ASCII of at most 200
    characters, else the first 32 hex digits of the SHA-256 of its UTF-8 bytes."""
    if len(model) <= 200 and model.isascii() and model.isprintable():
        return model
    return hashlib.sha256(model.encode(errors="surrogatepass")).hexdigest()[:32]


def model_of(namespace: str) -> str:
    """The model part of a namespace: what precedes its last ``@`` (all of it if none)."""
    model, at, _ = namespace.rpartition("@")
    return model if at else namespace


def block_seed(model: str, cache_salt: str | None, chunk_size: int) -> int:
    """The block hash before chunk 0 (``model`` as vLLM's connector negotiated with it)."""
    name = namespace_model(model).encode()
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    parts = (BLOCK_DOMAIN, len(name).to_bytes(4, "little"), name, salt)
    return xxhash.xxh3_64_intdigest(b"".join((*parts, chunk_size.to_bytes(8, "little"))))


def chain_block_hashes(
    prev: int, raw: memoryview | bytes, chunk_bytes: int, count: int
) -> list[int]:
    """Block hashes of the first ``count`` chunks of the token bytes ``raw``, the hash
    before them being ``prev``."""
    digest = xxhash.xxh3_64_intdigest
    hashes = []
    for offset in range(0, count * chunk_bytes, chunk_bytes):
        prev = digest(prev.to_bytes(8, "little") + raw[offset : offset + chunk_bytes])
        hashes.append(prev)
    return hashes


def block_hashes(
    model: str, cache_salt: str | None, tokens: Sequence[int] | np.ndarray, chunk_size: int
) -> list[int]:
    """The block hash of each whole chunk of ``tokens``: what a consumer of the KV
    events, or ``POST /cluster/lookup``, computes for a prompt."""
    arr = np.ascontiguousarray(np.asarray(tokens), dtype="<i4")
    raw = arr.data.cast("B")
    seed = block_seed(model, cache_salt, chunk_size)
    return chain_block_hashes(seed, raw, chunk_size * 4, len(arr) // chunk_size)
