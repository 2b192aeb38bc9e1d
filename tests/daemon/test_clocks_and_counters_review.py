"""Review: time, clocks, deadlines and counters over a long life.

Real daemons (`hicache serve` subprocesses) and real SIGSTOP/SIGCONT of real processes:
an engine stalled past its lease, a daemon stalled past its clients' deadlines and past
the engines' leases; timeouts at their extremes (a lease at the uint32 maximum, a client
deadline of `inf`, `0`, `nan`); and where the code reads the wall clock at all.
"""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from services import freeze

from hicache.config import MAX_LEASE_MS, UINT32_MAX
from hicache.errors import HicacheError, InvalidArgument, NoAnswer, NotFound

from .daemonkit import Daemon, eventually, free_port, pool, tokens

REPO = Path(__file__).resolve().parents[2]


def _stopped(pid: int, seconds: float) -> None:
    """SIGSTOP `pid` for `seconds`, then SIGCONT (always continued)."""
    freeze(pid)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------------------------------
# BUG: a stall of the daemon itself expires every healthy engine's lease at once.


def test_daemon_stall_longer_than_lease_keeps_live_engines(
        make_daemon: Callable[..., Daemon]) -> None:
    # The engine is alive and heartbeating the whole time (its heartbeat is in flight
    # while the daemon is stopped: a 30 s deadline); the daemon is what did not run.
    d = make_daemon("server.lease_ms=1500")
    assert d.proc is not None
    with d.client(timeout_s=30.0) as c:
        c.attach(map_pools=False)
        m = c.match(tokens(128, start=1), lock=True, allocate_tokens=128)
        assert c.heartbeat().locks == 1
        _stopped(d.proc.pid, 4.5)  # 3x the lease
        # Time for the queued heartbeat and the next ones to be served.
        time.sleep(1.5)
        expired = c.stats().counters["expired_leases"]
        detached = c.detached
        try:
            c.release(lock_id=m.lock_id)
            released: str = "ok"
        except NotFound as e:
            released = str(e)
        # Expected: the daemon's own absence is not the engine's; the engine keeps its
        # lease (at least one lease period after the daemon resumes to heartbeat).
        assert (expired, detached, released) == (0, None, "ok")
        c.release(allocation_id=m.allocation_id)


# ---------------------------------------------------------------------------------------
# An engine stalled longer than its lease, then continued: clear errors, nothing leaked.

_ENGINE = r"""
import json, sys, time
import numpy as np
from hicache.client import Client

def toks(n, start=1):
    return np.arange(start, start + n, dtype="<u4").tobytes()

calls = []
with Client(sys.argv[1], timeout_s=15.0,
            on_detached=lambda e: calls.append(type(e).__name__)) as c:
    c.attach(map_pools=False)
    m = c.match(toks(128), lock=True, allocate_tokens=128)
    print("ready", flush=True)
    sys.stdin.readline()  # stopped, continued, then told to go on
    out = {}
    try:
        c.insert(toks(128), lock_id=m.lock_id, allocation_id=m.allocation_id)
        out["insert"] = "ok"
    except Exception as e:
        out["insert"] = type(e).__name__ + ": " + str(e)
    t0 = time.monotonic()
    while (c.detached is None or not calls) and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    out["detached"] = type(c.detached).__name__ if c.detached else None
    out["callbacks"] = calls
    c.attach(map_pools=False)
    m2 = c.match(toks(128), lock=True, allocate_tokens=128)
    out["again"] = bool(m2.lock_id and m2.allocation_id)
    c.release(lock_id=m2.lock_id)
    c.release(allocation_id=m2.allocation_id)
    print(json.dumps(out), flush=True)
"""


