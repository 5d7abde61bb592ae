"""Scattered block copies with streaming stores: a small C kernel, built on first use.

numpy copies a vLLM block (32 KiB for a Llama-3-8B-like layer) with one cached
``memmove``: every destination line is read before it is written, so scattered
blocks move well below a large streaming copy's rate, and glibc streams only copies
far larger than a block (``dataplane.streaming``). ``blockcopy.c`` copies a list of
blocks with SSE2 streaming stores and prefetches the next block's first lines,
which beats a ``memcpy`` per block (bench/dataplane_bench.py measures both through
the server).

``load`` loads the kernel with ctypes (which releases the GIL for the call), built
by ``contract.kernels`` (compiled once, cached; a kernel built ahead needs no
compiler). Without x86-64, or with neither a built kernel nor a compiler, it raises
``KernelUnavailable`` with the reason and the copies stay with numpy; the server's
startup log says which.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.kernels import KernelUnavailable, build, kernel_dir

__all__ = ["BlockCopier", "KernelUnavailable", "kernel_dir", "load"]

SOURCE = Path(__file__).with_name("blockcopy.c")


@dataclass(frozen=True)
class BlockCopier:
    """The loaded kernel: ``copy(src, dst, nbytes)`` copies block ``i`` of
    ``nbytes`` from address ``src[i]`` to ``dst[i]`` (int64 arrays)."""

    path: Path
    _fn: Callable[[int, int, int, int], None]

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
        if src.dtype != np.int64 or dst.dtype != np.int64 or src.shape != dst.shape:
            raise ValueError("src and dst are int64 address arrays of one shape")
        src = np.ascontiguousarray(src)
        dst = np.ascontiguousarray(dst)
        self._fn(src.ctypes.data, dst.ctypes.data, src.size, nbytes)


def load() -> BlockCopier:
    """The kernel, compiled first if this source has not been yet
    (``KernelUnavailable`` says why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name != "posix":
        raise KernelUnavailable(f"streaming block copies need x86-64, not {platform.machine()}")
    target = build(SOURCE)
    try:
        fn = ctypes.CDLL(str(target)).mpcache_copy_blocks
    except (OSError, AttributeError) as exc:
        raise KernelUnavailable(f"cannot load {target}: {exc}") from exc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    return BlockCopier(target, fn)
