"""Review (session 29, third pass) of the day's diff (e5bb455..HEAD): unary calls served as
one-message request streams read within `server.message_timeout_s`, the growing
`ServerPool`, the probe listener's own interceptor, pool and health servicer.

Each test here is a problem it found, fixed (each was a strict xfail):
- at a stop, a call whose request message is on its way is ended CANCELLED, where the
  contract (`../shared/API.md`: "UNAVAILABLE (shutting down)") and the code before
  (`served` refused it once read) say UNAVAILABLE: a gRPC retry policy retrying
  UNAVAILABLE (any engine not using `hicache.client`) does not retry it;
- the probe listener stops cancelling half-sent calls once a stop begins (the "reads"
  loop ends with the other housekeeping at `Daemon.stop`'s first line), yet it serves on,
  NOT_SERVING, until the flush and the close are done: for that time (up to
  `longest_stop_s`) it is unguarded, though README / networkpolicy.yaml say it is;
- a message timeout on the probe listener is logged under the main listener's throttle
  key and names no listener: after one on the socket, the probe port's (open to anyone
  who reaches it) goes unsaid, and neither says which listener it came from;
- a call whose message arrived in time but which waited in the pool's queue past its
  deadline (a saturated pool, or one a pids limit keeps from growing) is cancelled if the
  once-a-second expiry lands while gRPC hands its (long arrived) message over.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
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
from hicache.server_pool import ServerPool

from .daemonkit import TINY, Aborted, Daemon, StandInContext, eventually, free_port, half_sent, ser

STATS = "/hicache.v1.HiCache/Stats"
CHECK = "/grpc.health.v1.Health/Check"
WAIT = 15.0  # a bound nothing should reach (a loaded machine)
_names = itertools.count()


class _InProcess:
    """A `hicache.server.Daemon` in this process (its interceptor, core and stop are the
    test's to reach), on a short unix socket path; `flush_gate`: the stop's flush waits
    for it (set by the test), `flushing` is set once the flush began."""

    def __init__(self, *sets: str) -> None:
        from hicache.config import load_config
        from hicache.controller.controller import build_controller
        from hicache.endpoint import parse_address
        from hicache.server import Daemon as ServerDaemon

        self.dir = tempfile.mkdtemp(prefix="s29r", dir="/tmp")
        self.cfg = load_config(None, [*TINY, *sets])
        self.core = build_controller(self.cfg, f"s29r{os.getpid()}_{next(_names)}")
        self.flush_gate = threading.Event()
        self.flush_gate.set()
        self.flushing = threading.Event()
        flush = self.core.flush

        def gated_flush(timeout_s: float) -> int:
            self.flushing.set()
            self.flush_gate.wait(WAIT * 2)
            return flush(timeout_s)

        self.core.flush = gated_flush  # type: ignore[method-assign]
        self.target = f"unix://{self.dir}/d.sock"
        self.daemon = ServerDaemon(self.cfg, self.core, parse_address(self.target))
        self.daemon.start()
        self._stopper: threading.Thread | None = None

    def stop_in_background(self) -> None:
        self._stopper = threading.Thread(target=self.daemon.stop, name="s29r-stop", daemon=True)
        self._stopper.start()

    def close(self) -> None:
        self.flush_gate.set()
        if self._stopper is None:
            self.daemon.stop()
        else:
            self._stopper.join(WAIT * 2)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def in_process() -> Iterator[Callable[..., _InProcess]]:
    made: list[_InProcess] = []

    def make(*sets: str) -> _InProcess:
        d = _InProcess(*sets)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


# --------------------------------------------------------------------------- findings


def test_a_call_whose_message_is_on_its_way_at_a_stop_is_refused_unavailable(
        in_process: Callable[..., _InProcess]) -> None:
    d = in_process()
    gate = threading.Event()

    def slow_message() -> Iterator[Any]:
        gate.wait(WAIT)  # (an engine's message still on the wire)
        yield pb.StatsRequest()

    with grpc.insecure_channel(d.target) as channel:
        call = channel.stream_unary(STATS, request_serializer=ser,
                                    response_deserializer=pb.StatsResponse.FromString)
        future = call.future(slow_message(), timeout=WAIT * 2)
        # Its thread waits for its message in `_read`.
        assert eventually(lambda: bool(d.daemon.interceptor._reading), WAIT)
        d.stop_in_background()  # (SIGTERM)
        assert eventually(lambda: d.daemon.interceptor._stopping, WAIT)
        gate.set()  # the message comes, as it would a moment later
        err = future.exception(timeout=WAIT * 2)
    assert err is not None
    assert err.code() is grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())


def test_the_probe_listener_cancels_half_sent_calls_while_the_daemon_flushes(
        in_process: Callable[..., _InProcess]) -> None:
    probe = f"127.0.0.1:{free_port()}"
    d = in_process(f"server.probe_listen={probe}", "server.message_timeout_s=0.5")
    d.flush_gate.clear()
    d.stop_in_background()
    assert d.flushing.wait(WAIT), "the stop never reached its flush"
    with grpc.insecure_channel(probe) as kubelet:
        check = kubelet.unary_unary(CHECK, request_serializer=ser,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        # (pinned: the probe listener answers NOT_SERVING during the flush)
        assert check(health_pb2.HealthCheckRequest(), timeout=WAIT).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        with half_sent(probe, CHECK, health_pb2.HealthCheckResponse.FromString) as start:
            call = start()
            # 0.5 s timeout: cancelled within a second or two, were it guarded.
            try:
                err = call.exception(timeout=10)
            except grpc.FutureTimeoutError:
                pytest.fail("a half-sent Check on the probe listener was not cancelled "
                            "10 s into the stop's flush (message_timeout_s=0.5)")
            assert err is not None and err.code() is grpc.StatusCode.CANCELLED, err
    finally:
        d.flush_gate.set()


def test_a_message_timeout_on_the_probe_listener_is_logged_naming_that_listener(
        make_daemon: Callable[..., Daemon]) -> None:
    probe = f"127.0.0.1:{free_port()}"
    d = make_daemon(f"server.probe_listen={probe}", "server.message_timeout_s=0.5")
    with half_sent(d.target, STATS, pb.StatsResponse.FromString) as main:
        err = main().exception(timeout=WAIT)
        assert err is not None and err.code() is grpc.StatusCode.CANCELLED, err
    assert eventually(lambda: "HiCache/Stats" in d.log(), WAIT), d.log()
    with half_sent(probe, CHECK, health_pb2.HealthCheckResponse.FromString) as side:
        err = side().exception(timeout=WAIT)
        assert err is not None and err.code() is grpc.StatusCode.CANCELLED, err

    def probe_timeout_logged() -> bool:
        return any("Health/Check" in line and "probe" in line.lower()
                   for line in d.log().splitlines() if "message_timeout_s" in line)

    assert eventually(probe_timeout_logged, 5), d.log()


def test_a_call_queued_past_its_deadline_whose_message_came_isserved() -> None:
    interceptor = ServerInterceptor(Authenticator(()), None, message_timeout_s=0.5)
    pool = ServerPool(1, 1, f"s29r{next(_names)}").start()  # (a pool that cannot grow)
    busy = threading.Event()
    released = threading.Event()
    context = StandInContext()

    def delivered() -> Iterator[Any]:
        # gRPC's poller hands the message (here since the call's arrival) to the reader;
        # the once-a-second expiry happens to run meanwhile.
        interceptor.expire_reads()
        yield "request"

    try:
        def hold() -> bool:
            busy.set()
            return released.wait(WAIT)

        pool.submit(hold)
        assert busy.wait(WAIT)
        queued = pool.submit(interceptor._read, "hicache.v1.HiCache/Stats", delivered(), context)
        time.sleep(0.7)  # (the pool's only thread stays busy past the 0.5 s timeout)
        released.set()
        try:
            got = queued.result(timeout=WAIT)
        except Aborted as e:
            pytest.fail(f"a call whose message came with it was refused: {e}")
        assert got == "request" and not context.cancelled
    finally:
        released.set()
        pool.shutdown(wait=False, cancel_futures=True)
