"""The chunk-size rule both sides apply: the seed's examples and its edges."""

from __future__ import annotations

import pytest

from contract.chunking import is_aligned, lcm_of_spans, smallest_multiple_at_least


@pytest.mark.parametrize(
    ("spans", "minimum", "alignment", "final"),
    [
        pytest.param((256,), 256, 256, 256, id="seed-256"),
        pytest.param((544,), 256, 544, 544, id="seed-544"),
        pytest.param((544,), 600, 544, 1088, id="seed-544-min-600"),
        pytest.param((32, 48), 256, 96, 288, id="seed-32-and-48"),
        pytest.param((16, 16, 64), 100, 64, 128, id="repeated-spans"),
        pytest.param((7,), 1, 7, 7, id="minimum-below-alignment"),
    ],
)
def test_seed_rule(spans: tuple[int, ...], minimum: int, alignment: int, final: int) -> None:
    assert lcm_of_spans(spans) == alignment
    assert smallest_multiple_at_least(alignment, minimum) == final
    assert all(is_aligned(final, span) for span in spans)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: lcm_of_spans([]), id="no-spans"),
        pytest.param(lambda: lcm_of_spans([16, 0]), id="zero-span"),
        pytest.param(lambda: smallest_multiple_at_least(0, 256), id="zero-alignment"),
        pytest.param(lambda: smallest_multiple_at_least(16, 0), id="zero-minimum"),
    ],
)
def test_non_positive_inputs_are_refused(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_alignment_check() -> None:
    assert is_aligned(288, 96) and is_aligned(288, 32)
    assert not is_aligned(288, 64)
    assert not is_aligned(0, 16) and not is_aligned(16, 0)
