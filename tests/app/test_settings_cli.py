"""Settings from MPCACHE_* variables and CLI flags."""

from __future__ import annotations

import pytest

from app.cli import parse_settings
from app.settings import Settings


def test_defaults_bind_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPCACHE_CHUNK_SIZE", "MPCACHE_HOST", "MPCACHE_PORT"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert (s.chunk_size, s.host, s.port) == (256, "127.0.0.1", 8000)


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCACHE_CHUNK_SIZE", "600")
    monkeypatch.setenv("MPCACHE_PORT", "9001")
    assert parse_settings(["server"]).chunk_size == 600
    s = parse_settings(["server", "--chunk-size", "512", "--host", "0.0.0.0"])
    assert (s.chunk_size, s.host, s.port) == (512, "0.0.0.0", 9001)


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        pytest.param(["server", "--chunk-size", "0"], {}, "chunk_size", id="zero-flag"),
        pytest.param(["server"], {"MPCACHE_CHUNK_SIZE": "big"}, "chunk_size", id="bad-env"),
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


def test_non_integer_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["server", "--chunk-size", "ten"])
    assert "--chunk-size" in capsys.readouterr().err
