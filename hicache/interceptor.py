"""The one place where exceptions become gRPC status codes (and RPC latency is measured).

Every call goes through `ServerInterceptor`:
-. its request message is read within `server.message_timeout_s` of the call's arrival
   (when gRPC handed it to the server's pool, `hicache.server_pool.submitted_at`), or the
   call is cancelled (`expire_reads`, run by the daemon every `read_check_s`; a read that
   begins past that, its call queued behind a full pool, gets `LATE_READ_GRACE_S` more;
   when the daemon stops, those waiting then are refused UNAVAILABLE at once): gRPC's sync
   server waits for a unary call's message on a worker thread, and a caller stopped
   mid-send (or a hostile one) would hold that thread for as long as it kept its
   connection;
0. while the daemon stops (`begin_stop`), a call is refused UNAVAILABLE (the health
   check excepted), and the stop waits for those under way (`wait_idle`);
1. authentication (`hicache.auth`): the bearer token → a `Principal`, made current for the
   call; a request with a `namespace` field is checked against it before the servicer runs
   (ops inside `Batch` are checked by the Batch servicer with the same principal). A call
   with no or a wrong token is refused on its headers, before its message is read;
2. the servicer;
3. a typed `HicacheError` → its status code and message; anything else → `INTERNAL`, with
   the traceback logged, and the daemon keeps serving;
4. the latency, by method and final code, into `hicache_rpc_seconds`.

`status_of` is the mapping itself; the Batch servicer uses it for per-op statuses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hicache.auth import Authenticator, reset_current_principal, set_current_principal
from hicache.errors import HicacheError, InvalidArgument, Unavailable
from hicache.logthrottle import ThrottledLog
from hicache.metrics import RpcMetrics
from hicache.server_pool import submitted_at

log = logging.getLogger("hicache.rpc")
_unexpected = ThrottledLog(log)
_unread = ThrottledLog(log)

# Services callable without credentials: the standard health check (probes, `hicache health`
# against a daemon whose tokens the prober does not hold). It reveals only SERVING or not.
UNAUTHENTICATED_SERVICES = frozenset({"grpc.health.v1.Health"})
# Answered while the daemon stops (NOT_SERVING then, which is what a probe should see).
_SERVED_WHILE_STOPPING = frozenset({"grpc.health.v1.Health"})


_STOPPING = "the daemon is shutting down; call again once it is back"
# A read that begins after its call's message deadline (the call waited in the pool's
# queue that long) waits this long (at most the timeout) before it is cancelled: the
# message may have come with the call.
LATE_READ_GRACE_S = 1.0

# A status message travels in a trailer, percent-encoded (up to 3 bytes a UTF-8 byte), and
# gRPC drops trailers past its metadata limit (8 KiB): the caller then sees
# RESOURCE_EXHAUSTED, not the status. Messages quote the caller's strings (a session id, a
# namespace), so they are cut to this many UTF-8 bytes.
MAX_STATUS_MESSAGE = 1024


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception raised while serving a request."""
    if isinstance(exc, HicacheError):
        code = getattr(grpc.StatusCode, exc.grpc_code_name, grpc.StatusCode.INTERNAL)
        return code, _bounded(str(exc) or type(exc).__name__)
    return grpc.StatusCode.INTERNAL, _bounded(
        f"internal error ({type(exc).__name__}: {exc}); see the daemon log")


def _bounded(message: str) -> str:
    data = message.encode(errors="replace")
    if len(data) <= MAX_STATUS_MESSAGE:
        return message
    kept = data[:MAX_STATUS_MESSAGE].decode(errors="ignore")  # (never half a character)
    return f"{kept}... ({len(message) - len(kept)} more characters)"


