"""Cache operations, batched per engine step: lookup, store, retrieve, end, blend match."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.deps import ReceivedAtDep, RuntimeDep
from app.problems import problem_doc
from contract.schemas import (
    BlendMatchRequest,
    BlendMatchResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    LookupRequest,
    LookupResponse,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = ["router"]

router = APIRouter(prefix="/cache", tags=["cache"])

_NOT_NEGOTIATED: dict[int | str, dict[str, Any]] = {409: problem_doc("No final chunk size yet")}
_TRANSFER_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_NEGOTIATED,
    404: problem_doc("No registration for this instance and rank"),
    422: problem_doc("Malformed request, or an item that cannot be served"),
}


@router.post(
    "/lookup",
    response_model=LookupResponse,
    summary="How many leading tokens are cached",
    description=(
        "For each request: the number of leading tokens cached (whole chunks only, "
        "present for every rank of `world_size`). The hits are leased to the request "
        "for a short while so the retrieve that follows finds them. Tokens go as a JSON "
        "list or, more compactly, as `tokens_b64` (little-endian int32)."
    ),
    responses={**_NOT_NEGOTIATED, 422: problem_doc("Malformed request")},
)
def lookup(body: LookupRequest, runtime: RuntimeDep) -> LookupResponse:
    return runtime.cache.lookup(body)


@router.post(
    "/store",
    response_model=StoreResponse,
    summary="Copy whole chunks from a registered KV cache into the cache",
    description=(
        "For each request, the whole chunks in `[start_token, end_token)`: each group's "
        "blocks (null block ids skipped) are copied into the cache pool. All-or-nothing "
        "per chunk; a chunk already cached is not copied again (`present_chunks`). With "
        "`timeout_s`, no chunk is committed once that long has passed since the request "
        "arrived (a copy that ends late is discarded); the rest count as `failed_chunks`."
    ),
    responses=_TRANSFER_ERRORS,
)
def store(body: StoreRequest, runtime: RuntimeDep, received: ReceivedAtDep) -> StoreResponse:
    return runtime.cache.store(body, received_at=received)


@router.post(
    "/retrieve",
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
    responses=_TRANSFER_ERRORS,
)
def retrieve(
    body: RetrieveRequest, runtime: RuntimeDep, received: ReceivedAtDep
) -> RetrieveResponse:
    return runtime.cache.retrieve(body, received_at=received)


@router.post(
    "/end",
    response_model=EndSessionsResponse,
    summary="End request sessions",
    description="Drop the sessions of finished requests and release their leases.",
)
def end(body: EndSessionsRequest, runtime: RuntimeDep) -> EndSessionsResponse:
    return runtime.cache.end(body)


@router.post(
    "/blend/match",
    response_model=BlendMatchResponse,
    summary="Which chunks of a token sequence are cached anywhere (CacheBlend)",
    description=(
        "Position-independent match: each whole chunk of the tokens is reported cached "
        "if a chunk with the same tokens (same namespace and salt) is in the cache at "
        "any position. Needs `--enable-blend`."
    ),
    responses={
        409: problem_doc("Blend matcher disabled, or no final chunk size"),
        422: problem_doc("Malformed request"),
    },
)
def blend_match(body: BlendMatchRequest, runtime: RuntimeDep) -> BlendMatchResponse:
    return runtime.cache.blend_match(body)
