"""Populating a mapping's page tables before its first copies (``MADV_POPULATE_WRITE``).

A fresh mapping of shared memory has no page-table entries: the first write to each
4 KiB page through it takes a fault on top of the copy (a 14.7 MB scattered copy into
a fresh memfd mapping: 3,584 faults, about 5x the time of the same copy into a
populated one; ``bench/prefault_bench.py``). The server populates the pool and
every worker memfd it maps once, in a background thread, in steps it can stop
between. The pages' contents are untouched; on kernels before 5.14 the call is
refused and first touches fault the pages instead.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from dataplane import libc

__all__ = ["Prefaulter", "populate"]

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python's mmap module
STEP_BYTES = 64 << 20
"""How much one call populates; ``stop`` is checked between calls."""

_JOIN_TIMEOUT_S = 5.0


def _madvise() -> Any:
    return libc.function("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def populate(address: int, size: int, stop: threading.Event | None = None) -> bool:
    """Populate ``[address, address + size)`` writable, in steps; True when all of it was.

    Stops early when ``stop`` is set, or when the kernel refuses (old kernel, no
    libc). The caller keeps the range mapped meanwhile. libc releases the GIL.
    """
    madvise = _madvise()
    if madvise is None:
        return False
    for start in range(0, size, STEP_BYTES):
        if stop is not None and stop.is_set():
            return False
        length = min(STEP_BYTES, size - start)
        if madvise(address + start, length, MADV_POPULATE_WRITE) != 0:
            return False
    return True


class Prefaulter:
    """One background thread that populates a list of ranges (``populate``).

    ``keep`` is held until the thread ends, so what owns the ranges' mappings cannot
    unmap them under it; ``stop`` ends it between steps and waits for it.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, ranges: Sequence[tuple[int, int]], keep: object) -> None:
        """Start populating ``(address, size)`` ranges (once; later calls do nothing)."""
        if self._thread is not None or self._stop.is_set():
            return

        def run(_kept: object) -> None:
            for address, size in ranges:
                if not populate(address, size, self._stop):
                    return

        self._thread = threading.Thread(target=run, args=(keep,), name=self._name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop between steps and wait for the thread (idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)
