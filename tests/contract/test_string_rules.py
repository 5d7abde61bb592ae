"""The schema's string rules say what the server takes (issue 25, item 5)."""

from __future__ import annotations

import base64
import random
import re
import struct

import pytest

from contract.schemas import NAME_PATTERN, TEXT_PATTERN, TOKENS_B64_PATTERN
from contract.tokens import decode_tokens

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _candidates(rng: random.Random) -> str:
    """Base64 of ids of either sign, random text of its alphabet, or base64 of bytes
    with one character changed: around every edge of the rule."""
    kind = rng.randrange(3)
    if kind == 0:
        n = rng.randrange(0, 9)
        ids = [
            rng.randrange(-(2**31), 2**31) if rng.random() < 0.2 else rng.randrange(2**31)
            for _ in range(n)
        ]
        return base64.b64encode(struct.pack(f"<{n}i", *ids)).decode()
    if kind == 1:
        return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(0, 30)))
    text = base64.b64encode(rng.randbytes(rng.randrange(0, 30))).decode()
    if text:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(_ALPHABET) + text[at + 1 :]
    return text


def _decodes(text: str) -> bool:
    try:
        decode_tokens(text)
    except ValueError:
        return False
    return True


def test_the_tokens_b64_pattern_is_what_decode_tokens_takes() -> None:
    pattern = re.compile(TOKENS_B64_PATTERN)
    rng = random.Random(25)
    seen = {True: 0, False: 0}
    for _ in range(20_000):
        text = _candidates(rng)
        taken = _decodes(text)
        seen[taken] += 1
        assert taken == bool(pattern.fullmatch(text)), text
    assert min(seen.values()) > 1000  # both sides of the rule were tried


@pytest.mark.parametrize(
    ("pattern", "good", "bad"),
    [
        pytest.param(NAME_PATTERN, ["meta-llama/Llama-3.1-8B@3f9a/ws1", " ~"], ["é", "\t", "\x7f"]),
        pytest.param(TEXT_PATTERN, ["engine 0", "mod\u00e8le", "\u2603"], ["a\nb", "\x00", "\x7f"]),
    ],
)
def test_name_and_text_patterns(pattern: str, good: list[str], bad: list[str]) -> None:
    assert all(re.fullmatch(pattern, text) for text in good)
    assert not any(re.fullmatch(pattern, text) for text in bad)
