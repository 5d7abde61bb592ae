"""Token hasher: chunk keys as a prefix hash chain over whole chunks (docs/design.md s.5.2).

``key_0 = H(namespace-seed, tokens of chunk 0)``, ``key_i = H(key_{i-1}, tokens of
chunk i)``, over the little-endian int32 token bytes, so a key names its whole
prefix. The seed binds model identity/layout (``namespace``), ``cache_salt`` and the
chunk size, so chunks of different namespaces, salts or chunk sizes never share a
key. Below the chunk, ``unit_keys`` names each leading run of whole alignment units of
one chunk, ``H(key_{i-1}, tag, tokens of those units)``: a hit may end at any unit
boundary (docs/design.md s.5), keyed as safely as a chunk. ``content_keys`` is the
position-independent hash of one chunk's tokens (CacheBlend). Which H, and why it is
safe for a shared cache: ``TokenHasher``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import xxhash

from contract import chunk_keys
from contract.chunk_keys import KEY_BYTES
from contract.keychain import KeyChain
from contract.tokens import TOKEN_DTYPE

__all__ = ["KEY_BYTES", "TokenHasher"]

_SEEDS_KEPT = 4096


def _as_tokens(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(tokens), dtype="<i4")


class TokenHasher:
    """Computes chunk keys; the chunk size is the caller's (the negotiated one).

    ``seed``: the secret key of H (a 64-bit integer); by default a fresh random one,
    so keys are the same for the life of this hasher, in any thread, and unrelated
    across server processes. Equal seeds give equal keys in every process.
    ``chain``: the C loop for prefix keys (``contract.keychain``, checked at its load to
    give the Python loop's keys byte for byte, without the interpreter's work per
    chunk); without it the keys are hashed in Python.

    **Which H.** A lookup hashes every chunk of the prompt, one short input (1 KiB for
    256 tokens, plus the 16-byte previous key) at a time, so the per-call cost of the
    binding matters as much as the hash's speed. ``bench/hash_bench.py`` measures the
    candidates on the same bytes (XXH3-128, SHA-256, BLAKE3, BLAKE2b-128): the
    cryptographic ones are all several times slower, BLAKE3 because its speed is SIMD
    over long inputs and 1 KiB is a single chunk of it. H is **XXH3-128 keyed with a
    per-server secret seed**.

    **Why that is safe for a shared cache.** Keys decide whose KV cache a request
    loads, and tenants choose their prompts' token ids, so a tenant who could make a
    chunk key collide with another's prefix could serve that prefix its own KV
    (corrupting the victim's output). 128 bits put accidental and generic (birthday)
    collisions out of reach (2^64 work), but an unkeyed non-cryptographic hash such as
    XXH3 has exploitable structure: with its public default secret an attacker can
    choose inputs whose stripes cancel and collide offline, which is why vLLM warns
    that its own xxhash prefix-cache option is for trusted tenants only. Keyed with a
    secret 64-bit seed drawn from ``secrets`` when the server starts, every stripe's
    multiply depends on the unknown secret, so collisions can no longer be computed
    offline; and the keys never leave the server (a lookup answers a hit count, not
    keys), so the only oracle is "hit or miss" on full 128-bit keys, which leaks
    nothing about the seed short of a collision. What remains is a heuristic property
    (XXH3 has no proof of being a PRF), not a cryptographic one. Deployments that
    must not rely on it separate tenants with vLLM's ``cache_salt`` (part of every
    key's seed), which makes cross-tenant sharing, and so cross-tenant collisions,
    impossible by construction. The price of the secret: keys differ between server
    processes (the pool is not persistent, so nothing is lost), except with the shared
    L2 tier (docs/design.md s.7), whose servers share one seed through Redis
    (``app.l2.L2Tier.connect``): there the seed is as secret as Redis is.
    The keys' definition is ``contract.chunk_keys`` (the connector computes them too,
    to read the key index); this class adds a memo of seeds and the C loop.
    """

    def __init__(self, seed: int | None = None, *, chain: KeyChain | None = None) -> None:
        self._chain = chain  # the C loop (``contract.keychain``), or None: the Python one
        self._key = secrets.randbits(64) if seed is None else seed
        # Seeds by (kind, namespace, salt, chunk size): one per tenant and model,
        # hashed once (dict operations are atomic: threads may share it).
        self._seeds: dict[tuple[bytes, str, str | None, int], bytes] = {}
        if not 0 <= self._key < 2**64:
            raise ValueError("the hash seed must be a 64-bit unsigned integer")

    @property
    def secret(self) -> int:
        """The key of H, for the key index's header (``dataplane.key_index``)."""
        return self._key

    def bind(self, chunk_size: int) -> None:
        """The ``token_hasher`` binding: check this hasher can key chunks of that size.

        It keeps no size: every call is given the negotiated one."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    def _seed(self, kind: bytes, namespace: str, cache_salt: str | None, size: int) -> bytes:
        memo = (kind, namespace, cache_salt, size)
        seed = self._seeds.get(memo)
        if seed is None:
            seed = chunk_keys.namespace_seed(self._key, kind, namespace, cache_salt, size)
            if len(self._seeds) >= _SEEDS_KEPT:
                self._seeds.clear()
            self._seeds[memo] = seed
        return seed

    def prefix_keys(
        self,
        namespace: str,
        cache_salt: str | None,
        tokens: np.ndarray | Sequence[int],
        *,
        chunk_size: int,
        known: Sequence[bytes] = (),
    ) -> list[bytes]:
        """Keys of every whole chunk of ``chunk_size`` tokens of ``tokens``.

        ``known`` are keys already computed for a prefix of the same tokens (a
        session's cache); they are reused, and only later chunks are hashed.
        """
        size = chunk_size
        if type(tokens) is np.ndarray and tokens.dtype == TOKEN_DTYPE and tokens.flags.c_contiguous:
            arr = tokens  # a lookup's ids as they came: no conversion call
        else:
            arr = _as_tokens(tokens)
        num_chunks = len(arr) // size
        keys = list(known[:num_chunks])
        prev = keys[-1] if keys else self._seed(b"prefix", namespace, cache_salt, size)
        step = size * 4
        key = self._key
        if self._chain is not None:
            keys += self._chain.keys(prev, arr, step, len(keys), num_chunks - len(keys), key)
            return keys
        raw = arr.data.cast("B")  # no copy: arr is contiguous; the loop stops at its chunks
        keys += chunk_keys.chain_keys(key, prev, raw, step, len(keys), num_chunks - len(keys))
        return keys

    def unit_keys(
        self,
        namespace: str,
        cache_salt: str | None,
        prev: bytes | None,
        tokens: np.ndarray,
        unit: int,
        count: int,
        *,
        chunk_size: int,
    ) -> list[bytes]:
        """Keys of the first 1, 2, ..., ``count`` whole units (``unit`` tokens each) of
        one chunk's ``tokens``, whose prefix key is ``prev`` (None: the first chunk,
        whose prefix is the namespace's seed). ``count`` must not pass the tokens
        given; one running hash gives every key."""
        if count * unit > len(tokens):
            raise ValueError(f"{count} units of {unit} tokens is more than {len(tokens)} tokens")
        if prev is None:
            prev = self._seed(b"prefix", namespace, cache_salt, chunk_size)
        raw = _as_tokens(tokens[: count * unit]).data.cast("B")
        return chunk_keys.unit_keys(self._key, prev, raw, unit * 4, count)

    def content_keys(
        self,
        namespace: str,
        cache_salt: str | None,
        tokens: np.ndarray | Sequence[int],
        *,
        chunk_size: int,
    ) -> list[bytes]:
        """Position-independent key of each whole chunk (same tokens, same key)."""
        size = chunk_size
        arr = _as_tokens(tokens)
        seed = self._seed(b"content", namespace, cache_salt, size)
        raw = arr[: (len(arr) // size) * size].tobytes()
        step = size * 4
        digest = xxhash.xxh3_128_digest
        return [digest(seed + raw[i : i + step], self._key) for i in range(0, len(raw), step)]
