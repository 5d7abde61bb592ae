"""HTTP control clients for one mpcache server.

``ControlClient`` (blocking ``httpx.Client``) serves calls made on vLLM's threads and
the scheduler's lookup thread, each with a short timeout; ``AsyncControlClient``
(``httpx.AsyncClient``) serves the heartbeat loop. Both take an injectable transport
(``httpx.MockTransport``, ``httpx.ASGITransport``, respx) so tests need no sockets.

Every request body is an ``contract.schemas`` model and every reply is validated into
one, so both ends share one contract. httpx errors and non-2xx replies are
translated into ``connector.errors`` in exactly one place, ``_translate`` plus
``_parse_reply``; nothing else in the connector catches httpx exceptions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from connector.errors import (
    ProtocolError,
    ServerFailure,
    ServerRejected,
    ServerTimeout,
    ServerUnreachable,
)
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    ChunkSizeResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    HealthResponse,
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

__all__ = ["AsyncControlClient", "ControlClient", "TransportFactory"]

TransportFactory = Callable[[str], "httpx.BaseTransport | None"]
"""Per server URL, the transport its blocking client uses (tests inject fakes)."""

_M = TypeVar("_M", bound=BaseModel)

_HEADERS = {"content-type": "application/json", "accept": "application/json"}
_FRAME_HEADERS = {"content-type": LOOKUP_FRAME_MEDIA_TYPE}


@contextlib.contextmanager
def _translate(url: str) -> Iterator[None]:
    """The one boundary where httpx exceptions become connector errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ServerTimeout(f"{url}: timed out ({type(exc).__name__})", url=url) from exc
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"{url}: {type(exc).__name__}: {exc}", url=url) from exc


def _retry_after(reply: httpx.Response) -> float | None:
    value = reply.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _problem(reply: httpx.Response) -> dict[str, Any]:
    try:
        body = reply.json()
    except ValueError:
        return {"detail": reply.text[:500]}
    return body if isinstance(body, dict) else {"detail": str(body)[:500]}


def _parse_reply(reply: httpx.Response, model: type[_M] | None, url: str) -> _M | None:
    status = reply.status_code
    if 200 <= status < 300:
        if model is None:
            return None
        try:
            return model.model_validate_json(reply.content)
        except ValidationError as exc:
            raise ProtocolError(
                f"{url}: reply does not match {model.__name__}: {exc.error_count()} error(s)",
                url=url,
            ) from exc
    problem = _problem(reply)
    detail = problem.get("detail") or problem.get("title") or reply.reason_phrase
    message = f"{url}: HTTP {status}: {detail}"
    if 400 <= status < 500:
        raise ServerRejected(message, url=url, status=status, problem=problem)
    raise ServerFailure(
        message, url=url, status=status, problem=problem, retry_after_s=_retry_after(reply)
    )


Body = BaseModel | bytes | Iterable[bytes] | None
"""A model (sent as JSON), or a binary lookup frame, whole or in pieces (chunked)."""


def _content(body: Body) -> bytes | Iterable[bytes] | None:
    if isinstance(body, BaseModel):
        return body.model_dump_json(exclude_none=True).encode()
    return body


def _frame_headers(body: Body) -> dict[str, str] | None:
    return None if body is None or isinstance(body, BaseModel) else _FRAME_HEADERS


def _register_path(instance_id: str, rank: int) -> str:
    return f"/register/{quote(instance_id, safe='')}/{rank}"


def _default_headers(api_token: str | None) -> dict[str, str]:
    if api_token is None:
        return dict(_HEADERS)
    return {**_HEADERS, "authorization": f"Bearer {api_token}"}


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

    def build(
        self,
        method: str,
        path: str,
        body: Body,
        timeout_s: float | None,
        registration_token: str | None,
    ) -> httpx.Request:
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
            method, url, headers=headers, content=_content(body), extensions={"timeout": timeout}
        )


class ControlClient:
    """Blocking client; every call is bounded by ``timeout_s`` (or its override)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
        api_token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout_s,
            transport=transport,
            headers=_default_headers(api_token),
        )
        self._requests = _Requests(self.base_url, self._http)

    def close(self) -> None:
        self._http.close()

    def _call(
        self,
        method: str,
        path: str,
        model: type[_M] | None,
        body: Body = None,
        timeout_s: float | None = None,
        registration_token: str | None = None,
    ) -> _M | None:
        url = f"{self.base_url}{path}"
        with _translate(url):
            request = self._requests.build(method, path, body, timeout_s, registration_token)
            reply = self._http.send(request)
        return _parse_reply(reply, model, url)

    def _call_model(
        self,
        method: str,
        path: str,
        model: type[_M],
        body: Body = None,
        timeout_s: float | None = None,
        registration_token: str | None = None,
    ) -> _M:
        result = self._call(method, path, model, body, timeout_s, registration_token)
        assert result is not None
        return result

    def negotiate(
        self, body: NegotiateRequest, timeout_s: float | None = None
    ) -> NegotiateResponse:
        return self._call_model("POST", "/negotiate", NegotiateResponse, body, timeout_s)

    def health(self, timeout_s: float | None = None) -> HealthResponse:
        return self._call_model("GET", "/health", HealthResponse, None, timeout_s)

    def chunk_size(self, timeout_s: float | None = None) -> ChunkSizeResponse:
        return self._call_model("GET", "/chunk-size", ChunkSizeResponse, None, timeout_s)

    def registration_info(self, timeout_s: float | None = None) -> RegistrationInfo:
        return self._call_model("GET", "/register", RegistrationInfo, None, timeout_s)

    def register(
        self,
        body: RegisterRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> RegisterResponse:
        """Register; ``registration_token`` (the current one, if any) lets it replace."""
        return self._call_model(
            "POST", "/register", RegisterResponse, body, timeout_s, registration_token
        )

    def unregister(
        self,
        instance_id: str,
        rank: int,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> None:
        self._call(
            "DELETE", _register_path(instance_id, rank), None, None, timeout_s, registration_token
        )

    def lookup(
        self, body: LookupRequest | bytes | Iterable[bytes], timeout_s: float | None = None
    ) -> LookupResponse:
        """A lookup in the JSON form, or a binary frame (``contract.frames``), whole or
        as pieces (sent chunked as they are produced)."""
        return self._call_model("POST", "/cache/lookup", LookupResponse, body, timeout_s)

    def register_lookup_area(
        self, body: LookupAreaRequest, timeout_s: float | None = None
    ) -> LookupAreaResponse:
        return self._call_model("POST", "/cache/lookup-areas", LookupAreaResponse, body, timeout_s)

    def store(
        self,
        body: StoreRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> StoreResponse:
        return self._call_model(
            "POST", "/cache/store", StoreResponse, body, timeout_s, registration_token
        )

    def retrieve(
        self,
        body: RetrieveRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> RetrieveResponse:
        return self._call_model(
            "POST", "/cache/retrieve", RetrieveResponse, body, timeout_s, registration_token
        )

    def end_sessions(
        self, body: EndSessionsRequest, timeout_s: float | None = None
    ) -> EndSessionsResponse:
        return self._call_model("POST", "/cache/end", EndSessionsResponse, body, timeout_s)


class AsyncControlClient:
    """Async twin of ``ControlClient`` for the heartbeat loop (same contract)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        api_token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            transport=transport,
            headers=_default_headers(api_token),
        )
        self._requests = _Requests(self.base_url, self._http)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        model: type[_M] | None,
        body: Body = None,
        timeout_s: float | None = None,
        registration_token: str | None = None,
    ) -> _M | None:
        url = f"{self.base_url}{path}"
        with _translate(url):
            request = self._requests.build(method, path, body, timeout_s, registration_token)
            reply = await self._http.send(request)
        return _parse_reply(reply, model, url)

    async def _call_model(
        self,
        method: str,
        path: str,
        model: type[_M],
        body: Body = None,
        timeout_s: float | None = None,
        registration_token: str | None = None,
    ) -> _M:
        result = await self._call(method, path, model, body, timeout_s, registration_token)
        assert result is not None
        return result

    async def negotiate(
        self, body: NegotiateRequest, timeout_s: float | None = None
    ) -> NegotiateResponse:
        return await self._call_model("POST", "/negotiate", NegotiateResponse, body, timeout_s)

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        return await self._call_model("GET", "/health", HealthResponse, None, timeout_s)

    async def registration_info(self, timeout_s: float | None = None) -> RegistrationInfo:
        return await self._call_model("GET", "/register", RegistrationInfo, None, timeout_s)

    async def register(
        self,
        body: RegisterRequest,
        timeout_s: float | None = None,
        *,
        registration_token: str | None = None,
    ) -> RegisterResponse:
        return await self._call_model(
            "POST", "/register", RegisterResponse, body, timeout_s, registration_token
        )

    async def end_sessions(
        self, body: EndSessionsRequest, timeout_s: float | None = None
    ) -> EndSessionsResponse:
        return await self._call_model("POST", "/cache/end", EndSessionsResponse, body, timeout_s)
