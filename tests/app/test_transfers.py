"""What store and retrieve share (app/transfers.py): deadlines, chunk ranges, token faults."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError

from app.bodies import span_tokens
from app.transfers import CheckedItem, Deadline
from contract.schemas import TransferItem


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_deadline_passes_at_its_time_or_at_shutdown() -> None:
    clock, stopping = Clock(), threading.Event()
    deadline, none = Deadline(5.0, clock, stopping), Deadline(None, clock, stopping)
    assert not deadline.passed() and not none.passed()
    clock.now = 5.0
    assert deadline.passed() and not none.passed()
    stopping.set()  # shutdown: every call stops at its next chunk
    assert none.passed()


def _item(start: int, end: int, num_tokens: int) -> CheckedItem:
    item = TransferItem(
        request_id="r",
        namespace="ns",
        tokens=list(range(num_tokens)),
        start_token=start,
        end_token=end,
        block_ids=[[]],
    )
    return CheckedItem(item, item.token_array(), (np.zeros(0, dtype=np.int64),))


@pytest.mark.parametrize(
    ("start", "end", "num_tokens", "num_keys", "chunks"),
    [
        pytest.param(0, 64, 64, 4, range(0, 4), id="whole"),
        pytest.param(16, 64, 64, 4, range(1, 4), id="from-a-boundary"),
        pytest.param(0, 60, 64, 4, range(0, 3), id="partial-trailing-chunk-left-out"),
        pytest.param(0, 640, 40, 2, range(0, 2), id="clamped-to-the-tokens-given"),
        pytest.param(0, 64, 64, 2, range(0, 2), id="clamped-to-the-keys"),
        pytest.param(32, 32, 64, 4, range(2, 2), id="empty"),
    ],
)
def test_an_items_chunks(
    start: int, end: int, num_tokens: int, num_keys: int, chunks: range
) -> None:
    assert _item(start, end, num_tokens).chunks([b"k"] * num_keys, 16) == chunks


def test_a_bad_token_field_is_the_malformed_request_422() -> None:
    bad = TransferItem(
        request_id="r", namespace="ns", tokens_b64="!!", start_token=0, end_token=0, block_ids=[]
    )
    with pytest.raises(RequestValidationError) as info:
        span_tokens(bad, "r")
    (error,) = info.value.errors()
    assert error["loc"] == ("body", "r") and error["msg"].startswith("bad tokens: ")
