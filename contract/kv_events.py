"""KV events on the wire: vLLM's own format, so its consumers read mpcache unchanged.

What ``vllm.distributed.kv_events.ZmqEventPublisher`` sends, and what the server's
publisher (``app.kv_events``) sends: every batch as three ZMQ frames on a PUB socket,

    topic (UTF-8)  |  sequence number (8 bytes, big-endian)  |  msgpack of a KVEventBatch

A ``KVEventBatch`` is a msgpack array ``[ts, events]`` (``ts`` in seconds since the
epoch); each event is a map tagged by ``"type"``: ``BlockStored``, ``BlockRemoved`` or
``AllBlocksCleared``. Sequence numbers count batches from 0; a number that never
arrives is a batch the server dropped (its queue was full: counted in
``mpcache_kv_event_batches_total{outcome="dropped"}``).

Replay (a ROUTER socket): a client's REQ (or DEALER) sends one frame, the first
sequence number it wants, 8 bytes big-endian; the server answers each buffered batch
from there as ``topic | seq | payload`` (after the empty delimiter frame a REQ
expects) and then the end marker ``b"" | END_SEQ | b""``.

Block hashes are ``contract.chunk_keys.block_hashes`` (64-bit unsigned integers);
``block_size`` is the server's chunk size, ``token_ids`` the tokens of the blocks
announced, ``medium`` ``"CPU"`` for the server's pool. These structs are this
project's; the tests decode with vLLM's own classes.
"""

from __future__ import annotations

import msgspec
import numpy as np

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "packed_token_ids",
    "seq_bytes",
]

MEDIUM_CPU = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of a replay's end marker."""


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a msgpack map tagged ``type`` with the class name."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] | msgspec.Raw
    """Decoded as a list; the server sends ``packed_token_ids`` (the same msgpack)."""
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)


_INT32 = np.dtype([("marker", "u1"), ("value", ">i4")])


def packed_token_ids(tokens: np.ndarray) -> msgspec.Raw:
    """``tokens`` as the msgpack array of ints a list would encode to (each an int32,
    marker 0xd2), built by numpy: no Python int per token on the publisher's thread."""
    records = np.empty(len(tokens), dtype=_INT32)
    records["marker"] = 0xD2
    records["value"] = tokens
    return msgspec.Raw(b"\xdd" + len(tokens).to_bytes(4, "big") + records.tobytes())


def seq_bytes(seq: int) -> bytes:
    """A sequence number's frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")
