"""Packing vLLM's token lists for the wire: a small C kernel, with struct as fallback.

Packing is most of the connector's own work in a lookup: a burst of 64 new
4k-token prompts is 262k Python ints to turn into int32 (``contract.tokens``).
``struct.pack(*tokens[a:b])`` walks them three times (slice, argument tuple,
packing); ``tokenpack.c`` walks them once, through the iterator protocol: on the
2-core development VM it packs such a burst in 0.73-0.75 of struct's time
(``bench/token_pack_bench.py``; the same bytes, ``tests/connector/test_tokenpack.py``).

``load`` builds the kernel with ``contract.kernels`` (compiled once per source,
cached) and returns a ``TokenPacker``: native where the kernel loads, else struct
only, with the reason. Either packs exactly what ``contract.tokens.pack_tokens``
packs and refuses what it refuses: any range the kernel does not finish (an id
that is negative, past int32, or not an int) is packed by struct instead. The
kernel runs with the GIL held (``ctypes.PyDLL``): it calls into the interpreter.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.kernels import KernelUnavailable, build
from contract.tokens import pack_range

__all__ = ["NATIVE_MIN_TOKENS", "TokenPacker", "load"]

SOURCE = Path(__file__).with_name("tokenpack.c")

NATIVE_MIN_TOKENS = 64
"""Ranges shorter than this (a decode step's new tokens) go through struct: the
kernel's call costs more than it saves there. The kernel also skips the ids before
a range one by one, so it takes only ranges at least as long as that prefix."""

_Kernel = Callable[[Sequence[int], int, int, bytearray], int]


@dataclass(frozen=True)
class TokenPacker:
    """``packer(tokens, start, end)``: ids ``tokens[start:end]`` as little-endian
    int32 bytes, as ``contract.tokens.pack_range``."""

    kernel: Path | None
    """The loaded kernel's library; None where packing is struct only."""
    reason: str
    """Why the kernel is off ("" when it is on)."""
    _fn: _Kernel | None = None

    def __call__(self, tokens: Sequence[int], start: int, end: int) -> bytes:
        n = end - start
        fn = self._fn
        if fn is not None and n >= NATIVE_MIN_TOKENS and n >= start:
            out = bytearray(4 * n)
            if fn(tokens, start, n, out) == n:
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
    fn.argtypes = [ctypes.py_object, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.py_object]
    fn.restype = ctypes.c_ssize_t
    packer = TokenPacker(target, "", fn)
    # A kernel that loads but packs other bytes (an interpreter it was not meant
    # for) would make every lookup miss, silently: it must pack this first.
    probe = [0, 1, 255, 256, 65535, 2**30 - 1, 2**30, 2**31 - 1] * NATIVE_MIN_TOKENS
    try:
        agrees = packer(probe, 0, len(probe)) == pack_range(probe, 0, len(probe))
    except Exception as exc:  # any failure means: not this kernel
        return TokenPacker(None, f"the token kernel failed its check: {exc!r}")
    if not agrees:
        return TokenPacker(None, "the token kernel packed other bytes than struct")
    return packer
