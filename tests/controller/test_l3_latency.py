"""L3 call latency: the recorder's buckets and outcomes, and the controller timing its real
calls to the file backend (puts on backup, exists on lookup, gets on prefetch, probes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_sim import Engine, prefetch_back, tiny_config, toks

from hicache.controller.base import (
    L3_OP_BUCKETS,
    L3Op,
    L3OpLatency,
    L3Outcome,
    L3Stats,
)
from hicache.controller.controller import build_controller
from hicache.controller.l3_latency import L3OpRecorder
from hicache.errors import BackendUnavailable

OK, UNAVAILABLE, ERROR = L3Outcome.OK, L3Outcome.UNAVAILABLE, L3Outcome.ERROR
BOUNDS = (0.001, 0.01, 0.1)


def series(stats: L3Stats, op: L3Op, outcome: L3Outcome = OK) -> L3OpLatency | None:
    return next((s for s in stats.ops if (s.op, s.outcome) == (op, outcome)), None)


def count(stats: L3Stats, op: L3Op, outcome: L3Outcome = OK) -> int:
    s = series(stats, op, outcome)
    return 0 if s is None else s.count


# ---------------------------------------------------------------------------- the recorder


def test_values_land_in_the_first_bucket_whose_bound_is_not_below_them() -> None:
    rec = L3OpRecorder("file", BOUNDS)
    for seconds in (0.0, 0.0005, 0.001, 0.0011, 0.01, 0.05, 0.1, 0.2, 30.0):
        rec.record(L3Op.GET, OK, seconds)
    (s,) = rec.snapshot().ops
    # le=0.001: 0, 0.0005, 0.001 (a bound is inclusive); le=0.01: 0.0011, 0.01;
    # le=0.1: 0.05, 0.1; +Inf: 0.2, 30.
    assert s.bucket_counts == (3, 2, 2, 2)
    assert s.cumulative_counts == (3, 5, 7, 9)
    assert s.count == 9
    assert s.sum_seconds == pytest.approx(0.0005 + 0.001 + 0.0011 + 0.01 + 0.05 + 0.1 + 0.2 + 30.0)
    assert s.mean_seconds == pytest.approx(s.sum_seconds / 9)


def test_series_are_kept_apart_by_op_and_outcome_and_sorted_in_the_snapshot() -> None:
    rec = L3OpRecorder("redis", BOUNDS)
    rec.record(L3Op.PUT, UNAVAILABLE, 2.0)
    rec.record(L3Op.GET, OK, 0.002)
    rec.record(L3Op.GET, OK, 0.003)
    snap = rec.snapshot(bytes_read=10, bytes_written=20)
    assert snap.backend == "redis" and snap.bounds == BOUNDS
    assert (snap.bytes_read, snap.bytes_written) == (10, 20)
    assert [(s.op, s.outcome, s.bucket_counts) for s in snap.ops] == [
        (L3Op.GET, OK, (0, 2, 0, 0)),
        (L3Op.PUT, UNAVAILABLE, (0, 0, 0, 1)),
    ]
    assert L3OpRecorder("none").snapshot().ops == ()


def test_timed_records_the_outcome_from_the_exception_and_lets_it_through() -> None:
    rec = L3OpRecorder("file")
    with rec.timed(L3Op.EXISTS):
        time.sleep(0.002)
    with pytest.raises(BackendUnavailable), rec.timed(L3Op.GET):
        raise BackendUnavailable("down")
    with pytest.raises(KeyError), rec.timed(L3Op.GET):
        raise KeyError("bug")
    snap = rec.snapshot()
    assert [(s.op, s.outcome, s.count) for s in snap.ops] == [
        (L3Op.EXISTS, OK, 1), (L3Op.GET, ERROR, 1), (L3Op.GET, UNAVAILABLE, 1),
    ]
    exists = series(snap, L3Op.EXISTS)
    assert exists is not None and exists.sum_seconds >= 0.002
    assert exists.bucket_counts[: L3_OP_BUCKETS.index(1e-3) + 1] == (0,) * 5  # >= 2 ms


def test_default_buckets_span_50us_to_10s() -> None:
    assert L3_OP_BUCKETS[0] == 50e-6 and L3_OP_BUCKETS[-1] == 10.0
    assert list(L3_OP_BUCKETS) == sorted(set(L3_OP_BUCKETS))
    with pytest.raises(ValueError, match="ascending"):
        L3OpRecorder("file", (0.1, 0.1))


def test_concurrent_records_are_all_counted() -> None:
    rec = L3OpRecorder("file", BOUNDS)
    threads, per_thread = 8, 5_000
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for k in range(per_thread):
            rec.record(L3Op.GET if i % 2 else L3Op.PUT, OK, (k % 4) * 0.004)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    snap = rec.snapshot()
    for op in (L3Op.GET, L3Op.PUT):
        s = series(snap, op)
        assert s is not None
        # k % 4 -> 0, 4 ms, 8 ms, 12 ms: buckets le=1ms, le=10ms, le=10ms, le=100ms
        n = threads // 2 * per_thread
        assert s.bucket_counts == (n // 4, n // 2, n // 4, 0)
        assert s.sum_seconds == pytest.approx(threads // 2 * per_thread / 4 * 0.024)


# ---------------------------------------------------------------------------- the controller


@pytest.fixture
def ctl(tmp_path):
    cfg = tiny_config(tmp_path, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    c = build_controller(cfg, f"lat{int(time.time() * 1000) % 100000}")
    yield c
    c.check_integrity()
    c.close()


def test_backup_lookup_prefetch_and_probe_are_timed_against_the_file_backend(ctl) -> None:
    assert ctl.stats().l3 == (ctl.l3.stats(),)
    before = ctl.stats().l3[0]
    assert before.backend == "file" and before.ops == () and before.bytes_written == 0

    eng = Engine(ctl)
    tokens = toks(np.arange(0, 6 * 4))
    eng.request_then_only_in_l3(tokens)  # L1 -> L2 -> L3 (write through): put
    assert prefetch_back(ctl, tokens).storage_tokens == 24  # exists, then get
    assert ctl.health(deep=True)[0].healthy

    (l3,) = ctl.stats().l3
    assert count(l3, L3Op.PUT) >= 1
    assert count(l3, L3Op.EXISTS) >= 1
    assert count(l3, L3Op.GET) >= 1
    assert count(l3, L3Op.PROBE_DEEP) == 1
    assert all(s.outcome is OK for s in l3.ops)
    for s in l3.ops:
        assert s.cumulative_counts[-1] == s.count and 0 < s.sum_seconds < 10 * s.count
    page_object_bytes = ctl.host.object_view("full", 0).nbytes
    assert l3.bytes_written == 6 * page_object_bytes
    assert l3.bytes_read == 6 * page_object_bytes


def test_failed_calls_are_timed_by_outcome(ctl, monkeypatch) -> None:
    members = ctl.cfg.model.members
    ids = np.array([0])

    def down(keys, buffers):
        raise BackendUnavailable("file: disk full")

    monkeypatch.setattr(ctl.l3.backend, "put_from", down)
    with pytest.raises(BackendUnavailable):
        ctl.l3.write("", [b"\x01" * 16], members, ids)

    def broken(keys, buffers):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ctl.l3.backend, "get_into", broken)
    with pytest.raises(RuntimeError):
        ctl.l3.read("", [b"\x01" * 16], members, ids)

    (l3,) = ctl.stats().l3
    assert count(l3, L3Op.PUT, UNAVAILABLE) == 1
    assert count(l3, L3Op.GET, ERROR) == 1
    assert count(l3, L3Op.PUT) == count(l3, L3Op.GET) == 0
