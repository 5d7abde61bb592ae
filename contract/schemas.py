"""Wire schema: every request and reply body of the HTTP API.

These pydantic models are the only source of the schema; ``openapi/openapi.json``
is generated from them (``make openapi``) and a test fails when it drifts. The
connector builds its requests from the same models, so both sides agree by
construction. Names fixed by docs/design.md s.4 must not change.

Conventions (docs/design.md s.4, s.5):
- token counts and positions are in tokens; sizes carry ``_bytes``;
- a ``namespace`` is the connector's identity for a model and KV layout
  (model name, layout digest, world size); with ``cache_salt`` and the chunk
  size it namespaces every chunk key;
- ``block_ids[g][j]`` is the block of the ``g``-th *registered* group (the order of
  ``RegisterRequest.groups``; scratch and transfer-disabled groups are never
  registered, nor sent) that holds tokens ``[j * span_g, (j + 1) * span_g)`` of the
  request, ``span_g`` being that group's token span; block id ``0`` is vLLM's null
  block and means "no data here" (skipped on store, never written on retrieve);
  positions past the end of a list count as null;
- ``rank`` / ``world_size`` are numbered per server: with several servers (one per
  node), a worker's rank is its position among the ranks that use its server, and
  a lookup's ``world_size`` is how many ranks use that server. A chunk hits only
  when every one of those ranks stored it.

Every field is bounded to what it can be, and the schema says so (docs/design.md
s.4.2): each list has a most length (``MAX_*``: what the server can hold) and stops
at its first bad element, so a malformed body costs one error, not one per item;
each string has a length and a character set:

- names the connector builds (``namespace``, layer names, GPU UUIDs) are printable
  ASCII (``NAME_PATTERN``);
- operator-chosen text (``instance_id``, ``model``) has no control characters
  (``TEXT_PATTERN``);
- secrets and handles the server hands out (tickets, lookup areas) are URL-safe
  (``URLSAFE_PATTERN``); CUDA handles are base64 (``BASE64_PATTERN``);
- a dtype is one of ``DTYPE_NAMES``;
- ``request_id`` and ``cache_salt`` come from vLLM's users unchanged, so any text is
  taken (only its length is bounded): refusing one would fail its whole batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from contract.tokens import decode_tokens, encode_tokens

__all__ = [
    "BASE64_PATTERN",
    "DTYPE_NAMES",
    "EVENT_HANDLE_BYTES",
    "EVENT_HANDLE_PATTERN",
    "MAX_BLOCKS_PER_GROUP",
    "MAX_GROUPS",
    "MAX_ITEMS",
    "MAX_LAYERS",
    "MAX_REGISTRATION_TOKEN_CHARS",
    "MAX_WORLD_SIZE",
    "MIN_REGISTRATION_TOKEN_CHARS",
    "NAME_PATTERN",
    "NULL_BLOCK_ID",
    "REGISTRATION_TOKEN_HEADER",
    "TEXT_PATTERN",
    "TOKENS_B64_PATTERN",
    "URLSAFE_PATTERN",
    "BindingStatus",
    "BlendChunk",
    "BlendMatchRequest",
    "BlendMatchResponse",
    "CacheOpResult",
    "ChunkSizeResponse",
    "ClusterHealth",
    "ClusterLookupRequest",
    "ClusterLookupResponse",
    "ClusterLookupServer",
    "ClusterMember",
    "ClusterResponse",
    "CudaIpcTensor",
    "DiskHealth",
    "EndSessionsRequest",
    "EndSessionsResponse",
    "GroupInfo",
    "HealthResponse",
    "KeyIndexInfo",
    "LayerInfo",
    "LookupAreaRequest",
    "LookupAreaResponse",
    "LookupFrameHeader",
    "LookupFrameItem",
    "LookupItem",
    "LookupRequest",
    "LookupResponse",
    "LookupResult",
    "LookupTarget",
    "MemfdTensor",
    "NegotiateRequest",
    "NegotiateResponse",
    "Problem",
    "RegisterRequest",
    "RegisterResponse",
    "RegistrationInfo",
    "RetrieveRequest",
    "RetrieveResponse",
    "RetrieveResult",
    "StoreRequest",
    "StoreResponse",
    "StoreResult",
    "TensorDescriptor",
    "TokenSpan",
    "TransferItem",
    "registration_token_problem",
]

NULL_BLOCK_ID = 0
"""vLLM's null block: a block id that holds no data."""

BindingStatus = Literal["done", "pending", "failed", "disabled"]

MAX_WORLD_SIZE = 4096
"""Most ranks one server serves; bounds the work a lookup or registration can ask for."""

