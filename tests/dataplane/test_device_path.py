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
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from connector.device_order import DeviceOrder
from contract.errors import InvalidRequest
from contract.schemas import EVENT_HANDLE_BYTES, MemfdTensor, RetrieveRequest, StoreRequest
from dataplane import device_path, registry, transfer
from dataplane.descriptors import tensor_geometry
from dataplane.device_path import HOST_REGISTER_PORTABLE, DevicePath, PoolPinning
from dataplane.layout import BlockTensorSpec, GroupSpec, chunk_layout
from dataplane.plans import TensorPlan, make_plan
from tests.dataplane.support import (
    CacheClient,
    KVFactory,
    random_tokens,
    register_body,
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
    geos = [
        tensor_geometry(
            MemfdTensor(
                ticket="t",
                offset_bytes=0,
                shape=list(t.shape),
                stride=list(t.stride()),
                dtype="bfloat16",
                block_dim=1,
            )
        )
        for t in tensors
    ]
    specs = [
        BlockTensorSpec(f"l{i}", 0, g.dtype_name, g.itemsize, g.shape, 1)
        for i, g in enumerate(geos)
    ]
    layout = chunk_layout(16 * n_per_chunk, [GroupSpec(0, "attention", 16)], specs)
    plans = [
        dataclasses.replace(make_plan(t, g, r), array=None, rows=None, region_rows=None)
        for t, g, r in zip(tensors, geos, layout.regions, strict=True)
    ]
    return plans, layout.chunk_bytes


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
