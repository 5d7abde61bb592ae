"""A bench's vLLM engine in a process of its own, driven a line at a time.

The engine benches (bench/ttft_bench.py, bench/step_bench.py) keep their engines
alive together and let them take turns, so the engines compared in a round are
timed seconds apart, not minutes. Each engine runs ``SCRIPT engine SPEC_FILE`` with
the e2e venv's python: it answers ``ready`` once started, then one line (JSON) per
line it reads, and shuts down when its stdin closes.
"""

from __future__ import annotations

import json
import select
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["EngineProcess"]


class EngineProcess:
    """One engine process; ``ask`` sends it a line and waits for its answer."""

    def __init__(
        self, python: Path, script: Path, spec: dict[str, Any], log: Path, env: dict[str, str]
    ) -> None:
        self.name: str = spec["engine"]
        spec_file = log.parent / f"{self.name}.spec.json"  # too long for argv
        spec_file.write_text(json.dumps(spec))
        self.log = log
        with log.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(python), str(script), "engine", str(spec_file)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
            )

    def _reply(self, timeout_s: float) -> str:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise SystemExit(f"the {self.name} engine did not answer; see {self.log}")
        return line

    def wait_ready(self, timeout_s: float = 600) -> None:
        line = self._reply(timeout_s)
        if line.strip() != "ready":
            self.kill()
            raise SystemExit(f"the {self.name} engine said {line.strip()!r}; see {self.log}")

    def ask(self, line: str, timeout_s: float = 900) -> Any:
        """Send ``line``; the engine's answer, decoded."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{line}\n")
        self._proc.stdin.flush()
        return json.loads(self._reply(timeout_s))

    def close(self) -> None:
        """Close its stdin (it shuts down) and wait for it to exit cleanly."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        rc = self._proc.wait(timeout=120)
        if rc != 0:
            raise SystemExit(f"the {self.name} engine failed (rc {rc}); see {self.log}")

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
