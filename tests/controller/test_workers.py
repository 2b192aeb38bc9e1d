"""The worker every background job runs on: retries with backoff, a give-up handler, a
failure that never kills the thread, drain, and no job accepted once closed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from hicache.controller.workers import BreakerOpen, Job, Worker


@contextlib.contextmanager
def _running(retries: int, backoff_s: float) -> Iterator[tuple[Worker, list[int], list[BaseException]]]:
    """A started worker (closed after), a list each attempt appends to and the errors
    passed to give-up handlers."""
    worker = Worker("test", capacity=8, retries=retries, backoff_s=backoff_s)
    worker.start()
    try:
        yield worker, [], []
    finally:
        worker.close()


def test_a_failing_job_is_retried_then_given_up_and_the_worker_goes_on() -> None:
    with _running(retries=2, backoff_s=0.001) as (worker, attempts, gave_up):

        def flaky() -> None:
            attempts.append(1)
            raise RuntimeError("backend down")

        assert worker.submit(Job("flaky", flaky, gave_up.append))
        done: list[str] = []
        assert worker.submit(Job("next", lambda: done.append("ran"), lambda _e: None))
        assert worker.drain(5)
        assert len(attempts) == 3 and worker.failures == 3  # the first try and two retries
        assert len(gave_up) == 1 and "backend down" in str(gave_up[0])
        assert done == ["ran"] and worker.alive


def test_a_closed_worker_refuses_jobs_so_callers_clean_up_themselves() -> None:
    worker = Worker("test", capacity=8)
    worker.start()
    worker.close()
    assert not worker.alive
    assert not worker.submit(Job("late", lambda: None, lambda _e: None))
    assert worker.drain(0.1)  # nothing was counted as queued


def test_a_full_queue_refuses_jobs() -> None:
    worker = Worker("test", capacity=1)  # not started: the queue only fills
    assert worker.submit(Job("a", lambda: None, lambda _e: None))
    assert not worker.submit(Job("b", lambda: None, lambda _e: None))


def test_a_job_that_retrying_cannot_help_is_given_up_at_once() -> None:
    """With the L3 circuit breaker open a write fails at once, again and again: backing
    off with every queued job (holding its L2 pages) would drain the queue for hours."""
    with _running(retries=5, backoff_s=10.0) as (worker, attempts, gave_up):

        def refused() -> None:
            attempts.append(1)
            raise BreakerOpen("L3: circuit breaker open")

        for _ in range(3):
            assert worker.submit(Job("write", refused, gave_up.append))
        assert worker.drain(5)  # (with the 10 s backoff, one retry would time this out)
        assert len(attempts) == 3 and len(gave_up) == 3
        assert all(isinstance(e, BreakerOpen) for e in gave_up)


def test_a_probe_taken_and_given_back_is_there_for_the_next_call() -> None:
    """`take` hands out a half-open probe like `allow`; `give_back` returns it when the
    call did not run (another breaker refused it), unless the breaker moved meanwhile."""
    from hicache.controller.workers import CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0, clock=lambda: now[0])
    assert breaker.take() == (None, None)  # closed: always through
    breaker.failure()
    assert breaker.take() is None  # open, cooling down
    now[0] = 2.0
    token = breaker.take()
    assert token is not None and breaker.take() is None  # the probe is out
    breaker.give_back(token)
    assert breaker.allow()  # back, and handed to the next call
    now[0] = 4.0
    token = breaker.take()
    assert token is not None
    breaker.success()  # the breaker moved meanwhile: giving back changes nothing
    breaker.give_back(token)
    assert not breaker.is_open


def test_on_trip_listeners_run_once_each_time_the_breaker_opens() -> None:
    """The L3 store clears its existence cache there: a store that went down may come back
    without what it held."""
    from hicache.controller.workers import CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown_s=1.0, clock=lambda: now[0])
    trips: list[int] = []
    breaker.on_trip.append(lambda: trips.append(breaker.trips))
    breaker.failure()
    assert trips == []  # one failure: still closed
    breaker.failure()
    breaker.failure()  # open already: no second call
    assert trips == [1]
    now[0] = 2.0
    assert breaker.allow()  # the half-open probe ...
    breaker.failure()  # ... fails: still the same outage, no new trip
    assert trips == [1]
    breaker.success()  # the store is back
    breaker.failure()
    breaker.failure()  # a new outage
    assert trips == [1, 2] and breaker.trips == 2


def test_a_flood_of_give_ups_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """While the L3 breaker is open every insert's backup is given up at once: one warning
    each would flood the log at the insert rate. The give-ups are all counted still."""
    with _running(retries=3, backoff_s=0.001) as (worker, attempts, gave_up):

        def refused() -> None:
            attempts.append(1)
            raise BreakerOpen("redis: circuit breaker open")

        with caplog.at_level(logging.WARNING, logger="hicache.controller"):
            for i in range(200):
                while not worker.submit(Job(f"write-through-{i}", refused, gave_up.append)):
                    worker.drain(1)
            assert worker.drain(5)
    warnings = [r for r in caplog.records if "giving up" in r.getMessage()]
    assert len(warnings) == 1 and "write-through-0" in warnings[0].getMessage()
    assert len(gave_up) == 200 and worker.failures == 200 and len(attempts) == 200


def test_closing_waits_once_for_every_thread_not_five_seconds_each(tmp_path, monkeypatch) -> None:
    """Close used to give each of its threads 5 s in turn: with a hung store (every worker
    in an L3 call) a stop took 5 s a thread, past the bound the deploy files' stop
    timeouts are checked against. Now one deadline (`close_wait_s`) covers them all."""
    import threading
    import time

    from engine_sim import tiny_config

    from hicache.controller import controller as controller_mod
    from hicache.controller.workers import Job

    monkeypatch.setattr(controller_mod, "CLOSE_WAIT_S", 0.2)
    cfg = tiny_config(tmp_path, storage__timeout_s=0.3)
    ctl = controller_mod.build_controller(cfg, f"closewait{int(time.time() * 1000) % 100000}")
    hung = threading.Event()
    workers = (ctl.transfers.copy_worker, ctl.transfers.backup_worker,
               ctl.prefetcher.worker, ctl.prefetcher.l1_worker)
    try:
        for worker in workers:
            assert worker.submit(Job("hung L3 call", lambda: hung.wait(30), lambda _e: None))
        start = time.monotonic()
        ctl.close()
        took = time.monotonic() - start
    finally:
        hung.set()
    assert controller_mod.close_wait_s(cfg) == 0.5
    assert took < 3.0, took  # four threads x 5 s before
