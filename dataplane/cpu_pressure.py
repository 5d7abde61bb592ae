"""Whether threads on this host have been waiting for a core: the copy pool asks
before each chunk (``dataplane.transfer.CopyPool``) and wakes its helper threads
only when none has.

The server's copy-thread count is measured at start, on a host vLLM is not using
yet. In service, vLLM's worker and engine-core processes keep cores busy (they spin
while they wait for each other) and a CPU engine's forward pass takes the rest; a
helper woken then takes a core from vLLM's step, and the chunk's copy is no faster
for it. Linux's pressure stall information says when this happens:
``/proc/pressure/cpu``'s ``some total=`` counts the microseconds in which at least
one runnable thread waited for a core. Its growth since the previous chunk, as a
share of the time between them, is the signal: near 0 on a quiet host (a thread
that runs for a moment, say a client about to block on its reply, makes no one
wait), most of the time beside a busy engine. Where the file is missing (no PSI)
the answer is "unknown" and every helper is used.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["BUSY_SHARE", "CpuPressure", "stalled_us"]

PRESSURE = "/proc/pressure/cpu"

BUSY_SHARE = 0.1
"""A host whose threads waited for a core this share of the time since the previous
chunk is busy: the chunk gets no helper."""


def stalled_us(pressure: bytes) -> int | None:
    """The ``some total=`` microseconds in ``pressure`` (/proc/pressure/cpu's text);
    None when it has none."""
    for line in pressure.splitlines():
        fields = line.split()
        if fields[:1] != [b"some"]:
            continue
        for field in fields[1:]:
            name, _, value = field.partition(b"=")
            if name == b"total" and value.isdigit():
                return int(value)
    return None


class CpuPressure:
    """The probe: ``/proc/pressure/cpu`` held open and read again at offset 0 on each
    call (about 2 us; the kernel regenerates the text on every read). Safe to call
    from several threads; ``close`` releases the file."""

    def __init__(
        self, path: str = PRESSURE, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def busy(self) -> bool | None:
        """Whether threads waited for a core at least ``BUSY_SHARE`` of the time since
        the previous call; None when that cannot be known (no PSI, or the first call)."""
        with self._lock:
            if self._fd is None:
                return None
            try:
                stalled = stalled_us(os.pread(self._fd, 256, 0))
            except OSError:  # PSI compiled in but turned off: EOPNOTSUPP
                stalled = None
            if stalled is None:
                return None
            now, last = self._clock(), self._last
            self._last = (now, stalled)
            if last is None or now <= last[0]:
                return None
            return (stalled - last[1]) / 1e6 >= BUSY_SHARE * (now - last[0])

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
