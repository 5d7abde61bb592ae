"""Worker KV-cache registration: GET/POST /register, DELETE /register/{instance_id}/{rank}."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.deps import GUARDED, GUARDED_RESPONSES, RegistrationTokenDep, RuntimeDep
from app.problems import problem_doc
from contract.fdpass import MAX_FDS_PER_HANDSHAKE, MAX_TICKETS_PER_CONNECTION
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    RegisterRequest,
    RegisterResponse,
    RegistrationInfo,
)

__all__ = ["router"]

router = APIRouter(tags=["registration"])


@router.get(
    "/register",
    response_model=RegistrationInfo,
    summary="Where to pass KV-cache memory (the registration socket)",
    description=(
        "The Unix socket that takes a worker's sealed memfds (SCM_RIGHTS) and answers "
        "one-time tickets for `POST /register` (protocol: contract/fdpass.py). The "
        "connection stays open for the worker's life: when it closes, that worker's "
        "registrations are released."
    ),
)
async def registration_info(runtime: RuntimeDep) -> RegistrationInfo:
    return RegistrationInfo(
        socket_path=str(runtime.gate.path),
        max_fds_per_handshake=MAX_FDS_PER_HANDSHAKE,
        max_tickets_per_connection=MAX_TICKETS_PER_CONNECTION,
    )


@router.post(
    "/register",
    dependencies=GUARDED,
    response_model=RegisterResponse,
    summary="Register a worker's KV caches",
    description=(
        "Map one worker rank's KV cache tensors: CPU tensors by the tickets the "
        "registration socket returned for their sealed memfds (`GET /register`), GPU "
        "tensors by CUDA IPC handles with the GPU's UUID. Nothing is opened by name. "
        "Every descriptor is validated before anything is mapped; tickets are used up "
        "either way. The reply's `registration_token` is needed by every later store, "
        "retrieve and DELETE of this `(instance_id, rank)`, and to replace it (a repeat "
        f"with the token in `{REGISTRATION_TOKEN_HEADER}` replaces it: "
        "`refreshed: true`). A first registration may send a token of its own in that "
        "header (32-256 URL-safe characters, e.g. `secrets.token_urlsafe(32)`); the "
        "registration keeps it, so a retry after a lost reply refreshes it. "
        "`chunk_size` must equal the server's final chunk size."
    ),
    responses={
        **GUARDED_RESPONSES,
        403: problem_doc("Registered by another client (replace needs its token)"),
        409: problem_doc("No final chunk size yet, or a different one"),
        422: problem_doc(
            "Malformed request or registration token, invalid descriptor, unknown or used ticket"
        ),
    },
)
def register(
    body: RegisterRequest, runtime: RuntimeDep, token: RegistrationTokenDep = None
) -> RegisterResponse:
    return runtime.cache.register(body, token=token)


@router.delete(
    "/register/{instance_id:path}/{rank}",
    dependencies=GUARDED,
    status_code=204,
    response_class=Response,
    summary="Unregister a worker's KV caches",
    description=(
        "Release every mapping of the registration (once no copy uses it). Needs the "
        f"registration's token in `{REGISTRATION_TOKEN_HEADER}`."
    ),
    responses={
        **GUARDED_RESPONSES,
        403: problem_doc("Registered by another client"),
        404: problem_doc("No such registration"),
    },
)
def unregister(
    instance_id: str, rank: int, runtime: RuntimeDep, token: RegistrationTokenDep = None
) -> Response:
    runtime.cache.unregister(instance_id, rank, token)
    return Response(status_code=204)
