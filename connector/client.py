"""HTTP control clients for one mpcache server, both built from ``contract.endpoints``.

``ControlClient`` (blocking ``httpx.Client``) serves calls made on vLLM's threads and
the scheduler's lookup thread, each with a short timeout; ``AsyncControlClient``
(``httpx.AsyncClient``) serves the heartbeat loop. Each named call (``negotiate``,
``lookup``, ...) is written once, in ``_Operations``, as the ``_Call`` its arguments
make of an endpoint-table entry; each client only sends it, blocking or awaited. Both
take an injectable transport (``httpx.MockTransport``, ``httpx.ASGITransport``, respx)
so tests need no sockets.

Every request body is a ``contract.schemas`` model and every reply is validated into
the entry's reply model. httpx errors are translated into ``connector.errors`` in exactly one place,
``_translate``, and non-2xx replies of any transport in ``reply_or_raise``; nothing
else in the connector catches httpx exceptions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

import httpx
from pydantic import BaseModel, ValidationError

from connector.errors import (
    ProtocolError,
    ServerFailure,
    ServerRejected,
    ServerTimeout,
    ServerUnreachable,
)
from contract import endpoints
from contract.endpoints import Endpoint
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    ChunkSizeResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    HealthResponse,
    KeyIndexInfo,
    LookupAreaRequest,
    LookupAreaResponse,
    LookupRequest,
    LookupResponse,
    NegotiateRequest,
    NegotiateResponse,
    RegisterRequest,
    RegisterResponse,
    RegistrationInfo,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = [
    "AsyncControlClient",
    "ControlClient",
    "TransportFactory",
    "problem_of",
    "reply_or_raise",
    "retry_after_s",
]

TransportFactory = Callable[[str], "httpx.BaseTransport | None"]
"""Per server URL, the transport its blocking client uses (tests inject fakes)."""

_R = TypeVar("_R", bound=BaseModel | None)
_M = TypeVar("_M", bound=BaseModel)
_P = ParamSpec("_P")

_HEADERS = {"content-type": "application/json", "accept": "application/json"}
_FRAME_HEADERS = {"content-type": LOOKUP_FRAME_MEDIA_TYPE}


class _translate:  # a lower-case name: used as ``with _translate(url):``, like a function
    """The one boundary where httpx exceptions become connector errors.

    A class, not ``contextlib.contextmanager``: it wraps every call, and a generator's
    set-up costs several times these two methods (bench/client_call_bench.py)."""

    __slots__ = ("_url",)

    def __init__(self, url: str) -> None:
        self._url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        url = self._url
        if isinstance(exc, httpx.TimeoutException):
            raise ServerTimeout(f"{url}: timed out ({type(exc).__name__})", url=url) from exc
        if isinstance(exc, httpx.HTTPError):
            raise ServerUnreachable(f"{url}: {type(exc).__name__}: {exc}", url=url) from exc


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` value in seconds, or None when absent or not a number."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def problem_of(content: bytes, fallback: str) -> dict[str, Any]:
    """An error reply's problem body (``{"detail": ...}`` around anything else)."""
    try:
        body = json.loads(content)
    except ValueError:
        return {"detail": content[:500].decode(errors="replace") or fallback}
    return body if isinstance(body, dict) else {"detail": str(body)[:500]}


def reply_or_raise(
    status: int,
    content: bytes,
    model: type[_M] | None,
    url: str,
    *,
    reason: str = "",
    retry_after: str | None = None,
) -> _M | None:
    """A reply of ``status`` validated into ``model`` (None where it has none), or the
    connector error the status means: the one translation of every transport's
    replies (HTTP here, the ops socket in ``connector.transfer_calls``)."""
    if 200 <= status < 300:
        try:
            return None if model is None else model.model_validate_json(content)
        except ValidationError as exc:
            assert model is not None
            raise ProtocolError(
                f"{url}: reply does not match {model.__name__}: {exc.error_count()} error(s)",
                url=url,
            ) from exc
    problem = problem_of(content, reason)
    detail = problem.get("detail") or problem.get("title") or reason
    message = f"{url}: HTTP {status}: {detail}"
    if 400 <= status < 500:
        raise ServerRejected(message, url=url, status=status, problem=problem)
    raise ServerFailure(
        message, url=url, status=status, problem=problem, retry_after_s=retry_after_s(retry_after)
    )