MAX_ITEMS = 4096
"""Most requests in one lookup, store or retrieve call (a vLLM step schedules fewer)."""
MAX_GROUPS = 64
"""Most KV cache groups one registration has (vLLM's hybrid models have a handful)."""
MAX_LAYERS = 1024
"""Most layers one registration has (the deepest models have a few hundred)."""
MAX_BLOCKS_PER_GROUP = 1 << 20
"""Most block ids per group in one transfer item (16M tokens of 16-token blocks)."""

NAME_PATTERN = r"^[\x20-\x7e]*$"
"""Printable ASCII: what a name the connector builds is made of."""
TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
"""Any text without control characters (so it cannot forge a log line)."""
URLSAFE_PATTERN = r"^[A-Za-z0-9_-]*$"
"""``secrets.token_urlsafe`` text: tickets, lookup areas."""
BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"

_B64 = "[A-Za-z0-9+/]"
TOKENS_B64_PATTERN = (
    f"^(?:{_B64}{{4}}[A-Za-f]{_B64}{{4}}[A-HQ-Xg-nw-z0-3]{_B64}{{4}}"
    f"[ABEFIJMNQRUVYZcdghklopstwx014589]{_B64})*"
    f"(?:{_B64}{{4}}[A-Za-f]{_B64}==|{_B64}{{4}}[A-Za-f]{_B64}{{4}}[A-HQ-Xg-nw-z0-3]{_B64}=)?$"
)
"""Base64 of little-endian int32 ids in ``[0, 2**31)``: what ``decode_tokens`` takes.
Sixteen characters hold three ids; the characters that carry an id's sign bit (the
top bit of its fourth byte: the 5th, 10th and 15th of the sixteen) are limited to
those whose bit is clear; the tail holds one id (``==``) or two (``=``)."""

EVENT_HANDLE_BYTES = 64
"""Bytes of a ``cudaIpcEventHandle_t`` (``CUDA_IPC_HANDLE_SIZE``)."""
EVENT_HANDLE_PATTERN = r"^[A-Za-z0-9+/]{85}[AQgw]==$"
"""Base64 of exactly ``EVENT_HANDLE_BYTES`` bytes: 85 free characters, then one whose
low four bits are zero (the last byte's final bits) and the padding, so every
string the pattern admits decodes to one whole handle."""

DTYPE_NAMES = (
    "float32",
    "float",
    "float16",
    "half",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""Tensor dtype names a descriptor may use, each also with a ``torch.`` prefix
(``contract.dtypes`` maps each to its torch dtype)."""
_DTYPE_CHOICES = (*DTYPE_NAMES, *(f"torch.{name}" for name in DTYPE_NAMES))


def _known_dtype(name: str) -> str:
    if name not in _DTYPE_CHOICES:
        raise ValueError(f"unknown dtype; use one of {', '.join(DTYPE_NAMES)}")
    return name


DTypeName = Annotated[
    str,
    AfterValidator(_known_dtype),
    Field(json_schema_extra={"enum": list(_DTYPE_CHOICES)}),
]


def _integral(value: Any) -> Any:
    """JSON Schema counts ``3.0`` as an integer, so the server takes it as 3; strings,
    booleans and fractions stay refused (``StrictInt``)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral)
PositiveInt = Annotated[StrictInt, Field(ge=1), _INTEGRAL]
NonNegativeInt = Annotated[StrictInt, Field(ge=0), _INTEGRAL]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31), _INTEGRAL]
UnitTokens = Annotated[StrictInt, Field(ge=1, le=65536), _INTEGRAL]
_UNIT_TOKENS = (
    "The alignment unit in tokens (the connector's required alignment: a block boundary "
    "of every KV cache group). Given, a hit or a load may end at any multiple of it, and "
    "a store keeps a prompt's last whole units short of a chunk (a tail); it must divide "
    "the chunk size, and every registered group's span must divide it. Omitted: whole "
    "chunks only."
)
Seconds = Annotated[StrictFloat, Field(gt=0, le=3600)]
"""A number of seconds (an integer is one too; strings and booleans are refused)."""
BlockId = Annotated[StrictInt, Field(ge=0, lt=2**62), _INTEGRAL]
BlockIds = Annotated[list[BlockId], Field(max_length=MAX_BLOCKS_PER_GROUP, fail_fast=True)]
WorldSize = Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE), _INTEGRAL]
Stride = Annotated[StrictInt, Field(ge=0, lt=2**48), _INTEGRAL]
ByteOffset = Annotated[StrictInt, Field(ge=0, lt=2**52), _INTEGRAL]

REGISTRATION_TOKEN_HEADER = "mpcache-registration-token"
"""Header carrying the secret ``POST /register`` returned: store, retrieve, DELETE and a
replacing register of that ``(instance_id, rank)`` need it. A first registration may
send a secret of the client's choosing here, which the registration keeps (through
refreshes too), so a retry after a lost reply refreshes it instead of being refused
(``registration_token_problem``)."""

