"""The server's log: configured for its own loggers, text or JSON, saying what matters."""

from __future__ import annotations

import json
import logging
import signal
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from app.logs import JsonFormatter, logging_config
from app.pool_pressure import PoolPressureLog
from tests.support import DEADLINE_S, server_process


def test_json_lines_carry_extras_and_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "app.x", logging.WARNING, __file__, 1, "hello %s", ("you",), sys.exc_info()
        )
    record.boot_id = "abc"
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "warning"
    assert line["logger"] == "app.x"
    assert line["message"] == "hello you"
    assert line["boot_id"] == "abc"
    assert "ValueError: boom" in line["exc_info"]
    assert line["ts"].endswith("Z")


@pytest.mark.parametrize(
    ("level", "access"),
    [
        pytest.param("info", logging.WARNING, id="info-hides-access-log"),
        pytest.param("debug", logging.DEBUG, id="debug-shows-access-log"),
    ],
)
def test_config_covers_our_loggers_and_uvicorns(level: str, access: int) -> None:
    config = logging_config(level, "text")  # type: ignore[arg-type]
    loggers = config["loggers"]
    for name in ("app", "dataplane", "contract", "uvicorn.error"):
        assert loggers[name]["level"] == logging.getLevelName(level.upper())
    assert loggers["uvicorn.access"]["level"] == access
    assert "uvicorn.error" not in logging_config("info", "json", uvicorn=False)["loggers"]


def test_negotiation_outcomes_are_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="app"):
        client.post("/negotiate", json={"required_alignment": 96, "model": "m"})
        client.post("/negotiate", json={"required_alignment": 96})
        client.post("/negotiate", json={"required_alignment": 64})
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("app.")]
    final = [m for m in messages if "is final" in m]
    assert len(final) == 1 and final[0].startswith("chunk size 288 is final")
    assert sum("negotiation: alignment 96 -> chunk size 288" in m for m in messages) == 2
    refused = [r for r in caplog.records if "negotiation refused (incompatible)" in r.message]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING


def test_pool_pressure_is_summarised(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = PoolPressureLog(interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="app.pool_pressure"):
        log.evicted(2, 2 << 20)  # the first is logged at once
        for _ in range(100):
            now[0] += 0.1
            log.evicted(1, 1 << 20)  # then summed up
        log.not_stored(3)
        now[0] = 61.0
        log.evicted(1, 1 << 20)  # an interval later: one summary line
        log.flush()  # nothing left: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "evicted 2 least recently used chunk(s) (2.0MiB)" in lines[0]
    assert "evicted 101" in lines[1] and "3 chunk(s) not stored" in lines[1]


def _server_log(*args: str) -> tuple[str, str]:
    """Run a server at info level, negotiate, stop it; (its log, its boot_id)."""
    with server_process("--log-level", "info", *args) as (url, proc):
        boot_id = str(httpx.get(f"{url}/health").json()["boot_id"])
        httpx.post(f"{url}/negotiate", json={"required_alignment": 96, "model": "demo"})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=DEADLINE_S)
    return out.decode(), boot_id


@pytest.mark.slow
def test_startup_negotiation_and_shutdown_are_in_the_log() -> None:
    log, boot_id = _server_log()
    for needle in (
        "listening on 127.0.0.1:",
        f"started: boot_id {boot_id}",
        "chunk size: minimum 256 tokens, at most 65536",
        "cache pool: 4.0MiB in 64.0KiB pages",
        "blend matcher off; coordinator standalone",
        "chunk size 288 is final",
        "negotiation: alignment 96 -> chunk size 288 (model=demo)",
        "shutting down after",
        "mpcache stopped",
    ):
        assert needle in log, f"{needle!r} not in:\n{log}"
    assert " INFO " in log


@pytest.mark.slow
def test_json_log_format() -> None:
    log, boot_id = _server_log("--log-format", "json")
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    assert {"ts", "level", "logger", "message"} <= set(records[0])
    assert any(r["message"] == f"mpcache 0.1.0 started: boot_id {boot_id}" for r in records)
    assert any(r["logger"] == "uvicorn.error" for r in records)