def _parse_reply(reply: httpx.Response, endpoint: Endpoint[Any, _R], url: str) -> _R:
    """The reply validated into the entry's reply model (``None`` where it has none),
    or the connector error its status means."""
    # An entry's ``Resp`` is its reply model's type: the one place that is assumed.
    model = cast("type[BaseModel] | None", endpoint.response)
    parsed = reply_or_raise(
        reply.status_code,
        reply.content,
        model,
        url,
        reason=reply.reason_phrase,
        retry_after=reply.headers.get("retry-after"),
    )
    return cast(_R, parsed)


Body = BaseModel | bytes | Iterable[bytes] | None
"""A model (sent as JSON), or a binary lookup frame, whole or in pieces (chunked)."""


def _content(body: Body) -> bytes | Iterable[bytes] | None:
    if isinstance(body, BaseModel):
        return body.model_dump_json(exclude_none=True).encode()
    return body


def _frame_headers(body: Body) -> dict[str, str] | None:
    return None if body is None or isinstance(body, BaseModel) else _FRAME_HEADERS


def _default_headers(api_token: str | None) -> dict[str, str]:
    if api_token is None:
        return dict(_HEADERS)
    return {**_HEADERS, "authorization": f"Bearer {api_token}"}


@dataclass(slots=True)
class _Call(Generic[_R]):
    """One control call as an operation's arguments make it, before it is sent: the
    table entry (whose reply model types ``_R``), the body and per-call options.

    Not frozen: one is made per call, and a frozen dataclass's ``__init__`` (a
    ``object.__setattr__`` per field) costs a few times a plain one's; nothing keeps it."""

    endpoint: Endpoint[Any, _R]
    body: Body = None
    timeout_s: float | None = None
    registration_token: str | None = None
    path: str | None = None
    """The entry's path with its parameters filled in, where it has any."""


class _Requests:
    """Each call's ``httpx.Request``, from parts its client's settings give once: the
    URL of each path, the headers of each kind of body, the timeout of each value.

    ``Client.request`` parses and merges the base URL, the headers and the timeout
    anew on every call, on the scheduler's lookup thread before a lookup's first
    byte; ``send`` of a request built here does the rest as before (transport,
    proxies, cookies, hooks).
    """

    def __init__(self, base_url: str, http: httpx.Client | httpx.AsyncClient) -> None:
        self._base_url = base_url
        self._timeout = http.timeout.as_dict()
        self._headers = {False: http.headers, True: http.headers.copy()}
        self._headers[True].update(_FRAME_HEADERS)  # a binary lookup frame
        self._urls: dict[str, httpx.URL] = {}
        self._timeouts: dict[float, dict[str, float | None]] = {}

    def build(self, call: _Call[Any], path: str) -> httpx.Request:
        body, timeout_s, registration_token = call.body, call.timeout_s, call.registration_token
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(f"{self._base_url}{path}")
        headers = self._headers[_frame_headers(body) is not None]
        if registration_token is not None:
            headers = headers.copy()
            headers[REGISTRATION_TOKEN_HEADER] = registration_token
        timeout = self._timeout
        if timeout_s is not None:
            timeout = self._timeouts.get(timeout_s) or httpx.Timeout(timeout_s).as_dict()
            self._timeouts[timeout_s] = timeout
        return httpx.Request(
            call.endpoint.method,
            url,
            headers=headers,
            content=_content(body),
            extensions={"timeout": timeout},
        )


