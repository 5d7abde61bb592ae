"""kv_connector_extra_config parsing: defaults, aliases, coercion, errors naming keys."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from connector.config import DEFAULT_SERVER_URL, KNOWN_KEYS, ConnectorConfig, parse_extra_config
from connector.errors import ConfigError
from tests.support import ROOT


def test_defaults() -> None:
    config = parse_extra_config(None)
    assert config == ConnectorConfig()
    assert config.server_urls == (DEFAULT_SERVER_URL,)
    assert config.heartbeat_interval_s == 10.0


@pytest.mark.parametrize(
    ("extra", "urls"),
    [
        pytest.param(
            {"mpcache.server_urls": "http://127.0.0.1:8733"}, ("http://127.0.0.1:8733",), id="one"
        ),
        pytest.param(
            {"mpcache.server_urls": "http://a:1, http://b:2/"},
            ("http://a:1", "http://b:2"),
            id="comma-string",
        ),
        pytest.param(
            {"mpcache.server_urls": ["http://a:1", "b:2"]},
            ("http://a:1", "http://b:2"),
            id="list-and-bare-host",
        ),
        pytest.param(
            {"lmcache.mp.server_urls": "https://a:1"}, ("https://a:1",), id="lmcache-urls"
        ),
        pytest.param(
            {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": "5555"},
            ("http://localhost:5555",),
            id="lmcache-host-port-tcp",
        ),
        pytest.param({"lmcache.mp.port": 9001}, ("http://127.0.0.1:9001",), id="port-only"),
        pytest.param(
            {"mpcache.server_urls": "http://a:1", "lmcache.mp.server_urls": "http://b:2"},
            ("http://a:1",),
            id="mpcache-wins",
        ),
        pytest.param({"mpcache.server_urls": "[::1]:8733"}, ("http://[::1]:8733",), id="ipv6"),
    ],
)
def test_server_urls(extra: dict[str, Any], urls: tuple[str, ...]) -> None:
    assert parse_extra_config(extra).server_urls == urls


@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        pytest.param(
            {"lmcache.mp.heartbeat_interval": "0.5"}, "heartbeat_interval_s", 0.5, id="hb-str"
        ),
        pytest.param({"mpcache.heartbeat_interval": 3}, "heartbeat_interval_s", 3.0, id="hb-int"),
        pytest.param(
            {"mpcache.heartbeat_interval": 1, "lmcache.mp.heartbeat_interval": 7},
            "heartbeat_interval_s",
            1.0,
            id="hb-mpcache-wins",
        ),
        pytest.param({"mpcache.request_timeout": " 0.25 "}, "request_timeout_s", 0.25, id="req"),
        pytest.param({"mpcache.lookup_timeout": 0.1}, "lookup_timeout_s", 0.1, id="lookup"),
        pytest.param({"mpcache.lookup_max_age": "4"}, "lookup_max_age_s", 4.0, id="lookup-age"),
        pytest.param(
            {"mpcache.heartbeat_timeout": "1"}, "heartbeat_timeout_s", 1.0, id="hb-timeout"
        ),
        pytest.param({"mpcache.startup_timeout": "5"}, "startup_timeout_s", 5.0, id="startup"),
        pytest.param({"mpcache.instance_id": " eng "}, "instance_id", "eng", id="instance"),
    ],
)
def test_coercion(extra: dict[str, Any], field: str, value: object) -> None:
    assert getattr(parse_extra_config(extra), field) == value


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        pytest.param(
            {"lmcache.mp.heartbeat_interval": "soon"},
            "lmcache.mp.heartbeat_interval",
            id="nan-text",
        ),
        pytest.param({"mpcache.heartbeat_interval": 0}, "mpcache.heartbeat_interval", id="zero"),
        pytest.param({"mpcache.request_timeout": -1}, "mpcache.request_timeout", id="negative"),
        pytest.param({"mpcache.lookup_timeout": "inf"}, "mpcache.lookup_timeout", id="inf"),
        pytest.param({"mpcache.lookup_timeout": True}, "mpcache.lookup_timeout", id="bool"),
        pytest.param({"mpcache.lookup_max_age": 0}, "mpcache.lookup_max_age", id="age-zero"),
        pytest.param({"mpcache.server_urls": ""}, "mpcache.server_urls", id="empty"),
        pytest.param({"mpcache.server_urls": 5}, "mpcache.server_urls", id="not-list"),
        pytest.param({"mpcache.server_urls": "ftp://x"}, "mpcache.server_urls", id="scheme"),
        pytest.param({"mpcache.server_urls": "http://x:99999"}, "mpcache.server_urls", id="port"),
        pytest.param(
            {"mpcache.server_urls": "http://a:1,http://a:1"}, "mpcache.server_urls", id="dup"
        ),
        pytest.param({"mpcache.server_urls": [1]}, "mpcache.server_urls", id="non-str"),
        pytest.param({"lmcache.mp.port": "x"}, "lmcache.mp.port", id="port-text"),
        pytest.param({"lmcache.mp.port": 0}, "lmcache.mp.port", id="port-zero"),
        pytest.param({"lmcache.mp.host": ""}, "lmcache.mp.host", id="host-empty"),
        pytest.param({"mpcache.instance_id": 3}, "mpcache.instance_id", id="instance-type"),
        pytest.param({"mpcache.heartbeat_intervall": 1}, "mpcache.heartbeat_intervall", id="typo"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_extra_config(extra)
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_config_is_frozen() -> None:
    config = parse_extra_config({})
    with pytest.raises(ValidationError, match="frozen"):
        config.heartbeat_interval_s = 1.0  # type: ignore[misc]


def test_unknown_mpcache_key_names_the_closest_known_one() -> None:
    with pytest.raises(ConfigError) as info:
        parse_extra_config({"mpcache.lookup_timout": 1})
    assert info.value.key == "mpcache.lookup_timout"
    assert "did you mean 'mpcache.lookup_timeout'" in str(info.value)


def test_unused_lmcache_keys_are_accepted_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra = {
        "lmcache.mp.mq_timeout": 5,
        "lmcache.mp.chunk_size": 256,
        "lmcache.mp.heartbeat_interval": 3,
        "other_connector.key": "x",  # another connector's key: not ours to judge
    }
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        config = parse_extra_config(extra)
    assert config.heartbeat_interval_s == 3.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "lmcache.mp.chunk_size, lmcache.mp.mq_timeout" in warnings[0]
    assert "other_connector" not in warnings[0]


def test_null_means_unset() -> None:
    assert parse_extra_config({"mpcache.request_timeout": None}).request_timeout_s == 2.0


def test_known_keys_are_the_documented_ones() -> None:
    documented = {
        "mpcache.server_urls",
        "lmcache.mp.server_urls",
        "lmcache.mp.host",
        "lmcache.mp.port",
        "mpcache.heartbeat_interval",
        "lmcache.mp.heartbeat_interval",
        "mpcache.request_timeout",
        "mpcache.lookup_timeout",
        "mpcache.lookup_max_age",
        "mpcache.heartbeat_timeout",
        "mpcache.startup_timeout",
        "mpcache.instance_id",
        "mpcache.api_token",
        "mpcache.lookup_area",
        "mpcache.key_index",
        "mpcache.ops_socket",
    }
    assert documented == KNOWN_KEYS
    page = (ROOT / "docs" / "connector.md").read_text()
    for key in documented:
        assert f"`{key}`" in page, f"docs/connector.md's key table lacks {key}"
