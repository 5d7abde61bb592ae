"""The endpoint table: every JSON operation the server serves, written once.

Each ``Endpoint`` is one HTTP operation: its method, path template, request and reply
models, success status, the problem replies it may give (status -> what it means),
whether the API token guards it, and the summary and description its OpenAPI entry
shows. The server declares each route from its entry (``app.routes.declare``), both
connector clients build their calls from it (``connector.client``), and
tests/app/test_openapi.py checks the served schema against it. ``GET /metrics``
(Prometheus text) and the docs pages are not JSON operations and stay outside.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import BaseModel

from contract.frames import LOOKUP_FRAME_MEDIA_TYPE
from contract.schemas import (
    REGISTRATION_TOKEN_HEADER,
    BlendMatchRequest,
    BlendMatchResponse,
    ChunkSizeResponse,
    ClusterLookupRequest,
    ClusterLookupResponse,
    ClusterResponse,
    EndSessionsRequest,
    EndSessionsResponse,
    HealthResponse,
    KeyIndexInfo,
    LookupAreaRequest,
    LookupAreaResponse,
    LookupFrameHeader,
    LookupRequest,
    LookupResponse,
    NegotiateRequest,
    NegotiateResponse,
    RegisterRequest,
    RegisterResponse,
    RegistrationInfo,
    RetrieveRequest,
    RetrieveResponse,
    StoreRequest,
    StoreResponse,
)

__all__ = [
    "BLEND_MATCH",
    "CHUNK_SIZE",
    "CLUSTER",
    "CLUSTER_LOOKUP",
    "COMMON_PROBLEMS",
    "DELETE_LOOKUP_AREA",
    "END",
    "ENDPOINTS",
    "GUARDED_PROBLEMS",
    "HEALTH",
    "KEY_INDEX",
    "LOOKUP",
    "NEGOTIATE",
    "REGISTER",
    "REGISTER_LOOKUP_AREA",
    "REGISTRATION_INFO",
    "RETRIEVE",
    "STORE",
    "UNREGISTER",
    "BinaryBody",
    "Endpoint",
]

Req = TypeVar("Req", bound=BaseModel | None)
Resp = TypeVar("Resp", bound=BaseModel | None)

COMMON_PROBLEMS: Mapping[int, str] = {
    413: "Request body larger than --max-body-size",
    422: "Malformed request",
}
"""What every operation may answer: a body over the limit, malformed input (an
entry's own ``problems`` may say more about its 422)."""

GUARDED_PROBLEMS: Mapping[int, str] = {
    401: "Missing or wrong API token (only when MPCACHE_API_TOKEN is set)",
}
"""What a guarded operation may answer besides its own problems."""


@dataclass(frozen=True, slots=True)
class BinaryBody:
    """A body an operation takes besides its JSON model: raw bytes of ``media_type``."""

    media_type: str
    description: str
    header: type[BaseModel] | None = None
    """The JSON header the bytes carry (documented beside the operation's models)."""


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req, Resp]):
    """One HTTP operation; ``Req`` and ``Resp`` are its JSON body and reply models
    (``None`` where it has none), so a client's call is typed by its entry."""

    name: str
    """The route's name (its OpenAPI ``operationId`` is built from it)."""
    method: str
    path: str
    """The OpenAPI path template: ``{name}`` for each path parameter."""
    request: type[Req] | None
    response: type[Resp] | None
    summary: str
    description: str | None = None
    status: int = 200
    guarded: bool = False
    """Whether the server's API token (``MPCACHE_API_TOKEN``) is required."""
    problems: Mapping[int, str] = field(default_factory=dict)
    """Problem replies of this operation beyond ``COMMON_PROBLEMS`` (and
    ``GUARDED_PROBLEMS`` when guarded): status -> when it is given."""
    slashed: tuple[str, ...] = ()
    """Path parameters whose values may hold ``/``: clients percent-encode it, and the
    server's route matches the decoded value whole."""
    binary_body: BinaryBody | None = None

    def all_problems(self) -> dict[int, str]:
        """Every problem reply: the common ones, the token's, then the entry's own."""
        guarded = GUARDED_PROBLEMS if self.guarded else {}
        return {**COMMON_PROBLEMS, **guarded, **self.problems}

    def url_path(self, **params: Any) -> str:
        """The path with its parameters filled in, each percent-encoded whole."""
        return self.path.format_map({k: quote(str(v), safe="") for k, v in params.items()})


