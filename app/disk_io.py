"""Block-aligned chunk-file I/O for the disk tier (``app.disk_tier``).

Every offset, length and buffer is a multiple of ``BLOCK_BYTES``, so a file may be
opened ``O_DIRECT`` (no page cache, DMA straight from or into the pool's pages)
where the filesystem allows it (``probe_direct``: tmpfs, for one, refuses it); else
the same calls run buffered. Payloads move straight between the file and the
pool's memory (aligned: pool entries start on a page); only a payload's last
partial block goes through a small aligned scratch buffer. Writes go to a temporary
name, renamed over the final one when complete, so a reader (or a restart) never
sees a half-written file under a chunk's name.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from app.disk_codec import BLOCK_BYTES, HEADER_BYTES

__all__ = ["TEMP_SUFFIX", "ChunkFiles", "probe_direct"]

TEMP_SUFFIX = ".tmp"
_DIRECT = getattr(os, "O_DIRECT", 0)
_Vectored = Callable[[int, Sequence[memoryview], int], int]


def probe_direct(directory: Path) -> str | None:
    """None if files in ``directory`` can be written and read ``O_DIRECT``, else why not."""
    if not _DIRECT:
        return "this platform has no O_DIRECT"
    path = directory / f".probe-{os.getpid()}{TEMP_SUFFIX}"
    buf = mmap.mmap(-1, BLOCK_BYTES)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _DIRECT, 0o600)
        try:
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"the filesystem refuses O_DIRECT ({os.strerror(exc.errno or errno.EINVAL)})"
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return None


def _aligned(array: np.ndarray) -> bool:
    return int(array.ctypes.data) % BLOCK_BYTES == 0


def _whole(op: _Vectored, fd: int, bufs: list[memoryview], offset: int) -> int:
    """Run ``os.preadv``/``os.pwritev`` until every buffer is done (or end of file);
    the bytes moved."""
    total = 0
    while bufs:
        done = op(fd, bufs, offset)
        if done == 0:
            return total
        total += done
        offset += done
        while bufs and done >= len(bufs[0]):
            done -= len(bufs[0])
            bufs.pop(0)
        if bufs and done:
            bufs[0] = bufs[0][done:]
    return total


class ChunkFiles:
    """Reads and writes whole chunk files under one directory; thread-safe (each
    thread has its own scratch blocks)."""

    def __init__(self, directory: Path, *, direct: bool) -> None:
        self.directory = directory
        self.direct = direct
        self._scratch = threading.local()

    def _blocks(self) -> tuple[memoryview, memoryview]:
        """This thread's header block and tail block (page-aligned, anonymous)."""
        blocks: tuple[memoryview, memoryview] | None = getattr(self._scratch, "blocks", None)
        if blocks is None:
            buf = mmap.mmap(-1, HEADER_BYTES + BLOCK_BYTES)
            view = memoryview(buf)
            blocks = (view[:HEADER_BYTES], view[HEADER_BYTES:])
            self._scratch.blocks = blocks
        return blocks

    def _flags(self, payload: np.ndarray) -> int:
        return _DIRECT if self.direct and _aligned(payload) else 0

    def write(self, name: str, header: bytes | bytearray, payload: np.ndarray) -> int:
        """Write a chunk file (``header``: its header block; ``payload``: uint8, in
        the pool) under a temporary name, then rename it to ``name``; the file's size."""
        head, tail = self._blocks()
        head[:] = header
        data = payload.data
        whole = len(data) // BLOCK_BYTES * BLOCK_BYTES
        bufs = [head, data[:whole]] if whole else [head]
        rest = len(data) - whole
        if rest:
            tail[:rest] = data[whole:]
            tail[rest:] = bytes(BLOCK_BYTES - rest)
            bufs.append(tail)
        size = sum(len(b) for b in bufs)
        path = self.directory / name
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f".{path.name}.{threading.get_ident()}{TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(payload), 0o600)
        try:
            try:
                written = _whole(os.pwritev, fd, bufs, 0)
            finally:
                os.close(fd)
            if written != size:
                raise OSError(errno.EIO, f"short write of {temp}: {written} of {size} bytes")
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)  # ENOSPC, EIO, a short write: no stray file
            raise
        return size

    def read_header(self, name: str) -> memoryview:
        """The header block of a file (this thread's scratch: use it before the next
        call); shorter if the file is."""
        head, _ = self._blocks()
        fd = os.open(self.directory / name, os.O_RDONLY | (_DIRECT if self.direct else 0))
        try:
            got = _whole(os.preadv, fd, [head], 0)
        finally:
            os.close(fd)
        return head[:got]

    def read(self, name: str, payload: np.ndarray) -> tuple[memoryview, int]:
        """Read a file's header block and its first ``len(payload)`` payload bytes into
        ``payload`` (uint8, in the pool): the header (this thread's scratch) and the
        payload bytes read (fewer if the file is short)."""
        head, tail = self._blocks()
        data = payload.data
        whole = len(data) // BLOCK_BYTES * BLOCK_BYTES
        rest = len(data) - whole
        bufs = [head, data[:whole]] if whole else [head]
        if rest:
            bufs.append(tail)
        fd = os.open(self.directory / name, os.O_RDONLY | self._flags(payload))
        try:
            got = _whole(os.preadv, fd, bufs, 0)
        finally:
            os.close(fd)
        body = max(0, got - HEADER_BYTES)
        if rest and body > whole:
            data[whole:] = tail[:rest]
        return head[: min(got, HEADER_BYTES)], min(body, len(data))

    def remove(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)