class _Operation(Generic[_P, _R]):
    """A named call of both clients, from a method that builds its ``_Call``: read
    from a ``ControlClient`` it sends the call and returns the reply; read from an
    ``AsyncControlClient`` it returns the coroutine that does."""

    def __init__(self, build: Callable[Concatenate[Any, _P], _Call[_R]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> _Operation[_P, _R]: ...

    @overload
    def __get__(
        self, client: ControlClient, owner: type[Any] | None = None
    ) -> Callable[_P, _R]: ...

    @overload
    def __get__(
        self, client: AsyncControlClient, owner: type[Any] | None = None
    ) -> Callable[_P, Coroutine[Any, Any, _R]]: ...

    def __get__(self, client: _Operations | None, owner: type[Any] | None = None) -> Any:
        if client is None:
            return self
        build, send = self._build, client._send

        def call(*args: _P.args, **kwargs: _P.kwargs) -> Any:
            return send(build(client, *args, **kwargs))

        return call


class _Operations:
    """Every named call, written once for both clients, as the ``_Call`` it makes."""

    def __init__(
        self, base_url: str, timeout_s: float, http: httpx.Client | httpx.AsyncClient
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._requests = _Requests(base_url, http)

    def _send(self, call: _Call[Any]) -> Any:
        raise NotImplementedError

    @_Operation
    def negotiate(
        self, body: NegotiateRequest, timeout_s: float | None = None
    ) -> _Call[NegotiateResponse]:
        return _Call(endpoints.NEGOTIATE, body, timeout_s)

    @_Operation
    def health(self, timeout_s: float | None = None) -> _Call[HealthResponse]:
        return _Call(endpoints.HEALTH, None, timeout_s)

    @_Operation
    def chunk_size(self, timeout_s: float | None = None) -> _Call[ChunkSizeResponse]:
        return _Call(endpoints.CHUNK_SIZE, None, timeout_s)

    @_Operation
    def registration_info(self, timeout_s: float | None = None) -> _Call[RegistrationInfo]:
        return _Call(endpoints.REGISTRATION_INFO, None, timeout_s)

    @_Operation
    def key_index(self, timeout_s: float | None = None) -> _Call[KeyIndexInfo]:
        return _Call(endpoints.KEY_INDEX, None, timeout_s)

    @_Operation
    def register(
        self,
        body: RegisterRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> _Call[RegisterResponse]:
        """Register; ``registration_token`` (the current one, if any) lets it replace."""
        return _Call(endpoints.REGISTER, body, timeout_s, registration_token)

    @_Operation
    def unregister(
        self,
        instance_id: str,
        rank: int,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> _Call[None]:
        path = endpoints.UNREGISTER.url_path(instance_id=instance_id, rank=rank)
        return _Call(endpoints.UNREGISTER, None, timeout_s, registration_token, path)

    @_Operation
    def lookup(
        self, body: LookupRequest | bytes | Iterable[bytes], timeout_s: float | None = None
    ) -> _Call[LookupResponse]:
        """A lookup in the JSON form, or a binary frame (``contract.frames``), whole or
        as pieces (sent chunked as they are produced)."""
        return _Call(endpoints.LOOKUP, body, timeout_s)

    @_Operation
    def register_lookup_area(
        self, body: LookupAreaRequest, timeout_s: float | None = None
    ) -> _Call[LookupAreaResponse]:
        return _Call(endpoints.REGISTER_LOOKUP_AREA, body, timeout_s)

    @_Operation
    def store(
        self,
        body: StoreRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> _Call[StoreResponse]:
        return _Call(endpoints.STORE, body, timeout_s, registration_token)

    @_Operation
    def retrieve(
        self,
        body: RetrieveRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> _Call[RetrieveResponse]:
        return _Call(endpoints.RETRIEVE, body, timeout_s, registration_token)

    @_Operation
    def end_sessions(
        self, body: EndSessionsRequest, timeout_s: float | None = None
    ) -> _Call[EndSessionsResponse]:
        return _Call(endpoints.END, body, timeout_s)


class ControlClient(_Operations):
    """Blocking client; every call is bounded by ``timeout_s`` (or its override)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
        api_token: str | None = None,
    ) -> None:
        base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=base_url,
            timeout=timeout_s,
            transport=transport,
            headers=_default_headers(api_token),
        )
        super().__init__(base_url, timeout_s, self._http)

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call[_R]) -> _R:
        path = call.path or call.endpoint.path
        url = f"{self.base_url}{path}"
        with _translate(url):
            reply = self._http.send(self._requests.build(call, path))
        return _parse_reply(reply, call.endpoint, url)


class AsyncControlClient(_Operations):
    """``ControlClient``'s calls, awaited: for the heartbeat loop."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        api_token: str | None = None,
    ) -> None:
        base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_s,
            transport=transport,
            headers=_default_headers(api_token),
        )
        super().__init__(base_url, timeout_s, self._http)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call[_R]) -> _R:
        path = call.path or call.endpoint.path
        url = f"{self.base_url}{path}"
        with _translate(url):
            reply = await self._http.send(self._requests.build(call, path))
        return _parse_reply(reply, call.endpoint, url)
