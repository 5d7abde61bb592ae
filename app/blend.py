"""CacheBlend matcher: which chunks of a token sequence are cached anywhere.

Unlike the prefix chain, a content key depends only on a chunk's own tokens
(``TokenHasher.content_keys``), so a chunk reused at another position (a retrieved
document placed elsewhere in a prompt) is still found. Bound to the chunk size like
the other bindings; while disabled its binding reads ``disabled``.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["BlendMatcher"]


class BlendMatcher:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._chunk_size: int | None = None
        self._refs: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    @property
    def chunk_size(self) -> int | None:
        return self._chunk_size

    def bind(self, chunk_size: int) -> None:
        with self._lock:
            if self._chunk_size != chunk_size:
                self._refs.clear()
            self._chunk_size = chunk_size

    def add(self, content_key: bytes) -> None:
        with self._lock:
            self._refs[content_key] += 1

    def discard(self, content_key: bytes) -> None:
        with self._lock:
            left = self._refs[content_key] - 1
            if left > 0:
                self._refs[content_key] = left
            else:
                self._refs.pop(content_key, None)

    def match(self, content_keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._refs for key in content_keys]
