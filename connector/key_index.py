"""The server's key index, mapped read-only: lookups answered on vLLM's thread.

``KeyIndexReader.open`` asks the server where its index is (``GET
/cache/key-index``), maps that segment read-only (mode 0600: this works only on the
server's host, as the server's user) and checks it is the same server process.
``hit_tokens`` then computes a prompt's chunk and unit keys itself
(``contract.chunk_keys``, with the secret the index's header carries) and probes the
index (``contract.key_index``): microseconds, no call. The index is advisory: a hit
it shows may be evicted before the load (which then fails, and vLLM recomputes), and
where it is not authoritative (an L2 tier) a miss is asked of the server as before.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from connector.client import ControlClient
from contract import chunk_keys
from contract.kernels import KernelUnavailable
from contract.key_index import MAX_RANKS, IndexView
from contract.keychain import KeyChain, load
from contract.shm_naming import INDEX_PREFIX, SHM_DIR

__all__ = ["KeyIndexReader"]


def _chain() -> KeyChain | None:
    """The C loop for chunk keys (``contract.keychain``); None: hash in Python."""
    try:
        return load()
    except KernelUnavailable:
        return None


_SEEDS_KEPT = 1024


class KeyIndexReader:
    """One server's key index for one namespace and chunk size (use ``open``)."""

    def __init__(
        self,
        mapping: mmap.mmap,
        *,
        namespace: str,
        chunk_size: int,
        world_size: int,
        chain: KeyChain | None = None,
    ) -> None:
        self._mapping = mapping
        self._chain = chain  # the C loop for chunk keys, or None: the Python one
        self._memory = memoryview(mapping)
        self._view = IndexView(self._memory)
        self.boot_id = self._view.header.boot_id
        self._secret = self._view.header.secret
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._world_size = world_size
        self._seeds: dict[str | None, bytes] = {}

    @classmethod
    def open(
        cls,
        client: ControlClient,
        *,
        namespace: str,
        chunk_size: int,
        world_size: int,
        boot_id: str | None,
    ) -> KeyIndexReader:
        """Map ``client``'s server's index; ``ValueError`` or ``OSError`` says why not
        (connector errors too: no index on that server, or it cannot be reached)."""
        if world_size > MAX_RANKS:
            raise ValueError(f"the key index names at most {MAX_RANKS} ranks")
        info = client.key_index()
        name = info.segment
        if "/" in name or not name.startswith(INDEX_PREFIX):
            raise ValueError(f"not a key-index segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            reader = cls(
                mapping,
                namespace=namespace,
                chunk_size=chunk_size,
                world_size=world_size,
                chain=_chain(),
            )
            if reader.boot_id != info.boot_id or (boot_id is not None and boot_id != info.boot_id):
                raise ValueError("the key index belongs to another server process")
        except BaseException:
            mapping.close()
            raise
        return reader

    @property
    def authoritative(self) -> bool:
        """A miss in the index is a miss on the server."""
        return self._view.authoritative

    def hit_tokens(
        self, packed: bytes, num_tokens: int, cache_salt: str | None, unit: int | None
    ) -> int:
        """Leading tokens of ``packed`` (int32 ids, ``num_tokens`` of them) the index
        holds for every rank: whole chunks, then whole units (``unit``) of the next."""
        size, view = self._chunk_size, self._view
        raw = memoryview(packed)
        prev = self._seed(cache_salt)
        chunks = num_tokens // size
        if self._chain is not None:
            ids = np.frombuffer(packed, dtype="<i4", count=num_tokens)
            keys = self._chain.keys(prev, ids, size * 4, 0, chunks, self._secret)
        else:
            keys = chunk_keys.chain_keys(self._secret, prev, raw, size * 4, 0, chunks)
        hits = view.leading(keys, self._world_size)
        tokens = hits * size
        if unit is None or unit >= size:
            return tokens
        count = min(size // unit - 1, (num_tokens - tokens) // unit)
        if count <= 0:
            return tokens
        prev = keys[hits - 1] if hits else prev
        start = tokens * 4
        units = chunk_keys.unit_keys(
            self._secret, prev, raw[start : start + count * unit * 4], unit * 4, count
        )
        # Held unit keys are a leading run: the longest held is the answer.
        for j in range(count, 0, -1):
            if view.holds(units[j - 1], (1 << self._world_size) - 1):
                return tokens + j * unit
        return tokens

    def _seed(self, cache_salt: str | None) -> bytes:
        seed = self._seeds.get(cache_salt)
        if seed is None:
            if len(self._seeds) >= _SEEDS_KEPT:
                self._seeds.clear()
            seed = chunk_keys.namespace_seed(
                self._secret, b"prefix", self._namespace, cache_salt, self._chunk_size
            )
            self._seeds[cache_salt] = seed
        return seed

    def close(self) -> None:
        """Unmap the index (on the thread that probes it: a probe after this raises)."""
        self._view.release()
        self._memory.release()
        self._mapping.close()
