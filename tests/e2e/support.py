"""Helpers for the end-to-end tests: the engine driver process and server logs.

The driver (``engine_driver.py``) runs in the e2e venv; these helpers run in the
test's own (dev venv) process and never import vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support import ROOT, server_process

PROMPT_LEN = 1100
MAX_TOKENS = 16
CHUNK_SIZE = 256
# Servers here get a small pool: a few chunks of a tiny model is all they hold.
SERVER_ENV = {"MPCACHE_POOL_SIZE": "16MiB"}
# A few prompts of a tiny model; far below any test machine's free space.
DISK_SIZE = "64MiB"
DISK_SWITCH = "MPCACHE_E2E_DISK"
"""``MPCACHE_E2E_DISK=1``: every server of the module that has no ``disk_path`` of its
own gets the disk tier on, in a fresh directory (removed when it stops), so the
whole module runs with it (issue 24). Off in CI: the module is too slow to run
twice; ``test_disk_tier_serves_the_prefix_after_sigterm_and_restart`` runs there."""

DRIVER = Path(__file__).resolve().parent / "engine_driver.py"
# Built and linked by scripts/bootstrap_e2e_venv.sh; MPCACHE_E2E_VENV points elsewhere.
E2E_VENV = Path(os.environ.get("MPCACHE_E2E_VENV") or ROOT / ".venv-e2e")

# Generous bounds: engines start in ~30 s on a quiet 2-core machine, several times
# that on a loaded one. Every wait below polls for an event and gives up only here.
ENGINE_START_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 120.0


def tail(text: str, max_chars: int = 12_000) -> str:
    return text if len(text) <= max_chars else "...\n" + text[-max_chars:]


class ServerLog:
    """Drains a server process's combined stdout/stderr (a pipe) in a thread, so the
    pipe never fills and the text is at hand for failure messages."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str) -> None:
        self.name = name
        self._chunks: list[str] = []
        self._thread = threading.Thread(target=self._drain, args=(proc,), daemon=True)
        self._thread.start()

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        stream = proc.stdout
        if stream is None:
            return
        with contextlib.suppress(ValueError, OSError):  # closed by server_process
            for line in iter(stream.readline, b""):
                self._chunks.append(line.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self._chunks)


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples, by ``name{labels}``."""
    reply = httpx.get(f"{url}/metrics", timeout=5.0)
    reply.raise_for_status()
    samples: dict[str, float] = {}
    for line in reply.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


class DriverError(AssertionError):
    pass


class EngineDriver:
    """One ``engine_driver.py run`` process, fed commands over stdin.

    Results come back as JSON lines in a file (see the driver's docstring); the
    process's own output (vLLM's and the connector's logs, its worker processes'
    too) goes to ``log_path``. The process leads its own process group, so
    ``close`` can end vLLM's workers with it if it hangs; it stays in the test's
    session (see ``__init__``).
    """

    def __init__(
        self,
        python: Path,
        workdir: Path,
        *,
        name: str,
        model: Path,
        prompt_len: int,
        max_tokens: int,
        extra_logs: list[ServerLog] | None = None,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.results_path = workdir / f"{name}.results.jsonl"
        self.log_path = workdir / f"{name}.log"
        self.extra_logs = extra_logs if extra_logs is not None else []
        self._seen = 0
        spec = {
            "model": str(model),
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "results": str(self.results_path),
        }
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # Keep vLLM's own sockets (message queues, gloo) on the loopback.
            "VLLM_HOST_IP": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        env.pop("VLLM_LOGGING_LEVEL", None)  # the dev suite quiets vLLM; keep INFO here
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER), "run", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own process group (``close`` kills the group), but not its own
            # session: Linux schedules each session as one group (autogroup), and
            # an engine in a session of its own, keeping both cores busy, left the
            # test's session (the mpcache servers) without CPU for 1-2 s at a time
            # on the 2-core VM: a lookup then timed out at the connector's 1 s.
            process_group=0,
        )

    # -------------------------------------------------------------- reporting

    def logs(self) -> str:
        parts = [f"--- driver {self.name} log ({self.log_path}) ---"]
        parts.append(tail(self.log_path.read_text(errors="replace")))
        for log in self.extra_logs:
            parts.append(f"--- server {log.name} log ---")
            parts.append(tail(log.text(), 6_000) or "(empty)")
        return "\n".join(parts)

    def fail(self, message: str) -> DriverError:
        return DriverError(f"{message}\n{self.logs()}")

    # --------------------------------------------------------------- commands

    def send(self, op: str, label: str | None = None, **fields: Any) -> None:
        assert self.proc.stdin is not None
        cmd = {"op": op, "label": label or op, **fields}
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise self.fail(f"driver {self.name} exited before {op!r}") from exc

    def wait(self, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """The next result record; raises with the logs on an error or a dead driver."""
        deadline = time.monotonic() + timeout_s
        while True:
            exited = self.proc.poll() is not None  # before reading: its last words count
            records = self._records()
            if len(records) > self._seen:
                record = records[self._seen]
                self._seen += 1
                if "error" in record:
                    raise self.fail(
                        f"driver {self.name}: {record['label']} failed:\n{record['error']}"
                    )
                return record
            if exited:
                raise self.fail(f"driver {self.name} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise self.fail(f"driver {self.name}: no result within {timeout_s:.0f}s")
            time.sleep(0.1)

    def call(
        self, op: str, label: str | None = None, *, timeout_s: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        self.send(op, label, **fields)
        if timeout_s is None:
            timeout_s = ENGINE_START_TIMEOUT_S if op == "open" else COMMAND_TIMEOUT_S
        return self.wait(timeout_s)

    def _records(self) -> list[dict[str, Any]]:
        if not self.results_path.exists():
            return []
        # A record is complete once its newline is written (the driver flushes each
        # one): whatever follows the last newline is still being written.
        lines = self.results_path.read_text().split("\n")[:-1]
        return [json.loads(line) for line in lines if line.strip()]

    # --------------------------------------------------------------- shutdown

    def finish(self) -> None:
        """Close stdin: the driver shuts its engine down and exits on its own
        (vLLM takes a few seconds), while the test goes on; ``close`` waits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def close(self) -> None:
        """``finish``, wait (bounded) for the driver to exit, then kill whatever is
        left of its process group."""
        self.finish()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=EXIT_TIMEOUT_S)
        # vLLM's worker processes share the driver's group; end any that outlived
        # it (by the group id of the driver we started).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: ServerLog