MIN_REGISTRATION_TOKEN_CHARS = 32
MAX_REGISTRATION_TOKEN_CHARS = 256
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def registration_token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a registration's secret, or None if it can: 32 to 256
    URL-safe characters, e.g. ``secrets.token_urlsafe(32)`` (256 random bits)."""
    if not MIN_REGISTRATION_TOKEN_CHARS <= len(token) <= MAX_REGISTRATION_TOKEN_CHARS:
        return (
            f"a registration token has {MIN_REGISTRATION_TOKEN_CHARS} to "
            f"{MAX_REGISTRATION_TOKEN_CHARS} characters, not {len(token)}; generate one "
            "with secrets.token_urlsafe(32)"
        )
    if not _TOKEN_CHARS.issuperset(token):
        return "a registration token has only the characters A-Z a-z 0-9 - _"
    return None


class _Body(BaseModel):
    """A request body: unknown fields are refused (a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    """A reply body: unknown fields are ignored, so older clients read newer servers."""

    model_config = ConfigDict(extra="ignore", frozen=True)


# --------------------------------------------------------------------------- errors


class Problem(BaseModel):
    """Problem-style error body (RFC 9457 shape) used by every error reply."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "type": "urn:mpcache:problem:incompatible-alignment",
                    "title": "Incompatible chunk alignment",
                    "status": 409,
                    "detail": "This server's chunk size is 288 tokens, which is not a "
                    "multiple of the required alignment 64. Use a separate mpcache "
                    "server for this model.",
                    "chunk_size": 288,
                    "required_alignment": 64,
                }
            ]
        },
    )

    type: str = Field(description="URN naming the kind of problem.")
    title: str = Field(description="Short, fixed summary of the kind of problem.")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong and what to do about it.")


# ---------------------------------------------------------------- negotiation/health


class NegotiateRequest(_Body):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "required_alignment": 96,
                    "model": "meta-llama/Llama-3.1-8B",
                    "role": "scheduler",
                    "instance_id": "engine-0",
                }
            ]
        },
    )

    required_alignment: PositiveInt = Field(
        description="lcm of the token spans of every cacheable KV cache group; at most "
        "the server's --max-chunk-size (the schema a server serves says its own)."
    )
    model: str = Field(
        "", max_length=512, pattern=TEXT_PATTERN, description="Model identity, for logs."
    )
    role: Literal["scheduler", "worker"] | None = Field(None, description="Caller role.")
    instance_id: str = Field(
        "", max_length=256, pattern=TEXT_PATTERN, description="Caller identity, for logs."
    )


class NegotiateResponse(_Reply):
    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "chunk_size": 288,
                    "min_chunk_size": 256,
                    "required_alignment": 96,
                    "boot_id": "5f0c3c1e9a2b4d7e8f10a2b3c4d5e6f7",
                }
            ]
        },
    )

    chunk_size: int = Field(description="The server's final chunk size, in tokens.")
    min_chunk_size: int = Field(description="The configured minimum (--chunk-size).")
    required_alignment: int = Field(description="The alignment this request asked for.")
    boot_id: str = Field(description="Identity of this server process start.")


class ChunkSizeResponse(_Reply):
    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "chunk_size": 288,
                    "final": True,
                    "min_chunk_size": 256,
                    "max_chunk_size": 1048576,
                    "alignments": [96, 48],
                    "bindings": {
                        "token_hasher": "done",
                        "session_manager": "done",
                        "blend_matcher": "disabled",
                        "telemetry": "done",
                        "disk_tier": "disabled",
                        "coordinator": "done",
                    },
                }
            ]
        },
    )

    chunk_size: int | None = Field(description="Selected size; null until selected.")
    final: bool = Field(description="True once every binding has succeeded.")
    min_chunk_size: int
    max_chunk_size: int
    alignments: list[int] = Field(description="Alignments accepted so far, in order.")
    bindings: dict[str, BindingStatus] = Field(description="Binding name -> status.")


class ClusterHealth(_Reply):
    mode: Literal["standalone", "redis"] = Field(
        description="`redis` with --coordinator-url, else `standalone`."
    )
    deployment: str
    coordinator: Literal["standalone", "up", "down", "conflict"] = Field(
        description="`down`: Redis unreachable (membership not renewed); `conflict`: the "
        "deployment's published size differs from this server's."
    )
    l2: Literal["off", "up", "down"] = Field(
        description="The shared L2 tier: `down` means L1 only until Redis answers again."
    )


class ClusterMember(_Reply):
    member_id: str = Field(description="The member's boot_id.")
    chunk_size: int | None = Field(description="Its final chunk size; null until final.")
    host: str | None = None
    port: int | None = None
    hostname: str | None = None
    version: str | None = None
    l2: bool | None = Field(None, description="Whether it writes to and reads from L2.")
    expires_in_s: float = Field(description="Seconds until it drops out unless it renews.")


class ClusterResponse(_Reply):
    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "deployment": "default",
                    "mode": "redis",
                    "coordinator": "up",
                    "coordinator_url": "redis://redis.internal:6379/0",
                    "deployment_chunk_size": 256,
                    "chunk_size": 256,
                    "members": [
                        {
                            "member_id": "5f0c3c1e9a2b4d7e8f10a2b3c4d5e6f7",
                            "chunk_size": 256,
                            "host": "10.0.0.5",
                            "port": 8733,
                            "hostname": "node-a",
                            "version": "0.1.0",
                            "l2": True,
                            "expires_in_s": 12.4,
                        }
                    ],
                    "l2": "up",
                    "l2_url": "redis://redis.internal:6379/1",
                    "l2_queued_chunks": 0,
                }
            ]
        },
    )

    deployment: str
    mode: Literal["standalone", "redis"]
    coordinator: Literal["standalone", "up", "down", "conflict"]
    coordinator_url: str | None = Field(description="Without its password.")
    deployment_chunk_size: int | None = Field(
        description="The size the deployment's members agreed on (null: none yet)."
    )
    chunk_size: int | None = Field(description="This server's final size (null: not yet).")
    members: list[ClusterMember] = Field(
        description="Live members, as last renewed (this server alone when standalone; "
        "empty when the coordinator cannot be reached)."
    )
    l2: Literal["off", "up", "down"]
    l2_url: str | None = Field(description="Without its password.")
    l2_queued_chunks: int = Field(description="Committed chunks waiting to be written to L2.")
    detail: str | None = Field(None, description="Why the coordinator or L2 is down, if it is.")


class DiskHealth(_Reply):
    """The local-disk tier (``--disk-path``), as its threads last left it (no I/O)."""

    path: str
    io: Literal["direct", "buffered"] = Field(
        description="`direct`: O_DIRECT reads and writes; `buffered`: the filesystem "
        "refused O_DIRECT (tmpfs does), through the page cache."
    )
    chunk_size: int | None = Field(description="The directory's chunk size (null: none yet).")
    capacity_bytes: int = Field(description="--disk-size.")
    used_bytes: int = Field(description="What its chunk files take.")
    chunks: int = Field(description="Chunk files held (one per chunk and rank).")
    queued_bytes: int = Field(description="Committed chunks waiting to be written behind.")


class HealthResponse(_Reply):
    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "status": "ok",
                    "boot_id": "5f0c3c1e9a2b4d7e8f10a2b3c4d5e6f7",
                    "chunk_size": 288,
                    "final": True,
                    "uptime_s": 12.5,
                    "sessions": 3,
                    "registrations": 2,
                    "lookup_areas": 1,
                    "version": "0.1.0",
                    "cluster": {
                        "mode": "standalone",
                        "deployment": "default",
                        "coordinator": "standalone",
                        "l2": "off",
                    },
                }
            ]
        },
    )

    status: Literal["ok"]
    boot_id: str = Field(description="New for every server process start.")
    chunk_size: int | None
    final: bool
    uptime_s: float
    sessions: int = Field(description="Live cache sessions.")
    registrations: int = Field(description="Registered worker KV caches.")
    lookup_areas: int = Field(
        0, description="Registered lookup areas (`POST /cache/lookup-areas`)."
    )
    version: str
    cluster: ClusterHealth | None = Field(
        None, description="Coordinator and L2 state (`GET /cluster` has the members)."
    )
    disk: DiskHealth | None = Field(None, description="The local-disk tier; null when off.")


# ---------------------------------------------------------------------- registration


class GroupInfo(_Body):
    group_id: NonNegativeInt
    kind: Literal["attention", "sliding_window", "recurrent"]
    token_span: PositiveInt = Field(description="Tokens covered by one block of the group.")


def _transport_required(schema: dict[str, Any]) -> None:
    """A tensor's ``transport`` picks its kind (``TensorDescriptor``), so a body must
    carry it: the schema says required, though Python code may leave it out."""
    schema["properties"]["transport"].pop("default", None)
    schema["required"] = ["transport", *schema.get("required", [])]


class MemfdTensor(_Body):
    """A CPU tensor inside sealed memory the worker passed over the registration
    socket (``contract.fdpass``), named by the one-time ticket the handshake returned.
    Zero copy: the server maps the very pages vLLM uses."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_transport_required)

    transport: Literal["memfd"] = "memfd"
    ticket: str = Field(
        min_length=1,
        max_length=128,
        pattern=URLSAFE_PATTERN,
        description="One-time ticket the registration socket returned for the memfd "
        "holding this tensor (docs/design.md s.5.3). All tickets of one registration "
        "come from one socket connection.",
    )
    offset_bytes: ByteOffset = Field(description="Byte offset of element 0.")
    shape: list[PositiveInt] = Field(fail_fast=True, min_length=1, max_length=8)
    stride: list[Stride] = Field(fail_fast=True, max_length=8, description="Strides in elements.")
    dtype: DTypeName = Field(description="torch dtype name, e.g. 'bfloat16'.")
    block_dim: NonNegativeInt = Field(description="Dimension that indexes blocks.")


class CudaIpcTensor(_Body):
    """A GPU tensor shared by CUDA IPC (see dataplane's CUDA IPC note)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_transport_required)

    transport: Literal["cuda_ipc"] = "cuda_ipc"
    device_uuid: str = Field(
        min_length=1, max_length=64, pattern=NAME_PATTERN, description="GPU UUID (not its ordinal)."
    )
    handle_b64: str = Field(
        max_length=1024,
        pattern=BASE64_PATTERN,
        description="cudaIpcMemHandle of the storage, base64.",
    )
    storage_size_bytes: PositiveInt
    storage_offset_bytes: NonNegativeInt
    ref_counter_handle_b64: str = Field(max_length=1024, pattern=BASE64_PATTERN)
    ref_counter_offset: NonNegativeInt
    event_handle_b64: str = Field(max_length=1024, pattern=BASE64_PATTERN)
    event_sync_required: bool
    tensor_offset: NonNegativeInt = Field(description="Tensor offset, in elements.")
    shape: list[PositiveInt] = Field(fail_fast=True, min_length=1, max_length=8)
    stride: list[Stride] = Field(fail_fast=True, max_length=8)
    dtype: DTypeName
    block_dim: NonNegativeInt


TensorDescriptor = Annotated[MemfdTensor | CudaIpcTensor, Field(discriminator="transport")]


class LayerInfo(_Body):
    name: str = Field(min_length=1, max_length=256, pattern=NAME_PATTERN)
    group_id: NonNegativeInt
    tensors: list[TensorDescriptor] = Field(fail_fast=True, min_length=1, max_length=4)


class RegisterRequest(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "instance_id": "engine-0",
                    "rank": 0,
                    "world_size": 1,
                    "chunk_size": 288,
                    "namespace": "meta-llama/Llama-3.1-8B@3f9a1c2b",
                    "groups": [{"group_id": 0, "kind": "attention", "token_span": 16}],
                    "layers": [
                        {
                            "name": "model.layers.0.self_attn.attn",
                            "group_id": 0,
                            "tensors": [
                                {
                                    "transport": "memfd",
                                    "ticket": "tk_Jx0r4QmS2w7c5bVd1Q9uEo3yHk8nLp6a",
                                    "offset_bytes": 0,
                                    "shape": [2, 64, 16, 8, 128],
                                    "stride": [1048576, 16384, 1024, 128, 1],
                                    "dtype": "bfloat16",
                                    "block_dim": 1,
                                }
                            ],
                        }
                    ],
                }
            ]
        }
    )

    instance_id: str = Field(min_length=1, max_length=256, pattern=TEXT_PATTERN)
    rank: NonNegativeInt
    world_size: WorldSize = 1
    chunk_size: PositiveInt = Field(description="The worker's negotiated chunk size.")
    namespace: str = Field(min_length=1, max_length=512, pattern=NAME_PATTERN)
    groups: list[GroupInfo] = Field(fail_fast=True, min_length=1, max_length=MAX_GROUPS)
    layers: list[LayerInfo] = Field(fail_fast=True, min_length=1, max_length=MAX_LAYERS)


class RegisterResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "instance_id": "engine-0",
                    "rank": 0,
                    "chunk_size": 288,
                    "num_layers": 1,
                    "chunk_bytes": 1179648,
                    "refreshed": False,
                    "registration_token": "rt_8c4q0mW2yZbT5uNf7pXa3dLk9sJh1gVe6rCo",
                }
            ]
        }
    )

    instance_id: str
    rank: int
    chunk_size: int
    num_layers: int
    chunk_bytes: int = Field(description="Bytes one chunk of this registration occupies.")
    refreshed: bool = Field(description="True when this replaced an earlier registration.")
    registration_token: str = Field(
        description="Secret of this registration: send it in the "
        f"`{REGISTRATION_TOKEN_HEADER}` header of every store, retrieve, DELETE and "
        "replacing register of this `(instance_id, rank)`. Shown once."
    )


class KeyIndexInfo(_Reply):
    """Where this server publishes its key index (``contract.key_index``)."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "segment": "mpcache-index-4026531836-24614-4110381ca9e1",
                    "slots": 131072,
                    "boot_id": "8620557f509d45cb8003db5b5fb5191f",
                }
            ]
        },
    )

    segment: str = Field(description="The POSIX shared-memory segment (in /dev/shm, mode 0600).")
    slots: int = Field(description="Slots of its hash table.")
    boot_id: str = Field(description="The server process the index belongs to.")


