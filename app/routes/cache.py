"""Cache operations, batched per engine step: lookup, store, retrieve, end, blend match.

Where each runs: every route is ``async`` and reads its own body (``app.bodies``:
JSON bodies over ``INLINE_BODY_BYTES`` are decoded in a helper process, never on
the event loop). ``lookup`` and ``end`` then run on the event loop (no thread-pool
hop; a lookup moves only its large parts there, ``app.lookup.Lookups``). ``store``,
``retrieve`` and ``blend/match`` run in the thread pool: their copies (and blend's
hashing of whole prompts) never block the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.bodies import read_json
from app.deps import ReceivedAtDep, RegistrationTokenDep, RuntimeDep
from app.routes.declare import declare
from contract import endpoints
from contract.errors import NotFound
from contract.schemas import (
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    KeyIndexInfo,
    LookupAreaRequest,
    LookupAreaResponse,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = ["router"]

router = APIRouter(tags=["cache"])


@declare(router, endpoints.LOOKUP)
async def lookup(request: Request, runtime: RuntimeDep) -> Response:
    reply = await runtime.cache.lookups.serve(request)
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


@declare(router, endpoints.KEY_INDEX)
async def key_index(runtime: RuntimeDep) -> KeyIndexInfo:
    index = runtime.key_index
    if index is None:
        raise NotFound("this server publishes no key index (--no-key-index, or not x86-64)")
    return KeyIndexInfo(segment=index.name, slots=index.slots, boot_id=runtime.boot_id)


@declare(router, endpoints.DELETE_LOOKUP_AREA)
async def delete_lookup_area(area_id: str, runtime: RuntimeDep) -> Response:
    if not runtime.lookup_areas.release(area_id):
        raise NotFound("no such lookup area", area_id=area_id)
    return Response(status_code=204)
