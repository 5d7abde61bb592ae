"""Binding pipeline: order, failure, and retry that resumes where it stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.bindings import Binding, BindingPipeline
from app.blend import BlendMatcher
from app.chunk_size import FinalChunkSize
from app.coordinator import StandaloneCoordinator
from app.disk_tier import DiskTier
from app.hashing import TokenHasher
from app.sessions import SessionManager
from app.state import BINDING_ORDER, Runtime
from app.telemetry import Telemetry
from contract.errors import BindingFailed, NotNegotiated
from tests.app.conftest import MakeClient

COMPONENTS: dict[str, type] = {
    "token_hasher": TokenHasher,
    "session_manager": SessionManager,
    "blend_matcher": BlendMatcher,
    "telemetry": Telemetry,
    "disk_tier": DiskTier,
    "coordinator": StandaloneCoordinator,
}
METHOD = {name: "join" if name == "coordinator" else "bind" for name in COMPONENTS}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record every binding call, in order, on every component class."""
    log: list[tuple[str, int]] = []
    for name, cls in COMPONENTS.items():
        original = getattr(cls, METHOD[name])

        def recorder(
            self: object, size: int, _name: str = name, _orig: Callable[..., object] = original
        ) -> object:
            log.append((_name, size))
            return _orig(self, size)

        monkeypatch.setattr(cls, METHOD[name], recorder)
    return log


def fail_times(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, times: int) -> list[int]:
    """Make ``cls.method`` raise for its first ``times`` calls; return the call log."""
    original = getattr(cls, method)
    seen: list[int] = []

    def flaky(self: object, size: int) -> object:
        seen.append(size)
        if len(seen) <= times:
            raise OSError(f"injected failure #{len(seen)}")
        return original(self, size)

    monkeypatch.setattr(cls, method, flaky)
    return seen


def runtime_of(client: TestClient) -> Runtime:
    runtime: Runtime = client.app.state.runtime  # type: ignore[attr-defined]
    return runtime


def test_bindings_run_in_order(
    make_client: MakeClient, calls: list[tuple[str, int]], tmp_path: Path
) -> None:
    client = make_client(enable_blend=True, disk_path=tmp_path, disk_size="16MiB")
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 200
    assert calls == [(name, 288) for name in BINDING_ORDER]
    assert set(client.get("/chunk-size").json()["bindings"].values()) == {"done"}
    # A confirmation by a second model binds nothing again.
    client.post("/negotiate", json={"required_alignment": 48})
    assert len(calls) == len(BINDING_ORDER)


def test_failed_binding_then_retry_resumes(
    make_client: MakeClient,
    monkeypatch: pytest.MonkeyPatch,
    calls: list[tuple[str, int]],
    tmp_path: Path,
) -> None:
    telemetry_calls = fail_times(monkeypatch, Telemetry, "bind", times=2)
    client = make_client(enable_blend=True, disk_path=tmp_path, disk_size="16MiB")

    for attempt in (1, 2):
        reply = client.post("/negotiate", json={"required_alignment": 96})
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "1"
        problem = reply.json()
        assert problem["binding"] == "telemetry" and problem["chunk_size"] == 288
        assert f"injected failure #{attempt}" in problem["detail"]
        state = client.get("/chunk-size").json()
        assert state["chunk_size"] == 288 and state["final"] is False
        assert state["bindings"] == {
            "token_hasher": "done",
            "session_manager": "done",
            "blend_matcher": "done",
            "telemetry": "failed",
            "disk_tier": "pending",
            "coordinator": "pending",
        }
        assert client.get("/health").json()["final"] is False

    reply = client.post("/negotiate", json={"required_alignment": 96})
    assert reply.status_code == 200 and reply.json()["chunk_size"] == 288
    assert telemetry_calls == [288, 288, 288]
    # Completed bindings ran once; the failed one was resumed, then the rest.
    # (``calls`` sees telemetry only when it got past the injected failures.)
    assert [name for name, _ in calls] == list(BINDING_ORDER)
    assert client.get("/chunk-size").json()["final"] is True
    metrics = client.get("/metrics").text
    assert 'mpcache_negotiations_total{outcome="binding_failed"} 2.0' in metrics
    assert 'mpcache_binding_failures_total{binding="telemetry"} 2.0' in metrics