class RegistrationInfo(_Reply):
    """Where and how to hand KV-cache memory to this server (``contract.fdpass``)."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "socket_path": "/run/user/1000/mpcache-8733-k2f9/register.sock",
                    "max_fds_per_handshake": 64,
                    "max_tickets_per_connection": 128,
                    "ops_socket_path": "/run/user/1000/mpcache-8733-k2f9/register.ops.sock",
                }
            ]
        },
    )

    socket_path: str = Field(
        description="Unix socket that takes sealed memfds (SCM_RIGHTS) and answers "
        "one-time tickets; keep the connection open while the registration lives."
    )
    max_fds_per_handshake: int
    max_tickets_per_connection: int
    ops_socket_path: str | None = Field(
        default=None,
        description="Unix socket that serves store and retrieve for workers on this "
        "host without HTTP (frames: contract/ops_frames.py); same bodies, replies and "
        "problems as `POST /cache/store` and `POST /cache/retrieve`.",
    )


# ----------------------------------------------------------------- cache operations


class TokenSpan(_Body):
    """Token ids, as a JSON list or as base64 of little-endian int32 (compact)."""

    tokens: list[TokenId] | None = Field(None, fail_fast=True)
    tokens_b64: str | None = Field(None, json_schema_extra={"pattern": TOKENS_B64_PATTERN})
    _decoded: np.ndarray | None = PrivateAttr(None)
    """The token ids, already decoded: set (with both fields then None) by the
    server's body decoder, which parses large bodies in a helper process and hands
    the ids back as an array (``app.bodies``)."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # What ``_exactly_one`` enforces: one of the two is given and not null.
        schema = handler.resolve_ref_schema(handler(core_schema))
        one_of: list[dict[str, Any]] = [
            {"required": ["tokens"], "properties": {"tokens": {"type": "array"}}},
            {"required": ["tokens_b64"], "properties": {"tokens_b64": {"type": "string"}}},
        ]
        one_of[0]["properties"]["tokens_b64"] = {"type": "null"}
        one_of[1]["properties"]["tokens"] = {"type": "null"}
        schema["oneOf"] = one_of
        return schema

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenSpan:
        if (self.tokens is None) == (self.tokens_b64 is None):
            raise ValueError("give exactly one of 'tokens' or 'tokens_b64'")
        return self

    def with_decoded(self, tokens: np.ndarray) -> TokenSpan:
        """A copy carrying ``tokens`` (this span's ids, decoded) instead of its fields."""
        copy = self.model_copy(update={"tokens": None, "tokens_b64": None})
        copy._decoded = tokens
        return copy

    def num_tokens(self) -> int:
        """How many token ids this span carries (base64 counted from its length)."""
        if self._decoded is not None:
            return len(self._decoded)
        if self.tokens is not None:
            return len(self.tokens)
        return len(self.tokens_b64 or "") * 3 // 4 // 4

    def token_array(self) -> np.ndarray:
        """The tokens as an int32 numpy array (raises ValueError if malformed)."""
        if self._decoded is not None:
            return self._decoded
        if self.tokens is not None:
            return np.asarray(self.tokens, dtype=np.int32)  # bounded by TokenId
        return decode_tokens(self.tokens_b64 or "")


