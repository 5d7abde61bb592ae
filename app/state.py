"""Runtime: every piece of server state, built once by the app's lifespan.

Nothing lives in module globals. ``Runtime.close`` releases what the runtime owns.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from app.bindings import Binding, BindingPipeline
from app.blend import BlendMatcher
from app.chunk_size import ChunkSizeAuthority
from app.coordinator import Coordinator, StandaloneCoordinator
from app.errors import InvalidRequest
from app.hashing import TokenHasher
from app.negotiation import NegotiationPolicy
from app.sessions import SessionManager
from app.settings import Settings
from app.telemetry import Telemetry

__all__ = ["BINDING_ORDER", "Runtime", "build_runtime"]

BINDING_ORDER = ("token_hasher", "session_manager", "blend_matcher", "telemetry", "coordinator")


@dataclass
class Runtime:
    settings: Settings
    boot_id: str
    started_at: float
    hasher: TokenHasher
    sessions: SessionManager
    blend: BlendMatcher
    telemetry: Telemetry
    coordinator: Coordinator
    pipeline: BindingPipeline
    chunk_size: ChunkSizeAuthority
    closed: bool = field(default=False)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sessions.close()
        self.coordinator.leave()


def build_runtime(settings: Settings) -> Runtime:
    boot_id = uuid.uuid4().hex
    if settings.coordinator_url:
        raise InvalidRequest(
            "MPCACHE_COORDINATOR_URL is set but networked coordinators are not supported "
            "yet; unset it to run standalone"
        )
    hasher = TokenHasher()
    sessions = SessionManager(hasher, settings.session_ttl_s)
    blend = BlendMatcher(settings.enable_blend)
    telemetry = Telemetry()
    coordinator = StandaloneCoordinator(boot_id)
    pipeline = BindingPipeline(
        [
            Binding("token_hasher", hasher.bind),
            Binding("session_manager", sessions.bind),
            Binding("blend_matcher", blend.bind, enabled=blend.enabled),
            Binding("telemetry", telemetry.bind),
            Binding("coordinator", coordinator.join),
        ]
    )
    assert pipeline.names == BINDING_ORDER
    authority = ChunkSizeAuthority(
        NegotiationPolicy(settings.chunk_size, settings.max_chunk_size),
        pipeline,
        sessions.live_count,
        telemetry,
    )
    return Runtime(
        settings=settings,
        boot_id=boot_id,
        started_at=time.monotonic(),
        hasher=hasher,
        sessions=sessions,
        blend=blend,
        telemetry=telemetry,
        coordinator=coordinator,
        pipeline=pipeline,
        chunk_size=authority,
    )
