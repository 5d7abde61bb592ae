"""Helpers shared by tests: free ports and real server subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


DEADLINE_S = 60.0
"""How long a test waits for something that should happen: generous, since a loaded
2-core machine can be many times slower than an idle one. Waits end as soon as the
condition holds, so a passing test never sleeps this long."""


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float = DEADLINE_S,
    what: str = "condition",
    poll_s: float = 0.01,
) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g} s")
        time.sleep(poll_s)


def returns_promptly(call: Callable[[], T], *, timeout_s: float = DEADLINE_S) -> T:
    """Run ``call`` on a helper thread and return its result; fail if it hangs.

    For calls whose contract is "never blocks vLLM indefinitely": a deadlock or an
    unbounded wait fails the test instead of hanging the suite. Not a speed bound.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"call still running after {timeout_s:g} s: it hangs")
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0
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
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    uvicorn: bool = False,
    open_files: int | None = None,
    start_timeout_s: float = 30.0,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run a real server process on 127.0.0.1; yield (base_url, process).

    ``open_files``: the process's soft and hard limit on open descriptors;
    ``start_timeout_s``: how long it may take to answer ``/health``."""
    port = port or free_port()
    full_env = {**os.environ, **(env or {})}
    if uvicorn:
        cmd = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--log-level", "warning", *args]
    else:
        cmd = [sys.executable, "-m", "app", "server", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning", *args]

    def limit_open_files() -> None:
        import resource

        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=limit_open_files if open_files is not None else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, start_timeout_s)
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


class RedisServer:
    """A real ``redis-server`` on a free 127.0.0.1 port with a temporary directory and
    no persistence (``--save ''``); ``stop`` and ``start`` again keep the port, as a
    restarted Redis would (and, like one without persistence, it comes back empty).
    """

    def __init__(self, workdir: Path, *, maxmemory: str = "64mb") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/ensure_redis.sh)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        with open(self.workdir / "redis.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self.answers, what=f"redis-server on port {self.port}")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()  # as a crash would: no goodbye to the clients
        proc.wait(timeout=30)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    """Run a ``RedisServer`` for the block; it is stopped even when the block fails."""
    server = RedisServer(workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def require_redis_server() -> None:
    """Skip the calling test without ``redis-server`` (fail under CI, where
    ``make test`` installs it: scripts/ensure_redis.sh)."""
    import pytest

    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (scripts/ensure_redis.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def require_kernel(load: Callable[[], T], what: str) -> T:
    """``load()``, a C kernel (``contract.kernels``); skips the calling test without
    a C compiler (fails under CI, whose machines have one: a kernel that stopped
    building must not go unseen)."""
    import pytest

    from contract.kernels import KernelUnavailable

    try:
        return load()
    except KernelUnavailable as exc:
        message = f"the {what} is unavailable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def quick_connector_config(url: str, **overrides: Any) -> Any:
    """A connector config for one server that notices a dead server within a second:
    heartbeat every 0.2 s, 1 s ping timeout; ``overrides`` replace any field."""
    from connector.config import ConnectorConfig

    fields: dict[str, Any] = {
        "server_urls": (url,),
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.0,
        "request_timeout_s": 5.0,
        "lookup_timeout_s": 3.0,
        "startup_timeout_s": 20.0,
        **overrides,
    }
    return ConnectorConfig(**fields)
