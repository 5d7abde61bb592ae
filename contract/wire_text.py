"""vLLM's free text (request ids, cache salts) as the server's fields take it.

vLLM passes a request's id and ``cache_salt`` from its users unchanged, so either may
be longer than the 256 characters a server field takes (``contract.schemas``). The
connector sends ``wire_text`` of each: the text itself up to ``MAX_TEXT_CHARS``, else a
fixed-length digest of it. Equal texts give equal wire texts, so a long request id
still names one session and a long salt still shares (and isolates) exactly what the
salt itself would; one long id no longer fails its whole lookup batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from contract.schemas import EndSessionsRequest

__all__ = ["MAX_TEXT_CHARS", "end_sessions", "wire_salt", "wire_text"]

MAX_TEXT_CHARS = 256
"""The longest request id or cache salt a server field takes."""

_DIGEST_PREFIX = "blake2b-256:"


def wire_text(text: str) -> str:
    """``text`` if a server field takes it, else ``blake2b-256:<64 hex digits>``."""
    if len(text) <= MAX_TEXT_CHARS:
        return text
    raw = text.encode("utf-8", errors="surrogatepass")
    return _DIGEST_PREFIX + hashlib.blake2b(raw, digest_size=32).hexdigest()


def wire_salt(cache_salt: str | None) -> str | None:
    """``wire_text`` of a cache salt (None: no salt)."""
    return None if cache_salt is None else wire_text(cache_salt)


def end_sessions(request_ids: Iterable[str]) -> EndSessionsRequest:
    """The body that ends vLLM's ``request_ids``' sessions, each as ``wire_text``."""
    return EndSessionsRequest(request_ids=[wire_text(r) for r in request_ids])
