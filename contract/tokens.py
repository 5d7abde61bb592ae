"""The compact token form: token ids as base64 of little-endian int32.

The connector encodes (``encode_tokens``, or ``TokenEncoder`` for a request whose
token list grows step by step); the server decodes (``decode_tokens``). A JSON list
of ints is accepted too (``contract.schemas.TokenSpan``), but parsing a long list
costs far more than decoding base64, so the connector always sends this form.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Sequence

import numpy as np

__all__ = ["TokenEncoder", "decode_tokens", "encode_tokens"]

_SWAP = sys.byteorder != "little"


def encode_tokens(tokens: Sequence[int]) -> str:
    """Token ids as base64 of little-endian int32."""
    packed = array("i", tokens)
    if _SWAP:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_tokens(text: str) -> np.ndarray:
    """The int32 token ids ``text`` encodes; ``ValueError`` names what is wrong."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"tokens_b64 is not valid base64: {exc}") from exc
    if len(raw) % 4:
        raise ValueError("tokens_b64 must decode to a whole number of int32 values")
    tokens = np.frombuffer(raw, dtype="<i4")
    if tokens.size and int(tokens.min()) < 0:
        raise ValueError("tokens_b64 holds a negative token id")
    return tokens


class TokenEncoder:
    """Incremental ``encode_tokens`` for one request's growing token list.

    A long prompt is packed once; later steps only pack the tokens they add.
    """

    __slots__ = ("_packed",)

    def __init__(self) -> None:
        self._packed = array("i")

    def encode(self, tokens: Sequence[int], end: int) -> str:
        have = len(self._packed)
        if end > have:
            more = array("i", tokens[have:end])
            if _SWAP:  # pragma: no cover
                more.byteswap()
            self._packed.extend(more)
        return base64.b64encode(memoryview(self._packed)[:end].tobytes()).decode("ascii")
