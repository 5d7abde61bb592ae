"""Cache operations, batched per engine step: lookup, store, retrieve, end, blend match.

Where each runs: every route is ``async`` and reads its own body (``app.bodies``:
JSON bodies over ``INLINE_BODY_BYTES`` are decoded in a helper process, never on
the event loop). ``lookup`` and ``end`` then run on the event loop (no thread-pool
hop; a lookup moves only its large parts there, ``app.lookup.Lookups``). ``store``,
``retrieve`` and ``blend/match`` run in the thread pool: their copies (and blend's
hashing of whole prompts) never block the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.bodies import json_body_doc, read_json
from app.deps import GUARDED, GUARDED_RESPONSES, ReceivedAtDep, RegistrationTokenDep, RuntimeDep
from app.problems import problem_doc
from contract.errors import NotFound
from contract.frames import LOOKUP_FRAME_MEDIA_TYPE
from contract.schemas import (
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    LookupAreaRequest,
    LookupAreaResponse,
    LookupResponse,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = ["router"]

router = APIRouter(prefix="/cache", tags=["cache"])

_NOT_NEGOTIATED: dict[int | str, dict[str, Any]] = {409: problem_doc("No final chunk size yet")}
_JSON_ONLY: dict[int | str, dict[str, Any]] = {415: problem_doc("A body that is not JSON")}
_TRANSFER_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_NEGOTIATED,
    **_JSON_ONLY,
    403: problem_doc("Not this registration's token"),
    404: problem_doc("No registration for this instance and rank"),
    422: problem_doc("Malformed request, or an item that cannot be served"),
    503: problem_doc("The server is shutting down, or the body decoder restarted; retry"),
}


_LOOKUP_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/LookupRequest"}},
            LOOKUP_FRAME_MEDIA_TYPE: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": (
                        "The binary form: magic `MPL1`, the header length (uint32 LE), a "
                        "`LookupFrameHeader` JSON header whose items give `num_tokens` "
                        "instead of tokens, zero padding to a multiple of 4 bytes, then "
                        "every item's token ids as little-endian int32, in item order "
                        "(contract/frames.py)."
                    ),
                }
            },
        },
    }
}


@router.post(
    "/lookup",
    dependencies=GUARDED,
    response_model=LookupResponse,
    summary="How many leading tokens are cached",
    description=(
        "For each request: the number of leading tokens cached (whole chunks only, "
        "present for every rank of `world_size`). The hits are leased to the request "
        "for a short while so the retrieve that follows finds them. Tokens go as a JSON "
        "list, as `tokens_b64` (base64 of little-endian int32), or, most compactly, in "
        f"the binary form (`content-type: {LOOKUP_FRAME_MEDIA_TYPE}`), which the "
        "connector sends; a binary lookup may carry a mark per item instead of its "
        "ids, written into a lookup area (`POST /cache/lookup-areas`)."
    ),
    responses={
        **GUARDED_RESPONSES,
        **_NOT_NEGOTIATED,
        404: problem_doc("The lookup area the frame names is unknown: register one again"),
        415: problem_doc("A body that is neither JSON nor the binary form"),
        422: problem_doc("Malformed request"),
        503: problem_doc("Session memory full, or the body decoder restarted; retry"),
    },
    openapi_extra=_LOOKUP_BODY,
)
async def lookup(request: Request, runtime: RuntimeDep) -> Response:
    reply = await runtime.cache.lookups.serve(request)
    return Response(reply.model_dump_json(), media_type="application/json")


@router.post(
    "/store",
    dependencies=GUARDED,
    response_model=StoreResponse,
    summary="Copy whole chunks from a registered KV cache into the cache",
    description=(
        "For each request, the whole chunks in `[start_token, end_token)`: each group's "
        "blocks (null block ids skipped) are copied into the cache pool. All-or-nothing "
        "per chunk; a chunk already cached is not copied again (`present_chunks`). With "
        "`timeout_s`, no chunk is committed once that long has passed since the request "
        "arrived (a copy that ends late is discarded); the rest count as `failed_chunks`."
    ),
    responses={**GUARDED_RESPONSES, **_TRANSFER_ERRORS},
    openapi_extra=json_body_doc(StoreRequest),
)
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


@router.post(
    "/retrieve",
    dependencies=GUARDED,
    response_model=RetrieveResponse,
    summary="Copy cached chunks into a registered KV cache",
    description=(
        "For each request, cached chunks from `start_token` are copied into the given "
        "block ids (null ids are never written). `loaded_tokens` counts the tokens "
        "loaded, contiguous from `start_token`; `failed_block_ids` lists the blocks that "
        "were not loaded, to be recomputed. A chunk lacking data the caller needs is a "
        "miss, never partial data. With `timeout_s`, no chunk's copy starts once that "
        "long has passed since the request arrived; the blocks left are listed as failed."
    ),
    responses={**GUARDED_RESPONSES, **_TRANSFER_ERRORS},
    openapi_extra=json_body_doc(RetrieveRequest),
)
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


@router.post(
    "/end",
    dependencies=GUARDED,
    response_model=EndSessionsResponse,
    summary="End request sessions",
    description="Drop the sessions of finished requests and release their leases.",
    responses={
        **GUARDED_RESPONSES,
        **_JSON_ONLY,
        503: problem_doc("The body decoder restarted; retry"),
    },
    openapi_extra=json_body_doc(EndSessionsRequest),
)
async def end(request: Request, runtime: RuntimeDep) -> EndSessionsResponse:
    return runtime.cache.end(await read_json(request, EndSessionsRequest))


@router.post(
    "/blend/match",
    dependencies=GUARDED,
    response_model=BlendMatchResponse,
    summary="Which chunks of a token sequence are cached anywhere (CacheBlend)",
    description=(
        "Position-independent match: each whole chunk of the tokens is reported cached "
        "if a chunk with the same tokens (same namespace and salt) is in the cache at "
        "any position. Needs `--enable-blend`."
    ),
    responses={
        **GUARDED_RESPONSES,
        **_JSON_ONLY,
        409: problem_doc("Blend matcher disabled, or no final chunk size"),
        422: problem_doc("Malformed request"),
        503: problem_doc("The body decoder restarted; retry"),
    },
    openapi_extra=json_body_doc(BlendMatchRequest),
)
async def blend_match(request: Request, runtime: RuntimeDep) -> BlendMatchResponse:
    body = await read_json(request, BlendMatchRequest)
    return await run_in_threadpool(runtime.cache.blend_match, body)


@router.post(
    "/lookup-areas",
    dependencies=GUARDED,
    response_model=LookupAreaResponse,
    status_code=201,
    summary="Register a lookup area: shared memory for lookups' token ids",
    description=(
        "A client on this host passes a memfd sealed against shrinking and growing "
        "over the registration socket (`GET /register`) and names its ticket here. A "
        "binary lookup whose header names the returned `area_id` carries a mark per "
        "item instead of its token ids, which the client wrote into the area first "
        "(contract/frames.py). The area lives as long as that socket connection, or "
        "until `DELETE`."
    ),
    responses={
        **GUARDED_RESPONSES,
        **_JSON_ONLY,
        422: problem_doc("Unknown or used ticket, unsealed memory, or a bad size"),
        503: problem_doc("The body decoder restarted; retry"),
    },
    openapi_extra=json_body_doc(LookupAreaRequest),
)
async def register_lookup_area(request: Request, runtime: RuntimeDep) -> LookupAreaResponse:
    body = await read_json(request, LookupAreaRequest)
    area_id, size = runtime.lookup_areas.register(body.ticket)
    return LookupAreaResponse(area_id=area_id, size_bytes=size)


@router.delete(
    "/lookup-areas/{area_id}",
    dependencies=GUARDED,
    status_code=204,
    summary="Drop a lookup area",
    responses={**GUARDED_RESPONSES, 404: problem_doc("No such lookup area")},
)
async def delete_lookup_area(area_id: str, runtime: RuntimeDep) -> Response:
    if not runtime.lookup_areas.release(area_id):
        raise NotFound("no such lookup area", area_id=area_id)
    return Response(status_code=204)
