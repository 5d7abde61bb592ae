"""The KV events' settings: what is refused, and a socket that cannot be bound."""

from __future__ import annotations

import pytest
import zmq
from pydantic import ValidationError

from app.settings import Settings
from app.state import StartupRefused, build_runtime
from tests.support import free_port


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"kv_events_endpoint": "http://x:1"}, "ZMQ endpoint", id="not-zmq"),
        pytest.param(
            {"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"},
            "needs kv_events_endpoint",
            id="replay-alone",
        ),
    ],
)
def test_bad_endpoints_are_refused(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**fields)  # type: ignore[arg-type]


def test_unset_or_blank_is_off() -> None:
    assert Settings(kv_events_endpoint="  ").kv_events_endpoint is None
    assert Settings().kv_events_endpoint is None


def test_a_taken_endpoint_refuses_startup_naming_the_variable() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind(endpoint)
    try:
        settings = Settings(
            kv_events_endpoint=endpoint, pool_size="1MiB", pool_prefault=False, copy_threads=1
        )
        with pytest.raises(StartupRefused, match="MPCACHE_KV_EVENTS_ENDPOINT"):
            build_runtime(settings)
    finally:
        taken.close(linger=0)
        ctx.term()
