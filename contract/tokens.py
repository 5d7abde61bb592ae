"""Token ids on the wire: little-endian int32, raw or as base64 text.

The connector packs a request's token ids once (``TokenEncoder``, or ``pack_tokens``)
and sends them raw in the binary lookup form (``contract.frames``) or as base64 text
in JSON (``tokens_b64``, ``encode_tokens``); the server decodes either
(``decode_tokens``, ``contract.frames.decode_lookup_frame``). A JSON list of ints is
accepted too (``contract.schemas.TokenSpan``), but parsing a long list costs far more
than either compact form, so the connector never sends one.

Packing goes through ``struct`` with an explicit little-endian format: it converts a
Python list faster than ``array("i", ...)`` or ``numpy.array`` (bench/
token_pack_bench.py measures struct against the connector's own kernel), and is
the same bytes on every host.
"""

from __future__ import annotations

import base64
import binascii
import struct
import threading
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "TOKEN_DTYPE",
    "PackRange",
    "TokenEncoder",
    "check_tokens",
    "decode_tokens",
    "encode_tokens",
    "pack_range",
    "pack_tokens",
]

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids on the wire: little-endian int32, non-negative."""


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (``struct.error`` past int32)."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def pack_range(tokens: Sequence[int], start: int, end: int) -> bytes:
    """``pack_tokens(tokens[start:end])``: the ``PackRange`` a ``TokenEncoder`` uses
    unless it is given another (the connector's native one, ``connector.tokenpack``)."""
    return pack_tokens(tokens[start:end])


PackRange = Callable[[Sequence[int], int, int], bytes]
"""``(tokens, start, end)`` to the little-endian int32 bytes of ``tokens[start:end]``."""


def encode_tokens(tokens: Sequence[int]) -> str:
    """Token ids as base64 of little-endian int32."""
    return base64.b64encode(pack_tokens(tokens)).decode("ascii")


def check_tokens(tokens: np.ndarray, what: str = "tokens") -> np.ndarray:
    """``tokens`` unchanged; ``ValueError`` if any id is negative."""
    if tokens.size and int(tokens.min()) < 0:
        raise ValueError(f"{what} holds a negative token id")
    return tokens


DECODE_SLICE_CHARS = 1 << 20
"""Long base64 text is decoded in slices of this many characters: ``b64decode``
holds the GIL for its whole call, so a server thread decoding a very large body in
one call would stall the event loop that answers ``/health`` for the whole decode;
a slice holds it for a short while only."""


def decode_tokens(text: str) -> np.ndarray:
    """The int32 token ids ``text`` encodes; ``ValueError`` names what is wrong.

    Takes exactly what ``contract.schemas.TOKENS_B64_PATTERN`` describes."""
    try:
        if len(text) % 4:  # b64decode would take a stray "=" after a whole quantum
            raise binascii.Error("its length is not a multiple of 4")
        if len(text) <= DECODE_SLICE_CHARS:
            raw = base64.b64decode(text, validate=True)
        else:
            if text.find("=", 0, len(text) - 2) != -1:  # padding only at the very end
                raise binascii.Error("padding before the end")
            raw = b"".join(
                base64.b64decode(text[i : i + DECODE_SLICE_CHARS], validate=True)
                for i in range(0, len(text), DECODE_SLICE_CHARS)
            )
    except binascii.Error as exc:
        raise ValueError(f"tokens_b64 is not valid base64: {exc}") from exc
    if len(raw) % 4:
        raise ValueError("tokens_b64 must decode to a whole number of int32 values")
    return check_tokens(np.frombuffer(raw, dtype=TOKEN_DTYPE), "tokens_b64")


class TokenEncoder:
    """One request's token ids, packed once as its token list grows.

    A long prompt is packed once; later calls only pack the tokens added since.
    Thread-safe: the scheduler packs a lookup on the connector's lookup thread and
    the store and load plans on vLLM's thread, from the same packed bytes. The
    bytes are immutable, so the first pack of a prompt (a lookup's) is handed out
    as it is, without a copy.
    """

    __slots__ = ("_lock", "_pack", "_packed")

    def __init__(self, pack: PackRange = pack_range) -> None:
        self._packed = b""
        self._pack = pack
        self._lock = threading.Lock()

    def packed(self, tokens: Sequence[int], end: int) -> bytes:
        """Little-endian int32 bytes of ``tokens[:end]``."""
        with self._lock:
            have = len(self._packed) // 4
            if end > have:
                more = self._pack(tokens, have, end)
                self._packed = self._packed + more if have else more
            packed = self._packed
        return packed if len(packed) == 4 * end else packed[: 4 * end]

    def encode(self, tokens: Sequence[int], end: int) -> str:
        """Base64 of ``packed(tokens, end)`` (the ``tokens_b64`` form)."""
        return base64.b64encode(self.packed(tokens, end)).decode("ascii")
