"""Request ids and cache salts past a server field's length travel as digests."""

from __future__ import annotations

from contract.wire_text import MAX_TEXT_CHARS, end_sessions, wire_salt, wire_text


def test_texts_a_field_takes_travel_unchanged() -> None:
    for text in ("req-7", "x" * MAX_TEXT_CHARS, "é" * MAX_TEXT_CHARS):
        assert wire_text(text) == text
    assert wire_salt(None) is None


def test_longer_texts_become_distinct_digests_a_field_takes() -> None:
    a, b = "a" * MAX_TEXT_CHARS + "1", "a" * MAX_TEXT_CHARS + "2"
    assert wire_text(a) == wire_text(a)
    assert wire_text(a) != wire_text(b)  # not a cut: texts equal up to the limit differ
    assert len(wire_text(a)) <= MAX_TEXT_CHARS
    assert wire_text("\ud800" * 300)  # a lone surrogate (vLLM takes any str) still hashes


def test_ending_sessions_names_them_as_the_calls_that_opened_them() -> None:
    long_id = "r" * (MAX_TEXT_CHARS + 1)
    body = end_sessions(["req-7", long_id])
    assert body.request_ids == ["req-7", wire_text(long_id)]
