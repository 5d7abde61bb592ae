"""Server settings: ``MPCACHE_*`` environment variables, overridden by CLI flags.

Loaded once (by the CLI or by the app's lifespan), validated, then injected.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "parse_size"]

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_SCALE = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``1073741824``, ``512MiB``, ``4GiB``, ``4g``.

    ``KiB``/``MiB``/``GiB``/``TiB`` and bare ``K``/``M``/``G``/``T`` are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` are powers of 1000.
    """
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '4GiB'")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError("a size must be a number of bytes or a string like '4GiB'")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 1073741824, 512MiB or 4GiB")
    number, unit, binary, _ = match.groups()
    exp = _SCALE[unit.lower()]
    base = 1000 if unit and not binary and match.group(4) else 1024
    size = float(number) * base**exp
    if size != int(size):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MPCACHE_", frozen=True, extra="ignore")

    chunk_size: int = Field(256, ge=1, description="Minimum chunk size in tokens.")
    max_chunk_size: int = Field(
        65536, ge=1, description="Largest chunk size a negotiation may select, in tokens."
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    session_ttl_s: float = Field(600.0, gt=0, description="Idle time before a session ends.")
    enable_blend: bool = Field(False, description="Enable the CacheBlend matcher.")
    coordinator_url: str | None = Field(
        None, description="Networked coordinator (not yet supported; standalone if unset)."
    )
    log_level: str = "info"
    pool_size: int = Field(
        1 << 30, ge=4096, description="Bytes of the shared-memory cache pool (e.g. '4GiB')."
    )
    pool_page_size: int = Field(
        64 << 10, ge=4096, description="Pool page size in bytes (a power of two)."
    )
    pool_prefault: bool = Field(
        True, description="Populate the pool's page tables in the background at start."
    )
    lease_ttl_s: float = Field(
        30.0, ge=0, description="How long a lookup keeps its hits from eviction (0: never)."
    )
    copy_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="Threads one copy may use (torch intra-op); 0: min(4, cores).",
    )

    @field_validator("pool_size", "pool_page_size", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> int:
        return parse_size(value)

    @model_validator(mode="after")
    def _bounds(self) -> Settings:
        if self.max_chunk_size < self.chunk_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must be >= chunk_size ({self.chunk_size})"
            )
        if self.pool_page_size & (self.pool_page_size - 1):
            raise ValueError(f"pool_page_size ({self.pool_page_size}) must be a power of two")
        if self.pool_size < self.pool_page_size:
            raise ValueError(
                f"pool_size ({self.pool_size}) must be at least one page ({self.pool_page_size})"
            )
        return self