def test_engine_stalled_past_its_lease_gets_clear_errors(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    d = make_daemon("server.lease_ms=1000")
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE)
    engine = subprocess.Popen([sys.executable, str(script), d.target], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert engine.stdout is not None and engine.stdin is not None
        assert engine.stdout.readline().strip() == "ready"
        with d.client() as c:
            assert pool(c, "device") == (2, 2)  # the allocation's 2 pages, locked
            freeze(engine.pid)
            try:
                # Its lease lapses meanwhile; the daemon takes everything back.
                assert eventually(lambda: c.stats().counters["expired_leases"] == 1, 15.0)
                assert pool(c, "device") == (0, 0)
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            engine.stdin.write("go\n")
            engine.stdin.flush()
            out = json.loads(engine.stdout.readline())
            assert engine.wait(timeout=30) == 0
            # The stalled engine's next call says what happened and what to do; its
            # heartbeat thread reports the detach once; a new attach works.
            assert out["insert"].startswith("NotFound") and "lease expired" in out["insert"]
            assert "Attach again" in out["insert"]
            assert out["detached"] == "NotFound" and out["callbacks"] == ["NotFound"]
            assert out["again"] is True
            assert pool(c, "device") == (0, 0)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


# ---------------------------------------------------------------------------------------
# A daemon stalled past its clients' deadlines (not past the lease): nothing leaks.


def test_daemon_stalled_past_deadlines_leaks_no_handles_over_tcp(
        make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon(listen=f"127.0.0.1:{free_port()}")
    assert d.proc is not None
    with d.client(timeout_s=1.0, retries=0) as c:
        c.attach(map_pools=False)
        freeze(d.proc.pid)
        try:
            with pytest.raises(NoAnswer):
                c.match(tokens(128, start=10_000), lock=True, allocate_tokens=128)
            with pytest.raises(NoAnswer):  # noqa: SIM117
                with c.matched(tokens(128, start=20_000), allocate_tokens=128):
                    pass
            time.sleep(1.0)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The daemon serves both late calls (their gRPC deadline is the wait + 10 s);
        # the replies nobody waited for are owed releases, made before the next call.
        assert eventually(lambda: len(c._owed) == 2, 10.0)
        info = c.heartbeat()
        assert (info.locks, info.allocations) == (0, 0)
        assert pool(c, "device") == (0, 0)


# ---------------------------------------------------------------------------------------
# Client deadlines at their extremes.


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, -1.0], ids=["inf", "nan", "negative"])
def test_client_deadline_extremes_are_refused_or_work(daemon: Daemon, timeout_s: float) -> None:
    try:
        c = daemon.client(timeout_s=timeout_s)
    except InvalidArgument:
        return  # refused where it is set: fine
    with c:
        t0 = time.monotonic()
        try:
            c.stats()
        except HicacheError as e:
            pytest.fail(f"Client(timeout_s={timeout_s}) accepted, then stats() failed after "
                        f"{time.monotonic() - t0:.3f} s: {type(e).__name__}: {e}")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_wait_ready_forever_on_a_ready_daemon(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.stats()  # connected
        try:
            c.wait_ready(timeout_s=math.inf)  # "until it is up": it is
        except InvalidArgument:
            pass  # refused clearly: fine too
        except OverflowError as e:
            pytest.fail(f"wait_ready(inf): OverflowError: {e}")


def test_huge_but_finite_client_deadline_and_flush_work(daemon: Daemon) -> None:
    # A year-long deadline is honoured; a flush timeout past the wire's uint32 ms is
    # capped (~49.7 days) and answers at once with nothing pending.
    with daemon.client(timeout_s=365 * 86400.0) as c:
        c.attach(map_pools=False)
        with c.matched(tokens(64, start=30_000)) as m:
            assert m.lock_id
        t0 = time.monotonic()
        assert c.flush(timeout_s=1e12) == 0
        assert time.monotonic() - t0 < 10


def test_lease_at_the_uint32_maximum(make_daemon: Callable[..., Daemon]) -> None:
    # The largest lease the config takes travels as is (uint32), the client's heartbeat
    # interval is a third of it (no OverflowError in its timed wait), and the daemon's
    # sweep (every lease / 3) neither overflows nor expires anything.
    assert MAX_LEASE_MS == UINT32_MAX
    d = make_daemon(f"server.lease_ms={MAX_LEASE_MS}")
    with d.client() as c:
        att = c.attach(map_pools=False)
        assert att.info.lease_ms == UINT32_MAX
        assert c._heartbeat_interval_s == pytest.approx(UINT32_MAX / 3e3)
        with c.matched(tokens(64, start=40_000), allocate_tokens=64) as m:
            info = c.heartbeat()
            assert (info.lease_ms, info.locks, info.allocations) == (UINT32_MAX, 1, 1)
            assert m.lock_id and m.allocation_id
        time.sleep(0.3)
        assert c._heartbeat_thread is not None and c._heartbeat_thread.is_alive()
        assert c.detached is None
        assert c.stats().counters["expired_leases"] == 0
    assert d.proc is not None and d.proc.poll() is None
    assert "Traceback" not in d.log()


# ---------------------------------------------------------------------------------------
# Where the wall clock is read at all.


def test_wall_clock_is_read_only_for_file_times() -> None:
    """Leases, prefetch deadlines, breakers, existence caches, throttled logs, L3 record
    ages and flush/drain deadlines all run on `time.monotonic` (a step of the wall clock
    cannot expire or extend them); `time.time()` appears only where it is compared with
    file mtimes (the file backend's stale temp files). Benchmarks are not the daemon."""
    users: list[str] = []
    for root in ("hicache", "controller", "tiers"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(("hicache/bench/", "hicache/pb/")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr in ("time", "time_ns")
                        and isinstance(node.value, ast.Name) and node.value.id == "time"):
                    users.append(f"{rel}:{node.lineno}")
    assert users, "the scan found nothing: wrong root?"
    assert {u.split(":")[0] for u in users} == {"tiers/storage/file.py"}, users
