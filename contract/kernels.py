"""Small C kernels, compiled once per source and loaded with ctypes.

``build`` returns the shared library of a C source: from
``$XDG_CACHE_HOME/mpcache/kernels`` (default ``~/.cache``) when this exact source
(and these flags) was built there before, else compiled there first with the
system C compiler (``cc``, or ``$CC``), or into a private temporary folder when
that one cannot be written. A library built ahead (the Dockerfile does, then
removes the compiler) needs no compiler. Without one, and nothing built, it raises
``KernelUnavailable`` with the reason; callers keep a pure-Python path for that.

Both sides use it: ``dataplane.blockcopy`` (the server's block copies) and
``connector.tokenpack`` (the connector's token packing). Imports only the standard
library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["KernelUnavailable", "build", "kernel_dir"]

FLAGS = ("-O2", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 60.0
_lock = threading.Lock()


class KernelUnavailable(Exception):
    """The kernel cannot be built or loaded here (the message says why)."""


def kernel_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpcache" / "kernels"


def _compiler() -> str:
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name)
    if path is None:
        raise KernelUnavailable(f"no C compiler ({name!r} is not on PATH)")
    return path


def _compile(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        out = Path(scratch) / target.name
        try:
            done = subprocess.run(
                [compiler, *FLAGS, "-o", str(out), str(source)],
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelUnavailable(f"{compiler} failed: {exc}") from exc
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: a concurrent process sees all of it or none


def build(source: Path) -> Path:
    """The shared library of ``source``, compiled first if this source has not
    been yet (``KernelUnavailable`` says why not)."""
    try:
        text = source.read_bytes()
    except OSError as exc:
        raise KernelUnavailable(f"its source is missing: {exc}") from exc
    key = hashlib.sha256(text + " ".join(FLAGS).encode())
    name = f"{source.stem}-{key.hexdigest()[:16]}.so"
    target = kernel_dir() / name
    with _lock:
        if target.exists():
            return target
        compiler = _compiler()
        try:
            _compile(compiler, source, target)
        except OSError:  # a read-only home, say: this process's own folder
            target = Path(tempfile.mkdtemp(prefix="mpcache-kernel-")) / name
            _compile(compiler, source, target)
    return target
