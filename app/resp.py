"""RESP2, the Redis wire protocol, as far as the L2 tier's raw reads need it: commands
encoded, reply headers parsed. Pure: no I/O here (``app.redis_wire`` reads sockets).

A reply starts with one line, ``<type><text>\\r\\n``: ``+`` a simple string, ``-`` an
error, ``:`` an integer, ``$<n>`` a bulk string of ``n`` bytes (then its bytes and
``\\r\\n``; ``$-1``: nil), ``*<n>`` an array of ``n`` replies (``*-1``: nil).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MAX_LINE_BYTES",
    "Header",
    "ProtocolError",
    "ReplyError",
    "encode",
    "parse_header",
]

MAX_LINE_BYTES = 64 << 10
"""A reply header (or simple string, or error) longer than this is a protocol error."""

Kind = Literal["simple", "error", "int", "bulk", "array", "nil"]


class ProtocolError(ValueError):
    """Bytes that are not a RESP reply (the connection cannot be used further)."""


class ReplyError(Exception):
    """Redis answered a command with an error reply (``-ERR ...``)."""


@dataclass(frozen=True)
class Header:
    """One reply's first line: its kind, its text (simple, error) or number (int, the
    length of a bulk string or array)."""

    kind: Kind
    text: str = ""
    number: int = 0


def _part(arg: bytes | str | int) -> bytes:
    if isinstance(arg, bytes):
        return arg
    return str(arg).encode()


def encode(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    if not args:
        raise ValueError("a command has at least its name")
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        part = _part(arg)
        out.append(b"$%d\r\n" % len(part))
        out.append(part)
        out.append(b"\r\n")
    return b"".join(out)


def _number(text: bytes) -> int:
    # int() accepts "+1", " 1" and "1_0"; RESP has only an optional minus and digits.
    digits = text[1:] if text.startswith(b"-") else text
    if not digits or not digits.isdigit() or len(digits) > 19:
        raise ProtocolError(f"not a RESP number: {text[:32]!r}")
    return int(text)


def parse_header(line: bytes) -> Header:
    """The header of a reply from its first line (without the ``\\r\\n``)."""
    if not line:
        raise ProtocolError("an empty reply line")
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return Header("simple", text=rest.decode("utf-8", "replace"))
    if kind == b"-":
        return Header("error", text=rest.decode("utf-8", "replace"))
    if kind == b":":
        return Header("int", number=_number(rest))
    if kind in (b"$", b"*"):
        n = _number(rest)
        if n == -1:
            return Header("nil")
        if n < 0:
            raise ProtocolError(f"a negative length: {line[:32]!r}")
        return Header("bulk" if kind == b"$" else "array", number=n)
    raise ProtocolError(f"not a RESP2 reply: {line[:32]!r}")
