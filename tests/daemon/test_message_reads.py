"""A call's request message is read within `server.message_timeout_s`, and calls waiting
for theirs leave threads for the others (`hicache.interceptor`, `hicache.server`).

gRPC's sync server waits for a unary call's request message on one of its worker threads,
with no bound but the caller's deadline: a caller stopped mid-send (or a hostile one)
sending HEADERS and never the message held a thread for as long as it kept its
connection, and 32 of them stalled every engine. Now such a call is cancelled once the
timeout passes, and the server's pool grows past its first 32 threads meanwhile
(`tests/daemon/test_fairness_between_engines_review.py` checks the other engines' latency
under 40 of them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from hicache.auth import Authenticator
from hicache.interceptor import ServerInterceptor
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.server_pool import ServerPool, submitted_at

from .daemonkit import (
    Aborted,
    Daemon,
    StandInContext,
    eventually,
    free_port,
    half_sent,
    raw_calls,
    rpc_count,
    ser,
    tokens,
)

MATCH = "/hicache.v1.HiCache/MatchPrefix"
LOAD = "/hicache.v1.HiCache/Load"
CHECK = "/grpc.health.v1.Health/Check"


def late(message: Any, after_s: float) -> Iterator[Any]:
    time.sleep(after_s)
    yield message


def test_a_call_whose_message_never_comes_is_cancelled_at_the_timeout(
        make_daemon: Callable[..., Daemon]) -> None:
    port = free_port()
    d = make_daemon("server.message_timeout_s=1", f"metrics.port={port}")
    with half_sent(d.target, MATCH, pb.MatchPrefixResponse.FromString) as start:
        t0 = time.monotonic()
        calls = [start() for _ in range(3)]
        for c in calls:
            err = c.exception(timeout=30)
            assert err is not None and err.code() is grpc.StatusCode.CANCELLED, err
        took = time.monotonic() - t0
    assert 0.95 < took < 20, took  # (the timeout, plus at most one check period, plus a loaded machine)
    assert eventually(lambda: "server.message_timeout_s=1s" in d.log(), 10), d.log()
    assert "hicache.v1.HiCache/MatchPrefix" in d.log()
    assert rpc_count(port, "hicache.v1.HiCache/MatchPrefix", "CANCELLED") == 3
    # (each measured from its arrival: at least the timeout)
    assert rpc_count(port, "hicache.v1.HiCache/MatchPrefix", "CANCELLED", "sum") >= 3 * 0.95
    with d.client(engine_id="after") as c:  # and the daemon serves as before
        c.attach()
        m = c.match(tokens(64, start=7_000_000), allocate_tokens=64)
        assert c.insert(tokens(64, start=7_000_000), lock_id=m.lock_id,
                        allocation_id=m.allocation_id).inserted_tokens == 64


def test_a_slow_sender_within_the_timeout_is_served(make_daemon: Callable[..., Daemon]) -> None:
    """The timeout bounds the wait for the message, not the call: a message that comes
    0.5 s after its call's headers (a slow link) is served."""
    d = make_daemon("server.message_timeout_s=5")
    with raw_calls(d.target, MATCH, pb.MatchPrefixResponse.FromString) as call:
        reply = call(late(pb.MatchPrefixRequest(tokens=tokens(64)), 0.5)).result(timeout=30)
        assert reply.device_tokens == 0 and not reply.lock_id  # (a plain lookup: nothing cached)
    with raw_calls(d.target, CHECK, health_pb2.HealthCheckResponse.FromString) as call:
        reply = call(late(health_pb2.HealthCheckRequest(), 0.5)).result(timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "message_timeout_s" not in d.log()


@pytest.mark.parametrize(("method", "reply", "stream"), [
    (MATCH, pb.MatchPrefixResponse.FromString, False),
    (LOAD, pb.LoadProgress.FromString, True),
    (CHECK, health_pb2.HealthCheckResponse.FromString, False),
])
def test_a_call_ended_without_its_message_is_refused(
        daemon: Daemon, method: str, reply: Callable[[bytes], Any], stream: bool) -> None:
    """A caller that ends its side without sending the message gets what gRPC's own
    unary read answered: UNIMPLEMENTED, "requires exactly one request message"."""
    with raw_calls(daemon.target, method, reply, stream=stream) as call:
        c = call(iter(()))
        with pytest.raises(grpc.RpcError) as info:
            if stream:
                list(c)
            else:
                c.result(timeout=30)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED, info.value
    assert info.value.details() == f'"{method}" requires exactly one request message.'


def test_the_probe_listener_answers_while_its_threads_wait_for_messages(
        make_daemon: Callable[..., Daemon]) -> None:
    """The probe listener (two threads started, growing as the main listener's) answers
    kubelet's checks while more half-sent checks than that wait on it, and cancels those
    at the timeout."""
    probe = free_port()
    d = make_daemon(f"server.probe_listen=127.0.0.1:{probe}", "server.message_timeout_s=8")
    with half_sent(f"127.0.0.1:{probe}", CHECK, health_pb2.HealthCheckResponse.FromString) as start:
        calls = [start() for _ in range(6)]
        time.sleep(0.3)
        with grpc.insecure_channel(f"127.0.0.1:{probe}") as channel:
            check = channel.unary_unary(CHECK, request_serializer=ser,
                                        response_deserializer=health_pb2.HealthCheckResponse.FromString)
            t0 = time.monotonic()
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - t0 < 5  # (not after the half-sent ones' timeout)
        for c in calls:
            err = c.exception(timeout=30)
            assert err is not None and err.code() is grpc.StatusCode.CANCELLED, err
    assert eventually(lambda: "grpc.health.v1.Health/Check" in d.log(), 10), d.log()


# --------------------------------------------------------------------------- in-process


def test_a_message_that_comes_as_the_timeout_expires_it_is_not_served() -> None:
    """The read and `expire_reads` race for the call: when the expiry wins, the call is
    cancelled and its handler never runs, even if the message came just after."""
    interceptor = ServerInterceptor(Authenticator(()), None, message_timeout_s=1e-9)
    context = StandInContext()
    served: list[Any] = []

    def messages() -> Iterator[Any]:
        time.sleep(0.001)
        assert interceptor.expire_reads() == 1  # (the timeout passed while we "waited")
        yield "request"

    with pytest.raises(Aborted) as info:
        served.append(interceptor._read("svc/Method", messages(), context))
    assert info.value.code is grpc.StatusCode.CANCELLED and context.cancelled and not served
    assert "message_timeout_s" in info.value.details
    assert interceptor.expire_reads() == 0  # (nothing left waiting)


def test_a_message_read_in_time_is_not_cancelled_later() -> None:
    interceptor = ServerInterceptor(Authenticator(()), None, message_timeout_s=0.01)
    context = StandInContext()
    assert interceptor._read("svc/Method", iter(["request"]), context) == "request"
    time.sleep(0.02)
    assert interceptor.expire_reads() == 0 and not context.cancelled


def test_the_server_pool_queues_calls_when_it_cannot_start_a_thread(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Past its started threads the pool starts more as calls need; a thread it cannot
    start (a limit on threads or memory) leaves the call queued for the running ones,
    instead of raising into gRPC's serving thread."""
    pool = ServerPool(2, 8, "t-nothread").start()  # (a prefix of its own: the warning is throttled by it)
    try:
        gate = threading.Event()
        monkeypatch.setattr(threading.Thread, "start", _cannot_start_pool_threads(threading.Thread.start))
        with caplog.at_level(logging.WARNING, logger="hicache.server"):
            done = [pool.submit(gate.wait, 10) for _ in range(5)]  # (none raises)
        assert "could not start another t-nothread thread" in caplog.text
        gate.set()
        assert [f.result(timeout=10) for f in done] == [True] * 5  # (the 2 threads ran them all)
    finally:
        monkeypatch.undo()
        pool.shutdown(wait=True)


def occupy(pool: ServerPool, n: int) -> tuple[threading.Event, list[Any]]:
    """`n` tasks holding threads of `pool` until the gate returned is set (their futures
    too), returned once all `n` run at once."""
    gate = threading.Event()
    running = threading.Semaphore(0)

    def hold() -> None:
        running.release()
        gate.wait(10)

    held = [pool.submit(hold) for _ in range(n)]
    assert all(running.acquire(timeout=10) for _ in range(n))
    return gate, held


def test_the_server_pool_grows_past_its_started_threads() -> None:
    pool = ServerPool(2, 6, "t-pool").start()
    try:
        gate, _ = occupy(pool, 6)  # (all 6 at once)
        gate.set()
    finally:
        pool.shutdown(wait=True)


def _cannot_start_pool_threads(start: Callable[[threading.Thread], None]) -> Callable[[threading.Thread], None]:
    """`Thread.start` failing for the test pool's threads only (the test process's other
    threads, pytest's and xdist's, start as usual)."""

    def cannot_start(self: threading.Thread) -> None:
        if self.name.startswith("t-nothread"):
            raise RuntimeError("can't start new thread")
        start(self)

    return cannot_start


def test_a_call_queued_behind_a_full_pool_counts_its_timeout_from_its_arrival() -> None:
    """A task that waited in the pool's queue (every thread busy) sees, through
    `submitted_at`, when it was submitted (when gRPC handed the call over), not when a
    thread took it: `ServerInterceptor._read` counts the message timeout from there."""
    pool = ServerPool(1, 1, "t-pool").start()
    try:
        gate = threading.Event()
        busy = pool.submit(gate.wait, 10)
        queued_at = time.monotonic()
        queued = pool.submit(submitted_at)
        time.sleep(0.2)
        gate.set()
        assert busy.result(timeout=10) is True
        seen = queued.result(timeout=10)
        assert seen is not None and queued_at <= seen < queued_at + 0.1, (queued_at, seen)
        assert submitted_at() is None  # (not a pool thread)
    finally:
        pool.shutdown(wait=True)


def test_the_server_pool_retires_the_threads_past_its_started_ones_once_idle() -> None:
    pool = ServerPool(1, 4, "t-pool", idle_s=0.2).start()
    try:
        gate = threading.Event()
        held = [pool.submit(gate.wait, 10) for _ in range(4)]
        assert eventually(lambda: pool.threads == 4, 10)
        gate.set()
        assert all(f.result(timeout=10) for f in held)
        assert eventually(lambda: pool.threads == 1, 10)  # (the started one stays)
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    finally:
        pool.shutdown(wait=True)


def test_the_server_pool_shrinks_back_under_steady_traffic() -> None:
    """Under traffic steady enough that every thread gets a task within `idle_s`, the
    threads a burst added still go: one finishing a task while `started` others are idle
    retires."""
    pool = ServerPool(2, 16, "t-pool", idle_s=600.0).start()
    try:
        gate, held = occupy(pool, 16)
        assert pool.threads == 16
        gate.set()
        assert all(f.result(timeout=10) is None for f in held)
        # Of the 14 added, those finishing while 2 others were idle retired: at most 2 stay.
        assert eventually(lambda: pool.threads <= 4, 10), pool.threads
        for _ in range(200):  # (steady traffic, far more often than idle_s: it adds none)
            assert pool.submit(int).result(timeout=10) == 0
        assert pool.threads <= 4, pool.threads
    finally:
        pool.shutdown(wait=True)


def test_the_client_reads_a_message_timeout_as_unavailable_without_blaming_a_stop() -> None:
    from hicache.client_errors import error_for
    from hicache.errors import Unavailable

    why = "hicache.v1.HiCache/MatchPrefix: the request message did not come within server.message_timeout_s=30s"
    err = error_for(grpc.StatusCode.CANCELLED, why)
    assert isinstance(err, Unavailable) and why in str(err) and "stopping" not in str(err), err
    stop = error_for(grpc.StatusCode.CANCELLED, "the daemon is shutting down; call again once it is back")
    assert isinstance(stop, Unavailable) and "shutting down" in str(stop)  # (its own words)
    bare = error_for(grpc.StatusCode.CANCELLED, "Cancelled")  # (gRPC's own, at a stop)
    assert isinstance(bare, Unavailable) and "stopping or restarting" in str(bare)
