"""Exceptions of failed calls: AttnError, and a subclass for each status code callers handle.

Every failed call raises an AttnError subclass chosen by the gRPC status code, so callers can
`except attnserve.PoolExhausted` (or any other) and still read `.code` and `.message`:

| class                 | code                | what it means on attnserve                        |
|-----------------------|---------------------|---------------------------------------------------|
| InvalidArgument       | INVALID_ARGUMENT    | bad input; the message names the field and limit   |
| NotFound              | NOT_FOUND           | unknown pool; a closed or expired session          |
| FailedPrecondition    | FAILED_PRECONDITION | a page id not allocated to the caller's session;   |
|                       |                     | a session handle from before a server restart      |
| PoolExhausted         | RESOURCE_EXHAUSTED  | AllocatePages: too few free pages, none allocated  |
| QueueFull             | RESOURCE_EXHAUSTED  | the request queue is full (retry-pushback trailer) |
| ResourceExhausted     | RESOURCE_EXHAUSTED  | base of the two above; also a message over a limit |
| Unavailable           | UNAVAILABLE         | server draining or unreachable                     |
| DeadlineExceeded      | DEADLINE_EXCEEDED   | the call's deadline passed                         |
| Cancelled             | CANCELLED           | the call was cancelled                             |
| Internal              | INTERNAL            | a backend (CUDA) failure                           |
| Unauthenticated       | UNAUTHENTICATED     | no or unknown bearer token                         |
| PermissionDenied      | PERMISSION_DENIED   | the token may not call this method                 |

Other codes raise AttnError itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

# The standard gRPC trailer a server sends with RESOURCE_EXHAUSTED to ask for a delay (ms).
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class AttnError(Exception):
    """A failed call: the gRPC status code and the server's message.

    retry_pushback_ms is the server's `grpc-retry-pushback-ms` trailer (sent when its queue is
    full), or None.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, retry_pushback_ms: int | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_pushback_ms = retry_pushback_ms


class InvalidArgument(AttnError):
    """Bad input (shape, dtype, indptr, page id out of range, layer, sm_scale); nothing changed."""


class NotFound(AttnError):
    """An unknown pool name."""


class FailedPrecondition(AttnError):
    """A page id that is not allocated; nothing changed."""


class ResourceExhausted(AttnError):
    """RESOURCE_EXHAUSTED: PoolExhausted, QueueFull, or a message over a size limit."""


class PoolExhausted(ResourceExhausted):
    """AllocatePages found fewer free pages than asked and allocated nothing.

    Never retried: the pool stays full until someone frees pages (preempt or wait for a
    sequence to finish, then allocate again).
    """


class QueueFull(ResourceExhausted):
    """The server's request queue was full: the call was refused before it was queued.

    retry_pushback_ms says how long the server asks callers to wait; retried by default.
    """


class Unavailable(AttnError):
    """The server is draining, or could not be reached."""


class DeadlineExceeded(AttnError):
    """The call's deadline passed (on the server: dropped before its launch)."""


class Cancelled(AttnError):
    """The call was cancelled."""


class Internal(AttnError):
    """A backend failure (CUDA); the server exits and should be restarted."""


class Unauthenticated(AttnError):
    """The server needs a bearer token (Client(token=...)) and got none or an unknown one."""


class PermissionDenied(AttnError):
    """The token may not call this method (e.g. a read-only token)."""


_BY_CODE: dict[grpc.StatusCode, type[AttnError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def error_for(
    code: grpc.StatusCode, message: str, *, method: str = "", retry_pushback_ms: int | None = None
) -> AttnError:
    """The AttnError subclass for a status of `method` (an AttentionService method name).

    RESOURCE_EXHAUSTED is QueueFull when the server sent a retry pushback, PoolExhausted when
    AllocatePages failed without one, and plain ResourceExhausted otherwise.
    """
    cls = _BY_CODE.get(code, AttnError)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if retry_pushback_ms is not None:
            cls = QueueFull
        elif method == "AllocatePages":
            cls = PoolExhausted
    return cls(code, message, retry_pushback_ms=retry_pushback_ms)


def from_rpc_error(error: grpc.RpcError, method: str) -> AttnError:
    """Converts a failed call of the sync or the asyncio API (both are grpc.Call objects)."""
    call: grpc.Call = error  # type: ignore[assignment]
    return error_for(
        call.code(),
        call.details() or "",
        method=method,
        retry_pushback_ms=_pushback_ms(call.trailing_metadata()),
    )


def _pushback_ms(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The retry-pushback trailer as a non-negative integer, None when absent or malformed."""
    for key, value in metadata or ():
        if key == RETRY_PUSHBACK_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else None
    return None