class ServerInterceptor(grpc.ServerInterceptor):
    def __init__(self, auth: Authenticator, metrics: RpcMetrics | None,
                 message_timeout_s: float = 30.0, listener: str = "server") -> None:
        """`listener`: which one this is, in its log lines ("server", "probe listener")."""
        self._auth = auth
        self._metrics = metrics
        self.message_timeout_s = message_timeout_s
        self._late_grace_s = min(message_timeout_s, LATE_READ_GRACE_S)
        self.listener = listener
        # Calls whose request message is being waited for: context -> (deadline, arrival,
        # method).
        # Whoever pops a call's entry first decides it: the reader (the message came) or
        # `expire_reads` (it is cancelled), so a message arriving at the deadline is
        # either served or refused, never served on a cancelled call.
        self._reading: dict[Any, tuple[float, float, str]] = {}
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()
        # Shutdown (`begin_stop`): calls that come meanwhile are refused UNAVAILABLE (the
        # contract; gRPC's own stop would cancel them), those under way finish.
        self._stopping = False
        self._active = 0  # calls under way (in `_served`), under `_idle`'s lock
        self._idle = threading.Condition()

    def begin_stop(self) -> None:
        with self._idle:
            self._stopping = True
        self.expire_reads(everything=True)  # (they would be refused: the stop need not wait)

    def wait_idle(self, timeout_s: float) -> bool:
        """After `begin_stop`: wait until no call is under way (at most `timeout_s`)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._active, timeout_s)

    @property
    def read_check_s(self) -> float:
        """How often `expire_reads` should run: a quarter of the timeout, within 0.05-1 s."""
        return min(1.0, max(0.05, self.message_timeout_s / 4))

    def expire_reads(self, everything: bool = False) -> int:
        """Cancel the calls whose request message has not come within
        `message_timeout_s` (`everything`: all those waiting for one, at a stop); their
        caller sees CANCELLED (UNAVAILABLE at a stop), with why. Returns how many."""
        now = time.monotonic()
        try:
            waiting = list(self._reading.items())
        except RuntimeError:  # (changed while copied: a collection ran Python code) next time
            return 0
        expired: list[str] = []
        code = grpc.StatusCode.UNAVAILABLE if everything else grpc.StatusCode.CANCELLED
        for context, (deadline, arrival, label) in waiting:
            if (everything or deadline <= now) and self._reading.pop(context, None) is not None:
                why = (_STOPPING if everything
                       else f"{label}: the request message did not come within "
                            f"server.message_timeout_s={self.message_timeout_s:g}s")
                _cancel(context, code, why)  # (wakes the worker waiting for the message)
                expired.append(label)
                if self._metrics is not None:
                    self._metrics.observe(label, code.name, now - arrival)
        if expired and not everything:
            _unread.warning(
                f"message-timeout:{self.listener}",
                "%s: cancelled %d call(s) whose request message did not come within "
                "server.message_timeout_s=%gs (a caller stopped mid-send, or a hostile one): %s",
                self.listener, len(expired), self.message_timeout_s, ", ".join(sorted(set(expired))),
            )
        return len(expired)

    def _read(self, label: str, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The call's one request message, waited for at most `message_timeout_s`."""
        reading = self._reading
        now = time.monotonic()
        arrival = submitted_at() or now
        # (a call queued almost that long: its message may be here already)
        deadline = max(arrival + self.message_timeout_s, now + self._late_grace_s)
        reading[context] = (deadline, arrival, label)
        try:
            request = next(requests, None)
        finally:
            mine = reading.pop(context, None) is not None
        # (an exception from `next` is gRPC's own RpcError: its caller cancelled, or let
        # the call's deadline pass; gRPC ends such a call quietly)
        if not mine:  # cancelled by `expire_reads`, whether or not the message just came
            if self._stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, _STOPPING)
            context.abort(grpc.StatusCode.CANCELLED, f"{label}: the request message did not "
                          f"come within server.message_timeout_s={self.message_timeout_s:g}s")
        if request is None:  # (its caller ended its side without sending one)
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          f'"/{label}" requires exactly one request message.')
        return request

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = continuation(handler_call_details)
            if handler is None:  # unknown method: UNIMPLEMENTED, not cached (names are free)
                return None
            wrapped = self._wrap(method, handler)
            with self._lock:
                self._wrapped[method] = wrapped
        if self._auth.enabled and method.split("/", 2)[1] not in UNAUTHENTICATED_SERVICES:
            try:
                self._auth.authenticate(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
            except HicacheError as e:
                return self._refusal(method.lstrip("/"), e)
        return wrapped

    def _refusal(self, label: str, exc: HicacheError) -> grpc.RpcMethodHandler:
        """A call refused on its headers (no or a wrong token), before its message is
        read: as a request-streaming handler, whose worker never waits for the message
        (a unary one waits for it on the worker: callers sending headers and never the
        message held every worker of the sync server)."""
        status, message = status_of(exc)

        def refuse(_requests: Any, context: grpc.ServicerContext) -> Any:
            if self._metrics is not None:
                self._metrics.observe(label, status.name, 0.0)
            context.abort(status, message)

        return grpc.stream_unary_rpc_method_handler(refuse)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        label = method.lstrip("/")
        service = label.split("/", 1)[0]
        auth = self._auth if self._auth.enabled and service not in UNAUTHENTICATED_SERVICES else None
        gated = service not in _SERVED_WHILE_STOPPING  # (a health Watch never ends)
        parse = _lenient(label, handler.request_deserializer)
        # A unary request is served as a one-message request stream, read by `_read`
        # (bounded by `message_timeout_s`): gRPC's own unary read waits for the message
        # on the worker thread with no bound but the caller's deadline.
        if handler.unary_unary is not None:
            unary = self._unary(label, auth, gated, handler.unary_unary)
            read = self._read

            def read_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return unary(read(label, requests, context), context)

            return grpc.stream_unary_rpc_method_handler(
                read_unary,
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = self._stream(label, auth, gated, handler.unary_stream)

            def read_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                yield from stream(self._read(label, requests, context), context)

            return grpc.stream_stream_rpc_method_handler(
                read_stream,
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        # Streaming requests (none in our services; server reflection's): authenticated and
        # measured the same way; a message that does not parse ends the call with
        # INVALID_ARGUMENT when the handler reaches it (an exception in gRPC's own
        # deserializer answered INTERNAL and could leave the call unfinished: a stop
        # then waited for it forever).
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(label, auth, gated, _checked_stream(handler.stream_stream)),
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(label, auth, gated, _checked_stream(handler.stream_unary)),
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(
        self, label: str, auth: Authenticator | None, gated: bool, inner: Callable[[Any, Any], Any]
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Any:
            with self._served(label, auth, gated, request, context):
                return inner(request, context)

        return behavior

    def _stream(
        self, label: str, auth: Authenticator | None, gated: bool,
        inner: Callable[[Any, Any], Iterator[Any]],
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._served(label, auth, gated, request, context):
                yield from inner(request, context)

        return behavior

    @contextlib.contextmanager
    def _served(self, label: str, auth: Authenticator | None, gated: bool, request: Any,
                context: grpc.ServicerContext) -> Iterator[None]:
        """Steps 0, 1, 3 and 4 around one call (for a stream: around all of its messages).
        `gated`: refused while the daemon stops, and waited for by `wait_idle`."""
        start = time.perf_counter()
        code = "OK"
        token = None
        if gated:
            with self._idle:
                self._active += 1
        try:
            if gated and self._stopping:
                raise Unavailable(_STOPPING)
            if auth is not None:  # first: an unauthenticated caller learns nothing more
                token = _authorize(auth, request, context)
            if isinstance(request, _Undecodable):
                raise InvalidArgument(request.message)
            yield
            code = _code_set(context) or code  # (a handler may answer a status itself)
        except GeneratorExit:  # a server stream its caller cancelled (or left)
            code = "CANCELLED"
            raise
        except grpc.RpcError:  # a request stream whose caller cancelled or let it expire
            code = "CANCELLED"  # (the call is over: nothing to answer, no bug to log)
            raise
        except Exception as exc:
            aborted = _code_set(context)
            if aborted is not None:  # the handler ended the call itself (context.abort)
                code = aborted
                raise
            status, message = op_status(exc, label)
            code = status.name
            context.abort(status, message)
        finally:
            if token is not None:
                reset_current_principal(token)
            if self._metrics is not None:
                self._metrics.observe(label, code, time.perf_counter() - start)
            if gated:
                with self._idle:
                    self._active -= 1
                    if self._stopping and not self._active:
                        self._idle.notify_all()


def _cancel(context: grpc.ServicerContext, code: grpc.StatusCode, why: str) -> None:
    """End the call with `code` and `why` as its message, through gRPC's own call object
    (the servicer context's `cancel` sends CANCELLED and no message); plainly cancelled if
    that is not there (another gRPC version)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], why)  # type: ignore[union-attr]
    except Exception:  # (AttributeError, TypeError: not the call object we know)
        context.cancel()


def _code_set(context: grpc.ServicerContext) -> str | None:
    """The status code the handler set on the call (`set_code`, `abort`), if any."""
    code_of = getattr(context, "code", None)  # (a test's stand-in context may lack it)
    set_code = code_of() if code_of is not None else None
    return None if set_code is None else str(set_code.name)


class _Undecodable:
    """A request body that did not parse: the handler answers INVALID_ARGUMENT (gRPC
    itself would answer INTERNAL for an exception in the deserializer)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _checked_stream(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`inner` over a request stream whose messages that did not parse raise
    InvalidArgument where the handler reads them."""

    def checked(messages: Iterator[Any]) -> Iterator[Any]:
        for message in messages:
            if isinstance(message, _Undecodable):
                raise InvalidArgument(message.message)
            yield message

    return lambda requests, context: inner(checked(requests), context)


def _lenient(label: str, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # protobuf's DecodeError, or whatever a parser raises
            return _Undecodable(f"{label}: the request is not a valid message ({e})")

    return lenient


def _authorize(auth: Authenticator, request: Any, context: grpc.ServicerContext) -> Any:
    principal = auth.authenticate(context.invocation_metadata())  # type: ignore[arg-type]
    principal.require_for(request)
    return set_current_principal(principal)


def op_status(exc: BaseException, where: str, site: str | None = None) -> tuple[grpc.StatusCode, str]:
    """`status_of` for a call or one op of a Batch, logging unexpected exceptions
    (throttled per `site`, default `where`, and exception type)."""
    status, message = status_of(exc)
    if status is grpc.StatusCode.INTERNAL:
        # A bug that every call of a method hits would log a traceback per call.
        _unexpected.error(f"{site or where}:{type(exc).__name__}", "%s failed unexpectedly", where,
                          exc_info=exc)
    return status, message
