"""Helpers shared by tests: free ports and real server subprocesses."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0
) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out}")
        try:
            reply = httpx.get(f"{url}/health", timeout=1.0)
            if reply.status_code == 200:
                body: dict[str, object] = reply.json()
                return body
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s}s")


@contextlib.contextmanager
def server_process(
    *args: str, port: int | None = None, env: dict[str, str] | None = None, uvicorn: bool = False
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run a real server process on 127.0.0.1; yield (base_url, process)."""
    port = port or free_port()
    full_env = {**os.environ, **(env or {})}
    if uvicorn:
        cmd = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--log-level", "warning", *args]
    else:
        cmd = [sys.executable, "-m", "app", "server", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning", *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
