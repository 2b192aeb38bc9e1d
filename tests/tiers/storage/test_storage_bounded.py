"""`BoundedCaller`: `submit_started` returns once a worker runs the call, not merely
queued; calls cancelled by `close` fail with the typed error."""

from __future__ import annotations

import threading

import pytest

from hicache.errors import BackendUnavailable
from hicache.tiers.storage import bounded
from hicache.tiers.storage.bounded import BoundedCaller


def test_submit_started_returns_with_the_call_running(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a loaded machine may take longer than STARTED_WAIT_S to wake the worker; the call
    # still returns as soon as the worker runs it)
    monkeypatch.setattr(bounded, "STARTED_WAIT_S", 10.0)
    caller = BoundedCaller("test", timeout_s=30.0, workers=1)
    gate = threading.Event()
    try:
        caller.call(lambda: None)  # the worker now idles on the queue, as between calls
        future = caller.submit_started(gate.wait)
        # A worker took it. NOTE: after a plain submit it is still queued at this point
        # (the idle worker has yet to wake up), which is what the test tells apart.
        assert future.running()
        gate.set()
        assert caller.result(future) is True
    finally:
        gate.set()
        caller.close()


def test_submit_started_gives_up_waiting_when_every_worker_is_busy() -> None:
    caller = BoundedCaller("test", timeout_s=30.0, workers=1)
    gate = threading.Event()
    try:
        busy = caller.submit(gate.wait)
        queued = caller.submit_started(lambda: 7)  # waits STARTED_WAIT_S, not timeout_s
        assert not queued.running() and not queued.done()
        gate.set()
        assert caller.result(busy, 30.0) is True
        assert caller.result(queued, 30.0) == 7
    finally:
        gate.set()
        caller.close()


def test_a_call_cancelled_by_close_is_backend_unavailable() -> None:
    """`close` cancels queued calls: their callers get the typed error, not CancelledError."""
    caller = BoundedCaller("test", timeout_s=30.0, workers=1)
    gate = threading.Event()
    busy = caller.submit(gate.wait, 10)  # the only worker is busy ...
    queued = caller.submit(lambda: 7)  # ... so this one waits in the queue
    caller.close()
    gate.set()
    with pytest.raises(BackendUnavailable, match="closed"):
        caller.result(queued)
    assert caller.result(busy) is True
