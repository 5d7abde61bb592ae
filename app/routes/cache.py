"""Cache operations, batched per engine step: lookup, store, retrieve, end, blend match.

Where each runs: every route is ``async`` and reads its own body (``app.bodies``:
JSON bodies over ``INLINE_BODY_BYTES`` are decoded in a helper process, never on
the event loop). ``lookup`` and ``end`` then run on the event loop (no thread-pool
hop): a lookup (JSON, or the binary form of ``contract.frames``, served item by item
as it arrives) hashes and asks the pool, all cheap (with ``--l2-url``, L2 is asked
about L1's misses from the thread pool, and awaited); only more than
``INLINE_LOOKUP_TOKENS`` tokens at once (a JSON lookup, or one item of a binary one)
move to the thread pool, so that /health never waits long behind them. ``store``,
``retrieve`` and ``blend/match`` run in the thread pool: their copies (and blend's
hashing of whole prompts) never block the event loop.
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.bodies import read_json
from app.deps import ReceivedAtDep, RegistrationTokenDep, RuntimeDep
from app.routes.declare import declare
from app.service import LookupBatch
from app.state import Runtime
from contract import endpoints
from contract.errors import NotFound, UnsupportedMediaType
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE, LookupFrameReader
from contract.schemas import (
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    LookupAreaRequest,
    LookupAreaResponse,
    LookupRequest,
    LookupResponse,
    LookupTarget,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = ["router"]

router = APIRouter(tags=["cache"])

INLINE_LOOKUP_TOKENS = 1 << 18
"""A JSON lookup of at most this many tokens in all, or one item of a binary lookup
(1 MiB of int32), is served on the event loop; more, in the thread pool. Hashing that
many and asking the pool is short enough for /health not to wait long behind it
(bench/hash_bench.py measures the hashing)."""


def _malformed(where: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", where), "msg": message, "type": "value_error"}])


Items = list[tuple[LookupTarget, np.ndarray]]


async def _lookup_frame(request: Request, runtime: Runtime) -> LookupResponse:
    """Serve a binary lookup as its body arrives: each item is looked up as soon as
    its tokens are in, while the sender packs the next. A fault (a bad length, a
    negative token id) refuses the call where it is found; the items before it have
    been served (sessions opened, hits leased: the connector's session end, or the
    lease's expiry, releases them)."""
    batch = runtime.cache.lookup_batch()  # 409 before the body is read
    reader = LookupFrameReader(runtime.lookup_areas.tokens)
    try:
        async for chunk in request.stream():
            inline: Items = []  # answered together, in order, before a large item
            for item, tokens in reader.feed(chunk):
                if len(tokens) <= INLINE_LOOKUP_TOKENS:
                    inline.append((item, tokens))
                    continue
                batch.add_many(inline)
                inline = []
                await run_in_threadpool(batch.add, item, tokens)
            batch.add_many(inline)
        reader.close()
    except ValidationError as exc:
        errors = [{**e, "loc": ("header", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from exc
    except ValueError as exc:
        raise _malformed("frame", str(exc)) from exc
    return await _finish(batch)


async def _finish(batch: LookupBatch) -> LookupResponse:
    """The reply, once L2 (if any) was asked, from the thread pool, about L1's misses."""
    if batch.needs_l2:
        await run_in_threadpool(batch.check_l2)
    return batch.finish()


def _lookup_items(req: LookupRequest) -> Items:
    """The items of a JSON lookup with their token ids; malformed tokens are a 422."""
    items: Items = []
    for item in req.requests:
        try:
            items.append((item, item.token_array()))
        except ValueError as exc:
            raise _malformed(item.request_id, f"bad tokens: {exc}") from exc
    return items


def _num_tokens(req: LookupRequest) -> int:
    """How many token ids the lookup carries (base64 counted from its length)."""
    return sum(item.num_tokens() for item in req.requests)


def _serve_json_lookup(runtime: Runtime, req: LookupRequest) -> LookupResponse:
    return runtime.cache.lookup_tokens(_lookup_items(req))


@declare(router, endpoints.LOOKUP)
async def lookup(request: Request, runtime: RuntimeDep) -> Response:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type == LOOKUP_FRAME_MEDIA_TYPE:
        reply = await _lookup_frame(request, runtime)
    elif media_type in ("", "application/json") or media_type.endswith("+json"):
        req = await read_json(request, LookupRequest)
        if _num_tokens(req) <= INLINE_LOOKUP_TOKENS:
            batch = runtime.cache.lookup_batch()
            batch.add_many(_lookup_items(req))
            reply = await _finish(batch)
        else:
            reply = await run_in_threadpool(_serve_json_lookup, runtime, req)
    else:
        raise UnsupportedMediaType(
            f"a lookup body is application/json or {LOOKUP_FRAME_MEDIA_TYPE} (the binary "
            f"form of contract/frames.py), not {media_type or 'untyped'}",
            media_type=media_type,
        )
    return Response(reply.model_dump_json(), media_type="application/json")


@declare(router, endpoints.STORE)
async def store(
    request: Request,
    runtime: RuntimeDep,
    received: ReceivedAtDep,
    token: RegistrationTokenDep = None,
) -> StoreResponse:
    body = await read_json(request, StoreRequest)
    return await run_in_threadpool(
        lambda: runtime.cache.store(body, received_at=received, token=token)
    )


@declare(router, endpoints.RETRIEVE)
async def retrieve(
    request: Request,
    runtime: RuntimeDep,
    received: ReceivedAtDep,
    token: RegistrationTokenDep = None,
) -> RetrieveResponse:
    body = await read_json(request, RetrieveRequest)
    return await run_in_threadpool(
        lambda: runtime.cache.retrieve(body, received_at=received, token=token)
    )


@declare(router, endpoints.END)
async def end(request: Request, runtime: RuntimeDep) -> EndSessionsResponse:
    return runtime.cache.end(await read_json(request, EndSessionsRequest))


@declare(router, endpoints.BLEND_MATCH)
async def blend_match(request: Request, runtime: RuntimeDep) -> BlendMatchResponse:
    body = await read_json(request, BlendMatchRequest)
    return await run_in_threadpool(runtime.cache.blend_match, body)


@declare(router, endpoints.REGISTER_LOOKUP_AREA)
async def register_lookup_area(request: Request, runtime: RuntimeDep) -> LookupAreaResponse:
    body = await read_json(request, LookupAreaRequest)
    area_id, size = runtime.lookup_areas.register(body.ticket)
    return LookupAreaResponse(area_id=area_id, size_bytes=size)


@declare(router, endpoints.DELETE_LOOKUP_AREA)
async def delete_lookup_area(area_id: str, runtime: RuntimeDep) -> Response:
    if not runtime.lookup_areas.release(area_id):
        raise NotFound("no such lookup area", area_id=area_id)
    return Response(status_code=204)
