"""Lookup areas: a client's token ids in shared memory, the body carrying marks.

A real in-process server (``make_client``) and real sealed memfds passed over its
registration socket, as the scheduler-side connector does (``connector.lookup_area``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from contract.fdpass import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SHRINK
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, encode_lookup_frame, lookup_frame_marks
from contract.schemas import LookupFrameHeader, LookupFrameItem
from contract.tokens import pack_tokens
from dataplane.fdgate import SealedMemory
from tests.dataplane.support import (
    NAMESPACE,
    CacheClient,
    KVFactory,
    WorkerSocket,
    post_ok,
    random_tokens,
    register_body,
    sealed_memfd,
    store,
    transfer_item,
    vllm_layer,
)
from tests.support import wait_until

ClientFactory = Callable[..., CacheClient]
AREA_BYTES = 64 << 10


@pytest.fixture
def memfds() -> Iterator[list[int]]:
    """Descriptors the test made; closed at teardown, even when it fails."""
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


def _register_area(client: CacheClient, fd: int, worker: WorkerSocket | None = None) -> str:
    (ticket,) = (worker or client.worker).tickets([fd])
    reply = client.post("/cache/lookup-areas", json={"ticket": ticket})
    assert reply.status_code == 201, reply.text
    assert reply.json()["size_bytes"] == os.fstat(fd).st_size
    return str(reply.json()["area_id"])


def _items(*sizes: int) -> list[LookupFrameItem]:
    return [
        LookupFrameItem(request_id=f"r{i}", namespace=NAMESPACE, num_tokens=n)
        for i, n in enumerate(sizes)
    ]


def _marks_frame(fd: int, area: str, prompts: list[np.ndarray]) -> bytes:
    """The frame of ``prompts`` with their ids written into the memfd ``fd``."""
    header = LookupFrameHeader(requests=_items(*map(len, prompts)), area=area)

    def write(offset: int, data: bytes) -> None:
        os.pwrite(fd, data, offset)

    return b"".join(lookup_frame_marks(header, [pack_tokens(p.tolist()) for p in prompts], write))


def _lookup(client: CacheClient, body: bytes) -> list[int] | dict[str, object]:
    reply = client.post(
        "/cache/lookup", content=body, headers={"content-type": LOOKUP_FRAME_MEDIA_TYPE}
    )
    if reply.status_code != 200:
        assert reply.headers["content-type"] == "application/problem+json"
        return {"status": reply.status_code, **reply.json()}
    return [int(r["hit_tokens"]) for r in reply.json()["results"]]


def _stored(make_client: ClientFactory, shm_kv: KVFactory) -> tuple[CacheClient, np.ndarray]:
    client = make_client(chunk_size=64)
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    post_ok(client, "/register", register_body(kv, "w", [(0, "attention", 16)], chunk_size=64))
    tokens = random_tokens(128, seed=4)
    store(client, "w", transfer_item("s", tokens, [list(range(1, 9))]))
    return client, tokens


def test_a_lookup_through_an_area_answers_as_one_with_ids_in_the_body(
    make_client: ClientFactory, shm_kv: KVFactory, memfds: list[int]
) -> None:
    client, tokens = _stored(make_client, shm_kv)
    memfds.append(fd := sealed_memfd(AREA_BYTES))
    area = _register_area(client, fd)
    other = random_tokens(128, seed=5)
    prompts = [tokens, other, tokens[:100], other[:0], tokens[:64]]
    through_area = _lookup(client, _marks_frame(fd, area, prompts))
    header = LookupFrameHeader(requests=_items(*map(len, prompts)))
    in_body = _lookup(
        client, encode_lookup_frame(header, [pack_tokens(p.tolist()) for p in prompts])
    )
    assert through_area == in_body == [128, 0, 64, 0, 64]
    # The area is reused from byte 0 by the next lookup: its new ids are the ones read.
    assert _lookup(client, _marks_frame(fd, area, [other, tokens])) == [0, 128]


def test_an_area_is_dropped_with_its_connection_or_on_delete(
    make_client: ClientFactory, shm_kv: KVFactory, memfds: list[int]
) -> None:
    client, tokens = _stored(make_client, shm_kv)
    memfds.append(fd := sealed_memfd(AREA_BYTES))
    worker = WorkerSocket(client.get("/register").json()["socket_path"])
    area = _register_area(client, fd, worker)
    assert _lookup(client, _marks_frame(fd, area, [tokens])) == [128]
    worker.close()  # the client went away: its area goes with its connection
    wait_until(lambda: client.get("/health").json()["lookup_areas"] == 0)
    gone = _lookup(client, _marks_frame(fd, area, [tokens]))
    assert isinstance(gone, dict) and gone["status"] == 404
    assert "register one again" in str(gone["detail"])

    area = _register_area(client, fd)
    assert client.delete(f"/cache/lookup-areas/{area}").status_code == 204
    assert client.delete(f"/cache/lookup-areas/{area}").status_code == 404
    sessions = client.get("/health").json()["sessions"]
    header = LookupFrameHeader(requests=_items(128, 128), area=area)
    body = b"".join(
        lookup_frame_marks(header, [pack_tokens(tokens.tolist())] * 2, lambda o, d: None)
    )
    gone = _lookup(client, body)
    assert isinstance(gone, dict) and gone["status"] == 404
    assert client.get("/health").json()["sessions"] == sessions  # refused before any session


def test_ids_past_the_area_or_a_bad_area_are_refused(
    make_client: ClientFactory, shm_kv: KVFactory, memfds: list[int]
) -> None:
    client, tokens = _stored(make_client, shm_kv)
    memfds.append(fd := sealed_memfd(4096))
    area = _register_area(client, fd)
    header = LookupFrameHeader(requests=_items(1000, 100), area=area)  # 4400 bytes of ids
    marks = b"".join(lookup_frame_marks(header, [b"\0" * 4000, b"\0" * 400], lambda o, d: None))
    past = _lookup(client, marks)
    assert isinstance(past, dict) and past["status"] == 422
    assert "past the lookup area's 4096 bytes" in str(past["detail"])

    unknown = _lookup(client, _marks_frame(fd, "no-such-area", [tokens]))
    assert isinstance(unknown, dict) and unknown["status"] == 404

    memfds.append(loose := os.memfd_create("loose", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    os.ftruncate(loose, 4096)  # not sealed: the client could shrink it under the server
    with pytest.raises(ValueError, match="not sealed against shrinking"):
        client.worker.tickets([loose])  # refused at the socket, before any ticket
    reply = client.post("/cache/lookup-areas", json={"ticket": "used-or-unknown"})
    assert reply.status_code == 422 and "unknown or already used" in reply.json()["detail"]


def test_the_server_reads_the_ids_the_area_holds_when_the_lookup_comes(
    make_client: ClientFactory, shm_kv: KVFactory, memfds: list[int]
) -> None:
    """The ids are read from the area when the lookup comes, not from the body (the
    area was rewritten after the body was built): a negative id is refused like in
    a body, and the area written again serves."""
    client, tokens = _stored(make_client, shm_kv)
    memfds.append(fd := sealed_memfd(AREA_BYTES))
    area = _register_area(client, fd)
    body = _marks_frame(fd, area, [tokens])
    os.pwrite(fd, pack_tokens([-1] * 4), 0)
    bad = _lookup(client, body)
    assert isinstance(bad, dict) and bad["status"] == 422 and "negative" in str(bad["detail"])
    assert _lookup(client, _marks_frame(fd, area, [tokens])) == [128]


def test_sizes_and_counts_of_areas_are_bounded(
    make_client: ClientFactory, memfds: list[int]
) -> None:
    from app.lookup_areas import MAX_AREA_BYTES, MAX_AREAS_PER_CONNECTION

    client = make_client(chunk_size=64)
    memfds.append(tiny := sealed_memfd(2))
    memfds.append(huge := os.memfd_create("huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    os.ftruncate(huge, MAX_AREA_BYTES + 4096)  # sparse: no memory behind it
    fcntl.fcntl(huge, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
    for fd in (tiny, huge):
        (ticket,) = client.worker.tickets([fd])
        reply = client.post("/cache/lookup-areas", json={"ticket": ticket})
        assert reply.status_code == 422, reply.text
        assert f"4 to {MAX_AREA_BYTES} bytes" in reply.json()["detail"]
    for _ in range(MAX_AREAS_PER_CONNECTION):
        memfds.append(fd := sealed_memfd(4096))
        _register_area(client, fd)
    memfds.append(fd := sealed_memfd(4096))
    (ticket,) = client.worker.tickets([fd])
    reply = client.post("/cache/lookup-areas", json={"ticket": ticket})
    assert reply.status_code == 422 and "one socket connection holds" in reply.json()["detail"]
    other = WorkerSocket(client.get("/register").json()["socket_path"])
    try:  # another connection (another connector) still gets one
        _register_area(client, fd, other)
        assert client.get("/health").json()["lookup_areas"] == MAX_AREAS_PER_CONNECTION + 1
    finally:
        other.close()


class _ClosedGate:
    """A gate whose connection closed right after its ticket was taken."""

    def take(self, tickets: list[str]) -> tuple[int, dict[str, SealedMemory]]:
        buffer = ctypes.create_string_buffer(64)
        return 7, {t: SealedMemory(buffer, 64) for t in tickets}

    def alive(self, conn_id: int) -> bool:
        return False


def test_an_area_whose_connection_closed_while_registering_is_refused() -> None:
    """The gate may release a connection between the ticket's redemption and the
    area's entry: the area would then never be released; it is refused instead."""
    from app.lookup_areas import LookupAreas
    from contract.errors import InvalidRequest

    areas = LookupAreas(_ClosedGate())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="has closed"):
        areas.register("t")
    assert areas.count() == 0
