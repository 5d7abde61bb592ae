"""The ``mpcache`` command.

- ``mpcache server [--flag ...]`` runs the server. Its flags are generated from
  ``app.settings.Settings`` (pydantic-settings CLI support): each setting, its
  default and its help are written once, there. Flags override ``MPCACHE_*``.
- ``mpcache health | chunk-size | stats [--url URL] [--json]`` ask a running server.
  Without ``--url`` they find it the way the server was configured: the URL in
  ``MPCACHE_ADDRESS_FILE`` if that file exists, else ``MPCACHE_HOST``/``MPCACHE_PORT``
  (loopback for a wildcard host). Exit status 1 when the server cannot be reached.
- ``mpcache --version``; bare ``mpcache`` prints the help (exit status 2).

Bad flags and variables fail fast, in one line naming the flag or variable, before
anything heavy (torch, the data plane) is imported. So does an address the server
cannot listen on: the CLI binds the socket itself and hands it to uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ByteSize, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliSettingsSource,
    CliSubCommand,
    CliToggleFlag,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    get_subcommand,
)

from app.settings import Settings, env_name, unknown_variables
from contract import __version__

__all__ = ["main", "metric_samples", "parse_settings"]

logger = logging.getLogger(__name__)

PROG = "mpcache"


class _ClientCommand(BaseModel):
    url: str | None = Field(
        None,
        description="Server base URL. Default: the URL in MPCACHE_ADDRESS_FILE if that file "
        "exists, else http://MPCACHE_HOST:MPCACHE_PORT (loopback for 0.0.0.0 and ::).",
    )
    json_: bool = Field(False, alias="json", description="Print the server's reply as JSON.")
    timeout_s: float = Field(5.0, gt=0, description="Seconds to wait for the server.")


class HealthCommand(_ClientCommand):
    """Check that the server answers; exit status 1 if it does not."""


class ChunkSizeCommand(_ClientCommand):
    """Show the server's chunk size, its negotiation state and bindings."""


class StatsCommand(_ClientCommand):
    """Show cache, pool and request statistics (read from /metrics)."""


class Cli(BaseSettings):
    """mpcache: an external KV-cache server for vLLM, and a client for it."""

    model_config = SettingsConfigDict(cli_prog_name=PROG, cli_kebab_case=True)

    version: CliToggleFlag[bool] = Field(False, description="Print the version and exit.")
    server: CliSubCommand[Settings] = Field(description="Run the server.")
    health: CliSubCommand[HealthCommand] = Field(description="Is the server up?")
    chunk_size: CliSubCommand[ChunkSizeCommand] = Field(
        description="The server's chunk size and its bindings."
    )
    stats: CliSubCommand[StatsCommand] = Field(description="Cache and pool statistics.")

    def cli_cmd(self) -> None:
        """Parsing only: ``main`` dispatches."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The command line only (it is added to these): a shell's VERSION or SERVER
        # variable must not reach the root. Server settings read MPCACHE_* themselves.
        return (init_settings,)


# ------------------------------------------------------------------------ parsing


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=PROG, description=Cli.__doc__)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _describe(exc: ValidationError, argv: Sequence[str]) -> str:
    """One line per error, naming the flag (or the MPCACHE_* variable) it came from."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        if loc and loc[0] in Settings.model_fields:  # Settings() read from the environment
            loc = ["server", *loc]
        field = loc[1] if len(loc) > 1 else None
        msg = err["msg"].removeprefix("Value error, ")
        if field is None:
            lines.append(f"{PROG}: invalid settings: {msg}")
            continue
        flag = _flag(field.rstrip("_"))
        from_env = loc[0] == "server" and not _given(argv, flag)
        where = env_name(field) if from_env else flag
        value = err.get("input")
        shown = (
            f" (got {value!r})" if isinstance(value, str | int) and repr(value) not in msg else ""
        )
        lines.append(f"{PROG}: invalid {where}: {msg}{shown}")
    return "\n".join(lines)


