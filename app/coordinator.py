"""Coordinator membership: which chunk size this server serves, as seen by peers.

Two implementations of one ``Coordinator`` protocol (join with the bound chunk size
as the last binding of ``app.bindings``, leave at shutdown, report status):
``StandaloneCoordinator`` (no ``--coordinator-url``: no peers, joining records the
membership locally and succeeds) and ``RedisCoordinator`` (the servers of one
``--deployment`` share a Redis/Valkey; its keys and its faults are on the class,
docs/design.md s.7).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import redis

from app.redis_io import RedisUnavailable, redacted, translated
from contract.errors import Conflict

__all__ = [
    "Coordinator",
    "CoordinatorState",
    "CoordinatorStatus",
    "DeploymentConflict",
    "MemberRecord",
    "Membership",
    "RedisCoordinator",
    "StandaloneCoordinator",
    "deployment_keys",
]

logger = logging.getLogger(__name__)

CoordinatorState = Literal["standalone", "up", "down", "conflict"]


@dataclass(frozen=True)
class Membership:
    member_id: str
    chunk_size: int
    mode: str
    joined_at: float


@dataclass(frozen=True)
class CoordinatorStatus:
    mode: Literal["standalone", "redis"]
    state: CoordinatorState
    deployment: str
    url: str | None
    """Without its password."""
    deployment_chunk_size: int | None
    """The size published for the deployment, as last seen (None: none yet, or standalone)."""
    detail: str | None = None


@dataclass(frozen=True)
class MemberRecord:
    member_id: str
    info: dict[str, Any]
    expires_in_s: float


class DeploymentConflict(Conflict):
    title = "Chunk size differs from the deployment's"
    slug = "deployment-chunk-size-conflict"


class Coordinator(Protocol):
    @property
    def membership(self) -> Membership | None: ...

    def join(self, chunk_size: int) -> Membership: ...

    def leave(self) -> None: ...

    def status(self) -> CoordinatorStatus: ...

    def members(self) -> list[MemberRecord]: ...


class StandaloneCoordinator:
    """No peers: membership is recorded locally."""

    def __init__(self, member_id: str, deployment: str = "default") -> None:
        self._member_id = member_id
        self._deployment = deployment
        self._membership: Membership | None = None

    @property
    def membership(self) -> Membership | None:
        return self._membership

    def join(self, chunk_size: int) -> Membership:
        self._membership = Membership(self._member_id, chunk_size, "standalone", time.time())
        return self._membership

    def leave(self) -> None:
        self._membership = None

    def status(self) -> CoordinatorStatus:
        size = self._membership.chunk_size if self._membership else None
        return CoordinatorStatus("standalone", "standalone", self._deployment, None, size)

    def members(self) -> list[MemberRecord]:
        m = self._membership
        info = {"chunk_size": m.chunk_size if m else None, "hostname": socket.gethostname()}
        return [MemberRecord(self._member_id, info, 0.0)]


def deployment_keys(deployment: str) -> tuple[str, str, str]:
    """(chunk-size key, members sorted set, member-info hash) of a deployment."""
    tag = f"mpcache:{{{deployment}}}"
    return f"{tag}:chunk-size", f"{tag}:members", f"{tag}:member-info"


# KEYS: size, members, info. ARGV: member id, info JSON, ttl ms, chunk size or "".
# Returns {published size or "", 1 if registered else 0}.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(gone) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
local size = redis.call('GET', KEYS[1])
if ARGV[4] ~= '' then
  if not size then
    redis.call('SET', KEYS[1], ARGV[4])
    size = ARGV[4]
  elseif size ~= ARGV[4] then
    return {size, 0}
  end
  redis.call('PEXPIRE', KEYS[1], ttl * 3)
end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ttl * 3)
redis.call('PEXPIRE', KEYS[3], ttl * 3)
return {size or '', 1}
"""

# KEYS: size, members, info. ARGV: member id. The last live member takes the size along.
_LEAVE = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
end
return 1
"""

# KEYS: size, members, info. Returns {size or "", now ms, {id, expiry, ...}, {info, ...}}.
_LIST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf', 'WITHSCORES')
local ids = {}
for i = 1, #live, 2 do ids[#ids + 1] = live[i] end
local infos = {}
if #ids > 0 then infos = redis.call('HMGET', KEYS[3], unpack(ids)) end
for i = 1, #infos do if not infos[i] then infos[i] = '' end end
return {redis.call('GET', KEYS[1]) or '', now, live, infos}
"""


