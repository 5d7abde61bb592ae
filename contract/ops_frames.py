"""Store and retrieve over the server's ops socket: the frames both sides write.

``POST /cache/store`` and ``POST /cache/retrieve`` are the documented path. A worker
on the server's host may send the same calls over a Unix socket instead (``GET
/register`` names it, ``ops_socket_path``), where each call skips the HTTP stack and
the event loop: a connection thread of the server reads the frame, validates the same
``StoreRequest`` / ``RetrieveRequest`` body and runs the same operation.

    worker                                         server
    connect(ops_socket_path) --------------------> accept; SO_PEERCRED: same uid
    <---------------- HELLO frame: {"boot_id": "..."}  (the client checks it is the
                                                   server it registered with)
    REQUEST frame: op, credentials, JSON body ---> validate, store or retrieve
    <---------------- REPLY frame: status, JSON    (the reply model on 200, else a
                                                   problem body, as over HTTP)
    ... one call at a time per connection; the connection stays open ...

Every frame is ``FRAME_HEAD`` (magic, head length, body length) then a small JSON head
and the body. The head of a request names the operation (``OPS``) and carries the
registration token and, where the server has one, its API token; the head of a reply
carries the HTTP status the same call would have had. Pure: no I/O here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

__all__ = [
    "FRAME_HEAD",
    "MAX_HEAD_BYTES",
    "OPS",
    "FrameError",
    "decode_head",
    "encode_frame",
    "frame_lengths",
]

MAGIC = b"MPO1"
FRAME_HEAD = struct.Struct("!4sII")
"""Magic, head length, body length (network order)."""

MAX_HEAD_BYTES = 4096
"""The longest JSON head a frame may carry (credentials and a status, no more)."""

OPS = ("store", "retrieve")
"""The operations a request frame may name."""


class FrameError(ValueError):
    """A frame that does not follow this module's layout."""


def encode_frame(head: Mapping[str, Any], body: bytes = b"") -> bytes:
    """One frame: ``head`` as compact JSON, then ``body`` as it is."""
    raw = json.dumps(head, separators=(",", ":")).encode()
    if len(raw) > MAX_HEAD_BYTES:
        raise FrameError(f"a frame head of {len(raw)} bytes (at most {MAX_HEAD_BYTES})")
    return FRAME_HEAD.pack(MAGIC, len(raw), len(body)) + raw + body


def frame_lengths(prefix: bytes, max_body_bytes: int) -> tuple[int, int]:
    """``(head length, body length)`` of the frame ``prefix`` (``FRAME_HEAD.size``
    bytes) starts; ``FrameError`` when it is not one of ours or too large."""
    magic, head, body = FRAME_HEAD.unpack(prefix)
    if magic != MAGIC:
        raise FrameError("not an mpcache ops frame (bad magic)")
    if head > MAX_HEAD_BYTES:
        raise FrameError(f"a frame head of {head} bytes (at most {MAX_HEAD_BYTES})")
    if body > max_body_bytes:
        raise FrameError(f"a frame body of {body} bytes (at most {max_body_bytes})")
    return head, body


def decode_head(raw: bytes) -> dict[str, Any]:
    """A frame's head: a JSON object, else ``FrameError``."""
    try:
        head = json.loads(raw)
    except ValueError as exc:
        raise FrameError(f"a frame head is not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise FrameError("a frame head is not a JSON object")
    return head
