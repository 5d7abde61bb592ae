"""The compact token form: what the connector encodes, the server decodes."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from contract.schemas import TransferItem
from contract.tokens import TokenEncoder, decode_tokens, encode_tokens


def _raw(b64: str) -> list[int]:
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").tolist()


def test_encode_tokens_is_little_endian_int32() -> None:
    tokens = [0, 1, 255, 256, 2**31 - 1]
    assert _raw(encode_tokens(tokens)) == tokens
    assert decode_tokens(encode_tokens(tokens)).tolist() == tokens
    item = TransferItem(
        request_id="r",
        namespace="n",
        tokens_b64=encode_tokens(tokens),
        start_token=0,
        end_token=5,
        block_ids=[[]],
    )
    assert item.token_array().tolist() == tokens


def test_token_encoder_grows_incrementally() -> None:
    tokens = list(range(100))
    enc = TokenEncoder()
    assert _raw(enc.encode(tokens, 10)) == tokens[:10]
    tokens.extend(range(100, 120))
    assert _raw(enc.encode(tokens, 120)) == tokens
    assert _raw(enc.encode(tokens, 64)) == tokens[:64]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("not base64!", "not valid base64", id="alphabet"),
        pytest.param(base64.b64encode(b"\x01\x00\x00").decode(), "whole number", id="ragged"),
        pytest.param(encode_tokens([5, -1]), "negative token id", id="negative"),
    ],
)
def test_malformed_token_text_is_a_value_error_naming_the_fault(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_tokens(text)
