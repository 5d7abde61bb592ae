"""The GPU path's parts that run without a GPU: the event field of store and retrieve
(its bounds, bad handles answered 422), the refusal of an event for a CPU
registration, pinning and its fallback against a fake libcudart, and the worker's
``DeviceOrder`` on CPU caches. The GPU itself: tests/dataplane/test_gpu_path.py.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import app.retrieve
import app.store
from connector.device_order import DeviceOrder
from contract.errors import InvalidRequest
from contract.schemas import EVENT_HANDLE_BYTES, RetrieveRequest, StoreRequest
from dataplane import device_path, registry, transfer
from dataplane.device_path import HOST_REGISTER_PORTABLE, CopyWindow, DevicePath, PoolPinning
from dataplane.plans import TensorPlan
from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    attention_plans,
    lookup,
    random_tokens,
    register_body,
    retrieve,
    store,
    transfer_item,
    vllm_layer,
)

CHUNK = 64
DEVICE_ID_PAIRS = [
    pytest.param([3, 0, 7, 5], [9, 0, 1, 2], id="fragmented"),
    pytest.param([4, 5, 6, 7], [8, 9, 10, 11], id="runs"),
    pytest.param([4, 5, 6, 7], [0, 0, 2, 3], id="nulls-on-load"),
    pytest.param([1, 2, 0, 0], [5, 4, 3, 2], id="nulls-on-store"),
]


def _handle(seed: int = 0) -> str:
    raw = bytes((seed + 37 * i) % 256 for i in range(EVENT_HANDLE_BYTES))
    return base64.b64encode(raw).decode()


# ------------------------------------------------------------------ the schema field


def _batch(**extra: Any) -> dict[str, Any]:
    return {"instance_id": "engine", "rank": 0, "requests": [], **extra}


@pytest.mark.parametrize("model", [StoreRequest, RetrieveRequest])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 255])
def test_a_whole_event_handle_is_taken(model: type[StoreRequest], seed: int) -> None:
    req = model.model_validate(_batch(event_ipc_b64=_handle(seed)))
    assert req.event_ipc_b64 is not None
    assert len(base64.b64decode(req.event_ipc_b64, validate=True)) == EVENT_HANDLE_BYTES


def test_the_event_handle_is_optional() -> None:
    assert StoreRequest.model_validate(_batch()).event_ipc_b64 is None


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(base64.b64encode(bytes(63)).decode(), id="63-bytes"),
        pytest.param(base64.b64encode(bytes(65)).decode(), id="65-bytes"),
        pytest.param(_handle()[:-2] + "AA", id="no-padding"),
        pytest.param(_handle()[:85] + "B==", id="stray-bits"),
        pytest.param(_handle()[:-3] + "!A==", id="not-base64"),
        pytest.param("", id="empty"),
        pytest.param("A" * 4096, id="huge"),
    ],
)
def test_anything_but_one_whole_handle_is_refused(text: str) -> None:
    with pytest.raises(ValidationError):
        StoreRequest.model_validate(_batch(event_ipc_b64=text))


def _register_cpu(client: CacheClient, shm_kv: KVFactory) -> None:
    kv = shm_kv([vllm_layer("l0", 0, 16)])
    body = register_body(kv, "cpu-engine", [(0, "attention", 16)], chunk_size=CHUNK)
    reply = client.post("/register", json=body)
    assert reply.status_code == 200, reply.text


def _transfer_body(**extra: Any) -> dict[str, Any]:
    item = transfer_item("req", random_tokens(CHUNK, seed=1), [[1, 2, 3, 4]])
    return {"instance_id": "cpu-engine", "rank": 0, "requests": [item], **extra}


@pytest.mark.parametrize("path", ["/cache/store", "/cache/retrieve"])
def test_a_malformed_event_handle_is_a_422_problem(
    make_client: Any, shm_kv: KVFactory, path: str
) -> None:
    client = make_client(chunk_size=CHUNK)
    _register_cpu(client, shm_kv)
    reply = client.post(path, json=_transfer_body(event_ipc_b64="AAAA"))
    assert reply.status_code == 422
    problem = reply.json()
    assert problem["type"] == "urn:mpcache:problem:malformed-request", problem
    assert "event_ipc_b64" in reply.text


@pytest.mark.parametrize("path", ["/cache/store", "/cache/retrieve"])
def test_an_event_for_a_cpu_registration_is_refused_before_any_copy(
    make_client: Any, shm_kv: KVFactory, path: str
) -> None:
    client = make_client(chunk_size=CHUNK)
    _register_cpu(client, shm_kv)
    reply = client.post(path, json=_transfer_body(event_ipc_b64=_handle()))
    assert reply.status_code == 422
    problem = reply.json()
    assert problem["type"] == "urn:mpcache:problem:invalid-request", problem
    assert "registered CPU tensors" in problem["detail"]
    if path == "/cache/store":  # nothing was stored: the same call without it stores
        ok = client.post(path, json=_transfer_body())
        assert ok.status_code == 200 and ok.json()["results"][0]["stored_chunks"] == 1
    pinning = client.app.state.runtime.device.pinning
    assert pinning.state == "off"  # a CPU registration never pins the pool


# -------------------------------------------------------------------- the server side


def _cpu_registration() -> Any:
    return SimpleNamespace(cuda_device=None, instance_id="engine", rank=0, events={})


def test_a_cpu_registration_copies_as_before() -> None:
    ran = []
    with DevicePath().ordered(_cpu_registration(), None):
        ran.append(True)
    assert ran == [True]


def test_a_cpu_registration_with_an_event_is_refused() -> None:
    with (
        pytest.raises(InvalidRequest, match="registered CPU tensors"),
        DevicePath().ordered(_cpu_registration(), _handle()),
    ):
        pytest.fail("the copies ran")


def test_a_registration_on_two_devices_is_refused() -> None:
    plans = (
        SimpleNamespace(view=torch.empty(1)),
        SimpleNamespace(view=torch.empty(1, device="meta")),
    )
    with pytest.raises(InvalidRequest, match="all be on one device"):
        registry._one_device(plans)  # type: ignore[arg-type]
    assert registry._one_device(plans[:1]) is None  # type: ignore[arg-type]


class FakeCudart:
    """libcudart as pinning calls it: records each call and the thread it ran on."""

    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple[str, tuple[int, ...], str]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", (ptr, size, flags), threading.current_thread().name))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", (ptr,), threading.current_thread().name))
        return 0

    def cudaGetErrorString(self, error: Any) -> str:
        return "operation not permitted when stream is capturing" if error == 900 else "?"


def test_pinning_registers_the_whole_pool_once_and_unregisters_it_at_close() -> None:
    cudart = FakeCudart()
    pinning = PoolPinning(0x7F0000000000, 1 << 30, cudart=lambda: cudart)
    assert pinning.state == "off"
    pinning.start()
    pinning.start()  # a second CUDA registration pins nothing more
    assert pinning.wait() == "pinned"
    pinning.close()
    pinning.close()
    assert pinning.state == "off"
    names = [name for name, _, _ in cudart.calls]
    assert names == ["register", "unregister"]
    assert cudart.calls[0][1] == (0x7F0000000000, 1 << 30, HOST_REGISTER_PORTABLE)
    assert cudart.calls[1][1] == (0x7F0000000000,)
    # Neither runs on the caller's thread, whose CUDA last-error they could leave set.
    assert all(thread != threading.current_thread().name for _, _, thread in cudart.calls)


def test_a_failed_pinning_is_logged_with_its_reason_and_never_unregistered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cudart = FakeCudart(register_error=900)
    pinning = PoolPinning(4096, 1 << 20, cudart=lambda: cudart)
    with caplog.at_level(logging.WARNING, logger="dataplane.device_path"):
        pinning.start()
        assert pinning.wait() == "failed"
    assert pinning.reason == "operation not permitted when stream is capturing (cudaError 900)"
    assert any(
        "pool not pinned" in r.getMessage() and "pageable" in r.getMessage() for r in caplog.records
    )
    pinning.close()
    assert [name for name, _, _ in cudart.calls] == ["register"]


def test_no_cuda_runtime_is_a_failed_pinning_not_a_crash() -> None:
    def missing() -> device_path.Cudart:
        raise AssertionError("Torch not compiled with CUDA enabled")

    pinning = PoolPinning(4096, 1 << 20, cudart=missing)
    pinning.start()
    assert pinning.wait() == "failed"
    assert pinning.reason is not None and "not compiled with CUDA" in pinning.reason


def test_pinning_switched_off_never_pins() -> None:
    cudart = FakeCudart()
    pinning = PoolPinning(4096, 1 << 20, enabled=False, cudart=lambda: cudart)
    pinning.start()
    assert pinning.wait() == "disabled"
    pinning.close()
    assert cudart.calls == []


def test_a_cpu_registration_starts_no_pinning() -> None:
    cudart = FakeCudart()
    path = DevicePath(PoolPinning(4096, 1 << 20, cudart=lambda: cudart))
    path.registered(_cpu_registration())
    assert path.pinning is not None and path.pinning.state == "off"
    path.close()
    assert cudart.calls == []


# -------------------------------------------------------------------- the worker side


def test_device_order_on_cpu_caches_is_none_and_touches_no_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_cuda(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a CPU worker must not touch CUDA")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    order = DeviceOrder(SimpleNamespace(cuda_device=None))
    assert order.handle() is None
    assert order.fallback is None


def test_without_interprocess_events_the_worker_synchronises_its_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    synced: list[object] = []
    stream = SimpleNamespace(synchronize=lambda: synced.append(True))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: stream)
    monkeypatch.setattr(torch.cuda, "device", lambda _device: _NullContext())

    def no_ipc(**_kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: operation not supported")

    monkeypatch.setattr(torch.cuda, "Event", no_ipc)
    order = DeviceOrder(SimpleNamespace(cuda_device=torch.device("cuda", 0)))
    with caplog.at_level(logging.WARNING, logger="mpcache.connector"):
        assert order.handle() is None
        assert order.handle() is None
    assert synced == [True, True]  # the old behaviour, each call
    assert order.fallback == "CUDA error: operation not supported"
    assert sum("no interprocess CUDA event" in r.getMessage() for r in caplog.records) == 1


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


# --------------------------------------------- the GPU kernels' staging, run on CPU


def _device_like_plans(
    tensors: list[torch.Tensor], n_per_chunk: int = 4
) -> tuple[list[TensorPlan], int]:
    """Plans of ``tensors`` (vLLM's KV layout, block dim 1) that take the device
    route (no numpy array), and the chunk's bytes."""
    plans, chunk_bytes = attention_plans(tensors, 16 * n_per_chunk, 16)
    device = [dataclasses.replace(p, array=None, rows=None, region_rows=None) for p in plans]
    return device, chunk_bytes


@pytest.mark.parametrize(("store_ids", "load_ids"), DEVICE_ID_PAIRS)
def test_the_device_kernels_move_exact_bytes_through_their_staging_buffer(
    monkeypatch: pytest.MonkeyPatch, store_ids: list[int], load_ids: list[int]
) -> None:
    """The GPU route of ``gather_chunk``/``scatter_chunk`` (staging buffer, one copy
    to the entry, ``index_select``/``index_copy_``) is plain torch, so it runs on
    CPU tensors too: the same code a GPU runs, minus the stream sync."""
    synced: list[torch.device] = []
    monkeypatch.setattr(transfer, "_sync_current_stream", synced.append)
    src = [torch.randn(2, 12, 16, 2, 8).bfloat16() for _ in range(3)]
    dst = [torch.zeros_like(t) for t in src]
    plans, chunk_bytes = _device_like_plans(src)
    dst_plans, _ = _device_like_plans(dst)
    entry = torch.zeros(chunk_bytes, dtype=torch.uint8)
    copied = transfer.gather_chunk(plans, [np.array(store_ids)], entry)
    assert copied == sum(p.region.nbytes for p in plans)
    written = transfer.scatter_chunk(dst_plans, [np.array(load_ids)], entry)
    assert written == copied // 4 * sum(1 for b in load_ids if b)  # nulls never written
    assert len(synced) == 2  # once a chunk each way
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(store_ids, load_ids, strict=True):
            if b:
                want = s[:, a] if a else s[:, 0]  # a null's slot holds block 0
                assert torch.equal(d[:, b].view(torch.int16), want.view(torch.int16)), (a, b)
        untouched = [i for i in range(12) if i not in load_ids]
        assert not d[:, untouched].view(torch.int16).any()


# ------------------------------------------------------------- the copy window


class FakeMarker:
    """A recorded CUDA event as the window sees it: ``synchronize`` is logged."""

    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")
        if self.fail:
            raise RuntimeError("CUDA error: unspecified launch failure")


def _window(log: list[str], fail_at: int | None = None) -> CopyWindow:
    made = iter(range(100))

    def marker(_device: int) -> FakeMarker:
        n = next(made)
        return FakeMarker(log, str(n), fail=n == fail_at)

    return CopyWindow(0, marker=marker)


def test_the_window_waits_for_each_chunk_one_chunk_late_and_drains_in_order() -> None:
    log: list[str] = []
    window = _window(log)
    for n in range(3):
        log.append(f"queue {n}")
        window.add(lambda n=n: log.append(f"done {n}"))
    log.append("drain")
    window.drain()
    assert log == [
        "queue 0",
        "queue 1",
        "wait 0",  # chunk 0 is waited for only once chunk 1's copies are queued
        "done 0",
        "queue 2",
        "wait 1",
        "done 1",
        "drain",
        "wait 2",
        "done 2",
    ]


def test_a_failed_wait_undoes_every_chunk_not_done_once_its_copies_stopped() -> None:
    log: list[str] = []
    window = _window(log, fail_at=1)
    window.add(lambda: log.append("done 0"), undo=lambda: log.append("undo 0"))
    window.add(lambda: log.append("done 1"), undo=lambda: log.append("undo 1"))
    with pytest.raises(RuntimeError, match="launch failure"):
        window.add(lambda: log.append("done 2"), undo=lambda: log.append("undo 2"))
    assert log == ["wait 0", "done 0", "wait 1", "wait 1", "undo 1", "wait 2", "undo 2"]
    window.drain()  # nothing left


def test_without_a_device_the_window_is_not_there() -> None:
    log: list[str] = []
    window = CopyWindow(None, marker=lambda _d: pytest.fail("no event on CPU"))
    window.add(lambda: log.append("done"))
    assert log == ["done"]


@pytest.fixture
def windowed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Store and retrieve of CPU registrations through the GPU path's window: each
    chunk's commit (or count) runs one chunk late, as on a GPU."""
    log: list[str] = []

    def make(_device: int | None) -> CopyWindow:
        return CopyWindow(0, marker=lambda _d: FakeMarker(log, "chunk"))

    monkeypatch.setattr(app.store, "CopyWindow", make)
    monkeypatch.setattr(app.retrieve, "CopyWindow", make)
    return log


def test_through_the_window_every_chunk_is_committed_and_loaded(
    make_client: Any, shm_kv: KVFactory, windowed: list[str]
) -> None:
    client = make_client(chunk_size=CHUNK)
    layers = [vllm_layer("l0", 0, 40), vllm_layer("l1", 0, 40)]
    a, b = shm_kv(layers), shm_kv(layers)
    a.fill_random(seed=3)
    for name, kv in (("a", a), ("b", b)):
        body = register_body(kv, name, [(0, "attention", 16)], chunk_size=CHUNK)
        assert client.post("/register", json=body).status_code == 200
    tokens = random_tokens(3 * CHUNK, seed=4)
    (stored,) = store(client, "a", transfer_item("p", tokens, [list(range(1, 13))]))
    assert (stored["stored_chunks"], stored["failed_chunks"]) == (3, 0)
    assert windowed.count("wait chunk") == 3
    assert lookup(client, tokens, "q") == 3 * CHUNK
    (loaded,) = retrieve(client, "b", transfer_item("p", tokens, [list(range(21, 33))]))
    assert loaded == {"request_id": "p", "loaded_tokens": 3 * CHUNK, "failed_block_ids": []}
    for layer in layers:
        for src, dst in zip(range(1, 13), range(21, 33), strict=True):
            want, got = a.block(layer.name, 0, src), b.block(layer.name, 0, dst)
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (src, dst)


def test_through_the_window_a_chunk_after_a_late_one_is_never_committed(
    make_client: Any, shm_kv: KVFactory, windowed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0's copy is queued, chunk 1's takes past the deadline: chunk 0 is only
    waited for after that, so it is judged late, and chunk 1 after it is aborted."""
    client = make_client(chunk_size=CHUNK)
    kv = shm_kv([vllm_layer("l0", 0, 40)])
    body = register_body(kv, "a", [(0, "attention", 16)], chunk_size=CHUNK)
    assert client.post("/register", json=body).status_code == 200
    real = app.store.gather_chunk
    calls: list[int] = []

    def slow_second(*args: Any, **kwargs: Any) -> int:
        calls.append(len(calls))
        if len(calls) == 2:
            time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(app.store, "gather_chunk", slow_second)
    tokens = random_tokens(3 * CHUNK, seed=5)
    item = transfer_item("p", tokens, [list(range(1, 13))])
    reply = client.post(
        "/cache/store", json={"instance_id": "a", "rank": 0, "requests": [item], "timeout_s": 0.5}
    )
    (result,) = reply.json()["results"]
    assert (result["stored_chunks"], result["failed_chunks"]) == (0, 3)
    assert calls == [0, 1]  # nothing more was copied once one was late
    assert lookup(client, tokens, "q") == 0
    stats = client.app.state.runtime.pool.stats()
    assert (stats.entries, stats.pending, stats.used_bytes) == (0, 0, 0)
