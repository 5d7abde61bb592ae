"""Server settings: ``MPCACHE_*`` environment variables, overridden by CLI flags.

Loaded once (by the CLI or by the app's lifespan), validated, then injected.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


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

    @model_validator(mode="after")
    def _bounds(self) -> Settings:
        if self.max_chunk_size < self.chunk_size:
            raise ValueError(
                f"max_chunk_size ({self.max_chunk_size}) must be >= chunk_size ({self.chunk_size})"
            )
        return self
