"""The connector's native token packing: the bytes struct packs, or struct itself.

vLLM hands the connector its prompts as Python lists (``Request.all_token_ids``, a
read-only ``ConstantList``); whichever packer the connector loaded, the server must
receive exactly ``contract.tokens.pack_tokens`` of the same ids, and an id struct
refuses must still be refused.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from connector import tokenpack
from connector.tokenpack import NATIVE_MIN_TOKENS, TokenPacker
from contract.tokens import TokenEncoder, pack_tokens


class _ReadOnly(Sequence[int]):
    """What vLLM's ConstantList offers: len, index, slice (a list), iteration."""

    def __init__(self, tokens: list[Any]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: Any) -> Any:
        return self._tokens[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._tokens)


@pytest.fixture(scope="module")
def native() -> TokenPacker:
    """The native packer; skips without a C compiler (fails under CI, whose machines
    have one: a kernel that stopped building must not go unseen)."""
    packer = tokenpack.load()
    if packer.kernel is None:
        if os.environ.get("CI"):
            pytest.fail(f"the token kernel is unavailable: {packer.reason}", pytrace=False)
        pytest.skip(f"the token kernel is unavailable: {packer.reason}")
    return packer


@pytest.fixture(params=["direct", "iterator"])
def packer(native: TokenPacker, request: pytest.FixtureRequest) -> TokenPacker:
    """The native packer in each of its two ways of reading ids (the direct one only
    where this CPython's layout is the one the kernel reads)."""
    if request.param == "iterator":
        return dataclasses.replace(native, direct=False)
    if not native.direct:
        pytest.skip(f"the kernel reads ids through the iterator here: {native.reason}")
    return native


def test_the_kernel_reads_lists_in_place_on_cpython_3_10_and_3_11(native: TokenPacker) -> None:
    """The figures the README quotes are the direct path's: it must be the one
    loaded where CI runs (CPython 3.11, 64-bit)."""
    expected = sys.version_info[:2] in ((3, 10), (3, 11)) and not hasattr(sys, "gettotalrefcount")
    assert native.direct is expected, native.reason
    assert native.mode == ("native, direct" if expected else f"native, iterator ({native.reason})")


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 2**31 - 1, size=n)]


@pytest.mark.parametrize("wrap", [list, tuple, _ReadOnly], ids=["list", "tuple", "constant-list"])
@pytest.mark.parametrize(
    ("start", "end"),
    [(0, 4096), (0, 4095), (100, 4096), (0, NATIVE_MIN_TOKENS), (4000, 4096), (0, 1), (5, 5)],
)
def test_native_packing_is_the_bytes_struct_packs(
    packer: TokenPacker, wrap: Any, start: int, end: int
) -> None:
    tokens = _prompt(4096)  # about half of them past 2**30: two digits in CPython
    tokens[:3] = [0, 2**31 - 1, 255]  # the range's edges
    tokens[100:104] = [2**30 - 1, 2**30, 2**30 + 1, 1]  # one digit and two
    assert packer(wrap(tokens), start, end) == pack_tokens(tokens[start:end])


class _Id(int):
    """An int subclass: struct packs it; the direct path leaves it to struct."""


@pytest.mark.parametrize(
    "bad",
    [-1, 2**31, 2**31 + 2**30, 2**40, -(2**40), True, np.int64(7), np.int32(-5), _Id(9)],
    ids=[
        "negative",
        "past-int32",
        "past-int32-low-digit",
        "huge",
        "huge-negative",
        "bool",
        "np.int64",
        "np.int32-neg",
        "int-subclass",
    ],
)
def test_an_id_the_kernel_does_not_pack_goes_to_struct(packer: TokenPacker, bad: Any) -> None:
    """Packed as struct packs it, or refused as struct refuses it, anywhere in a range."""
    for at in (0, 70, 199):
        tokens: list[Any] = _prompt(200, seed=at)
        tokens[at] = bad
        try:
            expected: bytes | type[Exception] = pack_tokens(tokens)
        except struct.error:
            expected = struct.error
        if isinstance(expected, bytes):
            assert packer(tokens, 0, 200) == expected
            assert packer(_ReadOnly(tokens), 0, 200) == expected
        else:
            with pytest.raises(struct.error):
                packer(tokens, 0, 200)


@pytest.mark.parametrize("bad", [1.5, "7", None], ids=["float", "str", "none"])
def test_a_value_that_is_not_an_id_is_refused_as_struct_refuses_it(
    packer: TokenPacker, bad: Any
) -> None:
    tokens: list[Any] = _prompt(300)
    tokens[150] = bad
    with pytest.raises(struct.error):
        packer(tokens, 0, 300)
    with pytest.raises(struct.error):
        packer(_ReadOnly(tokens), 0, 300)


def test_a_range_past_the_end_packs_what_is_there_as_struct_does(packer: TokenPacker) -> None:
    tokens = _prompt(100)
    assert packer(_ReadOnly(tokens), 0, 200) == pack_tokens(tokens) == packer(tokens, 0, 100)
    assert packer(tokens, 90, 200) == pack_tokens(tokens[90:])


def test_packing_leaves_every_reference_count_as_it_was(packer: TokenPacker) -> None:
    """The iterator path takes and drops a reference per id, the direct one none:
    none may leak or go missing, nor the list's or its iterator's."""
    big = 2**30 + 12345  # one shared object, not a cached small int
    tokens = [big] * 1000
    view = _ReadOnly(tokens)
    before = sys.getrefcount(big), sys.getrefcount(tokens), sys.getrefcount(view)
    for _ in range(50):
        packer(tokens, 0, 1000)
        packer(view, 10, 1000)
    refused: list[Any] = [big] * 500 + [-1] + [big] * 499
    packer(refused, 0, 1000)  # the kernel stops at the negative id; struct finishes
    del refused
    assert (sys.getrefcount(big), sys.getrefcount(tokens), sys.getrefcount(view)) == before


def test_an_encoder_with_the_native_packer_grows_as_with_struct(packer: TokenPacker) -> None:
    """A prompt packed at once, then a decode step's tokens one by one, as the
    scheduler packs a lookup and then its stores."""
    tokens = _prompt(3000)
    fast, slow = TokenEncoder(packer), TokenEncoder()
    view = _ReadOnly(tokens)
    assert fast.packed(view, 2048) == slow.packed(view, 2048)
    for _ in range(20):
        tokens.append(len(tokens) % 50000)
        assert fast.packed(view, len(tokens)) == slow.packed(view, len(tokens))
    assert fast.packed(view, 100) == pack_tokens(tokens[:100])


def test_without_a_compiler_packing_is_struct_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler-mpcache")
    packer = tokenpack.load()
    assert packer.kernel is None
    assert "no-such-compiler-mpcache" in packer.reason
    tokens = _prompt(5000)
    assert packer(_ReadOnly(tokens), 0, 5000) == pack_tokens(tokens)


def test_a_kernel_that_packs_other_bytes_is_not_used(
    native: TokenPacker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked at load against struct: a kernel built for another interpreter would
    otherwise make every lookup miss without a word."""

    def other_bytes(tokens: Sequence[int], start: int, end: int) -> bytes:
        return b"\0" * (4 * (end - start))

    monkeypatch.setattr(tokenpack, "pack_range", other_bytes)
    packer = tokenpack.load()
    assert packer.kernel is None
    assert "other bytes" in packer.reason