def _parse(argv: Sequence[str]) -> tuple[Cli, argparse.ArgumentParser]:
    parser = _parser()
    source: CliSettingsSource[Cli] = CliSettingsSource(
        Cli,
        root_parser=parser,
        cli_prog_name=PROG,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=True,
    )
    try:
        cli = CliApp.run(Cli, cli_args=list(argv), cli_settings_source=source)
    except ValidationError as exc:
        raise SystemExit(_describe(exc, argv)) from None
    except SettingsError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    return cli, parser


def _check_environment() -> None:
    problems = unknown_variables(os.environ)
    if problems:
        raise SystemExit("\n".join(f"{PROG}: {p}" for p in problems))


def parse_settings(argv: Sequence[str]) -> Settings:
    """Settings of ``mpcache server ...`` (env, then flags); SystemExit on bad input."""
    cli, _ = _parse(argv)
    command = get_subcommand(cli, is_required=False)
    if not isinstance(command, Settings):
        raise SystemExit(f"{PROG}: expected the server command, got {list(argv)}")
    return command


# ------------------------------------------------------------------------- server


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; SystemExit naming both if that is impossible."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise SystemExit(f"{PROG}: cannot listen on {where}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = " (another process listens there; choose another --port)"
        raise SystemExit(f"{PROG}: cannot listen on {where}: {exc.strerror}{hint}") from None
    return sock


def _local_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for a server bound to ``host:port``."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def _address_file(path: Path | None, url: str) -> Iterator[None]:
    if path is None:
        yield
        return
    path.write_text(url + "\n")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if path.read_text().strip() == url:
                path.unlink()


READ_BUFFER_BYTES = 4 << 20
"""How much of a request body uvicorn buffers before it waits for the app."""


