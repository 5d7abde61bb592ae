"""The raw RESP client of the L2 reads: parsing (pure), and a connection reading
replies as they arrive in pieces, refusing what is not RESP, bounded by its timeout."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from app.redis_io import RedisUnavailable
from app.redis_wire import Wire, WireParams, wire_params
from app.resp import Header, ProtocolError, ReplyError, encode, parse_header


def test_encode_is_an_array_of_bulk_strings() -> None:
    assert encode("GET", b"k\r\n") == b"*2\r\n$3\r\nGET\r\n$3\r\nk\r\n\r\n"
    assert encode("SELECT", 3) == b"*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"
    with pytest.raises(ValueError, match="name"):
        encode()


@pytest.mark.parametrize(
    ("line", "header"),
    [
        (b"+OK", Header("simple", text="OK")),
        (b"-ERR wrong type", Header("error", text="ERR wrong type")),
        (b":-12", Header("int", number=-12)),
        (b"$5", Header("bulk", number=5)),
        (b"$0", Header("bulk", number=0)),
        (b"$-1", Header("nil")),
        (b"*-1", Header("nil")),
        (b"*2", Header("array", number=2)),
    ],
)
def test_headers(line: bytes, header: Header) -> None:
    assert parse_header(line) == header


@pytest.mark.parametrize(
    "line", [b"", b"$", b"$+5", b"$ 5", b"$1_0", b"$-2", b"!3", b":1" + b"9" * 19]
)
def test_not_resp_is_refused(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_header(line)


def _params(**overrides: object) -> WireParams | None:
    url = str(overrides.pop("url", "redis://127.0.0.1:6379/0"))
    password = overrides.pop("password", None)
    assert password is None or isinstance(password, SecretStr)
    return wire_params(url, password=password, timeout_s=1.0, name="t")


def test_wire_params_follow_the_url() -> None:
    got = _params(url="redis://alice:s3cret@10.0.0.2:7000/3")
    assert got is not None
    assert (got.host, got.port, got.db, got.username, got.password) == (
        "10.0.0.2",
        7000,
        3,
        "alice",
        "s3cret",
    )
    unix = _params(url="unix:///run/redis.sock?db=2")
    assert unix is not None and (unix.path, unix.host, unix.db) == ("/run/redis.sock", None, 2)
    # The settings' password is used when the URL names none, never over it.
    assert _params(password=SecretStr("p")) == _params(url="redis://:p@127.0.0.1:6379/0")
    fromurl = _params(url="redis://:u@127.0.0.1:6379/0", password=SecretStr("p"))
    assert fromurl is not None and fromurl.password == "u"


@pytest.mark.parametrize(
    "url", ["rediss://127.0.0.1:6380/0", "redis://127.0.0.1:6379/0?socket_keepalive=true"]
)
def test_tls_and_unknown_options_read_through_redis_py(url: str) -> None:
    assert _params(url=url) is None


@pytest.fixture
def pair() -> Iterator[tuple[Wire, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.settimeout(0.5)
    wire = Wire(ours)
    try:
        yield wire, theirs
    finally:
        wire.close()
        theirs.close()


def _dribble(sock: socket.socket, data: bytes, *, close: bool = False) -> threading.Thread:
    """Send ``data`` one byte at a time (every read a short one), then maybe close."""

    def run() -> None:
        for i in range(len(data)):
            sock.sendall(data[i : i + 1])
        if close:
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_replies_read_in_pieces(pair: tuple[Wire, socket.socket]) -> None:
    wire, theirs = pair
    value = bytes(range(256)) * 3
    sender = _dribble(theirs, b"+OK\r\n$%d\r\n%s\r\n$-1\r\n-ERR no\r\n" % (len(value), value))
    wire.read_ok()
    head = wire.header()
    assert head == Header("bulk", number=len(value))
    target = bytearray(len(value))
    wire.read_into(memoryview(target))
    wire.end_of_bulk()
    assert bytes(target) == value
    assert wire.header().kind == "nil"
    assert wire.header() == Header("error", text="ERR no")  # returned, the wire still usable
    sender.join(5)
    assert not wire.closed


def test_a_value_past_the_buffer_lands_whole(pair: tuple[Wire, socket.socket]) -> None:
    wire, theirs = pair
    value = (b"0123456789abcdef" * (1 << 14))[: (1 << 18) + 5]  # over the 64 KiB line buffer
    sender = threading.Thread(
        target=theirs.sendall, args=(b"$%d\r\n%s\r\n+OK\r\n" % (len(value), value),), daemon=True
    )
    sender.start()
    head = wire.header()
    first = bytearray(10)
    wire.read_into(memoryview(first))
    wire.skip(head.number - 10)
    wire.end_of_bulk()
    wire.read_ok()
    sender.join(5)
    assert bytes(first) == value[:10]


def test_connection_closed_mid_value(pair: tuple[Wire, socket.socket]) -> None:
    wire, theirs = pair
    _dribble(theirs, b"$100\r\n" + b"x" * 40, close=True).join(5)
    assert wire.header().number == 100
    with pytest.raises(RedisUnavailable, match="closed"):
        wire.read_into(memoryview(bytearray(100)))
    assert wire.closed


def test_a_silent_server_times_out(pair: tuple[Wire, socket.socket]) -> None:
    wire, theirs = pair
    theirs.sendall(b"$10\r\nabc")
    assert wire.header().number == 10
    with pytest.raises(RedisUnavailable, match="timed out"):  # the socket timeout
        wire.read_into(memoryview(bytearray(10)))
    assert wire.closed


@pytest.mark.parametrize(
    ("reply", "reason"),
    [(b"!bogus\r\n", "RESP2"), (b"$3\r\nabcXY", "CRLF"), (b"+" + b"x" * (70 << 10), "line over")],
    ids=["kind", "crlf", "long"],
)
def test_garbage_closes_the_connection(
    pair: tuple[Wire, socket.socket], reply: bytes, reason: str
) -> None:
    wire, theirs = pair
    threading.Thread(target=theirs.sendall, args=(reply,), daemon=True).start()
    with pytest.raises(RedisUnavailable, match=reason):
        head = wire.header()
        wire.read_into(memoryview(bytearray(head.number)))
        wire.end_of_bulk()
    assert wire.closed


def test_a_refused_handshake_is_a_reply_error(pair: tuple[Wire, socket.socket]) -> None:
    wire, theirs = pair
    theirs.sendall(b"-WRONGPASS invalid username-password pair\r\n")
    params = _params(url="redis://:nope@127.0.0.1:1/0")
    assert params is not None
    with pytest.raises(ReplyError, match="WRONGPASS"):
        wire.handshake(params)
    assert wire.closed