_NOT_NEGOTIATED = {409: "No final chunk size yet"}
_JSON_ONLY = {415: "A body that is not JSON"}
_DECODER_RESTARTED = {503: "The body decoder restarted; retry"}
_TRANSFER_PROBLEMS = {
    **_NOT_NEGOTIATED,
    **_JSON_ONLY,
    403: "Not this registration's token",
    404: "No registration for this instance and rank",
    422: "Malformed request, or an item that cannot be served",
    503: "The server is shutting down, or the body decoder restarted; retry",
}

# ----------------------------------------------------------------------- control

NEGOTIATE: Endpoint[NegotiateRequest, NegotiateResponse] = Endpoint(
    name="negotiate",
    method="POST",
    path="/negotiate",
    request=NegotiateRequest,
    response=NegotiateResponse,
    guarded=True,
    summary="Negotiate the chunk size",
    description=(
        "Select (first caller) or confirm the server's chunk size: the smallest multiple "
        "of `required_alignment` at or above the configured minimum. Success is reported "
        "only after the size is bound to every chunk-dependent part."
    ),
    problems={
        409: "Incompatible alignment, or resize after sessions",
        415: "A body that is not JSON",
        422: "Malformed or out-of-range input",
        503: "A binding failed; retry (resumes), see Retry-After",
    },
)

CHUNK_SIZE: Endpoint[None, ChunkSizeResponse] = Endpoint(
    name="chunk_size",
    method="GET",
    path="/chunk-size",
    request=None,
    response=ChunkSizeResponse,
    summary="Read the chunk size (never selects or freezes it)",
)

HEALTH: Endpoint[None, HealthResponse] = Endpoint(
    name="health",
    method="GET",
    path="/health",
    request=None,
    response=HealthResponse,
    summary="Liveness and identity",
)

CLUSTER: Endpoint[None, ClusterResponse] = Endpoint(
    name="cluster",
    method="GET",
    path="/cluster",
    request=None,
    response=ClusterResponse,
    summary="The deployment: its chunk size, live members, coordinator and L2 state",
    description=(
        "With `--coordinator-url`, asks the coordinator (Redis/Valkey) for the "
        "deployment's published chunk size and its live members; standalone, lists this "
        "server alone. Never selects or freezes anything. When Redis cannot be reached "
        "the reply still comes, with `coordinator: down` and no members."
    ),
)

CLUSTER_LOOKUP: Endpoint[ClusterLookupRequest, ClusterLookupResponse] = Endpoint(
    name="cluster_lookup",
    method="POST",
    path="/cluster/lookup",
    request=ClusterLookupRequest,
    response=ClusterLookupResponse,
    guarded=True,
    summary="Which server holds how much of a prompt, deployment-wide",
    description=(
        "For each live member of the deployment: how many leading tokens of the prompt it "
        "holds in its pool (whole chunks, each held by every rank of its registration); "
        "and how many the shared L2 holds. Opens no session and takes no lease. Members "
        "keep the block hashes they hold in the coordinator's Redis (as their KV events "
        "announce them, within a few tens of milliseconds), so the answer needs no call "
        "to the other servers; a standalone server answers for itself. How to compute the "
        "same block hashes from a prompt: docs/cluster.md."
    ),
    problems={
        **_NOT_NEGOTIATED,
        **_JSON_ONLY,
        503: "The body decoder restarted; retry",
    },
)

# ------------------------------------------------------------------ registration

