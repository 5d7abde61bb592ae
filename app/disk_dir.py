"""The disk tier's directory (``--disk-path``): its ``meta.json``, its checks at
start, and the index rebuilt from its files' headers.

``meta.json`` (mode 0600: it holds the hash seed; written to a temporary name then
renamed) keeps what makes the files servable after a restart::

    {"format": "mpcache-disk", "version": 1, "seed": <64-bit int>,
     "chunk_size": <tokens, null until a chunk size is final>, "created_at": "<UTC>"}

The seed is the key of the chunk keys (``app.hashing.TokenHasher``): a restarted
server hashes with the directory's seed, so equal prompts name the same files. The
index is rebuilt at start from each file's header only (one block per file, no
checksum: that is checked on every read), so a full disk is indexed in bounded
time; temporary files (writes a crash cut short) and files that fail their header
are deleted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from app.disk_codec import CorruptFile, decode_header, file_bytes, parse_name
from app.disk_index import DiskIndex, DiskRecord
from app.disk_io import TEMP_SUFFIX, ChunkFiles

__all__ = [
    "META_FORMAT",
    "DiskMeta",
    "DiskRefused",
    "Found",
    "check_directory",
    "check_fits",
    "lock_directory",
    "read_meta",
    "scan",
]

logger = logging.getLogger(__name__)

META = "meta.json"
META_FORMAT = "mpcache-disk"
META_VERSION = 1
PATH_KEY = "MPCACHE_DISK_PATH (--disk-path)"
SIZE_KEY = "MPCACHE_DISK_SIZE (--disk-size)"


class DiskRefused(RuntimeError):
    """The disk tier cannot start on this directory (the message names the setting)."""


@dataclass(frozen=True)
class DiskMeta:
    seed: int
    chunk_size: int | None
    created_at: str
    format: str = META_FORMAT
    version: int = META_VERSION

    @classmethod
    def new(cls, seed: int | None) -> DiskMeta:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return cls(secrets.randbits(64) if seed is None else seed, None, stamp)


def read_meta(directory: Path) -> DiskMeta | None:
    """The directory's ``meta.json``; None if there is none."""
    path = directory / META
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != META_FORMAT or raw.get("version") != META_VERSION:
            raise DiskRefused(
                f"{PATH_KEY} {directory}: {META} is format {raw.get('format')!r} version "
                f"{raw.get('version')!r}, this server writes {META_FORMAT!r} version "
                f"{META_VERSION}; use another directory or empty this one"
            )
        seed, size = int(raw["seed"]), raw.get("chunk_size")
        return DiskMeta(seed, None if size is None else int(size), str(raw.get("created_at")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DiskRefused(f"{PATH_KEY} {directory}: unreadable {META} ({exc})") from exc


def write_meta(directory: Path, meta: DiskMeta) -> None:
    temp = directory / f".{META}{TEMP_SUFFIX}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(asdict(meta), out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, directory / META)


@dataclass(frozen=True)
class Found:
    """What a directory holds: its chunk files ``(name, size, mtime)``, oldest first,
    and its temporary files."""

    chunks: list[tuple[str, int, float]]
    temps: list[str]

    @property
    def held_bytes(self) -> int:
        return sum(size for _, size, _ in self.chunks)


def _entries(directory: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    for sub in os.scandir(directory):
        if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
            for entry in os.scandir(sub.path):
                yield f"{sub.name}/{entry.name}", entry


def scan(directory: Path) -> Found:
    chunks: list[tuple[str, int, float]] = []
    temps = [e.name for e in os.scandir(directory) if e.name.endswith(TEMP_SUFFIX)]
    for name, entry in _entries(directory):
        if name.endswith(TEMP_SUFFIX):
            temps.append(name)
        elif entry.is_file(follow_symlinks=False):
            stat = entry.stat(follow_symlinks=False)
            chunks.append((name, stat.st_size, stat.st_mtime))
    chunks.sort(key=lambda c: c[2])
    return Found(chunks, temps)


def check_fits(directory: Path, size_bytes: int, held_bytes: int) -> None:
    """Refuse a ``--disk-size`` over the filesystem's free space plus what the
    directory already holds."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if size_bytes > free + held_bytes:
        raise DiskRefused(
            f"{SIZE_KEY} is {size_bytes} bytes but {directory} has {free} bytes free "
            f"(+{held_bytes} its chunk files hold): lower {SIZE_KEY} or free space"
        )


def check_chunk_size(directory: Path, meta: DiskMeta, minimum: int, maximum: int) -> None:
    """Refuse a directory whose chunk size this server can never select."""
    size = meta.chunk_size
    if size is not None and not minimum <= size <= maximum:
        raise DiskRefused(
            f"{PATH_KEY} {directory} holds chunks of {size} tokens, but this server's "
            f"chunk size is {minimum} to {maximum} tokens (MPCACHE_CHUNK_SIZE, "
            f"MPCACHE_MAX_CHUNK_SIZE): use another directory, empty this one, or start "
            f"with --chunk-size {size}"
        )


def rebuild(files: ChunkFiles, index: DiskIndex, found: Found, chunk_size: int) -> list[str]:
    """Index every chunk file whose header and size agree with its name, oldest first
    (least recently used); delete the others and what the capacity has no room for.
    Returns why each refused file was refused."""
    refused: list[str] = []
    for name, size, _ in found.chunks:
        try:
            ident = parse_name(name.rsplit("/", 1)[-1])
            if not name.startswith(ident[0].hex()[:2] + "/"):
                raise CorruptFile("in another key's directory")
            header = decode_header(files.read_header(name), name=ident, chunk_size=chunk_size)
            if size != file_bytes(header.payload_bytes):
                raise CorruptFile(
                    f"{size} bytes, its header says {file_bytes(header.payload_bytes)}"
                )
        except (CorruptFile, OSError) as exc:
            refused.append(f"{name}: {exc}")
            files.remove(name)
            continue
        record = DiskRecord(name, header.present, header.payload_bytes, size)
        for evicted in index.add(ident, record):
            files.remove(evicted.name)
    return refused


def empty(files: ChunkFiles, found: Found) -> None:
    """Delete every chunk and temporary file ``found``."""
    for name, _, _ in found.chunks:
        files.remove(name)
    for name in found.temps:
        files.remove(name)


def lock_directory(directory: Path) -> int:
    """Create ``directory`` if need be and take its lock: the descriptor holding it
    (one server per directory; closing it, or the process's death, releases it)."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DiskRefused(f"{PATH_KEY} {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise DiskRefused(
            f"{PATH_KEY} {directory} is in use by another server process; give each "
            "server its own directory"
        ) from exc
    return fd


def check_directory(directory: Path, size_bytes: int, minimum: int, maximum: int) -> None:
    """What ``DiskTier.open`` refuses, checked before the server starts (a one-line
    error from the CLI): the directory can be made, its ``meta.json`` read, its chunk
    size selected, and ``--disk-size`` fits."""
    os.close(lock_directory(directory))  # in use by a running server: refused here
    try:
        meta = read_meta(directory)
        if meta is not None:
            check_chunk_size(directory, meta, minimum, maximum)
        check_fits(directory, size_bytes, scan(directory).held_bytes)
    except OSError as exc:
        raise DiskRefused(f"{PATH_KEY} {directory}: {exc}") from exc
