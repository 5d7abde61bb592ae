"""Settings from MPCACHE_* variables and CLI flags."""

from __future__ import annotations

import pytest

from app.cli import parse_settings
from app.settings import DEFAULT_PORT, Settings


def test_defaults_bind_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPCACHE_CHUNK_SIZE", "MPCACHE_HOST", "MPCACHE_PORT"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert (s.chunk_size, s.host, s.port) == (256, "127.0.0.1", DEFAULT_PORT)


@pytest.mark.parametrize(
    "port",
    [
        pytest.param(8000, id="vllm"),
        pytest.param(8080, id="lmcache-http"),
        pytest.param(5555, id="lmcache-zmq"),
        pytest.param(9090, id="prometheus"),
        pytest.param(3000, id="grafana"),
        pytest.param(6379, id="redis"),
        pytest.param(8265, id="ray-dashboard"),
        pytest.param(8001, id="triton-grpc"),
        pytest.param(8002, id="triton-metrics"),
    ],
)
def test_default_port_is_not_a_neighbours(port: int) -> None:
    assert port != DEFAULT_PORT


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCACHE_CHUNK_SIZE", "600")
    monkeypatch.setenv("MPCACHE_PORT", "9001")
    assert parse_settings(["server"]).chunk_size == 600
    s = parse_settings(["server", "--chunk-size", "512", "--host", "0.0.0.0"])
    assert (s.chunk_size, s.host, s.port) == (512, "0.0.0.0", 9001)


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        pytest.param(["server", "--chunk-size", "0"], {}, "--chunk-size", id="zero-flag"),
        pytest.param(["server"], {"MPCACHE_CHUNK_SIZE": "big"}, "MPCACHE_CHUNK_SIZE", id="bad-env"),
        pytest.param(
            ["server", "--chunk-size", "512", "--max-chunk-size", "256"],
            {},
            "max_chunk_size",
            id="max-below-min",
        ),
    ],
)
def test_bad_settings_name_the_key(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], needle: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        parse_settings(argv)
    assert needle in str(info.value)


def test_non_integer_flag_is_refused() -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(["server", "--chunk-size", "ten"])
    assert "--chunk-size" in str(info.value)
