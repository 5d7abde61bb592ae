"""Control plane: negotiation, chunk-size and health reads (``/metrics``: ``app.telemetry``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app import __version__
from app.bodies import json_body_doc, read_json
from app.deps import GUARDED, GUARDED_RESPONSES, RuntimeDep
from app.problems import problem_doc
from app.state import Runtime
from contract.schemas import (
    ChunkSizeResponse,
    ClusterResponse,
    HealthResponse,
    NegotiateRequest,
    NegotiateResponse,
)

__all__ = ["router"]

router = APIRouter(tags=["control"])


@router.post(
    "/negotiate",
    dependencies=GUARDED,
    response_model=NegotiateResponse,
    summary="Negotiate the chunk size",
    description=(
        "Select (first caller) or confirm the server's chunk size: the smallest multiple "
        "of `required_alignment` at or above the configured minimum. Success is reported "
        "only after the size is bound to every chunk-dependent part."
    ),
    responses={
        **GUARDED_RESPONSES,
        409: problem_doc("Incompatible alignment, or resize after sessions"),
        415: problem_doc("A body that is not JSON"),
        422: problem_doc("Malformed or out-of-range input"),
        503: problem_doc("A binding failed; retry (resumes), see Retry-After"),
    },
    openapi_extra=json_body_doc(NegotiateRequest),
)
async def negotiate(request: Request, runtime: RuntimeDep) -> NegotiateResponse:
    body = await read_json(request, NegotiateRequest)
    # The authority's lock may wait for a binding: off the event loop.
    return await run_in_threadpool(_negotiate, body, runtime)


def _negotiate(body: NegotiateRequest, runtime: Runtime) -> NegotiateResponse:
    who = {"model": body.model, "role": body.role, "instance": body.instance_id}
    caller = " ".join(f"{k}={v}" for k, v in who.items() if v)
    size = runtime.chunk_size.negotiate(body.required_alignment, caller=caller)
    return NegotiateResponse(
        chunk_size=size,
        min_chunk_size=runtime.chunk_size.policy.min_chunk_size,
        required_alignment=body.required_alignment,
        boot_id=runtime.boot_id,
    )


@router.get(
    "/chunk-size",
    response_model=ChunkSizeResponse,
    summary="Read the chunk size (never selects or freezes it)",
)
def chunk_size(runtime: RuntimeDep) -> ChunkSizeResponse:
    snap = runtime.chunk_size.snapshot()
    return ChunkSizeResponse(
        chunk_size=snap.state.selected,
        final=snap.state.final,
        min_chunk_size=runtime.chunk_size.policy.min_chunk_size,
        max_chunk_size=runtime.chunk_size.policy.max_chunk_size,
        alignments=list(snap.state.alignments),
        bindings=snap.bindings,
    )


@router.get("/health", response_model=HealthResponse, summary="Liveness and identity")
async def health(runtime: RuntimeDep) -> HealthResponse:
    # On the event loop (no thread-pool hop): nothing here waits on a negotiation.
    state = runtime.chunk_size.state
    return HealthResponse(
        status="ok",
        boot_id=runtime.boot_id,
        chunk_size=state.selected,
        final=state.final,
        uptime_s=round(runtime.uptime_s, 3),
        sessions=runtime.sessions.live_count(),
        registrations=runtime.registry.count(),
        lookup_areas=runtime.lookup_areas.count(),
        version=__version__,
        cluster=runtime.cluster_health(),
    )


@router.get(
    "/cluster",
    response_model=ClusterResponse,
    summary="The deployment: its chunk size, live members, coordinator and L2 state",
    description=(
        "With `--coordinator-url`, asks the coordinator (Redis/Valkey) for the "
        "deployment's published chunk size and its live members; standalone, lists this "
        "server alone. Never selects or freezes anything. When Redis cannot be reached "
        "the reply still comes, with `coordinator: down` and no members."
    ),
)
def cluster(runtime: RuntimeDep) -> ClusterResponse:
    # A plain function: FastAPI runs it in its thread pool, off the event loop.
    return runtime.cluster()
