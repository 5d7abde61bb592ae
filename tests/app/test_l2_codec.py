"""The L2 value format and key (pure): what is checked before a chunk is served."""

from __future__ import annotations

import pytest

from app.l2 import l2_key
from app.l2_values import CorruptValue, decode_value, encode_header, seal

KEY = bytes(range(16))
LAYOUT = bytes(range(16, 32))


def _value(payload: bytes, *, present: int = 0b1011, rank: int = 0) -> bytes:
    header = encode_header(KEY, rank, LAYOUT, present)
    buf = bytearray(header + payload)
    seal(buf, len(header))
    return bytes(buf)


def test_round_trip() -> None:
    value = decode_value(_value(b"kv" * 100), chunk_key=KEY, rank=0, layout=LAYOUT, max_bytes=1024)
    assert value.present == 0b1011
    assert bytes(value.payload) == b"kv" * 100


def _flip(raw: bytes, at: int) -> bytes:
    at %= len(raw)
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]


@pytest.mark.parametrize(
    ("raw", "kwargs", "reason"),
    [
        pytest.param(_flip(_value(b"x" * 64), -1), {}, "checksum", id="payload-bit-flip"),
        pytest.param(_flip(_value(b"x" * 64), 62), {}, "checksum", id="present-bit-flip"),
        pytest.param(_value(b"x" * 64)[:-1], {}, "length", id="truncated"),
        pytest.param(b"MPL3" + _value(b"x")[4:], {}, "format", id="other-format"),
        pytest.param(_value(b"x"), {"rank": 1}, "another chunk", id="other-rank"),
        pytest.param(_value(b"x"), {"layout": bytes(16)}, "another chunk", id="other-layout"),
        pytest.param(_value(b"x"), {"chunk_key": bytes(16)}, "another chunk", id="other-key"),
        pytest.param(_value(b"x" * 5000), {"max_bytes": 100}, "bound", id="too-large"),
        pytest.param(b"short", {}, "header", id="garbage"),
    ],
)
def test_refused(raw: bytes, kwargs: dict[str, object], reason: str) -> None:
    args: dict[str, object] = {"chunk_key": KEY, "rank": 0, "layout": LAYOUT, "max_bytes": 4096}
    with pytest.raises(CorruptValue, match=reason):
        decode_value(raw, **{**args, **kwargs})  # type: ignore[arg-type]


def test_key_names_everything_that_makes_a_chunk_valid() -> None:
    base = {
        "deployment": "prod",
        "namespace": "llama@abc",
        "chunk_size": 256,
        "layout": LAYOUT,
        "world_size": 2,
        "rank": 1,
        "chunk_key": KEY,
    }
    key = l2_key(**base)  # type: ignore[arg-type]
    assert key.startswith(b"mpcache:l2:v1:prod:") and key.endswith(KEY.hex().encode())
    for field, other in [
        ("deployment", "dev"),
        ("namespace", "llama@def"),
        ("chunk_size", 512),
        ("layout", bytes(16)),
        ("world_size", 4),
        ("rank", 0),
        ("chunk_key", bytes(16)),
    ]:
        assert l2_key(**{**base, field: other}) != key, field  # type: ignore[arg-type]
