"""Registration by sealed memfd: what a client can no longer do to the server.

One test per row of the hardening issue that concerns registration inputs: a client
truncating its memory, registering memory it does not hold (someone's segment by
name, a hard link, a directory), deleting or using another's registration, passing
many descriptors, and strides torch cannot hold.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from typing import Any

import posix_ipc
import pytest

from contract.fdpass import F_SEAL_GROW, F_SEAL_SHRINK, MAX_FDS_PER_HANDSHAKE
from contract.schemas import REGISTRATION_TOKEN_HEADER
from contract.shm_naming import SHM_DIR, segment_name
from dataplane.fdgate import FdGate, sweep_stale_socket_dirs
from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    WorkerSocket,
    post_ok,
    random_tokens,
    register_body,
    retrieve,
    sealed_memfd,
    shm_mappings,
    store,
    transfer_item,
    vllm_layer,
)
from tests.support import wait_until

CHUNK = 64
GROUPS = [(0, "attention", 16)]

ClientFactory = Callable[..., CacheClient]


def _problem(reply: Any, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = reply.json()
    assert body["status"] == status and body["detail"]
    return body


def _open_fds(label: str) -> int:
    """Descriptors this process (test and in-process server) holds on memfds ``label``."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}") == f"/memfd:{label} (deleted)"
    return count


# ------------------------------------------------------------------ truncation


def test_registered_memory_cannot_shrink_so_copies_stay_safe(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: the client truncates its segment, the server's next copy dies of SIGBUS."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    with pytest.raises(PermissionError):  # EPERM: F_SEAL_SHRINK
        os.ftruncate(kv.fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(kv.fd, kv.size_bytes // 2)
    kv.fill_random(1)
    tokens = random_tokens(CHUNK, seed=1)
    assert store(client, "w", transfer_item("s", tokens, [[1, 2, 3, 4]]))[0]["stored_chunks"] == 1
    kv.zero()
    assert retrieve(client, "w", transfer_item("r", tokens, [[4, 5, 6, 7]]))[0][
        "loaded_tokens"
    ] == (CHUNK)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("seals", "needle"),
    [
        pytest.param(0, "not sealed against shrinking", id="unsealed"),
        pytest.param(F_SEAL_GROW, "not sealed against shrinking", id="grow-only"),
    ],
)
def test_memory_that_could_shrink_is_refused_at_the_socket(
    make_client: ClientFactory, seals: int, needle: str
) -> None:
    client = make_client()
    fd = sealed_memfd(8192, "mpcache-test-unsealed", seals=seals)
    try:
        with pytest.raises(ValueError, match=needle):
            client.worker.tickets([fd])
        assert shm_mappings("mpcache-test-unsealed") == 0  # nothing kept
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["pipe", "file", "socket"])
def test_descriptors_that_are_not_memfds_are_refused(
    make_client: ClientFactory, tmp_path: Any, kind: str
) -> None:
    client = make_client()
    with contextlib.ExitStack() as stack:
        if kind == "pipe":
            r, w = os.pipe()
            stack.callback(os.close, r)
            stack.callback(os.close, w)
            fd = r
        elif kind == "file":
            path = tmp_path / "f"
            path.write_bytes(b"x" * 8192)
            fd = os.open(path, os.O_RDWR)
            stack.callback(os.close, fd)
        else:
            a, b = socket.socketpair()
            stack.enter_context(a)
            stack.enter_context(b)
            fd = a.fileno()
        with pytest.raises(ValueError, match="not a sealable memfd"):
            client.worker.tickets([fd])


# ------------------------------------------------------- memory a client does not hold


@contextlib.contextmanager
def _named_segment(name: str, size: int = 8448) -> Iterator[str]:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
    shm.close_fd()
    try:
        yield name
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)


def _by_name(body: dict[str, Any], name: str) -> dict[str, Any]:
    for layer in body["layers"]:
        for tensor in layer["tensors"]:
            del tensor["ticket"]
            tensor.update(transport="shm", segment=name)
    return body


def _mapped_by_path(path: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(path))


