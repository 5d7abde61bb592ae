"""Overload against a real server process (issue 8, item 4).

- /health answers while a 20 MB JSON body is being decoded (event-based: the
  server's kernel queue shows the whole body taken by the server, then /health
  completes while the big request, whose only work is decoding, has not been
  answered yet);
- a declared 200 MB body is refused (413) before any of it is sent, and a chunked
  200 MB one once the limit is passed, without the server's memory growing by the
  body's size;
- SIGTERM with a request still in flight exits after --shutdown-timeout-s and
  leaves no segment behind.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.reliability.support import (
    connect,
    peak_rss_bytes,
    port_of,
    read_status,
    readable,
    request_head,
    shm_bytes,
    tcp_queues,
)
from tests.support import server_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

MB = 1_000_000


def _negotiate(url: str) -> None:
    reply = httpx.post(f"{url}/negotiate", json={"required_alignment": 64}, timeout=60)
    assert reply.status_code == 200, reply.text


def _json_lookup(num_tokens: int, last: int = 7) -> bytes:
    head = b'{"requests": [{"request_id": "big", "namespace": "ns", "tokens": ['
    return head + b"7," * (num_tokens - 1) + str(last).encode() + b"]}]}"


def test_health_answers_while_a_20mb_body_is_decoded() -> None:
    with server_process("--chunk-size", "64") as (url, _):
        _negotiate(url)
        port = port_of(url)
        # 20 MB: ten million token ids, the last one invalid, so all the work is the
        # decoding (a 422 at its end), none of it the lookup.
        body = _json_lookup(10_000_000, last=-1)
        assert len(body) > 20 * MB
        big = connect(port)
        try:
            head = {"content-type": "application/json", "content-length": str(len(body))}
            big.sendall(request_head("POST", "/cache/lookup", port, head) + body)
            client_port = big.getsockname()[1]

            def body_taken() -> bool:
                mine, theirs = tcp_queues(client_port, port), tcp_queues(port, client_port)
                return mine is not None and theirs is not None and mine[0] == 0 == theirs[1]

            # Every byte sent has been read by the server: it is decoding the body now.
            wait_until(body_taken, what="the server to take the whole body")
            answered_first = 0
            with httpx.Client(timeout=120) as health:
                for _ in range(200):
                    if readable(big):
                        break
                    assert health.get(f"{url}/health").status_code == 200
                    if not readable(big):
                        answered_first += 1
                        if answered_first >= 3:
                            break
            assert answered_first >= 1, "/health waited for the big body to be decoded"
            assert read_status(big) == 422  # and the big body itself is answered
        finally:
            big.close()


def test_a_declared_200mb_body_is_refused_before_it_is_sent() -> None:
    with server_process("--chunk-size", "64") as (url, _):
        port = port_of(url)
        sock = connect(port)
        try:
            head = {"content-type": "application/json", "content-length": str(200 * MB)}
            sock.sendall(request_head("POST", "/cache/lookup", port, head))
            assert read_status(sock) == 413  # not one byte of the body was sent
        finally:
            sock.close()


def test_a_chunked_200mb_body_is_refused_without_buffering_it() -> None:
    with server_process("--chunk-size", "64") as (url, proc):
        _negotiate(url)
        port = port_of(url)
        before = peak_rss_bytes(proc.pid)
        sock = connect(port)
        sent = 0
        stop = threading.Event()

        def send() -> None:
            nonlocal sent

            def framed(data: bytes) -> bytes:
                return f"{len(data):x}\r\n".encode() + data + b"\r\n"

            chunk = framed(b"7," * (MB // 2))
            try:
                sock.sendall(
                    framed(b'{"requests": [{"request_id": "r", "namespace": "n", "tokens": [')
                )
                while sent < 200 * MB and not stop.is_set():
                    sock.sendall(chunk)
                    sent += MB
            except OSError:
                pass  # the server closed the connection after its 413

        head = {"content-type": "application/json", "transfer-encoding": "chunked"}
        sock.sendall(request_head("POST", "/cache/lookup", port, head))
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            assert read_status(sock) == 413
        finally:
            stop.set()
            sock.close()
            sender.join(60)
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        grown = peak_rss_bytes(proc.pid) - before
        # The limit (32 MiB) and uvicorn's read buffer, not the 200 MB body.
        assert grown < 120 * MB, f"peak RSS grew by {grown / MB:.0f} MB"


def test_sigterm_with_a_request_in_flight_exits_after_the_shutdown_deadline() -> None:
    before = set(shm_bytes())
    with server_process("--chunk-size", "64", "--shutdown-timeout-s", "1") as (url, proc):
        _negotiate(url)
        port = port_of(url)
        stuck = connect(port)  # a store whose body never finishes arriving
        try:
            head = {"content-type": "application/json", "content-length": "100000"}
            stuck.sendall(request_head("POST", "/cache/store", port, head) + b'{"instance')
            wait_until(
                lambda: (q := tcp_queues(port, stuck.getsockname()[1])) is not None and q[1] == 0,
                what="the server to read the request's start",
            )
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: proc.poll() is not None, what="the server to exit after SIGTERM")
        finally:
            stuck.close()
        assert proc.returncode in (0, 128 + signal.SIGTERM)
    assert set(shm_bytes()) <= before  # its pool segment is gone
