"""Pure helpers: token packing, plans, namespaces, rank placement, retries, CUDA IPC."""

from __future__ import annotations

import base64
import logging
import pickle
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from connector.alignment import layout_from_groups
from connector.client import ControlClient
from connector.errors import (
    ProtocolError,
    RecoveryError,
    ServerError,
    ServerFailure,
    ServerRejected,
    ServerTimeout,
    ServerUnreachable,
    StartupError,
)
from connector.identity import namespace_for
from connector.metadata import StepPlan, TransferOp
from connector.servers import (
    ServerLink,
    agree_chunk_size,
    negotiate_request,
    negotiate_until,
    ranks_of_server,
    renegotiate,
    server_for_rank,
)
from contract import cuda_ipc
from contract.schemas import CudaIpcTensor
from contract.tokens import encode_tokens
from tests.connector.fakes import AttnSpec, FakeServer, Group


def test_plan_pickles_and_touched_blocks() -> None:
    blocks = [[1, 2, 0, 4, 5, 6, 7, 8], [9, 10, 11]]
    op = TransferOp("r", 64, 128, encode_tokens(range(128)), blocks)
    plan = StepPlan(loads=(op,), stores=(), preempted=("x",))
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert bool(plan) and not bool(StepPlan())
    # group 0 span 16: blocks 4..7 cover [64, 128); group 1 span 64: block 1
    assert op.touched_block_ids([16, 64]) == {5, 6, 7, 8, 10}


def test_namespace_is_stable_and_layout_sensitive() -> None:
    a = layout_from_groups([Group(AttnSpec(16), ["l0"])])
    b = layout_from_groups([Group(AttnSpec(32), ["l0"])])
    assert namespace_for("m", a, 1) == namespace_for("m", a, 1)
    assert len({namespace_for("m", a, 1), namespace_for("m", b, 1), namespace_for("m", a, 2)}) == 3
    assert len(namespace_for("x" * 600, a, 1)) < 512


@pytest.mark.parametrize(
    ("urls", "world", "expected"),
    [
        pytest.param(("a",), 4, {"a": [0, 1, 2, 3]}, id="one-server"),
        pytest.param(("a", "b"), 4, {"a": [0, 1], "b": [2, 3]}, id="two-nodes"),
        pytest.param(("a", "b"), 1, {"a": [0], "b": []}, id="fewer-ranks"),
        pytest.param(("a", "b", "c"), 8, {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7]}, id="3x"),
    ],
)
def test_rank_placement(urls: tuple[str, ...], world: int, expected: dict[str, list[int]]) -> None:
    assert ranks_of_server(urls, world) == expected
    for url, ranks in expected.items():
        assert all(server_for_rank(urls, r, world) == url for r in ranks)
    with pytest.raises(ValueError):
        server_for_rank(urls, world, world)


def test_agree_chunk_size() -> None:
    assert agree_chunk_size({"a": 288, "b": 288}) == 288
    with pytest.raises(StartupError, match=r"a -> chunk size 288\n  b -> chunk size 576"):
        agree_chunk_size({"a": 288, "b": 576})


def test_negotiate_retries_503_then_succeeds() -> None:
    fake = FakeServer(min_chunk_size=64)
    problem = {"type": "t", "title": "t", "status": 503, "detail": "binding failed"}
    fake.fail_next["/negotiate"] = httpx.Response(503, json=problem, headers={"Retry-After": "0"})
    client = ControlClient(fake.url, timeout_s=1, transport=fake.transport())
    sleeps: list[float] = []
    try:
        from contract.schemas import NegotiateRequest

        reply = negotiate_until(
            client, NegotiateRequest(required_alignment=16), 1e18, sleep=sleeps.append
        )
    finally:
        client.close()
    assert reply.chunk_size == 64
    assert fake.paths() == ["POST /negotiate", "POST /negotiate"]
    assert len(sleeps) == 1


def test_negotiate_gives_up_at_deadline_and_never_retries_4xx() -> None:
    from contract.schemas import NegotiateRequest

    fake = FakeServer(min_chunk_size=64)
    client = ControlClient(fake.url, timeout_s=1, transport=fake.transport())
    try:
        fake.fail_next["/negotiate"] = httpx.Response(503, json={"detail": "x"})
        with pytest.raises(ServerFailure):
            negotiate_until(client, NegotiateRequest(required_alignment=16), 0.0)
        fake.fail_next["/negotiate"] = httpx.Response(409, json={"detail": "no"})
        with pytest.raises(ServerRejected):
            negotiate_until(client, NegotiateRequest(required_alignment=16), 1e18)
    finally:
        client.close()


_URL = "http://fake:8000"


