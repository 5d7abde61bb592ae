"""Worker KV-cache registration: POST /register, DELETE /register/{instance_id}/{rank}."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.deps import RuntimeDep
from app.problems import problem_doc
from contract.errors import NotFound
from contract.schemas import RegisterRequest, RegisterResponse

__all__ = ["router"]

router = APIRouter(tags=["registration"])


@router.post(
    "/register",
    response_model=RegisterResponse,
    summary="Register a worker's KV caches",
    description=(
        "Map one worker rank's KV cache tensors (POSIX shm segments named "
        "`mpcache-w-...`, or CUDA IPC handles with the GPU's UUID). Every descriptor is "
        "validated before anything is mapped. Idempotent per `(instance_id, rank)`: a "
        "repeat replaces the earlier registration (`refreshed: true`). `chunk_size` must "
        "equal the server's final chunk size."
    ),
    responses={
        409: problem_doc("No final chunk size yet, or a different one"),
        422: problem_doc("Malformed request or invalid tensor descriptor"),
    },
)
def register(body: RegisterRequest, runtime: RuntimeDep) -> RegisterResponse:
    return runtime.cache.register(body)


@router.delete(
    "/register/{instance_id:path}/{rank}",
    status_code=204,
    response_class=Response,
    summary="Unregister a worker's KV caches",
    description="Release every mapping of the registration. 404 if there is none.",
    responses={404: problem_doc("No such registration")},
)
def unregister(instance_id: str, rank: int, runtime: RuntimeDep) -> Response:
    if not runtime.cache.unregister(instance_id, rank):
        raise NotFound(
            f"no KV cache is registered for instance {instance_id!r} rank {rank}",
            instance_id=instance_id,
            rank=rank,
        )
    return Response(status_code=204)
