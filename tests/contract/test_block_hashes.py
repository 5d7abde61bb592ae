"""Block hashes (``contract.chunk_keys.block_hashes``): what a router computes from a
prompt, written out here step by step from docs/cluster.md, must be what the server
publishes (the server side: tests/app/test_kv_events.py, tests/cluster)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash

from connector.alignment import layout_from_groups
from connector.identity import namespace_for
from contract.chunk_keys import block_hashes, block_seed, model_of, namespace_model
from tests.connector.fakes import AttnSpec, Group


def _by_the_recipe(model: str, salt: str | None, tokens: list[int], size: int) -> list[int]:
    """docs/cluster.md "Block hashes", as a consumer in any language would write it."""
    name = model.encode()
    seed_input = b"mpcache/v1/block-hash/" + len(name).to_bytes(4, "little") + name
    seed_input += b"\x00" if salt is None else b"\x01" + salt.encode()
    seed_input += size.to_bytes(8, "little")
    prev = xxhash.xxh3_64_intdigest(seed_input)
    hashes = []
    for start in range(0, len(tokens) - size + 1, size):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + size])
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + chunk)
        hashes.append(prev)
    return hashes


@pytest.mark.parametrize(
    ("model", "salt", "size", "n"),
    [
        pytest.param("meta-llama/Llama-3.1-8B", None, 256, 1000, id="plain"),
        pytest.param("tiny", "tenant-a", 16, 70, id="salted"),
        pytest.param("m", None, 4, 3, id="shorter-than-a-chunk"),
    ],
)
def test_the_recipe_gives_the_published_hashes(
    model: str, salt: str | None, size: int, n: int
) -> None:
    tokens = [int(t) for t in np.random.default_rng(n).integers(0, 128_000, n)]
    assert block_hashes(model, salt, tokens, size) == _by_the_recipe(model, salt, tokens, size)
    assert all(0 <= h < 2**64 for h in block_hashes(model, salt, tokens, size))


def test_a_hash_names_its_whole_prefix_and_its_namespace() -> None:
    tokens = list(range(64))
    base = block_hashes("m", None, tokens, 16)
    assert block_hashes("m", None, tokens[:40], 16) == base[:2]  # a prefix's are a prefix
    changed = [*tokens[:20], 999, *tokens[21:]]
    assert block_hashes("m", None, changed, 16)[:1] == base[:1]
    assert not set(block_hashes("m", None, changed, 16)[1:]) & set(base)
    seeds = {
        block_seed("m", None, 16),
        block_seed("m", "", 16),
        block_seed("m", "s", 16),
        block_seed("n", None, 16),
        block_seed("m", None, 32),
    }
    assert len(seeds) == 5


def test_the_model_part_is_the_connectors() -> None:
    layout = layout_from_groups([Group(AttnSpec(16), ["l0"])])
    long_name = "/models/" + "x" * 300
    for model in ("meta-llama/Llama-3.1-8B", long_name, "modèle"):
        namespace = namespace_for(model, layout, 2)
        assert model_of(namespace) == namespace_model(model)
        # A router passes the model as it is: the same seed as the namespace's part.
        assert block_seed(model, None, 16) == block_seed(model_of(namespace), None, 16)
    assert namespace_model(long_name) == hashlib.sha256(long_name.encode()).hexdigest()[:32]
    assert model_of("no-at-sign") == "no-at-sign"
