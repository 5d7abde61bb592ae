"""A KV events consumer made of vLLM's own parts: its ``KVEventBatch`` decoder
(``vllm.distributed.kv_events``, msgspec) over pyzmq SUB and REQ sockets, as a
router that reads vLLM's ``--kv-events-config`` stream reads it.

Tests that use it are marked ``vllm``: they skip without vLLM, except under
``MPCACHE_REQUIRE_VLLM=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

from tests.support import DEADLINE_S

END_SEQ = -1


def vllm_kv_events() -> Any:
    """``vllm.distributed.kv_events`` (skips the test without vLLM, except under CI)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if os.environ.get("MPCACHE_REQUIRE_VLLM") == "1":
        import vllm.distributed.kv_events as module

        return module
    return pytest.importorskip(
        "vllm.distributed.kv_events", reason="vLLM 0.33 is not importable", exc_type=ImportError
    )


@dataclass(frozen=True)
class Received:
    topic: bytes
    seq: int
    batch: Any  # vllm.distributed.kv_events.KVEventBatch


class Consumer:
    """A SUB socket on the PUB endpoint and a DEALER on the replay endpoint.

    ``next`` gives the batches in sequence order, as a router that must not miss one
    reads them: what the SUB socket missed (everything sent before its subscription
    was live) is fetched by replay. ``next_seq`` is the first number not yet given.
    """

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "mpcache") -> None:
        self.kv = vllm_kv_events()
        self._decoder = msgspec.msgpack.Decoder(type=self.kv.KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._pending: list[Received] = []
        self.next_seq = 0

    def decode(self, frames: list[bytes]) -> Received:
        topic, seq, payload = frames
        return Received(
            topic, int.from_bytes(seq, "big", signed=True), self._decoder.decode(payload)
        )

    def next(self, timeout_s: float = DEADLINE_S) -> Received:
        """The batch numbered ``next_seq`` (fails after ``timeout_s``; a number the
        replay skips is given as the next one there is: a gap the caller sees)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self._take()
            if got is not None:
                return got
            if self._sub.poll(100):
                received = self.decode(self._sub.recv_multipart())
                if received.seq >= self.next_seq:
                    self._pending.append(received)
                continue
            self._pending += self.replay(self.next_seq)
        raise AssertionError(f"no KV event batch {self.next_seq} within {timeout_s:g} s")

    def _take(self) -> Received | None:
        """The lowest pending batch at or past ``next_seq``, if it follows without a
        gap, or if the replay was asked and has nothing lower."""
        self._pending = sorted(
            {r.seq: r for r in self._pending if r.seq >= self.next_seq}.values(),
            key=lambda r: r.seq,
        )
        if not self._pending:
            return None
        first = self._pending[0]
        if first.seq != self.next_seq:
            filled = [r for r in self.replay(self.next_seq) if r.seq < first.seq]
            if filled:
                self._pending = filled + self._pending
                first = filled[0]
        self._pending.pop(0)
        self.next_seq = first.seq + 1
        return first

    def quiet(self, timeout_s: float = 0.3) -> bool:
        """True if no batch past those given arrives within ``timeout_s`` and the
        replay has none (a check that nothing more is announced: it can only fail,
        never pass, by being slow)."""
        if self._sub.poll(int(timeout_s * 1000)):
            received = self.decode(self._sub.recv_multipart())
            if received.seq >= self.next_seq:
                return False
        return not self.replay(self.next_seq)

    def replay(self, start: int) -> list[Received]:
        """Every buffered batch from ``start``, up to the end marker (a DEALER: one
        request, many replies, each after the empty delimiter frame)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got: list[Received] = []
            deadline = time.monotonic() + DEADLINE_S
            while True:
                if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise AssertionError("the replay did not end")
                empty, *frames = dealer.recv_multipart()
                assert empty == b""
                if int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return got
                got.append(self.decode(frames))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()
