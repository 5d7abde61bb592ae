"""Worker KV-cache registration: GET/POST /register, DELETE /register/{instance_id}/{rank}."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.bodies import read_json
from app.deps import RegistrationTokenDep, RuntimeDep
from app.routes.declare import declare
from contract import endpoints
from contract.fdpass import MAX_FDS_PER_HANDSHAKE, MAX_TICKETS_PER_CONNECTION
from contract.schemas import RegisterRequest, RegisterResponse, RegistrationInfo

__all__ = ["router"]

router = APIRouter(tags=["registration"])


@declare(router, endpoints.REGISTRATION_INFO)
async def registration_info(runtime: RuntimeDep) -> RegistrationInfo:
    return RegistrationInfo(
        socket_path=str(runtime.gate.path),
        max_fds_per_handshake=MAX_FDS_PER_HANDSHAKE,
        max_tickets_per_connection=MAX_TICKETS_PER_CONNECTION,
        ops_socket_path=str(runtime.ops.path),
    )


@declare(router, endpoints.REGISTER)
async def register(
    request: Request, runtime: RuntimeDep, token: RegistrationTokenDep = None
) -> RegisterResponse:
    # A registration body can be megabytes (one descriptor per layer): decoded off
    # the event loop like every large body (app.bodies), registered in the thread pool.
    body = await read_json(request, RegisterRequest)
    return await run_in_threadpool(lambda: runtime.cache.register(body, token=token))


@declare(router, endpoints.UNREGISTER)
def unregister(
    instance_id: str, rank: int, runtime: RuntimeDep, token: RegistrationTokenDep = None
) -> Response:
    runtime.cache.unregister(instance_id, rank, token)
    return Response(status_code=204)
