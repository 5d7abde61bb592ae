"""Packing vLLM's token lists for the wire: a small C kernel, with struct as fallback.

Packing is most of the connector's own work in a lookup: a burst of 64 new
4k-token prompts is 262k Python ints to turn into int32 (``contract.tokens``).
``struct.pack(*tokens[a:b])`` walks them three times (slice, argument tuple,
packing); ``tokenpack.c`` walks them once. On CPython 3.10 and 3.11 (64-bit,
release builds) it reads a list's items and each int's digits in place
("direct"), which vLLM's ``ConstantList`` allows too since it iterates its list;
elsewhere it goes through the iterator protocol, one C API call per id.
``bench/token_pack_bench.py`` measures both ways against struct; either way the
bytes are struct's (``tests/connector/test_tokenpack.py``).

``load`` builds the kernel with ``contract.kernels`` (compiled once per source,
cached) and returns a ``TokenPacker``: native where the kernel loads and packs a
probe prompt as struct does, else struct only, with the reason. Either packs
exactly what ``contract.tokens.pack_tokens`` packs and refuses what it refuses:
any range the kernel does not finish (an id that is negative, past int32, or not
an int) is packed by struct instead. The kernel runs with the GIL held
(``ctypes.PyDLL``): it reads the interpreter's objects.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.kernels import KernelUnavailable, build
from contract.tokens import pack_range

__all__ = ["NATIVE_MIN_TOKENS", "TokenPacker", "load"]

SOURCE = Path(__file__).with_name("tokenpack.c")

NATIVE_MIN_TOKENS = 64
"""Ranges shorter than this (a decode step's new tokens) go through struct: the
kernel's call costs more than it saves there. The kernel also skips the ids before
a range one by one, so it takes only ranges at least as long as that prefix."""

_Kernel = Callable[[Sequence[int], int, int, bytearray, int], int]


def _direct_layout() -> str:
    """Why the kernel may not read lists and ints in place here ("" when it may):
    ``tokenpack.c`` spells out CPython 3.10/3.11's 64-bit release layouts."""
    if sys.version_info[:2] not in ((3, 10), (3, 11)):
        return f"CPython {sys.version_info[0]}.{sys.version_info[1]} lays out ints otherwise"
    if hasattr(sys, "gettotalrefcount"):
        return "a debug build of CPython lays out objects otherwise"
    digits = (sys.int_info.bits_per_digit, sys.int_info.sizeof_digit)
    if struct.calcsize("P") != 8 or digits != (30, 4):
        return "this CPython's ints are not 30-bit digits on 64-bit"
    return ""


@dataclass(frozen=True)
class TokenPacker:
    """``packer(tokens, start, end)``: ids ``tokens[start:end]`` as little-endian
    int32 bytes, as ``contract.tokens.pack_range``."""

    kernel: Path | None
    """The loaded kernel's library; None where packing is struct only."""
    reason: str
    """Why the kernel is off, or why it is not direct ("" when direct)."""
    _fn: _Kernel | None = None
    direct: bool = False
    """The kernel reads lists and ints in place (else through the iterator protocol)."""

    @property
    def mode(self) -> str:
        """How ids are packed, for the connector's startup log line."""
        if self._fn is None:
            return f"struct ({self.reason})"
        return "native, direct" if self.direct else f"native, iterator ({self.reason})"

    def __call__(self, tokens: Sequence[int], start: int, end: int) -> bytes:
        n = end - start
        fn = self._fn
        if fn is not None and n >= NATIVE_MIN_TOKENS and n >= start:
            out = bytearray(4 * n)
            if fn(tokens, start, n, out, self.direct) == n:
                return bytes(out)
        return pack_range(tokens, start, end)


def load() -> TokenPacker:
    """The native packer, or struct only with the reason (never raises)."""
    if sys.implementation.name != "cpython":
        return TokenPacker(
            None, f"the kernel calls CPython's C API; this is {sys.implementation.name}"
        )
    try:
        target = build(SOURCE)
        fn = ctypes.PyDLL(str(target)).mpcache_pack_tokens
    except KernelUnavailable as exc:
        return TokenPacker(None, str(exc))
    except (OSError, AttributeError) as exc:
        return TokenPacker(None, f"cannot load the token kernel: {exc}")
    fn.argtypes = [
        ctypes.py_object,
        ctypes.c_ssize_t,
        ctypes.c_ssize_t,
        ctypes.py_object,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_ssize_t
    layout = _direct_layout()
    packer = TokenPacker(target, layout, fn, direct=not layout)
    # A kernel that loads but packs other bytes (an interpreter it was not meant
    # for) would make every lookup miss, silently: it must pack this first, from a
    # list and through a view of one (the direct path's two ways in), and from a
    # tuple (the iterator's). Ints made afresh, as a tokenizer's are (CPython shares
    # only those up to 256).
    values = [0, 1, 255, 256, 65535, 2**30 - 1, 2**30, 2**31 - 1, 123456789]
    probe = [int(str(v)) for v in values * NATIVE_MIN_TOKENS]
    expected = pack_range(probe, 0, len(probe))
    try:
        agrees = all(
            packer(form, 0, len(probe)) == expected
            for form in (probe, _ListView(probe), tuple(probe))
        )
    except Exception as exc:  # any failure means: not this kernel
        return TokenPacker(None, f"the token kernel failed its check: {exc!r}")
    if not agrees:
        return TokenPacker(None, "the token kernel packed other bytes than struct")
    return packer


class _ListView(Sequence[int]):
    """A read-only view iterating its list, as vLLM's ``ConstantList`` (the probe)."""

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: Any) -> Any:
        return self._tokens[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)
