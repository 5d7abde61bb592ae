"""Control plane: negotiation, chunk-size and health reads (``/metrics``: ``app.telemetry``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app import __version__
from app.bodies import read_json
from app.deps import RuntimeDep
from app.routes.declare import declare
from app.state import Runtime
from contract import endpoints
from contract.schemas import (
    ChunkSizeResponse,
    ClusterLookupRequest,
    ClusterLookupResponse,
    ClusterResponse,
    HealthResponse,
    NegotiateRequest,
    NegotiateResponse,
)

__all__ = ["router"]

router = APIRouter(tags=["control"])


@declare(router, endpoints.NEGOTIATE)
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


@declare(router, endpoints.CHUNK_SIZE)
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


@declare(router, endpoints.HEALTH)
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
        disk=runtime.disk.health() if runtime.disk is not None else None,
    )


@declare(router, endpoints.CLUSTER)
def cluster(runtime: RuntimeDep) -> ClusterResponse:
    # A plain function: FastAPI runs it in its thread pool, off the event loop.
    return runtime.cluster()


@declare(router, endpoints.CLUSTER_LOOKUP)
async def cluster_lookup(request: Request, runtime: RuntimeDep) -> ClusterLookupResponse:
    body = await read_json(request, ClusterLookupRequest)
    # Hashing a long prompt and asking Redis: off the event loop.
    return await run_in_threadpool(runtime.cluster_lookups.answer, body)
