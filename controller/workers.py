"""Threads, queues and the defences around L3: circuit breaker, existence cache, workers.

A worker thread takes jobs from a bounded queue; a job that raises is counted and retried
with backoff, never kills the thread. The circuit breaker stops the controller from
queuing or waiting on a backend that keeps failing; a probe closes it again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hicache.errors import BackendUnavailable
from hicache.logthrottle import ThrottledLog

log = logging.getLogger("hicache.controller")
CLOSE_WAIT_S = 5.0  # how long `Worker.close` waits for its thread unless given a deadline


class NoRetry(Exception):
    """Mixed into an exception that retrying cannot help right now (e.g. the L3 circuit
    breaker is open): a Worker gives the job up at once instead of backing off with it
    (which held each queued backup's L2 pages for ~6 s, one job after another)."""


class BreakerOpen(BackendUnavailable, NoRetry):
    """The L3 circuit breaker refused the call."""


class CircuitBreaker:
    """Closed (healthy) until `threshold` consecutive failures; then open for `cooldown_s`,
    during which `allow()` is False; then one probe decides (half-open)."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 name: str = "L3 circuit breaker", failures: str = "failures") -> None:
        """`name` and `failures` (what a failure is) word its log lines."""
        self.name = name
        self._failures_are = failures
        self._threshold = threshold
        self._cooldown = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._tripped_at: float | None = None  # when it opened (the half-open probes restamp `_opened_at`)
        self._mu = threading.Lock()
        self.trips = 0
        # Called (on the failing call's thread, the breaker's lock not held) when it opens.
        self.on_trip: list[Callable[[], None]] = []

    @property
    def is_open(self) -> bool:
        with self._mu:
            return self._opened_at is not None

    def take(self) -> tuple[float | None, float | None] | None:
        """`allow` that can be undone: None when refused, else a token for `give_back`
        (which returns a half-open probe taken by a call that then did not run)."""
        with self._mu:
            opened = self._opened_at
            if opened is None:
                return (None, None)
            if self._clock() - opened >= self._cooldown:
                self._opened_at = stamp = self._clock()
                return (opened, stamp)
            return None

    def give_back(self, token: tuple[float | None, float | None]) -> None:
        opened, stamp = token
        with self._mu:
            if stamp is not None and self._opened_at == stamp:  # (nothing happened since)
                self._opened_at = opened

    def allow(self) -> bool:
        """Whether a call may go to the backend now (one probe after the cooldown)."""
        return self.take() is not None

    def success(self) -> None:
        with self._mu:
            self._failures = 0
            tripped_at, self._tripped_at = self._tripped_at, None
            self._opened_at = None
        if tripped_at is not None:  # (the outage's end, once: an operator reads when)
            log.warning("%s closed after %.1f s open", self.name, self._clock() - tripped_at)

    def failure(self) -> None:
        with self._mu:
            self._failures += 1
            tripped = self._failures >= self._threshold and self._opened_at is None
            if tripped:
                self._opened_at = self._tripped_at = self._clock()
                self.trips += 1
                log.warning("%s open after %d %s", self.name, self._failures, self._failures_are)
        if tripped:
            for listener in self.on_trip:
                listener()


class ExistenceCache:
    """Keys known present in L3 (bounded LRU) and known absent (short TTL), so a request
    does not cost an existence round trip per page it already asked about."""

    def __init__(self, capacity: int = 1 << 18, negative_ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 present_ttl_s: float | None = None) -> None:
        # key -> when it was known present. With `present_ttl_s` (a store whose objects
        # expire), an entry older than that is asked again; without, it lasts until the
        # LRU lets it go.
        self._present: OrderedDict[str, float] = OrderedDict()
        self._present_ttl = present_ttl_s
        self._absent: dict[str, float] = {}
        self._capacity = capacity
        self._ttl = negative_ttl_s
        self._clock = clock
        self._mu = threading.Lock()

    def known_run(self, keys: list[str]) -> tuple[int, bool]:
        """(n, stop): the first n keys are known present; stop=True if keys[n] is known
        absent (no need to ask the backend)."""
        now = self._clock()
        with self._mu:
            present = self._present
            n = 0
            if self._present_ttl is None:
                for key in keys:
                    if key not in present:
                        break
                    n += 1
            else:
                oldest = now - self._present_ttl
                for key in keys:
                    if present.get(key, oldest) <= oldest:
                        break
                    n += 1
            for key in reversed(keys[:n]):  # (the head ends most recent, as in add_present)
                present.move_to_end(key)
            if n == len(keys):
                return n, False
            expiry = self._absent.get(keys[n])
            return n, expiry is not None and expiry > now

    def add_present(self, keys: list[str], keep_marked: set[str] | frozenset[str] = frozenset()) -> None:
        """`keys` known present. Those of `keep_marked` (a put found something there
        already: possibly the unreadable object a mark is about) stay absent while an
        absent mark on them lasts."""
        with self._mu:
            if keep_marked and self._absent:
                now = self._clock()
                held = {k for k in keep_marked if self._absent.get(k, 0.0) > now}
                if held:
                    keys = [k for k in keys if k not in held]
            present = self._present
            # Set operations and one update run in C: a cold 32K-token prompt adds 512
            # keys per member, which one Python step per key made cost ~0.4 ms.
            for key in present.keys() & keys:  # known already: taken out, to go in again
                del present[key]
            # Reversed (known keys too): a run's head ends most recent, so the cache lets go
            # of tails first (a lookup stops at the first key it has lost and asks the
            # store from there).
            present.update(dict.fromkeys(reversed(keys), self._clock()))
            if self._absent:
                for key in self._absent.keys() & keys:
                    del self._absent[key]
            while len(present) > self._capacity:
                self._present.popitem(last=False)

    def add_absent(self, key: str, ttl_s: float | None = None) -> None:
        """`key` known absent for `ttl_s` (default: the cache's negative TTL)."""
        with self._mu:
            self._absent[key] = self._clock() + (self._ttl if ttl_s is None else ttl_s)
            self._present.pop(key, None)
            if len(self._absent) > self._capacity:
                now = self._clock()
                self._absent = {k: t for k, t in self._absent.items() if t > now}

    def forget(self, keys: list[str]) -> None:
        with self._mu:
            for key in keys:
                self._present.pop(key, None)

    def clear(self) -> None:
        with self._mu:
            self._present.clear()
            self._absent.clear()


@dataclass
class Job:
    name: str
    run: Callable[[], None]
    on_give_up: Callable[[BaseException], None]
    attempts: int = 0


class Worker:
    """One thread draining a bounded queue of jobs. `submit` never blocks: a full queue
    is reported to the caller (who counts a dropped job)."""

    def __init__(self, name: str, capacity: int = 1024, retries: int = 3,
                 backoff_s: float = 0.05) -> None:
        self.name = name
        self._queue: queue.Queue[Job | None] = queue.Queue(capacity)
        self._retries = retries
        self._backoff = backoff_s
        self._thread = threading.Thread(target=self._loop, name=f"hicache-{name}", daemon=True)
        self._idle = threading.Condition()
        self._busy = 0
        self._closed = False
        self.failures = 0
        # One job given up per insert while L3 is down: a flood, logged throttled.
        self._warn = ThrottledLog(log)

    def start(self) -> None:
        self._thread.start()

    @property
    def closed(self) -> bool:
        with self._idle:
            return self._closed

    def submit(self, job: Job) -> bool:
        """False when the queue is full or the worker is closed (the job would never
        run): the caller gives up on it itself."""
        # Checked and queued under one lock: `close` marks the worker closed under it
        # before queueing its stop, so no accepted job can land behind the stop.
        with self._idle:
            if self._closed:
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            self._busy += 1
            return True

    def queued(self) -> int:
        """Jobs waiting for the worker (approximate: it may take one meanwhile)."""
        return self._queue.qsize()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted job finished; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, deadline: float | None = None) -> None:
        """Stop after the jobs queued so far; wait for that until `deadline` (a monotonic
        time; default 5 s from now)."""
        with self._idle:
            self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            if deadline is None:
                deadline = time.monotonic() + CLOSE_WAIT_S
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            while True:
                try:
                    job.run()
                    break
                except BaseException as e:
                    job.attempts += 1
                    self.failures += 1
                    if job.attempts > self._retries or isinstance(e, NoRetry):
                        self._warn.warning(f"give-up:{type(e).__name__}",
                                           "%s: giving up on %s after %d attempts: %s",
                                           self.name, job.name, job.attempts, e)
                        try:
                            job.on_give_up(e)
                        except Exception:
                            log.exception("%s: give-up handler of %s failed", self.name, job.name)
                        break
                    time.sleep(self._backoff * (2 ** (job.attempts - 1)))
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