REGISTRATION_INFO: Endpoint[None, RegistrationInfo] = Endpoint(
    name="registration_info",
    method="GET",
    path="/register",
    request=None,
    response=RegistrationInfo,
    summary="Where to pass KV-cache memory (the registration socket)",
    description=(
        "The Unix socket that takes a worker's sealed memfds (SCM_RIGHTS) and answers "
        "one-time tickets for `POST /register` (protocol: contract/fdpass.py). The "
        "connection stays open for the worker's life: when it closes, that worker's "
        "registrations are released."
    ),
)

REGISTER: Endpoint[RegisterRequest, RegisterResponse] = Endpoint(
    name="register",
    method="POST",
    path="/register",
    request=RegisterRequest,
    response=RegisterResponse,
    guarded=True,
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
    problems={
        403: "Registered by another client (replace needs its token)",
        409: "No final chunk size yet, or a different one",
        422: "Malformed request or registration token, invalid descriptor, unknown or used ticket",
    },
)

UNREGISTER: Endpoint[None, None] = Endpoint(
    name="unregister",
    method="DELETE",
    path="/register/{instance_id}/{rank}",
    slashed=("instance_id",),
    request=None,
    response=None,
    status=204,
    guarded=True,
    summary="Unregister a worker's KV caches",
    description=(
        "Release every mapping of the registration (once no copy uses it). Needs the "
        f"registration's token in `{REGISTRATION_TOKEN_HEADER}`."
    ),
    problems={403: "Registered by another client", 404: "No such registration"},
)

# ------------------------------------------------------------------------- cache

LOOKUP: Endpoint[LookupRequest, LookupResponse] = Endpoint(
    name="lookup",
    method="POST",
    path="/cache/lookup",
    request=LookupRequest,
    response=LookupResponse,
    guarded=True,
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
    problems={
        **_NOT_NEGOTIATED,
        404: "The lookup area the frame names is unknown: register one again",
        415: "A body that is neither JSON nor the binary form",
        422: "Malformed request",
        503: "Session memory full, or the body decoder restarted; retry",
    },
    binary_body=BinaryBody(
        media_type=LOOKUP_FRAME_MEDIA_TYPE,
        header=LookupFrameHeader,
        description=(
            "The binary form: magic `MPL1`, the header length (uint32 LE), a "
            "`LookupFrameHeader` JSON header whose items give `num_tokens` "
            "instead of tokens, zero padding to a multiple of 4 bytes, then "
            "every item's token ids as little-endian int32, in item order "
            "(contract/frames.py)."
        ),
    ),
)

STORE: Endpoint[StoreRequest, StoreResponse] = Endpoint(
    name="store",
    method="POST",
    path="/cache/store",
    request=StoreRequest,
    response=StoreResponse,
    guarded=True,
    summary="Copy whole chunks from a registered KV cache into the cache",
    description=(
        "For each request, the whole chunks in `[start_token, end_token)`: each group's "
        "blocks (null block ids skipped) are copied into the cache pool. All-or-nothing "
        "per chunk; a chunk already cached is not copied again (`present_chunks`). With "
        "`timeout_s`, no chunk is committed once that long has passed since the request "
        "arrived (a copy that ends late is discarded); the rest count as `failed_chunks`."
    ),
    problems=_TRANSFER_PROBLEMS,
)

RETRIEVE: Endpoint[RetrieveRequest, RetrieveResponse] = Endpoint(
    name="retrieve",
    method="POST",
    path="/cache/retrieve",
    request=RetrieveRequest,
    response=RetrieveResponse,
    guarded=True,
    summary="Copy cached chunks into a registered KV cache",
    description=(
        "For each request, cached chunks from `start_token` are copied into the given "
        "block ids (null ids are never written). `loaded_tokens` counts the tokens "
        "loaded, contiguous from `start_token`; `failed_block_ids` lists the blocks that "
        "were not loaded, to be recomputed. A chunk lacking data the caller needs is a "
        "miss, never partial data. With `timeout_s`, no chunk's copy starts once that "
        "long has passed since the request arrived; the blocks left are listed as failed."
    ),
    problems=_TRANSFER_PROBLEMS,
)

