"""Client side of the status-code mapping: a gRPC status back to a `hicache.errors` type.

The inverse of the daemon's interceptor: the code names come from each error class's
`grpc_code_name`, so both directions read the same table. DEADLINE_EXCEEDED is `Unavailable`; codes with
no typed error (UNKNOWN, ABORTED, ...) become a plain `HicacheError` naming the code.
"""

from __future__ import annotations

import grpc

from hicache import errors
from hicache.errors import HicacheError

# The daemon could not be reached, or went away during the call: UNAVAILABLE, or CANCELLED
# (gRPC's server cancels the calls that reach it while it stops; the client's sync calls
# never cancel one, and a call on a closed client is told apart by the client).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})

# The most general class per code (InvalidArgument, not ConfigError; Unavailable, not
# BackendUnavailable).
_BY_CODE: dict[str, type[HicacheError]] = {}
for _cls in (
    errors.InvalidArgument,
    errors.NotFound,
    errors.FailedPrecondition,
    errors.ResourceExhausted,
    errors.Unauthenticated,
    errors.PermissionDenied,
    errors.Unavailable,
    errors.Unimplemented,
    errors.ObjectCorrupt,
):
    _BY_CODE[_cls.grpc_code_name] = _cls
# A daemon that does not answer in time, or that ends the call as it stops, is, to the
# caller, not available.
_BY_CODE["DEADLINE_EXCEEDED"] = errors.Unavailable
_BY_CODE["CANCELLED"] = errors.Unavailable
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
# What a call gRPC itself cancelled carries (the server's stop): no reason of the daemon's.
_BARE_CANCEL = frozenset({"", "cancelled"})


def error_for(code: grpc.StatusCode, message: str) -> HicacheError:
    cls = _BY_CODE.get(code.name)
    if cls is errors.Unavailable and code.name == "DEADLINE_EXCEEDED":
        return errors.NoAnswer(f"no answer in time ({message})")
    if cls is errors.Unavailable and code.name == "CANCELLED":
        if message.strip().lower() not in _BARE_CANCEL:  # (the daemon said why: that is it)
            return cls(f"the daemon ended the call: {message}")
        return cls(f"the daemon ended the call ({message or 'cancelled'}): it is stopping or restarting")
    if cls is None:
        return HicacheError(f"{code.name}: {message}")
    return cls(message)


def from_rpc_error(e: grpc.RpcError) -> HicacheError:
    """The typed error for a failed call (`grpc.RpcError` is also a `grpc.Call`)."""
    code = e.code()  # type: ignore[attr-defined]
    details = e.details() or ""  # type: ignore[attr-defined]
    return error_for(code, details)


def op_error(number: int, message: str) -> HicacheError:
    """The typed error of a failed Batch op (`OpStatus`)."""
    return error_for(_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)
