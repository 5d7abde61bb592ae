"""Domain errors and their one mapping to problem-style HTTP replies.

Routes and data-plane code raise these; ``app.problems.install_error_handlers`` turns each into
one JSON body ``{"type", "title", "status", "detail", ...extras}`` (see
``app.problems``). Nothing in the server raises ``HTTPException``; this module has
no web imports so pure modules can raise these too.

    MPCacheError                      500  (a bug or an unexpected fault)
    ├── InvalidRequest                422  input that parses but cannot be served
    │   ├── InvalidDescriptor         422  a tensor descriptor failed validation
    │   └── SegmentAccessError        422  a shm segment that cannot be opened or mapped
    ├── Unauthorized                  401  missing or wrong API bearer token
    ├── Forbidden                     403  a registration used without its token
    ├── NotFound                      404  unknown registration, segment, ...
    │   └── SegmentNotFound           404  no shm segment of that name
    ├── PayloadTooLarge               413  a request body over --max-body-size
    ├── UnsupportedMediaType          415  a body in a form the route does not take
    ├── Conflict                      409
    │   ├── IncompatibleAlignment     409  final size not a multiple of alignment
    │   ├── ResizeAfterSessions       409  a resize once sessions exist
    │   ├── NotNegotiated             409  an operation that needs a final size
    │   ├── ChunkSizeMismatch         409  a registration with another chunk size
    │   └── FeatureDisabled           409  e.g. blend matching without --enable-blend
    └── Unavailable                   503  + Retry-After
        ├── BindingFailed             503  a chunk-size binding failed; retry resumes
        ├── PoolExhausted             503  no room in the cache pool
        ├── SessionsFull              503  session memory full of recently used sessions
        └── SharedMemoryExhausted     503  /dev/shm cannot hold a new segment
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BindingFailed",
    "ChunkSizeMismatch",
    "Conflict",
    "FeatureDisabled",
    "Forbidden",
    "IncompatibleAlignment",
    "InvalidDescriptor",
    "InvalidRequest",
    "MPCacheError",
    "NotFound",
    "NotNegotiated",
    "PayloadTooLarge",
    "PoolExhausted",
    "ResizeAfterSessions",
    "SegmentAccessError",
    "SegmentNotFound",
    "SessionsFull",
    "SharedMemoryExhausted",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
]


class MPCacheError(Exception):
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal server error"
    slug: ClassVar[str] = "internal"

    def __init__(self, detail: str, **extras: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extras = extras

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(MPCacheError):
    status = 422
    title = "Invalid request"
    slug = "invalid-request"


class InvalidDescriptor(InvalidRequest):
    title = "Invalid tensor descriptor"
    slug = "invalid-descriptor"


class SegmentAccessError(InvalidRequest):
    title = "Shared-memory segment unusable"
    slug = "segment-access"


class Unauthorized(MPCacheError):
    status = 401
    title = "Unauthorized"
    slug = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="mpcache"'}


class Forbidden(MPCacheError):
    status = 403
    title = "Forbidden"
    slug = "forbidden"


class NotFound(MPCacheError):
    status = 404
    title = "Not found"
    slug = "not-found"


class SegmentNotFound(NotFound):
    title = "Shared-memory segment not found"
    slug = "segment-not-found"


class PayloadTooLarge(MPCacheError):
    status = 413
    title = "Request body too large"
    slug = "payload-too-large"


class UnsupportedMediaType(MPCacheError):
    status = 415
    title = "Unsupported media type"
    slug = "unsupported-media-type"


class Conflict(MPCacheError):
    status = 409
    title = "Conflict"
    slug = "conflict"


class IncompatibleAlignment(Conflict):
    title = "Incompatible chunk alignment"
    slug = "incompatible-alignment"


class ResizeAfterSessions(Conflict):
    title = "Chunk size cannot change after sessions started"
    slug = "resize-after-sessions"


class NotNegotiated(Conflict):
    title = "Chunk size not negotiated"
    slug = "not-negotiated"


class ChunkSizeMismatch(Conflict):
    title = "Chunk size mismatch"
    slug = "chunk-size-mismatch"


class FeatureDisabled(Conflict):
    title = "Feature disabled"
    slug = "feature-disabled"


class Unavailable(MPCacheError):
    status = 503
    title = "Temporarily unavailable"
    slug = "unavailable"
    retry_after_s: ClassVar[int] = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class BindingFailed(Unavailable):
    title = "Chunk-size binding failed"
    slug = "binding-failed"


class PoolExhausted(Unavailable):
    title = "Cache pool exhausted"
    slug = "pool-exhausted"


class SessionsFull(Unavailable):
    title = "Session memory full"
    slug = "sessions-full"
    retry_after_s = 5


class SharedMemoryExhausted(Unavailable):
    title = "Shared memory exhausted"
    slug = "shared-memory-exhausted"
    retry_after_s = 30
