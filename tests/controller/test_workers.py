"""The worker every background job runs on: retries with backoff, a give-up handler, a
failure that never kills the thread, drain, and no job accepted once closed."""

from __future__ import annotations

from hicache.controller.workers import Job, Worker


def test_a_failing_job_is_retried_then_given_up_and_the_worker_goes_on() -> None:
    worker = Worker("test", capacity=8, retries=2, backoff_s=0.001)
    worker.start()
    try:
        attempts: list[int] = []
        gave_up: list[BaseException] = []

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
    finally:
        worker.close()


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
    from hicache.controller.workers import BreakerOpen

    worker = Worker("test", capacity=8, retries=5, backoff_s=10.0)
    worker.start()
    try:
        attempts: list[int] = []
        gave_up: list[BaseException] = []

        def refused() -> None:
            attempts.append(1)
            raise BreakerOpen("L3: circuit breaker open")

        for _ in range(3):
            assert worker.submit(Job("write", refused, gave_up.append))
        assert worker.drain(5)  # (with the 10 s backoff, one retry would time this out)
        assert len(attempts) == 3 and len(gave_up) == 3
        assert all(isinstance(e, BreakerOpen) for e in gave_up)
    finally:
        worker.close()
