"""Bounded calls into client libraries that have no timeout of their own.

`BoundedCaller.call(fn, ...)` runs `fn` on a small worker pool and waits at most
`timeout_s`. A call that does not answer in time raises `BackendTimedOut` (a
`BackendUnavailable` carrying the call's future, for callers whose buffers it may still
write); its thread runs on (a C call cannot be interrupted), is counted in `stuck`, and
while any call is stuck every new call fails fast instead of piling more threads onto a
dead service. When the stuck call finally returns, calls go through again.

`close(wait_s)` cancels what has not started and waits (bounded) for what runs: a stuck
call may still write into the buffers it was given, so the caller learns whether any
still runs before it frees them. A fanned-out call (`map`) under way ends as soon as the
caller closes, not after its whole timeout.

Measured here: with the Mooncake master killed, client calls block 4-13 s before failing,
and `setup()` against a missing master blocks ~90 s; all of them release the GIL.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

from hicache.errors import BackendTimedOut, BackendUnavailable

_P = ParamSpec("_P")
_R = TypeVar("_R")

# How long `submit_started` waits for a worker: an idle one starts within a millisecond; a
# longer wait means all are busy, and waiting more would only delay the caller's own work.
STARTED_WAIT_S = 0.05
# How often a fanned-out call waiting on its parts looks whether the caller was closed
# (cancelled parts do not wake `concurrent.futures.wait`).
CLOSE_POLL_S = 0.05


class BoundedCaller:
    def __init__(self, name: str, timeout_s: float, workers: int = 4) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"l3-{name}")
        self._lock = threading.Lock()
        self._stuck = 0
        self._stuck_since = 0.0
        self._running: set[cf.Future[Any]] = set()  # submitted and not done (under `_lock`)
        self._closed = threading.Event()

    @property
    def stuck(self) -> int:
        with self._lock:
            return self._stuck

    @property
    def running(self) -> int:
        """Calls submitted and not done (stuck ones included)."""
        with self._lock:
            return len(self._running)

    def call(
        self,
        fn: Callable[_P, _R],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _R:
        return self.call_within(self.timeout_s, fn, *args, **kwargs)

    def call_within(
        self, timeout_s: float, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> _R:
        """Run `fn(*args)` and return its result, or raise `BackendUnavailable` after
        `timeout_s`. Exceptions of `fn` propagate unchanged."""
        return self.result(self.submit(fn, *args, **kwargs), timeout_s)

    def submit(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> cf.Future[_R]:
        """Start `fn(*args)` on the pool and return at once; collect it with `result`, so
        that the caller can work while the call waits on the store. Raises
        `BackendUnavailable` while a call is stuck, or once closed."""
        with self._lock:
            if self._stuck:
                waited = time.monotonic() - self._stuck_since
                raise BackendUnavailable(
                    f"{self.name}: a call has not answered for {waited:.1f} s; "
                    "failing fast until it does"
                )
        try:
            future = self._pool.submit(fn, *args, **kwargs)
        except RuntimeError as e:  # pool shut down
            raise BackendUnavailable(f"{self.name}: closed") from e
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._finished)  # (at once if it is done already)
        return future

    def _finished(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._running.discard(future)

    def submit_started(
        self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> cf.Future[_R]:
        """`submit`, returning once a worker is about to call `fn`, or after at most
        `STARTED_WAIT_S` when every worker is busy (the call then just waits its turn).

        NOTE: for overlapping a client call that releases the GIL with Python work in the
        caller. After a plain `submit` the worker first needs the GIL to enter the call,
        and a caller busy in Python keeps it for up to the interpreter's switch interval
        (5 ms): the call would start only after the caller's work, not beside it."""
        started = threading.Event()

        def run() -> _R:
            started.set()
            return fn(*args, **kwargs)

        future = self.submit(run)
        started.wait(min(self.timeout_s, STARTED_WAIT_S))
        return future

    def result(self, future: cf.Future[_R], timeout_s: float | None = None) -> _R:
        """The result of a `submit`ted call, waiting at most `timeout_s` (default: the
        caller's); a late call raises `BackendUnavailable` and counts as stuck."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except cf.CancelledError:  # `close` cancelled it before it ran
            raise BackendUnavailable(f"{self.name}: closed") from None
        except cf.TimeoutError:
            self._stick([future])
            raise BackendTimedOut(
                f"{self.name}: no answer within {timeout:g} s (storage.timeout_s)", [future]
            ) from None

    def map(self, fn: Callable[..., _R], arg_tuples: Sequence[tuple[Any, ...]],
            timeout_s: float | None = None) -> list[_R]:
        """Run ``fn(*args)`` for every tuple at once on the pool; their results in order,
        or `BackendUnavailable` when they are not all done within `timeout_s` (default:
        the caller's; the late ones count as stuck, like a late `call`; none left: nothing
        runs). The first exception of `fn` propagates (after every part finished, so no
        part still runs when this returns)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise BackendTimedOut(f"{self.name}: no answer within {self.timeout_s:g} s (storage.timeout_s)", [])
        if len(arg_tuples) == 1:
            return [self.call_within(timeout, fn, *arg_tuples[0])]
        futures = [self.submit(fn, *args) for args in arg_tuples]
        deadline = time.monotonic() + timeout
        late = set(futures)
        while late and not self._closed.is_set() and (left := deadline - time.monotonic()) > 0:
            _, late = cf.wait(late, timeout=min(left, CLOSE_POLL_S))
        late = {f for f in late if not f.done()}
        if self._closed.is_set() and (late or any(f.cancelled() for f in futures)):
            # Closed meanwhile: parts that had not started were cancelled; the others
            # may still write into the caller's buffers, which stay theirs until done.
            if not late:
                raise BackendUnavailable(f"{self.name}: closed")
            self._stick(list(late))
            raise BackendTimedOut(f"{self.name}: closed while the call ran", list(late))
        if late:
            self._stick(list(late))
            raise BackendTimedOut(
                f"{self.name}: no answer within {self.timeout_s:g} s (storage.timeout_s)", list(late)
            )
        return [future.result() for future in futures]

    def _stick(self, late: list[cf.Future[Any]]) -> None:
        with self._lock:
            if not self._stuck:
                self._stuck_since = time.monotonic()
            self._stuck += len(late)
        for future in late:
            future.add_done_callback(self._unstick)

    def _unstick(self, _: cf.Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until no call runs (stuck ones included); whether none
        does."""
        with self._lock:
            running = list(self._running)
        if not running:
            return True
        _, left = cf.wait(running, timeout=max(0.0, timeout_s))
        return not left

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop accepting calls: those not started are cancelled; those running (stuck
        ones included) are waited for, at most `wait_s`. Whether none still runs (False:
        one may still write into the buffers it was given)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return self.wait_idle(wait_s)