def _read_request_bodies_whole() -> None:
    """Let uvicorn buffer up to ``READ_BUFFER_BYTES`` of a request body, not 64 KiB.

    At its 64 KiB high-water mark uvicorn stops reading the socket until the app has
    taken what it holds, so a body arrives in rounds through the event loop: a
    1 MiB lookup frame (a burst of 64 new 4k-token requests) then takes several
    times longer to arrive than the socket needs to move it
    (``bench/scheduler_burst_bench.py`` measures the burst). uvicorn has no setting
    for it, so the constant its protocol
    modules import is raised here, for this server only (plain ``uvicorn
    app.main:app`` keeps uvicorn's default). The bound per connection stays.
    """
    import importlib

    for name in ("h11_impl", "httptools_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:  # httptools is optional
            continue
        limit = getattr(module, "HIGH_WATER_LIMIT", None)
        if isinstance(limit, int):
            setattr(module, "HIGH_WATER_LIMIT", max(limit, READ_BUFFER_BYTES))  # noqa: B010


def _connection_limit(settings: Settings) -> int:
    """``--max-connections``, fitted to the open-file limit (raised first)."""
    from app.connections import RESERVED_DESCRIPTORS, fit_connections, open_file_limit

    soft = open_file_limit()
    limit = fit_connections(settings.max_connections, soft)
    if limit < settings.max_connections:
        logger.warning(
            "--max-connections %d lowered to %d: the open-file limit is %d and the server "
            "keeps %d descriptors for the rest (raise it with `ulimit -n`)",
            settings.max_connections,
            limit,
            soft,
            RESERVED_DESCRIPTORS,
        )
    return limit


def _exit_on_signal(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def serve(settings: Settings) -> None:
    from app.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    sock = _listen(settings.host, settings.port)
    port = int(sock.getsockname()[1])
    url = _local_url(settings.host, port)

    # Heavy imports (torch) from here on.
    from contract.errors import SharedMemoryExhausted
    from contract.shm_naming import check_free_space
    from dataplane.segments import sweep_stale_segments

    try:
        # Segments of crashed servers and workers must not count against the check.
        sweep_stale_segments()
        check_free_space(settings.pool_size)
    except SharedMemoryExhausted as exc:
        sock.close()
        raise SystemExit(f"{PROG}: {exc.detail}") from None
    from app.state import StartupRefused, preflight

    try:
        preflight(settings)
    except StartupRefused as exc:
        sock.close()
        raise SystemExit(f"{PROG}: {exc}") from None
    if settings.port == 0:
        settings = settings.model_copy(update={"port": port})  # members advertise it
    import uvicorn

    from app.connections import ConnectionGuard, guarded_protocol
    from app.main import create_app

    _read_request_bodies_whole()
    guard = ConnectionGuard(
        max_connections=_connection_limit(settings),
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )

    logger.info(
        "mpcache %s listening on %s:%d: API %s, docs %s/docs, metrics %s/metrics",
        __version__,
        settings.host,
        port,
        url,
        url,
        url,
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=port,
        log_config=None,  # configured above (app.logs)
        lifespan="on",
        # Header and body timeouts and the connection limit (app.connections).
        http=guarded_protocol(guard),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        # SIGTERM: requests in flight get this long, then are cancelled; the lifespan
        # then stops store/retrieve at their next chunk (app.state, Runtime.close).
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s),
    )
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again; exit through
    # Python then, so that cleanups (the address file) run.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        with _address_file(settings.address_file, url):
            server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise SystemExit(3)  # uvicorn's "startup failed"; the log says why


# ------------------------------------------------------------------------- client


def _client_url(command: _ClientCommand) -> str:
    if command.url:
        return command.url.rstrip("/")
    try:
        settings = Settings()
    except ValidationError as exc:
        raise SystemExit(_describe(exc, [])) from None
    if settings.address_file is not None and settings.address_file.exists():
        return settings.address_file.read_text().strip().rstrip("/")
    return _local_url(settings.host, settings.port)


def _get(url: str, path: str, timeout_s: float) -> Any:
    import httpx

    try:
        reply = httpx.get(f"{url}{path}", timeout=timeout_s)
    except httpx.TimeoutException:
        raise SystemExit(f"{PROG}: {url} did not answer within {timeout_s:g}s") from None
    except httpx.HTTPError as exc:
        raise SystemExit(f"{PROG}: cannot reach {url}: {exc}") from None
    if reply.status_code != 200:
        raise SystemExit(f"{PROG}: {url}{path} answered HTTP {reply.status_code}: {reply.text}")
    return reply.json() if path != "/metrics" else reply.text


def _table(rows: Sequence[tuple[str, object]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _size_text(size: int | None, final: bool) -> str:
    if size is None:
        return "not selected yet (no negotiation so far)"
    return f"{size} tokens" + (" (final)" if final else " (selected, not final yet)")


def _health(command: HealthCommand, url: str) -> str:
    from contract.schemas import HealthResponse

    body = _get(url, "/health", command.timeout_s)
    if command.json_:
        return json.dumps(body, indent=2)
    health = HealthResponse.model_validate(body)
    return _table(
        [
            ("server", f"{url}: {health.status}"),
            ("version", health.version),
            ("boot_id", health.boot_id),
            ("uptime", f"{health.uptime_s:.1f} s"),
            ("chunk size", _size_text(health.chunk_size, health.final)),
            ("sessions", health.sessions),
            ("registrations", health.registrations),
            *_cluster_rows(health.cluster),
        ]
    )


def _cluster_rows(cluster: Any) -> list[tuple[str, object]]:
    """The deployment line of ``mpcache health`` (none from a server without one)."""
    if cluster is None:
        return []
    text = f"{cluster.deployment}: coordinator {cluster.coordinator}, L2 {cluster.l2}"
    return [("deployment", text)]


def _chunk_size(command: ChunkSizeCommand, url: str) -> str:
    from contract.schemas import ChunkSizeResponse

    body = _get(url, "/chunk-size", command.timeout_s)
    if command.json_:
        return json.dumps(body, indent=2)
    reply = ChunkSizeResponse.model_validate(body)
    return _table(
        [
            ("chunk size", _size_text(reply.chunk_size, reply.final)),
            ("minimum", f"{reply.min_chunk_size} tokens"),
            ("maximum", f"{reply.max_chunk_size} tokens"),
            ("alignments", ", ".join(map(str, reply.alignments)) or "none yet"),
            ("bindings", ", ".join(f"{k} {v}" for k, v in reply.bindings.items())),
        ]
    )


def metric_samples(text: str) -> dict[str, float]:
    """``name`` or ``name{label=value,...}`` -> value, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _stats(command: StatsCommand, url: str) -> str:
    samples = metric_samples(_get(url, "/metrics", command.timeout_s))
    if command.json_:
        return json.dumps(samples, indent=2, sort_keys=True)

    def value(name: str) -> int:
        return int(samples.get(name, 0))

    used, capacity = value("mpcache_pool_used_bytes"), value("mpcache_pool_capacity_bytes")
    hits, misses = value("mpcache_chunks_hit_total"), value("mpcache_chunks_missed_total")
    looked_up = hits + misses
    hit_rate = f" ({100 * hits / looked_up:.1f}% hit)" if looked_up else ""
    negotiations = ", ".join(
        f"{key.split('=', 1)[1].rstrip('}')} {int(v)}"
        for key, v in sorted(samples.items())
        if key.startswith("mpcache_negotiations_total{")
    )
    requests = []
    for key, count in sorted(samples.items()):
        if key.startswith("mpcache_cache_op_duration_seconds_count{") and count:
            op = key.split("=", 1)[1].rstrip("}")
            total = samples[key.replace("_count{", "_sum{")]
            requests.append(f"{op} {int(count)} ({1000 * total / count:.2f} ms mean)")
    return _table(
        [
            ("chunk size", value("mpcache_chunk_size_tokens") or "not selected yet"),
            ("sessions", value("mpcache_sessions")),
            ("registrations", value("mpcache_registrations")),
            (
                "pool",
                f"{ByteSize(used).human_readable()} of {ByteSize(capacity).human_readable()} "
                f"used ({100 * used / capacity if capacity else 0:.1f}%)",
            ),
            (
                "chunks",
                f"stored {value('mpcache_chunks_stored_total')}, looked up {looked_up}"
                f"{hit_rate}, evicted {value('mpcache_chunks_evicted_total')}",
            ),
            (
                "copied",
                f"store {ByteSize(value('mpcache_copied_bytes_total{op=store}')).human_readable()}"
                ", retrieve "
                f"{ByteSize(value('mpcache_copied_bytes_total{op=retrieve}')).human_readable()}",
            ),
            ("negotiations", negotiations or "none"),
            ("cache ops", ", ".join(requests) or "none"),
        ]
    )


# --------------------------------------------------------------------------- main


def _stream_long_copies() -> None:
    """Re-execute this process with streaming stores for long copies turned on.

    glibc reads the tunable only at process start (``dataplane.streaming`` says why
    and what it buys); does nothing when it is already set, or not x86-64 glibc.
    """
    from dataplane import streaming

    env = streaming.environment(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None and args[:1] == ["server"]:
        _stream_long_copies()  # as a program only: never re-runs a host process
    cli, parser = _parse(args)
    if cli.version:
        print(f"{PROG} {__version__}")
        return
    command = get_subcommand(cli, is_required=False)
    if command is None:
        parser.print_help()
        raise SystemExit(2)
    _check_environment()
    if isinstance(command, Settings):
        serve(command)
        return
    assert isinstance(command, _ClientCommand)
    url = _client_url(command)
    if isinstance(command, HealthCommand):
        print(_health(command, url))
    elif isinstance(command, ChunkSizeCommand):
        print(_chunk_size(command, url))
    else:
        assert isinstance(command, StatsCommand)
        print(_stats(command, url))
