"""Streaming (non-temporal) stores for the server's long copies, through glibc.

A copy that goes through the cache reads every destination line before writing it
(read-for-ownership): three memory transfers per byte instead of two. glibc's
``memcpy``/``memmove`` switch to non-temporal stores, which skip that read, only
above ``TUNABLE``, which it derives from the cache size it detects: on VMs whose
hypervisor reports a large shared cache, hundreds of MiB, so no copy of the server
ever streamed. ``THRESHOLD_BYTES`` says why we lower it.

glibc reads tunables once, at process start, so ``mpcache server`` re-executes
itself with the tunable added to ``GLIBC_TUNABLES`` (``environment``) before it
starts anything. A ``GLIBC_TUNABLES`` that already names the tunable is left alone
(set it to ``0xc000000``, say, to keep glibc's choice); plain ``uvicorn app.main:app``
needs the variable set by whoever starts it. Only x86-64 glibc has the tunable.
This module imports nothing heavy: the CLI uses it before torch is loaded.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

__all__ = ["THRESHOLD_BYTES", "TUNABLE", "describe", "environment"]

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
THRESHOLD_BYTES = 256 << 10
"""Copies from this size stream. numpy moves every contiguous run of blocks with one
``memmove``, so a run of vLLM blocks (a chunk's 16 blocks of 32 KiB are 512 KiB per
K or V of a layer) streams, and runs moved faster so; a single scattered block
(32 KiB) moved slower streamed, so it stays below. bench/dataplane_bench.py
measures the copies through the server."""


def _applies() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and platform.libc_ver()[0] == "glibc"


def _current(environ: Mapping[str, str]) -> str | None:
    for part in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = part.partition("=")
        if name == TUNABLE:
            return value
    return None


def environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with the tunable added, or None when there is nothing to add."""
    if not _applies() or _current(environ) is not None:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    ours = f"{TUNABLE}={THRESHOLD_BYTES:#x}"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


def describe(environ: Mapping[str, str]) -> str:
    """One line for the startup log: are long copies streamed, from which size."""
    if not _applies():
        return "streaming copies: glibc's own (not x86-64 glibc)"
    value = _current(environ)
    if value is None:
        return f"streaming copies: glibc's default threshold (set GLIBC_TUNABLES={TUNABLE}=...)"
    try:
        size = f"{int(value, 0) >> 10} KiB"
    except ValueError:
        size = repr(value)
    return f"streaming copies from {size} ({TUNABLE})"
