"""Contract tests (respx, MockTransport) for every control call of both clients."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import respx

from connector.client import AsyncControlClient, ControlClient
from connector.errors import (
    ProtocolError,
    ServerError,
    ServerFailure,
    ServerRejected,
    ServerTimeout,
    ServerUnreachable,
)
from contract import endpoints
from contract.endpoints import Endpoint
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    EndSessionsRequest,
    GroupInfo,
    LayerInfo,
    LookupAreaRequest,
    LookupItem,
    LookupRequest,
    MemfdTensor,
    NegotiateRequest,
    RegisterRequest,
    RetrieveRequest,
    StoreRequest,
    TransferItem,
)

URL = "http://mpcache.test:8000"
BOOT = "b" * 32

NEGOTIATE_REPLY = {
    "chunk_size": 288,
    "min_chunk_size": 256,
    "required_alignment": 96,
    "boot_id": BOOT,
}
HEALTH_REPLY = {
    "status": "ok",
    "boot_id": BOOT,
    "chunk_size": 288,
    "final": True,
    "uptime_s": 1.5,
    "sessions": 0,
    "registrations": 1,
    "lookup_areas": 1,
    "version": "0.1.0",
    "cluster": {"mode": "redis", "deployment": "d", "coordinator": "up", "l2": "down"},
    "disk": None,
}
CHUNK_REPLY = {
    "chunk_size": None,
    "final": False,
    "min_chunk_size": 256,
    "max_chunk_size": 65536,
    "alignments": [],
    "bindings": {"token_hasher": "pending"},
}
REGISTER_BODY = RegisterRequest(
    instance_id="eng/0",
    rank=0,
    world_size=1,
    chunk_size=288,
    namespace="ns",
    groups=[GroupInfo(group_id=0, kind="attention", token_span=16)],
    layers=[
        LayerInfo(
            name="l0",
            group_id=0,
            tensors=[
                MemfdTensor(
                    ticket="t-1",
                    offset_bytes=0,
                    shape=[4, 16, 2, 8],
                    stride=[256, 16, 8, 1],
                    dtype="float16",
                    block_dim=0,
                )
            ],
        )
    ],
)
REGISTER_REPLY = {
    "instance_id": "eng/0",
    "rank": 0,
    "chunk_size": 288,
    "num_layers": 1,
    "chunk_bytes": 9216,
    "refreshed": False,
    "registration_token": "rt-1",
}
ITEM = TransferItem(
    request_id="r1",
    namespace="ns",
    tokens_b64="AQAAAA==",
    start_token=0,
    end_token=288,
    block_ids=[[1, 2]],
)

# name, method, path, call(client), request json (or None), reply json, status
Call = Callable[[Any], Any]
CASES: list[Any] = [
    pytest.param(
        "POST",
        "/negotiate",
        lambda c: c.negotiate(NegotiateRequest(required_alignment=96, role="scheduler")),
        {"required_alignment": 96, "model": "", "role": "scheduler", "instance_id": ""},
        NEGOTIATE_REPLY,
        200,
        id="negotiate",
    ),
    pytest.param("GET", "/health", lambda c: c.health(), None, HEALTH_REPLY, 200, id="health"),
    pytest.param(
        "GET", "/chunk-size", lambda c: c.chunk_size(), None, CHUNK_REPLY, 200, id="chunk-size"
    ),
    pytest.param(
        "POST",
        "/register",
        lambda c: c.register(REGISTER_BODY),
        json.loads(REGISTER_BODY.model_dump_json(exclude_none=True)),
        REGISTER_REPLY,
        200,
        id="register",
    ),
    pytest.param(
        "DELETE",
        "/register/eng-0/0",
        lambda c: c.unregister("eng-0", 0),
        None,
        None,
        204,
        id="unregister",
    ),
    pytest.param(
        "POST",
        "/cache/lookup",
        lambda c: c.lookup(
            LookupRequest(requests=[LookupItem(request_id="r1", namespace="ns", tokens=[1, 2, 3])])
        ),
        {
            "requests": [
                {"request_id": "r1", "namespace": "ns", "tokens": [1, 2, 3], "world_size": 1}
            ]
        },
        {"results": [{"request_id": "r1", "hit_tokens": 0}]},
        200,
        id="lookup",
    ),
    pytest.param(
        "POST",
        "/cache/store",
        lambda c: c.store(StoreRequest(instance_id="eng", rank=0, requests=[ITEM])),
        None,
        {
            "results": [
                {"request_id": "r1", "stored_chunks": 1, "present_chunks": 0, "failed_chunks": 0}
            ]
        },
        200,
        id="store",
    ),
    pytest.param(
        "POST",
        "/cache/retrieve",
        lambda c: c.retrieve(RetrieveRequest(instance_id="eng", rank=0, requests=[ITEM])),
        None,
        {"results": [{"request_id": "r1", "loaded_tokens": 288, "failed_block_ids": []}]},
        200,
        id="retrieve",
    ),
    pytest.param(
        "POST",
        "/cache/end",
        lambda c: c.end_sessions(EndSessionsRequest(request_ids=["r1", "r2"])),
        {"request_ids": ["r1", "r2"]},
        {"ended": 2},
        200,
        id="end",
    ),
]


@pytest.fixture
def client() -> Iterator[ControlClient]:
    c = ControlClient(URL, timeout_s=0.5)
    yield c
    c.close()


@pytest.mark.parametrize(("method", "path", "call", "sent", "reply", "status"), CASES)
def test_call_contract(
    client: ControlClient,
    method: str,
    path: str,
    call: Call,
    sent: dict[str, Any] | None,
    reply: dict[str, Any] | None,
    status: int,
) -> None:
    with respx.mock(base_url=URL, assert_all_called=True) as router:
        route = router.route(method=method, path=path).respond(status, json=reply)
        result = call(client)
    request = route.calls.last.request
    if sent is not None:
        assert json.loads(request.content) == sent
    if method != "GET" and method != "DELETE":
        assert request.headers["content-type"] == "application/json"
    if reply is None:
        assert result is None
    else:
        assert json.loads(result.model_dump_json()) == reply


def test_transfer_item_sent_compactly(client: ControlClient) -> None:
    with respx.mock(base_url=URL) as router:
        route = router.post("/cache/store").respond(200, json={"results": []})
        client.store(StoreRequest(instance_id="eng", rank=3, requests=[ITEM]))
    body = json.loads(route.calls.last.request.content)
    assert body["rank"] == 3
    assert body["requests"][0]["tokens_b64"] == "AQAAAA=="
    assert "tokens" not in body["requests"][0]  # None fields are left out


@pytest.mark.parametrize(("method", "path", "call", "sent", "reply", "status"), CASES)
@pytest.mark.parametrize(
    ("effect", "error"),
    [
        pytest.param(httpx.ConnectTimeout("slow"), ServerTimeout, id="connect-timeout"),
        pytest.param(httpx.ReadTimeout("slow"), ServerTimeout, id="read-timeout"),
        pytest.param(httpx.ConnectError("refused"), ServerUnreachable, id="refused"),
        pytest.param(httpx.RemoteProtocolError("eof"), ServerUnreachable, id="eof"),
    ],
)
def test_transport_errors_are_translated(
    client: ControlClient,
    method: str,
    path: str,
    call: Call,
    sent: object,
    reply: object,
    status: int,
    effect: Exception,
    error: type[ServerError],
) -> None:
    with respx.mock(base_url=URL) as router:
        router.route(method=method, path=path).mock(side_effect=effect)
        with pytest.raises(error) as info:
            call(client)
    assert isinstance(info.value.__cause__, httpx.HTTPError)
    assert info.value.url == f"{URL}{path}"


@pytest.mark.parametrize(("method", "path", "call", "sent", "reply", "status"), CASES)
def test_5xx_is_server_failure_with_retry_after(
    client: ControlClient,
    method: str,
    path: str,
    call: Call,
    sent: object,
    reply: object,
    status: int,
) -> None:
    problem = {
        "type": "urn:mpcache:problem:binding-failed",
        "title": "Chunk-size binding failed",
        "status": 503,
        "detail": "telemetry binding failed; retry",
    }
    with respx.mock(base_url=URL) as router:
        router.route(method=method, path=path).respond(
            503, json=problem, headers={"Retry-After": "2"}
        )
        with pytest.raises(ServerFailure) as info:
            call(client)
    assert info.value.status == 503
    assert info.value.retry_after_s == 2.0
    assert info.value.problem_type == "urn:mpcache:problem:binding-failed"
    assert "telemetry binding failed" in str(info.value)


def test_500_without_problem_body(client: ControlClient) -> None:
    with respx.mock(base_url=URL) as router:
        router.get("/health").respond(500, text="boom")
        with pytest.raises(ServerFailure) as info:
            client.health()
    assert info.value.status == 500
    assert info.value.retry_after_s is None
    assert info.value.detail == "boom"


def test_409_problem_is_rejected(client: ControlClient) -> None:
    problem = {
        "type": "urn:mpcache:problem:incompatible-alignment",
        "title": "Incompatible chunk alignment",
        "status": 409,
        "detail": "this server's chunk size is 256 tokens, not a multiple of 96",
        "chunk_size": 256,
        "required_alignment": 96,
    }
    with respx.mock(base_url=URL) as router:
        router.post("/negotiate").respond(409, json=problem)
        with pytest.raises(ServerRejected) as info:
            client.negotiate(NegotiateRequest(required_alignment=96))
    assert info.value.status == 409
    assert info.value.problem["chunk_size"] == 256
    assert "not a multiple of 96" in info.value.detail


def test_malformed_reply_is_protocol_error(client: ControlClient) -> None:
    with respx.mock(base_url=URL) as router:
        router.get("/health").respond(200, json={"status": "ok"})
        with pytest.raises(ProtocolError, match="HealthResponse"):
            client.health()


def test_timeout_override_reaches_httpx(client: ControlClient) -> None:
    with respx.mock(base_url=URL) as router:
        route = router.get("/health").respond(200, json=HEALTH_REPLY)
        client.health(timeout_s=0.125)
    assert route.calls.last.request.extensions["timeout"]["read"] == 0.125


def test_unregister_quotes_instance_id() -> None:
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(204)

    c = ControlClient(URL, timeout_s=1, transport=httpx.MockTransport(handler))
    try:
        c.unregister("eng/0 x", 2)
    finally:
        c.close()
    assert seen == [b"/register/eng%2F0%20x/2"]


def test_injected_transport() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json=HEALTH_REPLY)

    c = ControlClient(URL, timeout_s=1, transport=httpx.MockTransport(handler))
    try:
        assert c.health().boot_id == BOOT
    finally:
        c.close()
    assert seen == ["/health"]


# ------------------------------------------------------------------------- async


ASYNC_CASES = [
    pytest.param("POST", "/negotiate", NEGOTIATE_REPLY, id="negotiate"),
    pytest.param("GET", "/health", HEALTH_REPLY, id="health"),
    pytest.param("POST", "/register", REGISTER_REPLY, id="register"),
    pytest.param("POST", "/cache/end", {"ended": 1}, id="end"),
]


async def _async_call(client: AsyncControlClient, path: str) -> Any:
    if path == "/negotiate":
        return await client.negotiate(NegotiateRequest(required_alignment=96))
    if path == "/health":
        return await client.health()
    if path == "/register":
        return await client.register(REGISTER_BODY)
    return await client.end_sessions(EndSessionsRequest(request_ids=["r1"]))


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "path", "reply"), ASYNC_CASES)
async def test_async_contract(method: str, path: str, reply: dict[str, Any]) -> None:
    client = AsyncControlClient(URL, timeout_s=0.5)
    try:
        with respx.mock(base_url=URL, assert_all_called=True) as router:
            router.route(method=method, path=path).respond(200, json=reply)
            result = await _async_call(client, path)
        assert json.loads(result.model_dump_json()) == reply
    finally:
        await client.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "path", "reply"), ASYNC_CASES)
@pytest.mark.parametrize(
    ("effect", "status", "error"),
    [
        pytest.param(httpx.ReadTimeout("slow"), None, ServerTimeout, id="timeout"),
        pytest.param(httpx.ConnectError("refused"), None, ServerUnreachable, id="refused"),
        pytest.param(None, 502, ServerFailure, id="502"),
        pytest.param(None, 422, ServerRejected, id="422"),
    ],
)
async def test_async_errors(
    method: str,
    path: str,
    reply: object,
    effect: Exception | None,
    status: int | None,
    error: type[ServerError],
) -> None:
    client = AsyncControlClient(URL, timeout_s=0.5)
    try:
        with respx.mock(base_url=URL) as router:
            route = router.route(method=method, path=path)
            if effect is not None:
                route.mock(side_effect=effect)
            else:
                route.respond(status or 500, json={"detail": "nope", "status": status})
            with pytest.raises(error):
                await _async_call(client, path)
    finally:
        await client.aclose()


def test_every_call_carries_the_client_headers_and_its_own() -> None:
    """Requests are built from parts made once per client: the API token and the
    JSON headers go on every call, the frame's media type only on a binary lookup,
    the registration token only on the call given one, and a timeout override only
    on its own call."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        for _ in request.stream:  # a chunked frame is read to its end
            pass
        seen.append(request)
        if request.url.path == "/cache/lookup":
            return httpx.Response(200, json={"results": []})
        if request.url.path == "/cache/end":
            return httpx.Response(200, json={"ended": 0})
        return httpx.Response(200, json=HEALTH_REPLY)

    c = ControlClient(URL, timeout_s=2, transport=httpx.MockTransport(handler), api_token="s3cret")
    try:
        c.lookup(iter([b"MPL1", b"\x00" * 4]))
        c.health(timeout_s=0.25)
        c.end_sessions(EndSessionsRequest(request_ids=["a"]))
        c.lookup(iter([b"MPL1", b"\x00" * 4]), timeout_s=0.25)
        c.health()
    finally:
        c.close()
    assert [r.headers["authorization"] for r in seen] == ["Bearer s3cret"] * 5
    kinds = [r.headers["content-type"] for r in seen if r.method == "POST"]
    assert kinds == ["application/octet-stream", "application/json", "application/octet-stream"]
    assert [r.extensions["timeout"]["read"] for r in seen] == [2, 0.25, 2, 0.25, 2]
    assert all(str(r.url).startswith(f"{URL}/") for r in seen)


