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
    """A SUB socket on the PUB endpoint, and replays through a REQ socket."""

    def __init__(self, endpoint: str, topic: str = "mpcache") -> None:
        self.kv = vllm_kv_events()
        self._decoder = msgspec.msgpack.Decoder(type=self.kv.KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)

    def decode(self, frames: list[bytes]) -> Received:
        topic, seq, payload = frames
        return Received(topic, int.from_bytes(seq, "big", signed=True), self._decoder.decode(payload))

    def receive(self, timeout_s: float = DEADLINE_S) -> Received:
        """The next batch published (fails after ``timeout_s``)."""
        if not self._sub.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no KV event batch within {timeout_s:g} s")
        return self.decode(self._sub.recv_multipart())

    def quiet(self, timeout_s: float = 0.3) -> bool:
        """True if nothing arrives within ``timeout_s`` (a check that nothing more is
        announced: it can only fail, never pass, by being slow)."""
        return not self._sub.poll(int(timeout_s * 1000))

    def replay(self, endpoint: str, start: int) -> list[Received]:
        """Every buffered batch from ``start``, up to the end marker (a DEALER: one
        request, many replies, each after the empty delimiter frame)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
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

    def subscribed(self, publish: Any, timeout_s: float = DEADLINE_S) -> Received:
        """Wait until the subscription is live (a PUB drops what it sends before):
        call ``publish`` until a batch arrives; that batch."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            publish()
            if self._sub.poll(200):
                return self.decode(self._sub.recv_multipart())
        raise AssertionError("the subscription never received a batch")

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()
