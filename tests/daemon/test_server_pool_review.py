"""Review (session 29) of `hicache.server_pool.ServerPool` (89b0527, 755987c) and its use.

Found, and fixed (each was a strict xfail; the other tests pin behaviour found right):
- the idle count was a semaphore, which stops at 0: a task that found no idle thread and
  got none (the pool at `most`, or a thread that could not start) left it one too high
  when a busy thread took the task, for good; retiring threads used real counts, so
  these "phantom" idle threads piled up (20,000 trivial tasks on a ServerPool(4, 16):
  2,817 for 4 threads), and after a burst past `most` the pool never grew again, or a call
  waited behind a Watch stream with no thread started for it. The pool now counts idle
  threads and owed tasks exactly, under its lock;
- a retiring thread left the pool outside its lock: a call submitted between found no idle
  thread and no room below `most`;
- `Daemon.stop` left the pools' threads running (they hold their pool);
- an idle thread kept its last task's result (or the cancelled task it skipped);
- a read cancelled by a stop as its message came said "the message did not come".
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from hicache.auth import Authenticator
from hicache.interceptor import ServerInterceptor
from hicache.server_pool import ServerPool, submitted_at

from .daemonkit import TINY, Aborted, StandInContext, eventually

WAIT = 10.0  # (a bound nothing should reach; the machine is loaded)
_names = itertools.count()


@pytest.fixture
def make_pool() -> Iterator[Callable[..., ServerPool]]:
    """ServerPools whose started threads are all counted idle before the test submits; each shut down (gates released first by the tests' `finally`)."""
    made: list[ServerPool] = []

    def make(started: int, most: int, idle_s: float = 5.0) -> ServerPool:
        pool = ServerPool(started, most, f"rv{next(_names)}-pool", idle_s=idle_s)
        made.append(pool.start())
        _all_idle(pool, started)
        return pool

    yield make
    for pool in made:
        pool.shutdown(wait=False, cancel_futures=True)


def _all_idle(pool: ServerPool, n: int) -> None:
    assert eventually(lambda: pool._idle == n, WAIT), pool._idle


class _Holds:
    """Tasks that run until `release` (or WAIT), counting those running."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.running = threading.Semaphore(0)

    def __call__(self) -> bool:
        self.running.release()
        return self.gate.wait(WAIT)

    def started(self, n: int) -> bool:
        return all(self.running.acquire(timeout=WAIT) for _ in range(n))

    def release(self) -> None:
        self.gate.set()


# --------------------------------------------------------------------------- findings


def test_a_burst_past_most_leaves_the_pool_able_to_grow(make_pool: Callable[..., ServerPool]) -> None:
    pool = make_pool(2, 3, idle_s=0.1)
    burst = _Holds()
    try:
        held = [pool.submit(burst) for _ in range(3)]  # 2 started threads + 1 extra: `most`
        assert burst.started(3)
        late = pool.submit(int)  # queued: no thread idle, none may start
        burst.release()
        assert all(f.result(timeout=WAIT) for f in held) and late.result(timeout=WAIT) == 0
        assert eventually(lambda: pool.threads == 2, WAIT)  # (the extra one retired)
        # (2 threads, both idle, and 3 idle tokens: the semaphore never fell below 0)
    finally:
        burst.release()
    calls = _Holds()
    try:
        for _ in range(3):
            pool.submit(calls)
        # Two idle threads, three calls: the third needs a thread, started by its submit.
        assert pool.threads == 3, f"{pool.threads} threads for 3 calls ({pool._idle} idle)"
        assert calls.started(3)
    finally:
        calls.release()


def test_a_failed_thread_start_leaves_no_later_call_without_a_thread(
        make_pool: Callable[..., ServerPool], monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(1, 4, idle_s=0.1)
    watch = _Holds()  # the started thread, held for the test (a Watch stream: for ever)
    try:
        pool.submit(watch)
        assert watch.started(1)
        start = threading.Thread.start

        def cannot_start(self: threading.Thread) -> None:
            if self.name.startswith(pool.prefix):
                raise RuntimeError("can't start new thread")
            start(self)

        monkeypatch.setattr(threading.Thread, "start", cannot_start)
        queued = pool.submit(int)  # logged; waits in the queue
        monkeypatch.undo()
        later = pool.submit(int)  # starts a thread, which runs both
        assert queued.result(timeout=WAIT) == 0 and later.result(timeout=WAIT) == 0
        assert eventually(lambda: pool.threads == 1, WAIT)  # (that thread retired)
        probe = pool.submit(int)
        # No thread is idle (the started one is held): this call needs one started for it,
        # or it waits for as long as the Watch stream lasts.
        assert pool.threads == 2, f"no thread for the call ({pool._idle} counted idle, none idle)"
        assert probe.result(timeout=WAIT) == 0
    finally:
        watch.release()


def test_a_call_submitted_while_a_thread_retires_at_most_gets_a_thread(
        make_pool: Callable[..., ServerPool]) -> None:
    """At `most` threads, with the started one busy, calls come now and then around the
    extra thread's idle time: each finds it idle, retiring or gone, and must get a thread
    (a retiring thread used to take its idle token outside the pool's lock and leave
    `_threads` after: a call between found neither, and waited for the busy one)."""
    pool = make_pool(1, 2, idle_s=0.05)
    held = _Holds()
    try:
        pool.submit(held)  # the started thread: busy
        assert held.started(1)
        for i in range(40):
            assert pool.submit(int).result(timeout=WAIT / 2) == 0, f"call {i} got no thread"
            threading.Event().wait(0.03 + (i % 5) * 0.01)  # (around idle_s)
    finally:
        held.release()


class _Big:
    """Stands for what a task holds (a gRPC call's state, a reply)."""


@pytest.mark.parametrize("how", ["result", "cancelled"])
def test_an_idle_thread_keeps_nothing_of_its_last_task(
        make_pool: Callable[..., ServerPool], how: str) -> None:
    pool = make_pool(1, 1)
    if how == "result":
        f = pool.submit(_Big)
        ref = weakref.ref(f.result(timeout=WAIT))
        del f
    else:
        held = _Holds()
        busy = pool.submit(held)
        assert held.started(1)
        big = _Big()
        ref = weakref.ref(big)
        f = pool.submit(id, big)
        del big
        assert f.cancel()
        del f
        held.release()
        assert busy.result(timeout=WAIT)
        assert eventually(pool._queue.empty, WAIT)  # (the thread took the cancelled task)

    def freed() -> bool:
        gc.collect()
        return ref() is None

    assert eventually(freed, WAIT), "the idle thread still holds the task's object"


def test_a_stopped_daemon_leaves_no_server_threads(tmp_path: Path) -> None:
    from hicache.config import load_config
    from hicache.controller.controller import build_controller
    from hicache.endpoint import parse_address
    from hicache.server import Daemon

    before = set(threading.enumerate())
    cfg = load_config(None, TINY)
    core = build_controller(cfg, f"rv{os.getpid()}_{next(_names)}")
    daemon = Daemon(cfg, core, parse_address(f"unix://{tmp_path}/u.sock"))
    daemon.start()
    daemon.stop()
    del daemon, core

    def pool_threads() -> list[str]:
        gc.collect()
        return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("rpc_")]

    assert eventually(lambda: not pool_threads(), WAIT), f"{len(pool_threads())} left"


def test_a_read_cancelled_by_a_stop_says_the_daemon_stops() -> None:
    interceptor = ServerInterceptor(Authenticator(()), None, message_timeout_s=30.0)
    context = StandInContext()

    def messages() -> Iterator[Any]:
        interceptor.begin_stop()  # (the SIGTERM, while the message was on its way)
        yield "request"

    with pytest.raises(Aborted) as info:
        interceptor._read("svc/Method", messages(), context)
    # (UNAVAILABLE, the contract's code for a daemon shutting down: a session-29 review)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and context.cancelled
    assert "shutting down" in info.value.details, info.value.details


# --------------------------------------------------------------------------- pinned (found right)


def test_two_calls_and_one_idle_thread_start_one_thread(make_pool: Callable[..., ServerPool]) -> None:
    pool = make_pool(1, 4)
    calls = _Holds()
    try:
        pool.submit(calls)
        pool.submit(calls)
        assert pool.threads == 2  # (one token taken, one thread started)
        assert calls.started(2)
    finally:
        calls.release()


def test_a_task_raising_base_exception_fails_its_future_and_the_thread_serves_on(
        make_pool: Callable[..., ServerPool]) -> None:
    pool = make_pool(1, 1)

    def leave() -> None:
        raise SystemExit(3)

    f = pool.submit(leave)
    assert isinstance(f.exception(timeout=WAIT), SystemExit)
    # The same (only) thread serves on; each task sees its own submit time, none is left.
    for _ in range(3):
        seen = pool.submit(lambda: (submitted_at(), threading.current_thread().name))
        at, name = seen.result(timeout=WAIT)
        assert at is not None and name == f"{pool.prefix}_1"
    assert pool.threads == 1
    assert submitted_at() is None  # (not a pool thread)
    assert futures.ThreadPoolExecutor(1).submit(submitted_at).result(timeout=WAIT) is None


def test_shutdown_cancels_the_queued_calls_refuses_new_ones_and_ends_every_thread(
        make_pool: Callable[..., ServerPool]) -> None:
    pool = make_pool(1, 2, idle_s=60)
    held = _Holds()
    running = [pool.submit(held) for _ in range(2)]
    assert held.started(2) and pool.threads == 2
    queued = [pool.submit(int) for _ in range(3)]
    threads = [t for t in threading.enumerate() if t.name.startswith(pool.prefix)]
    pool.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)
    held.release()
    assert all(f.result(timeout=WAIT) for f in running)
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads) and pool.threads == 0
