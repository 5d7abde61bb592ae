"""How many of the host's cores no runnable thread wants, right now.

The copy pool asks before each chunk (``dataplane.transfer.CopyPool``) and wakes a
helper thread only for a core that is idle. The server's copy-thread count is
measured at start, on a host vLLM is not using yet; in service vLLM's worker and
engine-core processes each keep a core busy (they spin while they wait for each
other), and a CPU engine's forward pass takes the rest. A helper woken then takes a
core from vLLM's step, and the chunk's copy is no faster for it: on a quiet host
helpers speed a copy up, beside a busy engine they slow both down.

Linux counts runnable threads host-wide in ``/proc/loadavg``'s fourth field
(``running/total``); elsewhere the probe answers ``None`` and every helper is used.
"""

from __future__ import annotations

import os

__all__ = ["IdleCores", "idle_cores"]

LOADAVG = "/proc/loadavg"


def idle_cores(loadavg: bytes, cores: int) -> int | None:
    """``cores`` less the runnable threads ``loadavg`` counts (the caller, which is
    running, among them), at least 0; ``None`` when the text is not /proc/loadavg's."""
    fields = loadavg.split()
    if len(fields) < 4 or b"/" not in fields[3]:
        return None
    running = fields[3].split(b"/", 1)[0]
    if not running.isdigit():
        return None
    return max(0, cores - int(running))


class IdleCores:
    """The probe: ``/proc/loadavg`` held open and read again at offset 0 on each
    call (a few microseconds; the kernel regenerates the text on every read).
    ``close`` releases it."""

    def __init__(self, path: str = LOADAVG, cores: int | None = None) -> None:
        # Runnable threads are counted host-wide, so they are set against every
        # online core, not only those this process may run on.
        self.cores = cores or os.cpu_count() or 1
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def __call__(self) -> int | None:
        """Idle cores now; ``None`` when they cannot be known."""
        if self._fd is None:
            return None
        try:
            text = os.pread(self._fd, 128, 0)
        except OSError:
            return None
        return idle_cores(text, self.cores)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
