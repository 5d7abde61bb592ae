"""The C library, through ctypes, for the few calls the ``os`` module lacks.

Loaded once per process. ``function`` hands each caller its own function pointer,
so the argument types one module declares never change another's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["function"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        # find_library may answer None (no ldconfig cache): the process's own
        # symbols, which include libc on Linux, then.
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def function(name: str, restype: Any, *argtypes: Any) -> Any:
    """libc's ``name`` with these types (errno kept for ``ctypes.get_errno``), or
    None where this C library has no such function."""
    lib = _library()
    if lib is None:
        return None
    try:
        fn = lib[name]
    except AttributeError:
        return None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn
