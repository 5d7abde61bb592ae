"""Request bodies: a size limit checked as they stream in, and decoding off the event loop.

Why (docs/design.md s.4.1): the event loop that reads bodies also answers
``/health``, and every connector's heartbeat marks the server down when a ping
takes longer than its timeout. A body of any size would be buffered whole
(``BodyLimit`` refuses one over ``--max-body-size`` as it streams in), and parsing
JSON holds the GIL for the whole call (``BodyParser`` decodes large bodies in a
helper process). ``bench/health_under_body_bench.py`` measures both.

Every route that takes a JSON body reads it with ``read_json``: malformed JSON,
bytes that are not UTF-8, and a body that does not fit the model are each a 422
problem, another media type a 415; a bad token field is a 422 of ``span_tokens``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import signal
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.problems import BriefValidationError, brief_errors, problem_response
from contract.errors import PayloadTooLarge, Unavailable, UnsupportedMediaType
from contract.schemas import TokenSpan, TransferItem
from dataplane import libc

__all__ = [
    "INLINE_BODY_BYTES",
    "BodyLimit",
    "BodyParser",
    "decode_json",
    "is_json",
    "json_body_doc",
    "read_json",
    "span_tokens",
]

M = TypeVar("M", bound=BaseModel)

INLINE_BODY_BYTES = 64 << 10
"""Bodies up to this size (at most ~30k JSON values) are decoded on the event loop,
where parsing them is short; larger ones go to the helper process."""


def _too_large(limit: int, received: int | None) -> PayloadTooLarge:
    got = f"{received} bytes" if received is not None else "more bytes than that"
    return PayloadTooLarge(
        f"the request body is larger than this server's limit of {limit} bytes (got "
        f"{got}); split the batch, send lookups in the binary form, or raise "
        "--max-body-size (MPCACHE_MAX_BODY_SIZE)",
        max_body_bytes=limit,
    )


class BodyLimit:
    """Refuse request bodies over the runtime's ``max_body_size`` with 413.

    Pure ASGI middleware, so the server never holds more than the limit plus
    uvicorn's read buffer of any body. The limit is read from ``app.state.runtime``
    (built by the lifespan) on each request. A declared ``Content-Length`` over the
    limit is refused before any of the body is read; otherwise (chunked, or a length
    that lies) bytes are counted as the app receives them and the read that passes
    the limit raises ``PayloadTooLarge``, which the app's error
    handlers turn into the 413 problem.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        runtime = getattr(scope["app"].state, "runtime", None)
        if runtime is None:  # no lifespan (a bare test app): no limit
            await self.app(scope, receive, send)
            return
        limit = int(runtime.settings.max_body_size)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    exc = _too_large(limit, declared)
                    reply = problem_response(
                        exc.status, exc.title, exc.slug, exc.detail, **exc.extras
                    )
                    reply.headers["connection"] = "close"
                    await reply(scope, receive, send)
                    return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit, None)
            return message

        await self.app(scope, limited, send)


# ----------------------------------------------------------------------- decoding


def _die_with_parent() -> None:
    """Helper-process initializer: exit when the server dies, even by SIGKILL."""
    prctl = libc.function("prctl", ctypes.c_int, ctypes.c_int, ctypes.c_ulong)
    if prctl is not None:  # else not Linux: the pool's pipes still close
        pr_set_pdeathsig = 1
        prctl(pr_set_pdeathsig, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server handles Ctrl-C


def _compact(value: Any) -> Any:
    """``value`` with token lists as base64 text and block ids as arrays (cheap to
    send back); other fields unchanged. No validation runs again."""
    if isinstance(value, BaseModel):
        update: dict[str, Any] = {}
        if isinstance(value, TokenSpan):
            try:
                decoded = value.token_array()
            except ValueError:
                decoded = None  # bad base64: the route refuses it, as for a small body
            if decoded is not None:
                value = value.with_decoded(decoded)
        if isinstance(value, TransferItem):
            update["block_ids"] = [np.asarray(ids, dtype=np.int64) for ids in value.block_ids]
        for name in type(value).model_fields:
            if name in update:
                continue
            field = getattr(value, name)
            if isinstance(field, list) and field and isinstance(field[0], BaseModel):
                update[name] = [_compact(v) for v in field]
        return value.model_copy(update=update) if update else value
    return value


def _decode(model: type[BaseModel], raw: bytes) -> tuple[bool, Any]:
    """In the helper process: ``(True, compact model)`` or ``(False, (its first
    errors, how many))``: the reply is built from a few errors whatever the body."""
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        return False, (brief_errors(_errors(exc)), exc.error_count())
    return True, _compact(parsed)


def _errors(exc: ValidationError) -> list[Any]:
    return exc.errors(include_url=False, include_input=False, include_context=False)


class BodyParser:
    """Decodes large bodies in one helper process, started on first use.

    Parsing and validating JSON holds the GIL for the whole call (pydantic-core and
    ``json`` never release it), so a thread pool would not keep it off the event
    loop. The helper sends back a compact model: token ids (JSON list or base64)
    already decoded into int32 arrays (``TokenSpan.with_decoded``) and block-id lists
    as int64 arrays, each a memcpy to unpickle.

    One process is enough: its job is to keep the GIL-bound parse away from the
    event loop, not to parse faster; bodies queue behind each other there. If the
    helper dies, the call is answered 503 and the next one starts a new helper.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_die_with_parent,
                )
            return self._executor

    async def decode(self, model: type[M], raw: bytes) -> M:
        pool = self._pool()
        try:
            ok, value = await asyncio.wrap_future(pool.submit(_decode, model, raw))
        except BrokenProcessPool as exc:
            with self._lock:
                if self._executor is pool:
                    self._executor = None
            raise Unavailable("the body decoder restarted; retry the call") from exc
        if not ok:
            errors, count = value
            raise BriefValidationError(errors, count)
        assert isinstance(value, model)
        return value

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            # Waits for a decode in flight (one body, bounded by --max-body-size): on
            # CPython 3.11 an executor left running races the interpreter's exit hook,
            # which then writes to a wake-up pipe its manager thread has just closed
            # (EBADF, a traceback in the server's last lines).
            executor.shutdown(wait=True, cancel_futures=True)


def is_json(media_type: str) -> bool:
    """``media_type`` (lower case, no parameters) is read as JSON; none at all is too."""
    return media_type in ("", "application/json") or media_type.endswith("+json")


def span_tokens(span: TokenSpan, where: str) -> np.ndarray:
    """The span's token ids as int32: the one place a bad token field (base64 that
    does not decode, a ragged length, a negative id) becomes a 422, the same
    malformed-request problem as a token list the model refuses. ``where`` (the
    item's request id) names the item in the problem's ``errors``."""
    try:
        return span.token_array()
    except ValueError as exc:
        raise RequestValidationError(
            [{"loc": ("body", where), "msg": f"bad tokens: {exc}", "type": "value_error"}]
        ) from exc


async def read_json(request: Request, model: type[M]) -> M:
    """The request's body as ``model``: 415 unless JSON, 422 if it does not fit.

    Small bodies are decoded here, large ones by the runtime's ``BodyParser``.
    """
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not is_json(media_type):
        raise UnsupportedMediaType(
            f"this route takes application/json, not {media_type}", media_type=media_type
        )
    return await decode_json(request, model, await request.body())


async def decode_json(request: Request, model: type[M], raw: bytes) -> M:
    """``raw`` (JSON text of ``model``, part of ``request``) decoded here when small,
    else by the runtime's ``BodyParser``; 422 if it does not fit."""
    if len(raw) > INLINE_BODY_BYTES:
        parser: BodyParser = request.app.state.runtime.parser
        return await parser.decode(model, raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BriefValidationError(_errors(exc), exc.error_count()) from exc


def json_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` with ``read_json``."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