class LookupTarget(_Body):
    """What a lookup item names besides its tokens (both the JSON and binary forms)."""

    request_id: str = Field(min_length=1, max_length=256)
    namespace: str = Field(min_length=1, max_length=512, pattern=NAME_PATTERN)
    cache_salt: str | None = Field(None, max_length=256)
    world_size: WorldSize = Field(1, description="A chunk hits only if every rank has it.")
    unit_tokens: UnitTokens | None = Field(None, description=_UNIT_TOKENS)


class LookupItem(TokenSpan, LookupTarget):
    pass


class LookupRequest(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "requests": [
                        {
                            "request_id": "req-7",
                            "namespace": "meta-llama/Llama-3.1-8B@3f9a1c2b",
                            "cache_salt": None,
                            "tokens": [128000, 791, 4062, 14198],
                            "world_size": 1,
                        }
                    ]
                }
            ]
        }
    )

    requests: list[LookupItem] = Field(fail_fast=True, max_length=MAX_ITEMS)


class LookupFrameItem(LookupTarget):
    num_tokens: NonNegativeInt = Field(
        description="How many int32 token ids of the frame's token section are this item's."
    )


class LookupFrameHeader(_Body):
    """The JSON header of the binary lookup form (``contract.frames``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "requests": [
                        {
                            "request_id": "req-7",
                            "namespace": "meta-llama/Llama-3.1-8B@3f9a1c2b",
                            "world_size": 1,
                            "num_tokens": 4,
                        }
                    ]
                }
            ]
        }
    )

    requests: list[LookupFrameItem] = Field(fail_fast=True, max_length=MAX_ITEMS)
    area: str | None = Field(
        default=None,
        max_length=64,
        pattern=URLSAFE_PATTERN,
        description="A lookup area of this connection's client (`POST "
        "/cache/lookup-areas`) that holds the items' token ids, item after item from "
        "byte 0, as the token section would; the body then carries, instead of the "
        "ids, each item's index (uint32 little-endian) once its ids are written.",
    )


class LookupAreaRequest(_Body):
    """Register a lookup area: a sealed memfd passed over the registration socket."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"ticket": "tk_Jx0r4QmS2w7c5bVd1Q9uEo3yHk8nLp6a"}]}
    )

    ticket: str = Field(
        min_length=1,
        max_length=128,
        pattern=URLSAFE_PATTERN,
        description="The ticket the registration socket (`GET /register`) gave for the "
        "memfd, sealed against shrinking and growing.",
    )