def test_registration_token_goes_only_with_its_call() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(200, json=HEALTH_REPLY)

    c = ControlClient(URL, timeout_s=1, transport=httpx.MockTransport(handler))
    try:
        c.unregister("eng", 0, registration_token="tok-1")
        c.health()
        c.unregister("eng", 1)
    finally:
        c.close()
    header = REGISTRATION_TOKEN_HEADER
    assert [r.headers.get(header) for r in seen] == ["tok-1", None, None]


@pytest.mark.anyio
async def test_async_calls_carry_the_client_headers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=HEALTH_REPLY)

    client = AsyncControlClient(
        URL, timeout_s=0.5, transport=httpx.MockTransport(handler), api_token="s3cret"
    )
    try:
        await client.health()
        await client.health(timeout_s=0.125)
    finally:
        await client.aclose()
    assert [r.headers["authorization"] for r in seen] == ["Bearer s3cret"] * 2
    assert [r.extensions["timeout"]["read"] for r in seen] == [0.5, 0.125]


# ------------------------------------------------------------- the endpoint table

# Each named call of both clients: its table entry, its arguments, and the path its
# parameters fill in (the entry's own path where it has none).
OPERATIONS: list[tuple[str, Endpoint[Any, Any], tuple[Any, ...], str | None]] = [
    ("negotiate", endpoints.NEGOTIATE, (NegotiateRequest(required_alignment=96),), None),
    ("health", endpoints.HEALTH, (), None),
    ("chunk_size", endpoints.CHUNK_SIZE, (), None),
    ("registration_info", endpoints.REGISTRATION_INFO, (), None),
    ("key_index", endpoints.KEY_INDEX, (), None),
    ("register", endpoints.REGISTER, (REGISTER_BODY,), None),
    ("unregister", endpoints.UNREGISTER, ("eng/0", 1), "/register/eng%2F0/1"),
    ("lookup", endpoints.LOOKUP, (b"MPL1",), None),
    (
        "register_lookup_area",
        endpoints.REGISTER_LOOKUP_AREA,
        (LookupAreaRequest(ticket="t-1"),),
        None,
    ),
    ("store", endpoints.STORE, (StoreRequest(instance_id="eng", rank=0, requests=[ITEM]),), None),
    (
        "retrieve",
        endpoints.RETRIEVE,
        (RetrieveRequest(instance_id="eng", rank=0, requests=[ITEM]),),
        None,
    ),
    ("end_sessions", endpoints.END, (EndSessionsRequest(request_ids=["r1"]),), None),
]
OPERATION_IDS = [name for name, *_ in OPERATIONS]