def test_retry_from_another_client_resumes_too(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_times(monkeypatch, StandaloneCoordinator, "join", times=1)
    client = make_client()
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 503
    # A different model (compatible alignment) completes the pending size.
    reply = client.post("/negotiate", json={"required_alignment": 32, "model": "other"})
    assert reply.status_code == 200 and reply.json()["chunk_size"] == 288
    assert runtime_of(client).coordinator.membership is not None
    assert runtime_of(client).coordinator.membership.chunk_size == 288  # type: ignore[union-attr]


def open_session(client: TestClient, request_id: str) -> None:
    runtime = runtime_of(client)
    runtime.sessions.keys_for(
        request_id, "ns", None, np.arange(600, dtype=np.int32), chunk_size=288
    )


def test_resize_refused_after_sessions_started(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_times(monkeypatch, Telemetry, "bind", times=1)
    client = make_client()
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 503
    open_session(client, "req-1")  # sessions run on the bound hasher/session manager
    assert client.get("/health").json()["sessions"] == 1

    reply = client.post("/negotiate", json={"required_alignment": 64})
    assert reply.status_code == 409
    problem = reply.json()
    assert problem["type"].endswith("resize-after-sessions")
    assert problem["chunk_size"] == 288 and problem["live_sessions"] == 1
    assert client.get("/chunk-size").json()["chunk_size"] == 288

    # A negotiation that needs no resize still succeeds (and completes the bindings).
    reply = client.post("/negotiate", json={"required_alignment": 48})
    assert reply.status_code == 200 and reply.json()["chunk_size"] == 288
    assert client.get("/chunk-size").json()["final"] is True


def test_reselect_before_final_when_no_sessions(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, int]]
) -> None:
    fail_times(monkeypatch, Telemetry, "bind", times=1)
    client = make_client()
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 503
    reply = client.post("/negotiate", json={"required_alignment": 64})
    # lcm(96, 64) = 192 -> 384: every alignment seen so far still divides it.
    assert reply.status_code == 200 and reply.json()["chunk_size"] == 384
    assert [c for c in calls if c[1] == 384] == [
        ("token_hasher", 384),
        ("session_manager", 384),
        ("telemetry", 384),
        ("coordinator", 384),
    ]
    assert client.post("/negotiate", json={"required_alignment": 96}).json()["chunk_size"] == 384


def test_pipeline_unit_resume() -> None:
    seen: list[str] = []
    failures = {"b": 1}

    def step(name: str) -> Callable[[int], None]:
        def bind(size: int) -> None:
            seen.append(name)
            if failures.get(name, 0) > 0:
                failures[name] -= 1
                raise RuntimeError("boom")

        return bind

    pipeline = BindingPipeline(
        [
            Binding("a", step("a")),
            Binding("off", step("off"), enabled=False),
            Binding("b", step("b")),
            Binding("c", step("c")),
        ]
    )
    with pytest.raises(BindingFailed, match="'b' failed"):
        pipeline.run(10)
    assert pipeline.status() == {"a": "done", "off": "disabled", "b": "failed", "c": "pending"}
    pipeline.run(10)
    assert seen == ["a", "b", "b", "c"]
    with pytest.raises(ValueError, match="unique"):
        BindingPipeline([Binding("a", step("a")), Binding("a", step("a"))])


def test_the_final_size_is_one_frozen_value_behind_one_guard(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_times(monkeypatch, Telemetry, "bind", times=1)
    client = make_client()
    authority = runtime_of(client).chunk_size
    with pytest.raises(NotNegotiated, match="negotiate first"):
        authority.final()
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 503
    # Selected but not final (a binding failed): still refused, with the caller's why.
    with pytest.raises(NotNegotiated, match="before registering KV caches"):
        authority.final(before="registering KV caches")
    assert client.post("/negotiate", json={"required_alignment": 96}).status_code == 200
    assert authority.final() == FinalChunkSize(288)
    assert authority.final() is authority.final()