END: Endpoint[EndSessionsRequest, EndSessionsResponse] = Endpoint(
    name="end",
    method="POST",
    path="/cache/end",
    request=EndSessionsRequest,
    response=EndSessionsResponse,
    guarded=True,
    summary="End request sessions",
    description="Drop the sessions of finished requests and release their leases.",
    problems={**_JSON_ONLY, **_DECODER_RESTARTED},
)

BLEND_MATCH: Endpoint[BlendMatchRequest, BlendMatchResponse] = Endpoint(
    name="blend_match",
    method="POST",
    path="/cache/blend/match",
    request=BlendMatchRequest,
    response=BlendMatchResponse,
    guarded=True,
    summary="Which chunks of a token sequence are cached anywhere (CacheBlend)",
    description=(
        "Position-independent match: each whole chunk of the tokens is reported cached "
        "if a chunk with the same tokens (same namespace and salt) is in the cache at "
        "any position. Needs `--enable-blend`."
    ),
    problems={
        **_JSON_ONLY,
        409: "Blend matcher disabled, or no final chunk size",
        422: "Malformed request",
        **_DECODER_RESTARTED,
    },
)

REGISTER_LOOKUP_AREA: Endpoint[LookupAreaRequest, LookupAreaResponse] = Endpoint(
    name="register_lookup_area",
    method="POST",
    path="/cache/lookup-areas",
    request=LookupAreaRequest,
    response=LookupAreaResponse,
    status=201,
    guarded=True,
    summary="Register a lookup area: shared memory for lookups' token ids",
    description=(
        "A client on this host passes a memfd sealed against shrinking and growing "
        "over the registration socket (`GET /register`) and names its ticket here. A "
        "binary lookup whose header names the returned `area_id` carries a mark per "
        "item instead of its token ids, which the client wrote into the area first "
        "(contract/frames.py). The area lives as long as that socket connection, or "
        "until `DELETE`."
    ),
    problems={
        **_JSON_ONLY,
        422: "Unknown or used ticket, unsealed memory, or a bad size",
        **_DECODER_RESTARTED,
    },
)

DELETE_LOOKUP_AREA: Endpoint[None, None] = Endpoint(
    name="delete_lookup_area",
    method="DELETE",
    path="/cache/lookup-areas/{area_id}",
    request=None,
    response=None,
    status=204,
    guarded=True,
    summary="Drop a lookup area",
    problems={404: "No such lookup area"},
)
KEY_INDEX: Endpoint[None, KeyIndexInfo] = Endpoint(
    name="key_index",
    method="GET",
    path="/cache/key-index",
    request=None,
    response=KeyIndexInfo,
    summary="Where the key index is: the keys the pool holds, to read in place",
    description=(
        "A shared-memory hash table of every chunk and unit key the pool holds, with "
        "the hash's secret in its header, kept in step with the pool (layout: "
        "contract/key_index.py). Only processes of the server's user can map it (mode "
        "0600): a connector on this host answers lookups by probing it, without a call."
    ),
    problems={404: "This server publishes no key index (--no-key-index, or not x86-64)"},
)

ENDPOINTS: tuple[Endpoint[Any, Any], ...] = (
    NEGOTIATE,
    CHUNK_SIZE,
    HEALTH,
    CLUSTER,
    CLUSTER_LOOKUP,
    REGISTRATION_INFO,
    REGISTER,
    UNREGISTER,
    LOOKUP,
    STORE,
    RETRIEVE,
    END,
    BLEND_MATCH,
    REGISTER_LOOKUP_AREA,
    DELETE_LOOKUP_AREA,
    KEY_INDEX,
)
"""Every operation, in the order the server declares them."""