class LookupAreaResponse(_Reply):
    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [{"area_id": "tE6FOSP9ON8cDMAnSMaIMCXP", "size_bytes": 4194304}]
        },
    )

    area_id: str = Field(description="Name it as `area` in a binary lookup's header.")
    size_bytes: int = Field(description="The area's size: its room for token ids is a quarter.")


class LookupResult(_Reply):
    request_id: str
    hit_tokens: int = Field(
        description="Leading tokens cached: whole chunks, then whole units (`unit_tokens`)."
    )


class LookupResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"results": [{"request_id": "req-7", "hit_tokens": 512}]}]}
    )

    results: list[LookupResult]


class ClusterLookupRequest(TokenSpan):
    """A prompt to find across the deployment (``POST /cluster/lookup``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "meta-llama/Llama-3.1-8B",
                    "tokens": [128000, 791, 4062, 14198],
                    "cache_salt": None,
                }
            ]
        }
    )

    model: str = Field(
        min_length=1,
        max_length=4096,
        pattern=TEXT_PATTERN,
        description="The model name vLLM's connector negotiated with (vLLM's `--model`).",
    )
    cache_salt: str | None = Field(None, max_length=256)


class ClusterLookupServer(_Reply):
    member_id: str = Field(description="The member's boot_id.")
    url: str | None = Field(description="Its HTTP address, as it published it (null: none).")
    l1_tokens: int = Field(
        description="Leading tokens of the prompt it holds in its pool, in whole chunks."
    )


class ClusterLookupResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "chunk_size": 256,
                    "servers": [
                        {
                            "member_id": "5f0c3c1e9a2b4d7e8f10a2b3c4d5e6f7",
                            "url": "http://10.0.0.5:8733",
                            "l1_tokens": 1024,
                        },
                        {
                            "member_id": "9a1d2e3f4b5c6d7e8f9a0b1c2d3e4f5a",
                            "url": "http://10.0.0.6:8733",
                            "l1_tokens": 0,
                        },
                    ],
                    "l2_tokens": 512,
                }
            ]
        }
    )

    chunk_size: int = Field(description="The chunk size the counts are in whole chunks of.")
    servers: list[ClusterLookupServer] = Field(
        description="Each live member of the deployment, the answering server first (it "
        "alone when standalone, or when the coordinator cannot be reached)."
    )
    l2_tokens: int = Field(
        description="Leading tokens the shared L2 tier holds for every rank (0 without L2, "
        "or when the answering server has no registration of the model)."
    )


class TransferItem(TokenSpan):
    """One request's chunks to store or retrieve, by token range and block ids."""

    request_id: str = Field(min_length=1, max_length=256)
    namespace: str = Field(min_length=1, max_length=512, pattern=NAME_PATTERN)
    cache_salt: str | None = Field(None, max_length=256)
    start_token: NonNegativeInt = Field(description="First token; a chunk boundary.")
    end_token: NonNegativeInt = Field(
        description="End (exclusive): whole chunks, then whole units (`unit_tokens`)."
    )
    block_ids: list[BlockIds] = Field(
        max_length=MAX_GROUPS, fail_fast=True, description="Per group, the request's blocks."
    )
    unit_tokens: UnitTokens | None = Field(None, description=_UNIT_TOKENS)


