"""Typed errors of the core.

The core raises these; exactly one place (the gRPC interceptor) maps them to status codes.
Each carries a message that says what was wrong, in terms the caller can act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HicacheError(Exception):
    """Base class of every error hicache raises on purpose."""

    grpc_code_name = "INTERNAL"


class InvalidArgument(HicacheError):
    """The request itself is malformed (bad token bytes, page id out of range, unknown member)."""

    grpc_code_name = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """A configuration value is wrong; the message names the key path and what is allowed."""


class NotFound(HicacheError):
    """An unknown or expired handle: lock, allocation, prefetch, session or engine."""

    grpc_code_name = "NOT_FOUND"


class FailedPrecondition(HicacheError):
    """The request is well formed but the state does not allow it (e.g. Load before Attach)."""

    grpc_code_name = "FAILED_PRECONDITION"


class ResourceExhausted(HicacheError):
    """No room: locked pages leave nothing to evict."""

    grpc_code_name = "RESOURCE_EXHAUSTED"


class Unauthenticated(HicacheError):
    grpc_code_name = "UNAUTHENTICATED"


class PermissionDenied(HicacheError):
    grpc_code_name = "PERMISSION_DENIED"


class Unavailable(HicacheError):
    """The daemon is shutting down or a dependency cannot be reached."""

    grpc_code_name = "UNAVAILABLE"


class NoAnswer(Unavailable):
    """Client side: the daemon did not answer within the call's deadline (it may be hung
    or overloaded; asking it something else would wait as long again)."""


class BackendUnavailable(Unavailable):
    """An L3 backend did not answer (connection refused, timeout, disk full, permission)."""


class BackendTimedOut(BackendUnavailable):
    """A bounded L3 call was given up on while it still runs: `pending` holds the futures
    (`concurrent.futures.Future`) that complete when it returns. Until then it may still
    write into the buffers it was given, so those must not be reused."""

    def __init__(self, message: str, pending: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.pending = list(pending)


class Unimplemented(HicacheError):
    """The endpoint does not serve that method (e.g. a probe listener, which serves only
    the standard health check)."""

    grpc_code_name = "UNIMPLEMENTED"


class DeadlineExceeded(HicacheError):
    """Too little of the caller's deadline was left to deliver the reply: what the call
    made for the caller (locks, allocations) was released instead."""

    grpc_code_name = "DEADLINE_EXCEEDED"


class ObjectCorrupt(HicacheError):
    """An L3 object failed its header or checksum check; callers treat it as a miss."""

    grpc_code_name = "DATA_LOSS"
