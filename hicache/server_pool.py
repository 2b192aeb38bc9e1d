"""The gRPC server's thread pool: some threads started at once, more as calls need them.

gRPC's sync server runs each call on a thread of the pool it is given, from the moment the
call arrives: a call whose request message is slow to come (or never does, until
`server.message_timeout_s`) holds its thread meanwhile, and calls that come then must still
find one. So `ServerPool`:
- starts `started` threads at once (`start`): a limit on threads or memory (`ulimit -u`,
  `-v`, a pids cgroup) refuses the daemon's start rather than, reached under load, leave
  it alive and answering nothing;
- starts another thread for a call when none is idle, up to `most`; one it cannot start
  (such a limit) leaves the call queued for the running ones, logged, instead of raising
  into gRPC's serving thread (an exception there ended that thread);
- retires the threads past `started` once idle for `idle_s`, or as they finish a task
  while `started` others are idle (under steady traffic every thread gets a task within
  `idle_s`), so that a burst's threads do not keep, for the daemon's life, what other
  threads (the metrics exporter's, a reload's) would need under such a limit;
- records when each call was handed over (`submitted_at`), which is when it arrived: the
  message timeout counts from there, not from when a thread was free to read it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from hicache.errors import FailedPrecondition
from hicache.logthrottle import ThrottledLog

log = logging.getLogger("hicache.server")
_no_thread = ThrottledLog(log)

IDLE_S = 5.0  # how long a thread past the started ones waits for work before it ends

_task = threading.local()  # .at: when the task this thread runs was submitted

_Task = tuple["futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any], float]


def submitted_at() -> float | None:
    """The `time.monotonic()` at which the task this thread runs was submitted to a
    `ServerPool` (None on any other thread)."""
    return getattr(_task, "at", None)


class ServerPool(futures.Executor):
    def __init__(self, started: int, most: int, prefix: str, idle_s: float = IDLE_S) -> None:
        self.started = started
        self.most = max(started, most)
        self.prefix = prefix
        self.idle_s = idle_s
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Under `_lock`, with I the threads not running a task and Q the tasks queued:
        # `_idle` - `_owed` == I - Q, and never both above 0. `_idle`: idle threads no
        # queued task has claimed (one may retire); `_owed`: queued tasks no thread was
        # idle or started for (the next thread to finish one takes them, staying busy).
        self._idle = 0
        self._owed = 0
        self._threads: set[threading.Thread] = set()
        self._serial = 0
        self._serving = False
        self._shutdown = False

    @property
    def threads(self) -> int:
        """Threads running now (idle or not)."""
        with self._lock:
            return len(self._threads)

    def start(self) -> ServerPool:
        """Start the first `started` threads; FailedPrecondition naming the limit when
        they cannot all start."""
        with self._lock:
            try:
                for _ in range(self.started):
                    self._start_thread(lasting=True)
                    self._idle += 1
            except RuntimeError as e:  # "can't start new thread"
                self._shutdown = True
                self._queue.put(None)
                raise FailedPrecondition(
                    f"cannot start the server's {self.started} {self.prefix} threads ({e}): a "
                    "limit on threads or memory (ulimit -u, -v; a pids cgroup)") from None
            self._serving = True
        return self

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, fn, args, kwargs, time.monotonic()))
            if self._idle:
                self._idle -= 1  # (an idle thread takes it)
            elif not self._started_for_task():
                self._owed += 1  # (a busy thread takes it once done)
        return future

    def _started_for_task(self) -> bool:
        """(Under `_lock`.) Start a thread for a task just queued, if `most` allows and
        the thread starts."""
        if len(self._threads) >= self.most:
            return False
        try:
            self._start_thread(lasting=not self._serving)
        except RuntimeError as e:
            _no_thread.warning(f"no-thread:{self.prefix}", "could not start another %s thread (%s; %d "
                               "running): calls wait for a free one", self.prefix, e,
                               len(self._threads))
            return False
        return True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
        self._queue.put(None)  # (each thread passes it on as it ends)
        if wait:
            for thread in threads:
                thread.join()

    def _start_thread(self, lasting: bool) -> None:
        """(Under `_lock`.) `lasting`: one of the started threads, which never retire."""
        self._serial += 1
        thread = threading.Thread(target=self._work, args=(lasting,),
                                  name=f"{self.prefix}_{self._serial}", daemon=True)
        thread.start()
        self._threads.add(thread)

    def _work(self, lasting: bool) -> None:
        timeout = None if lasting else self.idle_s
        me = threading.current_thread()
        while True:
            try:
                task = self._queue.get(timeout=timeout)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # (else a task queued meanwhile is for this thread)
                        self._idle -= 1
                        self._threads.discard(me)
                        return
                continue
            if task is None:
                self._queue.put(None)
                with self._lock:
                    self._threads.discard(me)
                return
            future, fn, args, kwargs, at = task
            del task
            if future.set_running_or_notify_cancel():
                _task.at = at
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:
                    future.set_exception(e)
                else:
                    future.set_result(result)
                    del result
                finally:
                    _task.at = None
            del future, fn, args, kwargs  # (an idle thread keeps nothing of its last task)
            with self._lock:
                if self._owed:
                    self._owed -= 1
                elif not lasting and self._idle >= self.started:  # (enough are idle)
                    self._threads.discard(me)
                    return
                else:
                    self._idle += 1
