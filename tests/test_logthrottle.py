"""ThrottledLog: a record per key per interval, the held-back ones counted into the next."""

from __future__ import annotations

import logging
import threading

import pytest

from hicache.logthrottle import ThrottledLog

LOGGER = "hicache.test.throttle"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_one_record_per_key_per_interval_and_the_held_back_are_counted_into_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    throttle = ThrottledLog(logging.getLogger(LOGGER), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert throttle.warning("a", "backup %d failed: %s", 1, "down")
        for i in range(2, 6):
            clock.now += 1.0
            assert not throttle.warning("a", "backup %d failed: %s", i, "down")
        assert throttle.warning("b", "other %s", "key")  # keys are independent
        clock.now = 110.0  # the interval since the first record has passed
        assert throttle.warning("a", "backup %d failed: %s", 6, "down")
        clock.now += 10.0
        assert throttle.warning("a", "backup %d failed: %s", 7, "down")  # nothing held back
    assert _messages(caplog) == [
        "backup 1 failed: down",
        "other key",
        "backup 6 failed: down (and 4 more like it in the last 10 s)",
        "backup 7 failed: down",
    ]


def test_a_literal_percent_in_a_message_without_arguments_survives_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    throttle = ThrottledLog(logging.getLogger(LOGGER), interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        throttle.warning("k", "disk 100% full")
        throttle.warning("k", "disk 100% full")
        clock.now += 2.0
        throttle.warning("k", "disk 100% full")
    assert _messages(caplog) == ["disk 100% full", "disk 100% full (and 1 more like it in the last 2 s)"]


def test_errors_keep_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    throttle = ThrottledLog(logging.getLogger(LOGGER))
    try:
        raise ValueError("boom")
    except ValueError as e:
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            throttle.error("k", "call failed", exc_info=e)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.exc_info is not None and record.exc_info[1] is not None


def test_a_disabled_level_is_neither_written_nor_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    throttle = ThrottledLog(logging.getLogger(LOGGER), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert not throttle.warning("k", "quiet")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert throttle.warning("k", "loud")  # the disabled one did not start an interval
    assert _messages(caplog) == ["loud"]


def test_keys_are_bounded_oldest_first() -> None:
    clock = _Clock()
    throttle = ThrottledLog(logging.getLogger(LOGGER), interval_s=10.0, clock=clock, max_keys=2)
    assert throttle.warning("a", "x") and throttle.warning("b", "x") and throttle.warning("c", "x")
    assert throttle.warning("a", "x")  # forgotten when c came: written again
    assert not throttle.warning("c", "x")


def test_threads_writing_one_key_write_it_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    throttle = ThrottledLog(logging.getLogger(LOGGER), interval_s=3600.0)
    written: list[bool] = []
    lock = threading.Lock()

    def flood() -> None:
        for _ in range(500):
            ok = throttle.warning("k", "flood")
            with lock:
                written.append(ok)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert written.count(True) == 1 and len(written) == 2000
    assert _messages(caplog) == ["flood"]