class RedisCoordinator:
    """Membership of one deployment in Redis.

    Keys, all under one hash tag so a Redis Cluster keeps them in one slot::

        mpcache:{<deployment>}:chunk-size    the deployment's final chunk size
        mpcache:{<deployment>}:members       sorted set: member id -> expiry (ms, Redis clock)
        mpcache:{<deployment>}:member-info   hash: member id -> JSON (host, port, size, ...)

    Each step is one Lua script, so it is atomic on the Redis side. ``join`` publishes
    the size if none is published (the first final size wins) and succeeds only when
    its own size equals the published one; otherwise it raises ``DeploymentConflict``
    naming both sizes (the binding fails; the negotiation answers 503 and the next one
    retries this binding). Membership carries a TTL (``--membership-ttl-s``) that a
    background thread renews every third of it, re-publishing the size if Redis lost
    it (a restart without persistence); the published size expires three TTLs after
    its last live member renewed it, and is removed when the last member leaves, so
    an emptied deployment may start over with another size.

    Faults: Redis down at start is refused by ``connect`` (the caller falls back to
    standalone under ``--coordinator-optional``); down at negotiation time fails the
    binding (retried), or under ``--coordinator-optional`` joins locally and verifies
    when Redis answers; down later only marks the state ``down`` (``/health``,
    ``mpcache_coordinator_up``) until a renewal succeeds again.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        url: str,
        deployment: str,
        member_id: str,
        info: dict[str, Any],
        ttl_s: float,
        optional: bool,
        on_state: Any = None,
    ) -> None:
        self._client = client
        self._url = redacted(url)
        self._deployment = deployment
        self._member_id = member_id
        self._info = dict(info)
        self._ttl_ms = max(1000, int(ttl_s * 1000))
        self._optional = optional
        self._keys = deployment_keys(deployment)
        self._renew = client.register_script(_RENEW)
        self._leave = client.register_script(_LEAVE)
        self._list = client.register_script(_LIST)
        self._lock = threading.Lock()
        self._membership: Membership | None = None
        self._state: CoordinatorState = "down"
        self._published: int | None = None
        self._detail: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_state = on_state  # called with the new state ("up", "down", "conflict")

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> None:
        """Register this member (no size yet) and start renewing; raise if unreachable."""
        self._renew_once(raise_errors=True)
        self._thread = threading.Thread(
            target=self._renew_loop, name="mpcache-membership", daemon=True
        )
        self._thread.start()
        logger.info(
            "coordinator %s: member %s of deployment %r (ttl %.0fs)",
            self._url,
            self._member_id,
            self._deployment,
            self._ttl_ms / 1000,
        )

    @property
    def membership(self) -> Membership | None:
        return self._membership

    def join(self, chunk_size: int) -> Membership:
        with self._lock:
            size = str(chunk_size)
            try:
                with translated(f"coordinator {self._url}"):
                    published, registered = self._call_renew(size)
            except RedisUnavailable as exc:
                if not self._optional:
                    raise
                logger.warning(
                    "%s; --coordinator-optional: chunk size %d joins unverified, checked "
                    "when the coordinator answers",
                    exc,
                    chunk_size,
                )
                self._set_state("down", str(exc))
                self._membership = Membership(self._member_id, chunk_size, "redis", time.time())
                return self._membership
            if not registered:
                self._set_state("up", None)
                raise DeploymentConflict(
                    f"deployment {self._deployment!r} serves chunk size {published} "
                    f"(published by its first member at {self._url}), but this server's "
                    f"chunk size would be {chunk_size}; start this server with a "
                    f"--chunk-size that yields {published}, or in another --deployment",
                    deployment=self._deployment,
                    deployment_chunk_size=published,
                    server_chunk_size=chunk_size,
                )
            self._membership = Membership(self._member_id, chunk_size, "redis", time.time())
            self._set_state("up", None)
            logger.info(
                "joined deployment %r at %s with chunk size %d",
                self._deployment,
                self._url,
                chunk_size,
            )
            return self._membership

    def leave(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._membership = None
        try:
            with translated("coordinator leave"):
                self._leave(keys=list(self._keys), args=[self._member_id])
        except RedisUnavailable as exc:
            logger.warning("could not leave deployment %r: %s", self._deployment, exc)
        finally:
            self._client.close()

    # ------------------------------------------------------------------ reads

    def status(self) -> CoordinatorStatus:
        return CoordinatorStatus(
            "redis", self._state, self._deployment, self._url, self._published, self._detail
        )

    def members(self) -> list[MemberRecord]:
        """The deployment's live members (raises ``RedisUnavailable``)."""
        with translated(f"coordinator {self._url}"):
            size, now, live, infos = self._list(keys=list(self._keys))
        self._published = int(size) if size else None
        records = []
        for i, raw in enumerate(infos):
            member_id = live[2 * i].decode()
            expires = (float(live[2 * i + 1]) - int(now)) / 1000
            try:
                info = json.loads(raw) if raw else {}
            except ValueError:
                info = {}
            records.append(MemberRecord(member_id, info, round(expires, 3)))
        return records

    # ------------------------------------------------------------------ internals

    def _call_renew(self, size: str) -> tuple[int | None, bool]:
        info = {**self._info, "chunk_size": int(size) if size else None}
        published, registered = self._renew(
            keys=list(self._keys),
            args=[self._member_id, json.dumps(info), self._ttl_ms, size],
        )
        self._published = int(published) if published else None
        return self._published, bool(registered)

    def _renew_once(self, *, raise_errors: bool = False) -> None:
        with self._lock:
            m = self._membership
            try:
                with translated(f"coordinator {self._url}"):
                    published, registered = self._call_renew(str(m.chunk_size) if m else "")
            except RedisUnavailable as exc:
                if raise_errors:
                    raise
                self._set_state("down", str(exc))
                return
            if registered:
                self._set_state("up", None)
            else:
                self._set_state(
                    "conflict",
                    f"deployment {self._deployment!r} now serves chunk size {published}, "
                    f"this server {m.chunk_size if m else None}; it keeps its size and "
                    "is not listed as a member",
                )

    def _renew_loop(self) -> None:
        period = self._ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                self._renew_once()
            except Exception:  # the renewer must outlive any surprise
                logger.exception("membership renewal failed")

    def _set_state(self, state: CoordinatorState, detail: str | None) -> None:
        previous = self._state
        self._state, self._detail = state, detail
        if state == previous:
            return
        if state == "down":
            logger.warning("coordinator unreachable, membership not renewed: %s", detail)
        elif state == "conflict":
            logger.error("coordinator: %s", detail)
        elif previous in ("down", "conflict") and self._thread is not None:
            logger.info("coordinator reachable again: membership renewed")
        if self._on_state is not None:
            self._on_state(state)


def member_info(host: str, port: int, version: str, l2: bool) -> dict[str, Any]:
    """What a member publishes about itself (``GET /cluster`` lists it)."""
    return {
        "host": host,
        "port": port,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "version": version,
        "l2": l2,
        "started_at": round(time.time(), 3),
    }