def test_a_live_workers_segment_cannot_be_registered_by_name(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: 200, and the registrant could read and overwrite that worker's KV cache."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    with _named_segment(segment_name("w")) as name:
        body = _by_name(register_body(kv, "thief", GROUPS, chunk_size=CHUNK), name)
        _problem(client.post("/register", json=body), 422)
        assert _mapped_by_path(f"{SHM_DIR}/{name}") == 0
    assert client.get("/health").json()["registrations"] == 0


def test_a_hard_link_with_a_worker_name_is_never_opened(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: a hard link named ``mpcache-w-*`` to another segment was accepted."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    link = segment_name("w")
    with _named_segment(segment_name("x")) as target:
        os.link(f"{SHM_DIR}/{target}", f"{SHM_DIR}/{link}")
        try:
            body = _by_name(register_body(kv, "w", GROUPS, chunk_size=CHUNK), link)
            _problem(client.post("/register", json=body), 422)
            assert _mapped_by_path(f"{SHM_DIR}/{target}") == 0
            assert _mapped_by_path(f"{SHM_DIR}/{link}") == 0
        finally:
            os.unlink(f"{SHM_DIR}/{link}")


def test_a_directory_with_a_worker_name_is_a_4xx(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: HTTP 500."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    name = segment_name("w")
    os.mkdir(f"{SHM_DIR}/{name}")
    try:
        body = _by_name(register_body(kv, "w", GROUPS, chunk_size=CHUNK), name)
        _problem(client.post("/register", json=body), 422)
    finally:
        os.rmdir(f"{SHM_DIR}/{name}")


def test_tickets_are_one_time_and_from_one_connection(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv1 = shm_kv([vllm_layer("l0", 0, 8)])
    kv2 = shm_kv([vllm_layer("l1", 0, 8)])
    path = client.get("/register").json()["socket_path"]
    a, b = WorkerSocket(path), WorkerSocket(path)
    try:
        body = register_body(kv1, "w", GROUPS, chunk_size=CHUNK)
        body["layers"] += register_body(kv2, "w", GROUPS, chunk_size=CHUNK)["layers"]
        (t1,) = a.tickets([kv1.fd])
        (t2,) = b.tickets([kv2.fd])
        mixed = _set_tickets(body, [t1, t2])
        problem = _problem(client.post("/register", json=mixed), 422)
        assert problem["reason"] == "mixed-connections"
        # Refused tickets are not taken: each still works, once, from its connection.
        (t2b,) = a.tickets([kv2.fd])
        ok = client.post("/register", json=_set_tickets(body, [t1, t2b]))
        assert ok.status_code == 200, ok.text
        again = client.post(
            "/register",
            json=_set_tickets(body, [t1, t2b]),
            headers={REGISTRATION_TOKEN_HEADER: ok.json()["registration_token"]},
        )
        assert _problem(again, 422)["reason"] == "unknown-ticket"
    finally:
        a.close()
        b.close()


def _set_tickets(body: dict[str, Any], tickets: list[str]) -> dict[str, Any]:
    import copy

    body = copy.deepcopy(body)
    for layer, ticket in zip(body["layers"], tickets, strict=True):
        for tensor in layer["tensors"]:
            tensor["ticket"] = ticket
    return body


# ---------------------------------------------------------------------- ownership


def test_only_the_registrant_can_use_replace_or_delete_a_registration(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: DELETE /register/{id}/{rank} from a client that never registered it: 204."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    token = post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))[
        "registration_token"
    ]
    item = transfer_item("s", random_tokens(CHUNK, seed=2), [[1, 2, 3, 4]])
    transfer = {"instance_id": "w", "rank": 0, "requests": [item]}
    for headers in ({}, {REGISTRATION_TOKEN_HEADER: "not-the-token"}):
        client.auto_token = False
        _problem(client.delete("/register/w/0", headers=headers), 403)
        _problem(client.post("/cache/store", json=transfer, headers=headers), 403)
        _problem(client.post("/cache/retrieve", json=transfer, headers=headers), 403)
        other = shm_kv([vllm_layer("l0", 0, 8)])
        replace = register_body(other, "w", GROUPS, chunk_size=CHUNK)
        _problem(client.post("/register", json=replace, headers=headers), 403)
        assert shm_mappings(other.name) == 1  # the refused replacement mapped nothing
    assert client.get("/health").json()["registrations"] == 1
    good = {REGISTRATION_TOKEN_HEADER: token}
    assert client.post("/cache/store", json=transfer, headers=good).status_code == 200
    assert client.delete("/register/w/0", headers=good).status_code == 204
    assert shm_mappings(kv.name) == 1  # ours only


def test_a_token_the_client_chose_survives_a_retried_registration(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    """Was: a registration whose reply the worker lost (a slow server) got a token
    the worker never saw, and its retry was refused as another client's for good."""
    client = make_client()
    client.auto_token = False
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    mine = {REGISTRATION_TOKEN_HEADER: secrets.token_urlsafe(32)}
    first = client.post(
        "/register", json=register_body(kv, "w", GROUPS, chunk_size=CHUNK), headers=mine
    )
    assert first.status_code == 200, first.text
    assert first.json()["registration_token"] == mine[REGISTRATION_TOKEN_HEADER]
    # The retry (same token, fresh tickets) refreshes it and keeps the token.
    again = client.post(
        "/register", json=register_body(kv, "w", GROUPS, chunk_size=CHUNK), headers=mine
    )
    assert again.status_code == 200, again.text
    assert again.json()["refreshed"] is True
    assert again.json()["registration_token"] == mine[REGISTRATION_TOKEN_HEADER]
    item = transfer_item("s", random_tokens(CHUNK, seed=3), [[1, 2, 3, 4]])
    transfer = {"instance_id": "w", "rank": 0, "requests": [item]}
    stored = client.post("/cache/store", json=transfer, headers=mine)
    assert stored.json()["results"][0]["stored_chunks"] == 1
    # Anyone else's token, however well formed, is still refused.
    theirs = {REGISTRATION_TOKEN_HEADER: secrets.token_urlsafe(32)}
    other = shm_kv([vllm_layer("l0", 0, 8)])
    replace = register_body(other, "w", GROUPS, chunk_size=CHUNK)
    _problem(client.post("/register", json=replace, headers=theirs), 403)
    assert shm_mappings(other.name) == 1  # ours only


@pytest.mark.parametrize("token", ["short", "x" * 31, "x" * 257, "a" * 31 + "!", "a" * 32 + " b"])
def test_a_registration_token_too_weak_or_odd_is_refused_naming_the_header(
    make_client: ClientFactory, shm_kv: KVFactory, token: str
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    body = register_body(kv, "w", GROUPS, chunk_size=CHUNK)
    problem = _problem(
        client.post("/register", json=body, headers={REGISTRATION_TOKEN_HEADER: token}), 422
    )
    assert REGISTRATION_TOKEN_HEADER in problem["detail"]
    assert client.get("/health").json()["registrations"] == 0
    assert shm_mappings(kv.name) == 1  # ours only: the server mapped nothing


# ----------------------------------------------------------- descriptors and fds


def test_a_handshake_with_too_many_descriptors_is_refused_and_keeps_none(
    make_client: ClientFactory,
) -> None:
    """Was: one open fd per segment, no cap, "Too many open files" in the log."""
    client = make_client()
    worker = client.worker
    fds = [sealed_memfd(4096, "mpcache-test-many") for _ in range(MAX_FDS_PER_HANDSHAKE + 1)]
    try:
        assert _open_fds("mpcache-test-many") == len(fds)  # ours
        with pytest.raises(ValueError, match=f"at most {MAX_FDS_PER_HANDSHAKE} descriptors"):
            worker.tickets(fds)
        assert _open_fds("mpcache-test-many") == len(fds)  # the server closed every one
        assert shm_mappings("mpcache-test-many") == 0
        # At the cap it works, and still no descriptor stays open: memory is mapped.
        tickets = worker.tickets(fds[:MAX_FDS_PER_HANDSHAKE])
        assert len(set(tickets)) == MAX_FDS_PER_HANDSHAKE
        assert _open_fds("mpcache-test-many") == len(fds)
        assert shm_mappings("mpcache-test-many") == MAX_FDS_PER_HANDSHAKE
    finally:
        for fd in fds:
            os.close(fd)
    client.close_worker()
    wait_until(lambda: shm_mappings("mpcache-test-many") == 0, what="unused tickets unmapped")


def test_connections_beyond_the_cap_are_dropped(tmp_path: Any) -> None:
    released: list[int] = []
    gate = FdGate(tmp_path / "g.sock", on_disconnect=released.append, max_connections=2)
    gate.start()
    socks = []
    try:
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(str(gate.path))
            socks.append(s)
        fd = sealed_memfd(4096)
        try:
            with contextlib.suppress(OSError):  # dropped: closed without a reply
                socket.send_fds(socks[2], [b"MPFD1"], [fd])
                assert socks[2].recv(100) == b""
            socket.send_fds(socks[0], [b"MPFD1"], [fd])
            assert b"tickets" in socks[0].recv(1000)
        finally:
            os.close(fd)
        assert oct(os.stat(gate.path).st_mode & 0o777) == oct(0o600)
    finally:
        for s in socks:
            s.close()
        gate.close()
    assert not gate.path.exists()


@pytest.mark.parametrize(
    ("shape", "stride", "ok_stride"),
    [
        pytest.param(
            [2, 8, 16, 2, 1], [2048, 256, 16, 8, 2**63], [2048, 256, 16, 8, 2**47], id="last-dim"
        ),
        pytest.param(
            [1, 8, 16, 2, 8], [2**63, 256, 16, 8, 1], [2**47, 256, 16, 8, 1], id="first-dim"
        ),
    ],
)
def test_a_stride_of_2_63_on_a_size_1_dimension_is_a_4xx(
    make_client: ClientFactory,
    shm_kv: KVFactory,
    shape: list[int],
    stride: list[int],
    ok_stride: list[int],
) -> None:
    """Was: HTTP 500 (torch's int64 maths overflowed; main: the last-dim case)."""
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    body = register_body(kv, "w", GROUPS, chunk_size=CHUNK)
    tensor = body["layers"][0]["tensors"][0]
    tensor["shape"], tensor["stride"] = shape, stride
    _problem(client.post("/register", json=body), 422)
    assert client.get("/health").json()["registrations"] == 0
    # Within the schema's bound, a stride on a size-1 dimension is never used: fine.
    tensor["stride"] = ok_stride
    assert client.post("/register", json=body).status_code == 200


def test_unused_tickets_of_a_closed_connection_are_unmapped(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    base = shm_mappings(kv.name)
    client.worker.tickets([kv.fd])
    assert shm_mappings(kv.name) == base + 1
    client.close_worker()
    wait_until(lambda: shm_mappings(kv.name) == base, what="unused ticket unmapped")


def test_a_closed_connection_releases_its_registrations(
    make_client: ClientFactory, shm_kv: KVFactory
) -> None:
    client = make_client()
    kv = shm_kv([vllm_layer("l0", 0, 8)])
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    assert client.get("/health").json()["registrations"] == 1
    client.close_worker()
    wait_until(
        lambda: client.get("/health").json()["registrations"] == 0,
        what="registration released",
    )
    assert shm_mappings(kv.name) == 1  # ours only
    # The worker can come back on a new connection.
    post_ok(client, "/register", register_body(kv, "w", GROUPS, chunk_size=CHUNK))
    assert client.get("/health").json()["registrations"] == 1


def test_socket_directory_is_private(make_client: ClientFactory) -> None:
    client = make_client()
    path = client.get("/register").json()["socket_path"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert F_SEAL_SHRINK  # the constant the server checks is defined on this platform


def test_socket_directories_of_killed_servers_are_swept(tmp_path: Any) -> None:
    dead, live, other = tmp_path / "mpcache-1-dead", tmp_path / "mpcache-2-live", tmp_path / "x"
    for folder in (dead, live, other):
        folder.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(dead / "register.sock"))  # bound, then closed: nobody listens
    gate = FdGate(live / "register.sock", on_disconnect=lambda _: None)
    gate.start()
    try:
        assert sweep_stale_socket_dirs(tmp_path, min_age_s=60) == []  # too young to judge
        assert sweep_stale_socket_dirs(tmp_path, min_age_s=0) == [dead]
        assert not dead.exists() and gate.path.exists() and other.exists()
    finally:
        gate.close()


def test_a_killed_servers_ops_socket_is_swept_with_its_registration_socket(
    tmp_path: Any,
) -> None:
    dead, odd = tmp_path / "mpcache-1-dead", tmp_path / "mpcache-3-odd"
    for folder in (dead, odd):
        folder.mkdir(mode=0o700)
        for name in ("register.sock", "register.ops.sock"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
                gone.bind(str(folder / name))  # bound, then closed: nobody listens
    (odd / "notes.txt").write_text("not ours to remove")
    assert sweep_stale_socket_dirs(tmp_path, min_age_s=0) == [dead]
    assert not dead.exists()
    assert sorted(p.name for p in odd.iterdir()) == [
        "notes.txt",
        "register.ops.sock",
        "register.sock",
    ]