_EXAMPLE_CHUNK = 288
"""The chunk size the ``/negotiate`` example selects (alignment 96 over the default
minimum 256): the register, store and retrieve examples fit it, so they succeed when
tried in that order on a fresh server (tests/app/test_openapi_examples.py)."""
_EXAMPLE_TOKENS_B64 = encode_tokens(range(1000, 1000 + _EXAMPLE_CHUNK))


class _TransferBatch(_Body):
    """The transfers of one engine step for one registered worker (instance, rank)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "instance_id": "engine-0",
                    "rank": 0,
                    "requests": [
                        {
                            "request_id": "req-7",
                            "namespace": "meta-llama/Llama-3.1-8B@3f9a1c2b",
                            "cache_salt": None,
                            "tokens_b64": _EXAMPLE_TOKENS_B64,
                            "start_token": 0,
                            "end_token": _EXAMPLE_CHUNK,
                            "block_ids": [list(range(3, 3 + _EXAMPLE_CHUNK // 16))],
                        }
                    ],
                }
            ]
        }
    )

    instance_id: str = Field(min_length=1, max_length=256, pattern=TEXT_PATTERN)
    rank: NonNegativeInt
    requests: list[TransferItem] = Field(fail_fast=True, max_length=MAX_ITEMS)
    timeout_s: Seconds | None = Field(
        None,
        description=(
            "How long the client waits for this reply. The server counts it from when it "
            "received the request and, once it has passed, commits no further chunk and "
            "writes no further block (the client may already have reused its blocks); "
            "the chunks left are reported failed. Clients should send somewhat less than "
            "their own timeout, to allow for transit."
        ),
    )
    event_ipc_b64: str | None = Field(
        None,
        min_length=88,
        max_length=88,
        pattern=EVENT_HANDLE_PATTERN,
        description=(
            "GPU registrations only: the IPC handle (base64 of a cudaIpcEventHandle_t) of "
            "a CUDA event the worker recorded on its stream after the writes this call "
            "reads or overwrites. The server's copies wait for it on the server's own "
            "stream, so the worker need not synchronise its device first. Refused for a "
            "registration of CPU tensors. Without it, the worker must have synchronised "
            "(Note [mpcache CUDA IPC invariants], rule 5)."
        ),
    )


class StoreRequest(_TransferBatch):
    """Copy whole chunks from the worker's registered KV cache into the cache."""