@pytest.mark.parametrize(
    ("exc", "force", "suspect"),
    [
        pytest.param(ServerUnreachable("refused", url=_URL), False, True, id="unreachable"),
        pytest.param(ServerTimeout("slow", url=_URL), False, True, id="timeout"),
        pytest.param(ServerRejected("gone", url=_URL, status=404), False, True, id="404"),
        pytest.param(ServerRejected("changed", url=_URL, status=409), False, True, id="409"),
        pytest.param(ServerRejected("bad body", url=_URL, status=422), False, False, id="422"),
        pytest.param(ServerFailure("boom", url=_URL, status=500), False, False, id="500"),
        pytest.param(ProtocolError("odd reply", url=_URL), False, False, id="protocol"),
        pytest.param(ServerRejected("bad body", url=_URL, status=422), True, True, id="forced"),
    ],
)
def test_which_failed_calls_make_a_server_suspect(
    exc: ServerError, force: bool, suspect: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """One rule for both adapters (connector.servers.ServerLink.call_failed)."""
    client = ControlClient(_URL, timeout_s=1, transport=FakeServer().transport())
    link = ServerLink(_URL, client, role="test")
    link.mark_healthy("boot")
    try:
        assert link.call_failed("store", exc, force=force) is suspect
        assert link.call_failed("store", exc, force=force) is suspect
    finally:
        client.close()
    assert link.healthy is not suspect
    once = [r for r in caplog.records if "reported once" in r.getMessage()]
    assert len(once) == (0 if suspect else 1)


def test_a_recovery_failure_is_logged_once_until_the_server_is_healthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator sees "restart it with the same --chunk-size" once per outage, even
    when a transient timeout comes between two of the heartbeat's re-join attempts."""
    client = ControlClient(_URL, timeout_s=1, transport=FakeServer().transport())
    link = ServerLink(_URL, client, role="test")
    mismatch, timeout = "the server answers chunk size 112", "negotiate: timed out"
    try:
        with caplog.at_level(logging.ERROR, logger="mpcache.connector"):
            for reason in (mismatch, mismatch, timeout, mismatch, timeout):
                link.note_recovery_failure(reason)
            logged = [r.getMessage() for r in caplog.records]
            assert [mismatch in m for m in logged] == [True, False]
            link.mark_healthy("boot")  # the outage ended: the next one is news
            link.note_recovery_failure(mismatch)
            assert len(caplog.records) == 3 and mismatch in caplog.records[-1].getMessage()
    finally:
        client.close()


def test_negotiate_request_fits_the_schema() -> None:
    body = negotiate_request(96, model="m" * 600, role="worker", instance_id="i" * 300)
    assert (body.required_alignment, body.role) == (96, "worker")
    assert (len(body.model), len(body.instance_id)) == (512, 256)


def test_renegotiate_requires_the_exact_size() -> None:
    import asyncio

    from connector.client import AsyncControlClient

    fake = FakeServer(min_chunk_size=64)

    async def rejoin(expected: int) -> int:
        client = AsyncControlClient(fake.url, timeout_s=1, transport=fake.transport())
        try:
            request = negotiate_request(16, model="m", role="scheduler", instance_id="e")
            reply = await renegotiate(client, request, expected, holder="this engine")
            return reply.chunk_size
        finally:
            await client.aclose()

    assert asyncio.run(rejoin(64)) == 64
    with pytest.raises(RecoveryError, match=r"answers chunk size 64 .* this engine runs with 128"):
        asyncio.run(rejoin(128))


# ----------------------------------------------------------------------- CUDA IPC


def test_cuda_descriptor_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Field mapping of reduce_tensor's tuple, checked without a GPU."""
    import torch.multiprocessing.reductions as reductions

    t = SimpleNamespace(is_cuda=True)  # reduce_tensor is faked: no GPU needed
    args: tuple[Any, ...] = (
        torch.Tensor,
        torch.Size([4, 2, 3]),
        (6, 3, 1),
        5,
        object,
        torch.bfloat16,
        0,
        b"handle",
        4096,
        512,
        False,
        b"refc",
        7,
        b"event",
        True,
    )
    monkeypatch.setattr(reductions, "reduce_tensor", lambda _t: (None, args))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(uuid="GPU-1234")
    )
    d = cuda_ipc.describe(t, block_dim=0)  # type: ignore[arg-type]
    assert isinstance(d, CudaIpcTensor)
    assert d.model_dump() == {
        "transport": "cuda_ipc",
        "device_uuid": "1234",  # normalised: the server matches either spelling
        "handle_b64": base64.b64encode(b"handle").decode(),
        "storage_size_bytes": 4096,
        "storage_offset_bytes": 512,
        "ref_counter_handle_b64": base64.b64encode(b"refc").decode(),
        "ref_counter_offset": 7,
        "event_handle_b64": base64.b64encode(b"event").decode(),
        "event_sync_required": True,
        "tensor_offset": 5,
        "shape": [4, 2, 3],
        "stride": [6, 3, 1],
        "dtype": "bfloat16",
        "block_dim": 0,
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_descriptor_real_gpu() -> None:  # pragma: no cover - GPU only
    t = torch.zeros(8, 2, 16, 4, device="cuda", dtype=torch.float16)
    d = cuda_ipc.describe(t[:, 1], block_dim=0)
    assert d.shape == [8, 16, 4] and d.stride == [128, 4, 1]
    assert d.tensor_offset == 64
    assert d.device_uuid in str(torch.cuda.get_device_properties(0).uuid)
    assert d.handle_b64 and d.storage_size_bytes >= t.numel() * 2
