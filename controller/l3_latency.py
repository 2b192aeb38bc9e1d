"""Latency of the controller's L3 calls, by operation and outcome: the one owner of the
histograms behind `hicache_l3_op_seconds`.

The prefetch and backup workers, the prober and gRPC threads all call L3 at once, so the
recorder keeps its series under one lock; a record is one bisect outside the lock and a few
integer increments inside it, nothing next to the I/O it measures. Readers take
`snapshot()`: frozen and consistent (every series read under the same lock hold).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from itertools import pairwise
from types import TracebackType

from hicache.controller.base import L3_OP_BUCKETS, L3Op, L3OpLatency, L3Outcome, L3Stats
from hicache.errors import BackendUnavailable


class _Series:
    __slots__ = ("counts", "sum_seconds")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * n_buckets
        self.sum_seconds = 0.0


class L3OpRecorder:
    """Fixed-bucket latency histograms of one backend's calls, keyed by (op, outcome).

    A value lands in the first bucket whose bound is >= it (Prometheus `le`), or in the
    last (+Inf) bucket past the largest bound. Counts only grow; there is no reset."""

    def __init__(self, backend: str, bounds: tuple[float, ...] = L3_OP_BUCKETS) -> None:
        if not bounds or any(b <= a for a, b in pairwise(bounds)):
            raise ValueError(f"bucket bounds must be non-empty and strictly ascending: {bounds}")
        self.backend = backend
        self.bounds = bounds
        self._series: dict[tuple[L3Op, L3Outcome], _Series] = {}
        self._mu = threading.Lock()

    def record(self, op: L3Op, outcome: L3Outcome, seconds: float) -> None:
        i = bisect_left(self.bounds, seconds)
        with self._mu:
            series = self._series.get((op, outcome))
            if series is None:
                series = self._series[(op, outcome)] = _Series(len(self.bounds) + 1)
            series.counts[i] += 1
            series.sum_seconds += seconds

    def timed(self, op: L3Op) -> _Timed:
        """`with recorder.timed(L3Op.GET): backend.get_into(...)`: records the call's wall
        time as OK, or by its exception (BackendUnavailable → UNAVAILABLE, other → ERROR),
        which propagates unchanged."""
        return _Timed(self, op)

    def snapshot(self, bytes_read: int = 0, bytes_written: int = 0, corrupt: int = 0,
                 corrupt_removed: int = 0, evicted: int = 0, evicted_pages: int = 0) -> L3Stats:
        with self._mu:
            ops = tuple(
                L3OpLatency(op, outcome, tuple(s.counts), s.sum_seconds)
                for (op, outcome), s in self._series.items()
            )
        ops = tuple(sorted(ops, key=lambda s: (s.op.value, s.outcome.value)))
        return L3Stats(self.backend, self.bounds, ops, bytes_read, bytes_written, corrupt,
                       corrupt_removed, evicted, evicted_pages)


class _Timed:
    __slots__ = ("_op", "_recorder", "_t0")

    def __init__(self, recorder: L3OpRecorder, op: L3Op) -> None:
        self._recorder = recorder
        self._op = op
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        seconds = time.perf_counter() - self._t0
        if exc_type is None:
            outcome = L3Outcome.OK
        elif issubclass(exc_type, BackendUnavailable):
            outcome = L3Outcome.UNAVAILABLE
        else:
            outcome = L3Outcome.ERROR
        self._recorder.record(self._op, outcome, seconds)
