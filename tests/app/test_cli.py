"""The ``mpcache`` command: version, help, one-line errors, client commands."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.cli import main
from app.settings import TOOLING_VARIABLES, Settings, env_name, unknown_variables
from contract import __version__
from tests.support import DEADLINE_S, ROOT, free_port, server_process, wait_healthy


def _mpcache(
    *args: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m app ARGS`` from a checkout, as the README documents it."""
    full_env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=ROOT,
        env={**full_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--version"])
    assert capsys.readouterr().out == f"mpcache {__version__}\n"


def test_bare_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    out = capsys.readouterr().out
    for command in ("server", "health", "chunk-size", "stats", "--version"):
        assert command in out


def test_server_help_shows_defaults_once_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["server", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--chunk-size", "(default: 256)", "(default: 1GiB)", "--no-pool-prefault"):
        assert text in out
    assert "MPCACHE_" in out


@pytest.mark.parametrize(
    ("argv", "env", "needles"),
    [
        pytest.param(
            ["server", "--log-level", "foo"], {}, ["--log-level", "'foo'"], id="log-level"
        ),
        pytest.param(["server", "--host", "999.1.1.1"], {}, ["--host", "999.1.1.1"], id="host"),
        pytest.param(
            ["server"],
            {"MPCACHE_PROT": "9000"},
            ["MPCACHE_PROT", "did you mean MPCACHE_PORT?"],
            id="unknown-variable",
        ),
        pytest.param(
            ["server"], {"MPCACHE_LOG_LEVEL": "loud"}, ["MPCACHE_LOG_LEVEL"], id="bad-variable"
        ),
        pytest.param(["server", "--pool-size", "lots"], {}, ["--pool-size", "'lots'"], id="size"),
        pytest.param(["health"], {"MPCACHE_PROT": "1"}, ["MPCACHE_PROT"], id="client-env"),
    ],
)
def test_bad_input_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], needles: list[str]
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("mpcache: ") and "\n" not in message
    for needle in needles:
        assert needle in message


def test_tooling_variables_are_not_settings_but_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MPCACHE_REQUIRE_VLLM": "1", "MPCACHE_PORT": "1", "PATH": "/bin"}
    assert unknown_variables(env) == []
    assert unknown_variables({"mpcache_chunk_sise": "1"}) == [
        "unknown environment variable mpcache_chunk_sise; did you mean MPCACHE_CHUNK_SIZE?"
    ]


def test_every_mpcache_variable_in_the_tree_is_known() -> None:
    """Tooling that exports a new MPCACHE_* variable must list it in TOOLING_VARIABLES,
    or every server a test starts would refuse to run."""
    known = {env_name(f) for f in Settings.model_fields} | TOOLING_VARIABLES
    found: set[str] = set()
    for folder in ("scripts", "tests", "app", "bench", "deploy", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".yaml", ".yml", ".toml"):
                found |= set(re.findall(r"\bMPCACHE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    found |= set(re.findall(r"\bMPCACHE_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / "Makefile").read_text()))
    # The misspelling the tests above use on purpose.
    found.discard("MPCACHE_PROT")
    assert found - known == set()


def test_bad_flag_fails_before_torch_is_imported() -> None:
    code = (
        "import sys\n"
        "from app.cli import main\n"
        "try:\n"
        "    main(['server', '--log-level', 'foo'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code)\n"
        "print('torch' in sys.modules, 'dataplane' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[-1] == "False False"


def test_busy_port_is_named() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _mpcache("server", "--port", str(port), "--log-level", "warning")
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_client_without_server_fails_in_one_line() -> None:
    result = _mpcache("health", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert result.stderr.startswith("mpcache: cannot reach http://127.0.0.1:")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_client_commands_against_a_server() -> None:
    with server_process() as (url, _):
        health = _mpcache("health", "--url", url)
        assert health.returncode == 0, health.stderr
        assert f"{url}: ok" in health.stdout
        assert "not selected yet" in health.stdout
        httpx.post(f"{url}/negotiate", json={"required_alignment": 96})

        size = _mpcache("chunk-size", "--url", url)
        assert "288 tokens (final)" in size.stdout
        assert "token_hasher done" in size.stdout
        as_json = json.loads(_mpcache("chunk-size", "--url", url, "--json").stdout)
        assert as_json["chunk_size"] == 288

        stats = _mpcache("stats", "--url", url)
        assert stats.returncode == 0, stats.stderr
        assert "chunk size     288" in stats.stdout
        assert "negotiations   ok 1" in stats.stdout
        assert "of 4.0MiB used" in stats.stdout
        samples = json.loads(_mpcache("stats", "--url", url, "--json").stdout)
        assert samples["mpcache_chunk_size_tokens"] == 288


@pytest.mark.slow
def test_address_file_lets_clients_find_a_server_started_with_port(tmp_path: Path) -> None:
    """The container's HEALTHCHECK runs ``mpcache health`` with no flags while the
    server may have been given --port: the address file carries the real URL."""
    address = tmp_path / "mpcache.address"
    env = {"MPCACHE_ADDRESS_FILE": str(address)}
    with server_process(env=env) as (url, proc):
        assert address.read_text().strip() == url
        health = _mpcache("health", env=env, drop=("MPCACHE_PORT", "MPCACHE_HOST"))
        assert health.returncode == 0, health.stderr
        assert f"{url}: ok" in health.stdout
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=DEADLINE_S)
    assert not address.exists()


@pytest.mark.slow
def test_make_serve_honours_mpcache_port_and_ignores_host_and_port(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "MPCACHE_PORT": str(port),
        "HOST": "999.1.1.1",  # a shell's own HOST/PORT must not reach the server
        "PORT": "1",
    }
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert (
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=DEADLINE_S)["status"] == "ok"
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=DEADLINE_S)
