"""CacheBlend matcher: which chunks of a token sequence are cached anywhere.

Unlike the prefix chain, a content key depends only on a chunk's own tokens
(``TokenHasher.content_keys``), so a chunk reused at another position (a retrieved
document placed elsewhere in a prompt) is still found. Its binding (``bind``) forgets
the keys of any earlier size; while disabled it reads ``disabled``.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["BlendMatcher"]


class BlendMatcher:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._refs: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def bind(self, chunk_size: int) -> None:
        """The ``blend_matcher`` binding. A binding runs once per selected size, so any
        key held now is of another size (content keys are seeded with it): drop them."""
        with self._lock:
            self._refs.clear()

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