class StoreResult(_Reply):
    request_id: str
    stored_chunks: int = Field(description="Chunks copied into the cache.")
    present_chunks: int = Field(description="Chunks already cached, not copied again.")
    failed_chunks: int = Field(description="Chunks not stored (pool full, bad block).")


class StoreResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "results": [
                        {
                            "request_id": "req-7",
                            "stored_chunks": 1,
                            "present_chunks": 0,
                            "failed_chunks": 0,
                        }
                    ]
                }
            ]
        }
    )

    results: list[StoreResult]


class RetrieveRequest(_TransferBatch):
    """Copy cached chunks into the worker's registered KV cache."""


class RetrieveResult(_Reply):
    request_id: str
    loaded_tokens: int = Field(description="Tokens loaded, contiguous from start_token.")
    failed_block_ids: list[int] = Field(description="Blocks not loaded: recompute them.")


class RetrieveResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "results": [
                        {"request_id": "req-7", "loaded_tokens": 256, "failed_block_ids": [11, 12]}
                    ]
                }
            ]
        }
    )

    results: list[RetrieveResult]


CacheOpResult = LookupResult | StoreResult | RetrieveResult


class EndSessionsRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"examples": [{"request_ids": ["req-7", "req-8"]}]})

    request_ids: list[Annotated[str, Field(max_length=256)]] = Field(
        max_length=65536, fail_fast=True
    )


class EndSessionsResponse(_Reply):
    model_config = ConfigDict(json_schema_extra={"examples": [{"ended": 2}]})

    ended: int


class BlendMatchRequest(TokenSpan):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "namespace": "meta-llama/Llama-3.1-8B@3f9a1c2b",
                    "cache_salt": None,
                    "tokens": [128000, 791, 4062, 14198],
                }
            ]
        }
    )

    namespace: str = Field(min_length=1, max_length=512, pattern=NAME_PATTERN)
    cache_salt: str | None = Field(None, max_length=256)


class BlendChunk(_Reply):
    index: int
    start_token: int
    cached: bool


class BlendMatchResponse(_Reply):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "chunk_size": 256,
                    "chunks": [
                        {"index": 0, "start_token": 0, "cached": True},
                        {"index": 1, "start_token": 256, "cached": False},
                    ],
                }
            ]
        }
    )

    chunk_size: int
    chunks: list[BlendChunk]
