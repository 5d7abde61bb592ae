"""The server process keeps the memory it frees, and its startup objects out of the
garbage collector's walks, so a hot route neither faults the same pages in on every
call nor waits on a full collection.

``keep_freed_memory`` tunes glibc's ``mallopt`` thresholds (``bench/lookup_heap_bench.py``
measures a burst lookup's page faults both ways); ``freeze_startup_objects`` freezes
what the imports and the runtime leave alive (``bench/gc_pause_bench.py`` measures
a full collection both ways). Where the C library is not glibc the first does
nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging

from dataplane import libc

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "freeze_startup_objects",
    "keep_freed_memory",
    "unfreeze_objects",
]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 16 << 20
"""Blocks this large or larger are mapped on their own (and unmapped when freed)."""

TRIM_THRESHOLD_BYTES = 64 << 20
"""Free memory at the top of the heap is given back past this much."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False where that is not possible.

    A binary lookup of a burst of 64 new 4k-token requests moves a 1 MiB body:
    uvicorn, h11 and the frame reader each buffer pieces of it, and the token copies
    follow. With glibc's defaults, a freed block above the mmap threshold goes back
    to the OS at once, and so does the free top of the heap past the trim
    threshold: the next call maps and faults the same pages in again. Both
    thresholds are raised here (fixing them also stops glibc's dynamic threshold
    from moving): blocks under ``MMAP_THRESHOLD_BYTES`` come from the heap, and up
    to ``TRIM_THRESHOLD_BYTES`` of free heap stay mapped for the next call. That
    bounds what the server holds beyond its live data, next to a cache pool of
    gigabytes.
    """
    mallopt = libc.function("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)
    if mallopt is None or libc.function("gnu_get_libc_version", ctypes.c_char_p) is None:
        logger.debug("not glibc: the heap keeps the C library's defaults")
        return False
    done: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    if not done:
        logger.warning("glibc refused the heap thresholds; freed memory goes back at once")
    return done


def freeze_startup_objects() -> int:
    """Keep every object alive now out of later collections; returns how many are
    frozen.

    The server's imports (torch, numpy, FastAPI, pydantic) and its runtime leave
    several hundred thousand objects alive for the life of the process, and every
    full collection walks all of them again, holding the event loop (one such
    collection inside a burst lookup is what this prevents). Once started, the
    server freezes every object alive (``gc.freeze``): later collections walk only
    what was made since. The young generations are collected first (a full
    collection would cost the walk this saves). ``unfreeze_objects`` hands them back
    when the server stops, so an app run in a host's process (a test client) leaves
    nothing frozen behind."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_objects() -> None:
    """Hand the frozen objects back to the collector (when the server stops)."""
    gc.unfreeze()
