"""``mpcache server ...``: start the server with CLI flags over ``MPCACHE_*`` env."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from app.settings import Settings

__all__ = ["main", "parse_settings"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpcache", description="mpcache KV-cache server")
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser(
        "server", help="run the server", description="Flags override MPCACHE_* variables."
    )
    server.add_argument("--chunk-size", type=int, help="minimum chunk size in tokens (256)")
    server.add_argument("--max-chunk-size", type=int, help="largest selectable chunk size")
    server.add_argument("--host", help="bind address (127.0.0.1)")
    server.add_argument("--port", type=int, help="port (8000)")
    server.add_argument("--session-ttl-s", type=float, help="idle session lifetime (600)")
    server.add_argument(
        "--enable-blend", action="store_true", default=None, help="enable CacheBlend matcher"
    )
    server.add_argument("--log-level", help="uvicorn log level (info)")
    server.add_argument("--pool-size", help="cache pool size, e.g. 4GiB (1GiB)")
    server.add_argument("--pool-page-size", help="cache pool page size, e.g. 64KiB (64KiB)")
    server.add_argument(
        "--pool-prefault",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="populate the pool's page tables at start (on)",
    )
    server.add_argument("--lease-ttl-s", type=float, help="lease on looked-up chunks (30)")
    server.add_argument("--copy-threads", type=int, help="threads per copy; 0 = min(4, cores) (0)")
    return parser


def parse_settings(argv: Sequence[str]) -> Settings:
    """Settings from env, overridden by the flags given; raise SystemExit on bad input."""
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None
    }
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
            for e in exc.errors()
        ]
        raise SystemExit("mpcache: invalid settings:\n" + "\n".join(lines)) from exc


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    from contract.errors import SharedMemoryExhausted
    from contract.shm_naming import check_free_space
    from dataplane.segments import sweep_stale_segments

    try:
        # Segments of crashed servers and workers must not count against the check.
        sweep_stale_segments()
        check_free_space(settings.pool_size)
    except SharedMemoryExhausted as exc:
        raise SystemExit(f"mpcache: {exc.detail}") from exc
    import uvicorn

    from app.main import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
    )
