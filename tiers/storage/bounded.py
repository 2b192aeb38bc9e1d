"""Bounded calls into client libraries that have no timeout of their own.

`BoundedCaller.call(fn, ...)` runs `fn` on a small worker pool and waits at most
`timeout_s`. A call that does not answer in time raises `BackendUnavailable`; its thread runs
on (a C call cannot be interrupted), is counted in `stuck`, and while any call is stuck every
new call fails fast instead of piling more threads onto a dead service. When the stuck call
finally returns, calls go through again.

Measured here: with the Mooncake master killed, client calls block 4-13 s before failing,
and `setup()` against a missing master blocks ~90 s; all of them release the GIL.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from hicache.errors import BackendUnavailable

_P = ParamSpec("_P")
_R = TypeVar("_R")


class BoundedCaller:
    def __init__(self, name: str, timeout_s: float, workers: int = 4) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"l3-{name}")
        self._lock = threading.Lock()
        self._stuck = 0
        self._stuck_since = 0.0

    @property
    def stuck(self) -> int:
        with self._lock:
            return self._stuck

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
        try:
            return future.result(timeout=timeout_s)
        except cf.TimeoutError:
            with self._lock:
                if not self._stuck:
                    self._stuck_since = time.monotonic()
                self._stuck += 1
            future.add_done_callback(self._unstick)
            raise BackendUnavailable(
                f"{self.name}: no answer within {timeout_s:g} s (storage.timeout_s)"
            ) from None

    def _unstick(self, _: cf.Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    def close(self) -> None:
        """Stop accepting calls; does not wait for stuck ones."""
        self._pool.shutdown(wait=False, cancel_futures=True)
