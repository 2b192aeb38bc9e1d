"""The gRPC servicers: protobuf -> one core call -> protobuf, nothing else.

Errors are not handled here: the core raises typed `hicache.errors`, and the interceptor
turns them into status codes. The one exception is `Batch`, whose ops each get a result
(a response or an `OpStatus`) so that one failing op does not fail the others; it uses the
interceptor's own mapping (`op_status`) and checks each op's namespace like the
interceptor checks a plain call's.

The engine's id comes from the `x-hicache-engine` metadata header (sent by the client
after `Attach`); Attach and Heartbeat carry it in the request instead.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from hicache import convert
from hicache.auth import current_principal, scoped
from hicache.config import MAX_MESSAGE_BYTES, MESSAGE_SLACK_BYTES, header_value
from hicache.controller.base import MAX_ENGINE_ID, CacheService, InsertRequest, MatchRequest
from hicache.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    HicacheError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from hicache.interceptor import op_status
from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import admin_pb2_grpc as apb_grpc
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

log = logging.getLogger("hicache.service")

ENGINE_HEADER = "x-hicache-engine"

Op = Callable[..., Any]
"""One op: (engine_id, request message) -> response message; the FILLED_IN_PLACE ones take
a third argument, the response message to fill."""


# Batch ops whose op fills the result's response field in place (the ops of a typical
# Batch: no response copy); the others' responses are copied in.
FILLED_IN_PLACE = frozenset({"match_prefix", "insert"})


RUN_HEADER = "x-hicache-run"
STALE_RUN = ("engine not attached to this run of the daemon: it restarted since the engine "
             "attached, and the pools the engine mapped are gone; attach again")
RELEASED_BY_RESTART = "a handle of an earlier run of the daemon: its restart released it"


def caller_of(context: grpc.ServicerContext, run: str) -> tuple[str, bool]:
    """The caller's engine id from the metadata ("" when it sent none), scoped to the
    caller's token (`scoped_engine`), and whether it names another run of the daemon
    (`RUN_HEADER`: it attached before a restart, so what it would write or read through
    its old mappings is not this daemon's pools, and its handles are gone)."""
    engine: str | None = None
    stale = False
    for key, value in context.invocation_metadata():  # type: ignore[misc]
        if key == ENGINE_HEADER:
            if engine is None:  # (the first, if a caller sends two)
                engine = scoped_engine(value if isinstance(value, str) else value.decode())
        elif key == RUN_HEADER:
            stale = stale or value != run
    return engine or "", stale


def engine_of(context: grpc.ServicerContext, run: str) -> str:
    """`caller_of`'s engine; a caller of an earlier run is refused."""
    engine, stale = caller_of(context, run)
    if stale:
        raise FailedPrecondition(STALE_RUN)
    return engine


# Ops that use no attachment: served under an earlier run's header, as their RPCs are.
_RUNLESS_OPS = frozenset({"attach", "stats", "close_session"})


def _stale_op(kind: str | None) -> None:
    """An op sent under an earlier run's header: a release finds its handle gone (the
    restart released it); ops that use no attachment go through; the rest is refused."""
    if kind == "release":
        raise NotFound(RELEASED_BY_RESTART)
    if kind not in _RUNLESS_OPS:
        raise FailedPrecondition(STALE_RUN)


# A handle-making reply with less of the caller's deadline left than this is not sent:
# delivering it takes ~0.3-1 ms here, and a reply that arrives late leaks its handles.
REPLY_MARGIN_S = 0.005


def _cancelled(context: grpc.ServicerContext) -> bool:
    """Whether the caller cancelled the ended RPC or let its deadline pass.
    NOTE: grpc's sync server keeps this only in the context's private RPC state; where
    that is missing (another grpc version) this says False and only the check while the
    handler runs remains."""
    state = getattr(context, "_state", None)
    return getattr(state, "client", None) == "cancelled"


def _batch_handles(request: Any, response: Any) -> tuple[list[int], list[int]]:
    """Lock and allocation ids a Batch's ops made (not those of grown allocations)."""
    locks: list[int] = []
    allocations: list[int] = []
    for op, result in zip(request.ops, response.results, strict=True):
        kind = result.WhichOneof("result")
        if kind == "match_prefix":
            locks.append(result.match_prefix.lock_id)
            allocations.append(result.match_prefix.allocation_id)
        elif kind == "allocate" and not op.allocate.allocation_id:
            allocations.append(result.allocate.allocation_id)
    return locks, allocations


def scoped_engine(engine_id: str) -> str:
    """The engine id the core knows: with bearer tokens, the token's label and the id the
    engine sent, so that a caller with another token naming the same engine reaches a
    different (unattached) one and never another tenant's locks or allocations. Without
    tokens (one trust domain) the id as sent."""
    return scoped(current_principal(), engine_id)


def scoped_session(session_id: str) -> str:
    """A session id as the core knows it: with bearer tokens, prefixed by the token's label
    (like `scoped_engine`), so that two tenants using the same id never share a session
    and one cannot close another's."""
    return scoped(current_principal(), session_id)


_R = TypeVar("_R", MatchRequest, InsertRequest)


def _session_scoped(req: _R) -> _R:
    """`req` with its session id as the core knows it (`scoped_session`)."""
    if not req.session_id:
        return req
    scoped = scoped_session(req.session_id)
    return req if scoped == req.session_id else req._replace(session_id=scoped)


class HiCacheServicer(pb_grpc.HiCacheServicer):
    """The engine-facing service over one `CacheService`."""

    def __init__(self, core: CacheService, max_tokens_per_request: int,
                 max_reply_bytes: int = 0) -> None:
        """`max_reply_bytes`: the largest reply one op can need (`HicacheConfig.
        max_reply_bytes`): a Batch that could pass gRPC's message limit is answered op by op
        within it (0: not checked)."""
        self._core = core
        self._limit = max_tokens_per_request
        self._max_reply = max_reply_bytes
        self.run = secrets.token_hex(8)  # this run of the daemon (`RUN_HEADER`)
        # BatchOp's oneof field name -> op; also what each unary RPC calls.
        self._ops: dict[str, Op] = {
            "attach": self._attach,
            "heartbeat": self._heartbeat,
            "match_prefix": self._match,
            "prefetch_status": self._prefetch_status,
            "cancel_prefetch": self._cancel_prefetch,
            "allocate": self._allocate,
            "insert": self._insert,
            "release": self._release,
            "close_session": self._close_session,
            "stats": self._stats,
        }

    # ------------------------------------------------------------------ ops

    def _attach(self, _engine: str, r: pb.AttachRequest) -> pb.AttachResponse:
        if len(r.engine_id) > MAX_ENGINE_ID:  # counted as sent, before `scoped_engine`
            raise InvalidArgument(f"engine_id: {len(r.engine_id)} characters, at most {MAX_ENGINE_ID}")
        if not header_value(r.engine_id):
            # Every later call names the engine in a header, which holds printable ASCII
            # only: attached, it could make no call.
            raise InvalidArgument(f"engine_id: {r.engine_id!r} is not printable ASCII "
                                  f"(calls send it in the {ENGINE_HEADER!r} header)")
        return convert.attach_to_pb(
            self._core.attach(scoped_engine(r.engine_id), r.tp_rank, r.tp_size, r.instance_id),
            r.tp_rank,
            self.run,
        )

    def _heartbeat(self, _engine: str, r: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        if not r.engine_id:  # (the core's message would point at the metadata header)
            raise InvalidArgument("engine_id: must be a non-empty string (Heartbeat names "
                                  "its engine in the request)")
        return convert.heartbeat_to_pb(
            self._core.heartbeat(scoped_engine(r.engine_id), r.tp_rank, r.instance_id)
        )

    def _match(self, engine: str, r: pb.MatchPrefixRequest,
               out: pb.MatchPrefixResponse | None = None) -> pb.MatchPrefixResponse:
        req = _session_scoped(convert.match_request_from_pb(r, self._limit))
        return convert.match_to_pb(self._core.match(engine, req), out)

    def _prefetch_status(self, engine: str, r: pb.PrefetchStatusRequest) -> pb.PrefetchStatusResponse:
        return convert.prefetch_to_pb(self._core.prefetch_status(r.prefetch_id, engine))

    def _cancel_prefetch(self, engine: str, r: pb.CancelPrefetchRequest) -> pb.CancelPrefetchResponse:
        return pb.CancelPrefetchResponse(tokens_ready=self._core.cancel_prefetch(r.prefetch_id, engine))

    def _allocate(self, engine: str, r: pb.AllocateRequest) -> pb.AllocateResponse:
        req = convert.allocate_request_from_pb(r)
        return convert.allocation_to_pb(self._core.allocate(engine, req))

    def _insert(self, engine: str, r: pb.InsertRequest,
                out: pb.InsertResponse | None = None) -> pb.InsertResponse:
        req = _session_scoped(convert.insert_request_from_pb(r, self._limit))
        return convert.insert_to_pb(self._core.insert(engine, req), out)

    def _release(self, engine: str, r: pb.ReleaseRequest) -> pb.ReleaseResponse:
        lock_id, allocation_id = convert.release_target(r)
        self._core.release(engine, lock_id, allocation_id)
        return pb.ReleaseResponse()

    def _close_session(self, _e: str, r: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(
            released_refs=self._core.close_session(
                scoped_session(convert.check_name("session_id", r.session_id)))
        )

    def _stats(self, _engine: str, _r: pb.StatsRequest) -> pb.StatsResponse:
        # Daemon-wide figures: a tenant limited to some namespaces would watch the others'
        # lookups, hits, locks and allocations move. An operator's view, like Flush.
        if not current_principal().unrestricted:
            raise PermissionDenied(
                "Stats needs a token that allows every namespace ('*'): its figures are "
                "every tenant's"
            )
        return convert.stats_to_pb(self._core.stats())

    # ------------------------------------------------------------------ RPCs

    def Attach(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._attach("", request)

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        engine_of(context, self.run)  # (a client of an earlier run is told: it detaches)
        return self._heartbeat("", request)

    def MatchPrefix(self, request: Any, context: grpc.ServicerContext) -> Any:
        engine = engine_of(context, self.run)
        response = self._match(engine, request)
        if response.lock_id or response.allocation_id:
            self._drop_if_abandoned(
                context, engine, lambda: ([response.lock_id], [response.allocation_id])
            )
        return response

    def Load(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        for progress in self._core.load(engine_of(context, self.run), request.lock_id):
            yield convert.load_to_pb(progress)

    def PrefetchStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._prefetch_status(engine_of(context, self.run), request)

    def CancelPrefetch(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._cancel_prefetch(engine_of(context, self.run), request)

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        engine = engine_of(context, self.run)
        response = self._allocate(engine, request)
        if not request.allocation_id:  # (a grown allocation the engine knows already)
            self._drop_if_abandoned(context, engine, lambda: ([], [response.allocation_id]))
        return response

    def _drop_if_abandoned(self, context: grpc.ServicerContext, engine: str,
                           made: Callable[[], tuple[list[int], list[int]]]) -> None:
        """Handles this RPC made (`made()`: lock ids, allocation ids; read only when
        needed), released if its caller gives up on it (deadline passed, cancelled): the
        engine never learns their ids, and its heartbeats would keep them, and their
        pages, for its lifetime. Checked now, and again when the RPC has ended (the
        deadline may pass while the reply is being sent)."""
        if not context.is_active():
            self._drop_handles(engine, *made())
            return
        left = context.time_remaining()
        if left is not None and left < REPLY_MARGIN_S:
            # A reply this late may reach the caller after its deadline: the caller then
            # sees DEADLINE_EXCEEDED while the handles stay made (the RPC ended well on
            # this side, nothing here can tell). Release them and say so instead. A call
            # that made none (a Batch of Inserts and Releases) replies as it is: failing
            # it would say its applied ops were not.
            locks, allocations = made()
            if not any(locks) and not any(allocations):
                return
            self._drop_handles(engine, locks, allocations)
            raise DeadlineExceeded(
                f"{left * 1e3:.1f} ms of the caller's deadline left to reply (under "
                f"{REPLY_MARGIN_S * 1e3:g} ms): the locks and allocations made were released"
            )

        def at_end() -> None:  # on gRPC's poller thread: never wait for the core there
            if _cancelled(context):
                threading.Thread(target=self._drop_handles, args=(engine, *made()),
                                 name="hicache-drop-abandoned", daemon=True).start()

        if not context.add_callback(at_end):
            at_end()

    def _drop_handles(self, engine: str, locks: list[int], allocations: list[int]) -> None:
        """Release each handle (ids of 0 are none); ones consumed or released meanwhile
        are fine."""
        for lock in filter(None, locks):
            with contextlib.suppress(HicacheError):
                self._core.release(engine, lock, None)
        for allocation in filter(None, allocations):
            with contextlib.suppress(HicacheError):
                self._core.release(engine, None, allocation)

    def Insert(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._hold_background_until_sent(context)
        return self._insert(engine_of(context, self.run), request)

    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:
        engine, stale = caller_of(context, self.run)
        if stale:  # (its ids may name another handle of this run)
            raise NotFound(RELEASED_BY_RESTART)
        return self._release(engine, request)

    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._close_session("", request)

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._stats("", request)

    def Batch(self, request: Any, context: grpc.ServicerContext) -> Any:
        engine, stale = caller_of(context, self.run)
        principal = current_principal()
        response = pb.BatchResponse()
        self._hold_background_until_sent(context)  # and its ops' copies go in one flush
        self._run_batch(request.ops, engine, principal, response, stale)
        self._drop_if_abandoned(context, engine, lambda: _batch_handles(request, response))
        return response

    def _hold_background_until_sent(self, context: grpc.ServicerContext) -> None:
        """Write-through copies this RPC starts wait until its response is on the wire
        (gRPC runs the callback when the RPC ends, however it ends): started at once,
        they would compete with sending it (bench rpc, 6 alternating runs: a round went
        from 2.59x to 2.50x an empty call, mean)."""
        release = self._core.hold_background()
        if not context.add_callback(release):  # already over
            release()

    def _run_batch(self, ops_in: Any, engine: str, principal: Any, response: Any,
                   stale: bool = False) -> None:
        restricted = not principal.unrestricted  # checked once per call, not per op
        ops = self._ops
        add_result = response.results.add
        # A reply past gRPC's message limit could not be sent, after its ops took effect:
        # where that could happen, an op that might pass it is refused (not run).
        room = (MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES
                if self._max_reply and len(ops_in) * self._max_reply > MAX_MESSAGE_BYTES else None)
        for i, op in enumerate(ops_in):
            kind = op.WhichOneof("op")
            result = add_result()
            try:
                if room is not None and room < self._max_reply:
                    raise ResourceExhausted(
                        f"the Batch's reply could pass gRPC's {MAX_MESSAGE_BYTES}-byte message "
                        f"limit: op {i} on were not run; send them in another Batch")
                if kind is None:
                    raise InvalidArgument("empty op: set one of the BatchOp fields")
                if stale:
                    _stale_op(kind)
                msg = getattr(op, kind)
                if restricted:
                    principal.require_for(msg)
                if kind in FILLED_IN_PLACE:
                    ops[kind](engine, msg, getattr(result, kind))
                else:
                    getattr(result, kind).CopyFrom(ops[kind](engine, msg))
            except Exception as exc:
                code, message = op_status(exc, f"Batch op {i} ({kind})", f"Batch {kind}")
                result.status.code = code.value[0]
                result.status.message = f"op {i} ({kind}): {message}"
            if room is not None:
                room -= result.ByteSize() + 8  # (the field's tag and length)


class AdminServicer(apb_grpc.AdminServicer):
    """The operator-facing service."""

    def __init__(self, core: CacheService, default_flush_s: float) -> None:
        self._core = core
        self._default_flush_s = default_flush_s

    def Health(self, request: Any, context: grpc.ServicerContext) -> Any:
        return convert.health_to_pb(self._core.health(request.deep))

    def Flush(self, request: Any, context: grpc.ServicerContext) -> Any:
        # Every tenant's data goes down, at the store's full bandwidth: an operator's call.
        if not current_principal().unrestricted:
            raise PermissionDenied("Flush needs a token that allows every namespace ('*')")
        timeout_s = request.timeout_ms / 1e3 if request.timeout_ms else self._default_flush_s
        started = time.monotonic()
        written = self._core.flush(timeout_s)
        left = self._core.unflushed_pages()
        # "Writes everything pending": pages left behind are an error, not an OK answer an
        # operator would read as done. Left at the deadline: too slow (or hung); left before
        # it with none written: the store took nothing (down, refusing writes, never
        # connected). Pages inserted during a flush that kept writing are the next flush's.
        # (FAILED_PRECONDITION, not DEADLINE_EXCEEDED: callers read that as their own
        # deadline, an answer that never came.)
        if left and (not written or time.monotonic() - started >= timeout_s):
            raise FailedPrecondition(f"flushed {written} pages; {left} pages L3 lacks are not "
                                     "written (the store is down, refusing writes, not "
                                     f"connected, or slower than {timeout_s:g} s)")
        return apb.FlushResponse(pages_written=written)