def _table_server(endpoint: Endpoint[Any, Any], seen: list[httpx.Request]) -> httpx.MockTransport:
    """Answer with the entry's success status and an example of its reply model."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if endpoint.response is None:
            return httpx.Response(endpoint.status)
        example = endpoint.response.model_json_schema()["examples"][0]
        return httpx.Response(endpoint.status, json=example)

    return httpx.MockTransport(handler)


def _check_sent(
    seen: list[httpx.Request], endpoint: Endpoint[Any, Any], path: str | None, result: Any
) -> None:
    assert [(r.method, r.url.raw_path.decode()) for r in seen] == [
        (endpoint.method, path or endpoint.path)
    ]
    if endpoint.response is None:
        assert result is None
    else:
        assert type(result) is endpoint.response


def test_both_clients_make_the_same_calls() -> None:
    def calls(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert calls(ControlClient) - {"close"} == set(OPERATION_IDS)
    assert calls(AsyncControlClient) - {"aclose"} == set(OPERATION_IDS)


@pytest.mark.parametrize(("name", "endpoint", "args", "path"), OPERATIONS, ids=OPERATION_IDS)
def test_each_call_sends_its_table_entry(
    name: str, endpoint: Endpoint[Any, Any], args: tuple[Any, ...], path: str | None
) -> None:
    seen: list[httpx.Request] = []
    c = ControlClient(URL, timeout_s=1, transport=_table_server(endpoint, seen))
    try:
        result = getattr(c, name)(*args)
    finally:
        c.close()
    _check_sent(seen, endpoint, path, result)


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "endpoint", "args", "path"), OPERATIONS, ids=OPERATION_IDS)
async def test_each_async_call_sends_its_table_entry(
    name: str, endpoint: Endpoint[Any, Any], args: tuple[Any, ...], path: str | None
) -> None:
    seen: list[httpx.Request] = []
    c = AsyncControlClient(URL, timeout_s=1, transport=_table_server(endpoint, seen))
    try:
        result = await getattr(c, name)(*args)
    finally:
        await c.aclose()
    _check_sent(seen, endpoint, path, result)