def disk_switch_on() -> bool:
    return os.environ.get(DISK_SWITCH, "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def mpcache_server(
    name: str, port: int | None = None, *flags: str, disk_path: Path | None = None
) -> Iterator[Server]:
    """A real mpcache server process (dev venv) on 127.0.0.1 with chunk size 256;
    ``disk_path``: its disk tier's directory (else none, unless ``DISK_SWITCH``)."""
    with contextlib.ExitStack() as stack:
        if disk_path is None and disk_switch_on():
            disk_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="e2e-disk-")))
        disk = ("--disk-path", str(disk_path), "--disk-size", DISK_SIZE) if disk_path else ()
        args = ("--chunk-size", str(CHUNK_SIZE), *disk, *flags)
        url, proc = stack.enter_context(server_process(*args, port=port, env=SERVER_ENV))
        yield Server(url, int(url.rsplit(":", 1)[1]), proc, ServerLog(proc, name))


class Baselines:
    """One driver that makes the tiny models, then generates with each of them in an
    engine without the connector. It starts with the module's first test and runs
    while the tests run their own engines; ``models`` and ``tokens`` wait for it."""

    def __init__(self, python: Path, workdir: Path, kinds: tuple[str, ...]) -> None:
        self.model_paths = {kind: workdir / kind for kind in kinds}
        self._models_ready = False
        self._tokens: dict[str, list[int]] = {}
        self._pending = list(kinds)
        self.driver = EngineDriver(
            python,
            workdir,
            name="baselines",
            model=self.model_paths[kinds[0]],
            prompt_len=PROMPT_LEN,
            max_tokens=MAX_TOKENS,
        )
        models = {kind: str(path) for kind, path in self.model_paths.items()}
        self.driver.send("make-models", models=models)
        for kind, model in models.items():
            self.driver.send("open", f"{kind} engine", engine={"model": model})
            self.driver.send("generate", kind)
        self.driver.send("close")

    def models(self) -> dict[str, Path]:
        """The tiny models' folders, once made."""
        if not self._models_ready:
            self.driver.wait()
            self._models_ready = True
        return self.model_paths

    def tokens(self, kind: str) -> list[int]:
        """The token ids model ``kind`` generates without the connector."""
        self.models()
        while kind not in self._tokens and self._pending:
            done = self._pending.pop(0)
            self.driver.wait(ENGINE_START_TIMEOUT_S)  # its engine is up
            record = self.driver.wait()
            if record["num_cached_tokens"]:
                raise self.driver.fail(f"an engine without connector had a cache hit: {record}")
            self._tokens[done] = record["token_ids"]
        return self._tokens[kind]

    def close(self) -> None:
        self.driver.close()


# Every connector engine the module runs, by driver name, and its model.
ENGINE_DRIVERS = {
    "llama-engine-1": "llama",
    "llama-engine-2": "llama",
    "hybrid": "hybrid",
    "node-a": "llama",
    "node-b": "llama",
    "disk": "llama",
}


class EngineDrivers:
    """The module's engine drivers by name, each started on first use or earlier by
    ``start``: a test about to wait on one engine can start the next driver, so that
    its import of vLLM (~15 s of CPU) overlaps the wait."""

    def __init__(self, python: Path, workdir: Path, baselines: Baselines) -> None:
        self._python = python
        self._workdir = workdir
        self._baselines = baselines
        self._started: dict[str, EngineDriver] = {}

    def __getitem__(self, name: str) -> EngineDriver:
        return self.start(name)

    def start(self, name: str) -> EngineDriver:
        if name not in self._started:
            self._started[name] = EngineDriver(
                self._python,
                self._workdir,
                name=name,
                model=self._baselines.model_paths[ENGINE_DRIVERS[name]],
                prompt_len=PROMPT_LEN,
                max_tokens=MAX_TOKENS,
            )
        return self._started[name]

    def close(self) -> None:
        for driver in self._started.values():
            driver.close()
