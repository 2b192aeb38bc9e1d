"""Fairness between engines sharing one daemon: one heavy or misbehaving engine must not
stall the others' requests, and the daemon must serve normally once it stops.

Every test runs an abuser against the module's daemon while a second, well-behaved engine
("good") times its own request lives (MatchPrefix with an allocation, then Insert), and
checks its latency against generous bounds (this is a 2-core machine shared with other
test runs), then that the daemon recovers once the abuser stops.

Found (fixed in session 29; it was a strict xfail, a documented limit of the sync server):
- half-sent requests (HEADERS without the request message) each held one of the sync
  server's 32 threads until their caller went away: 40 of them, from any client that can
  connect to a daemon without tokens (or holding a token), stalled every engine's calls.
  Calls without a valid token are refused on their headers and hold no thread (the last
  test); the others now wait at most `server.message_timeout_s`, and the server's pool
  grows past its 32 started threads meanwhile (`tests/daemon/test_message_reads.py`).
  (gRPC's `grpc.max_concurrent_streams` does not bound it: the server refuses the excess
  streams with RST_STREAM REFUSED_STREAM, which engines making concurrent calls on one
  channel then get as UNAVAILABLE.)

Checked and fine: unread Load streams, max-size Batches on 4 threads, prompts at
`server.max_tokens_per_request`, a prefetch flood from 8 threads (the other engine's
prefetches start and end), an engine pinning all of L1 (others get RESOURCE_EXHAUSTED at
once), Flush and deep Health under way, engines attaching and leaving in a loop, idle and
preface-only connections.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from hicache.client import Client, match_op
from hicache.errors import HicacheError, ResourceExhausted
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.server import WORKERS

from .daemonkit import PAGE, Daemon, eventually, half_sent, pool, tokens

MATCH = "/hicache.v1.HiCache/MatchPrefix"

L1_PAGES = 64  # tiers.l1.tokens below; L2 holds twice that, the prefetch budget a quarter
MAX_TOKENS = 65536  # server.max_tokens_per_request
BOUND_S = 1.0  # the good engine's request life while an abuser runs ...
STALL_S = 5.0  # ... and what none may reach, stalls of a loaded machine included


@pytest.fixture(scope="module")
def fair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("fair")
    d = Daemon(
        work,
        f"tiers.l1.tokens={L1_PAGES * PAGE}",
        f"server.max_tokens_per_request={MAX_TOKENS}",
        "storage.backend=file",
        f"storage.file.path={work / 'l3'}",
        "write.l2_to_l3=write_through",
    ).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def good(fair: Daemon) -> Iterator[Client]:
    with fair.client(engine_id="good", timeout_s=10) as c:
        c.attach()
        yield c


@pytest.fixture(scope="module")
def heavy(fair: Daemon) -> Iterator[Client]:
    with fair.client(engine_id="heavy", timeout_s=30) as c:
        c.attach()
        yield c


def request_life(c: Client, i: int, base: int = 100_000) -> float:
    """One short request of the good engine (2 pages, one of 8 prompts): match with an
    allocation, insert; its duration."""
    t = time.perf_counter()
    p = tokens(2 * PAGE, start=base + (i % 8) * 1000)
    m = c.match(p, allocate_tokens=2 * PAGE)
    c.insert(p, lock_id=m.lock_id, allocation_id=m.allocation_id)
    return time.perf_counter() - t


def p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def served(xs: list[float]) -> bool:
    """Every request within BOUND_S, but for one in twenty (at least one) that a loaded
    machine stalled (a preemption, a collection in a busy process), and none near STALL_S:
    starvation, which holds every request past it, still fails."""
    return sum(x > BOUND_S for x in xs) <= max(1, len(xs) // 20) and max(xs) < STALL_S


def baseline(c: Client) -> float:
    return p50([request_life(c, i) for i in range(30)])


def timed_while(c: Client, busy: Callable[[], bool], least_s: float, most_s: float) -> list[float]:
    """The good engine's request lives while `busy()` (at least `least_s` unless it stops,
    at most `most_s`); at least 5."""
    lat: list[float] = []
    t0 = time.monotonic()
    while (len(lat) < 5 or (busy() and time.monotonic() - t0 < least_s)) \
            and time.monotonic() - t0 < most_s:
        lat.append(request_life(c, len(lat)))
    return lat


def recovered(c: Client, base_s: float) -> None:
    after = [request_life(c, i) for i in range(20)]
    assert p50(after) < max(10 * base_s, 0.05), (base_s, after)


def put(c: Client, prompt: bytes) -> None:
    m = c.match(prompt, allocate_tokens=len(prompt) // 4)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)


# --------------------------------------------------------------------------- fine


def test_unread_load_streams_hold_no_server_threads(fair: Daemon, good: Client,
                                                     heavy: Client) -> None:
    """40 Load streams (more than the server's threads) opened and never read: each load
    finishes and lands; the other engine is served meanwhile; cancelled, nothing stays."""
    base = baseline(good)
    prompts = [tokens(PAGE, start=500_000 + k * 10_000) for k in range(L1_PAGES + 40)]
    for p in prompts:  # L1 overflows: the first ones are left in L2 only
        put(heavy, p)
    locks: list[int] = []
    for p in prompts[:40]:
        m = heavy.match(p, lock=True)
        if m.host_tokens:
            locks.append(m.lock_id)
        else:
            heavy.release(lock_id=m.lock_id)
    assert len(locks) >= WORKERS, len(locks)
    streams = [heavy._stub.Load(pb.LoadRequest(lock_id=lock), metadata=heavy._metadata, timeout=30)
               for lock in locks]
    try:
        time.sleep(0.3)
        lat = timed_while(good, lambda: True, 1.5, 5.0)
        assert served(lat), lat
    finally:
        for s in streams:
            s.cancel()
        for lock in locks:
            with contextlib.suppress(HicacheError):
                heavy.release(lock_id=lock)
    assert eventually(lambda: pool(good, "device")[1] == 0, 10), pool(good, "device")
    recovered(good, base)


def test_max_size_batches_on_many_threads_leave_others_served(good: Client,
                                                              heavy: Client) -> None:
    """4 threads sending Batches as large as a request may be (1000 MatchPrefix ops of 4
    pages: ~1 MiB) back to back: the other engine shares the CPU (its requests are
    slower) but none waits long."""
    base = baseline(good)
    ops = [match_op(tokens(4 * PAGE, start=2_000_000 + k * PAGE)) for k in range(1000)]
    stop = threading.Event()
    done: list[float] = []
    errors: list[BaseException] = []

    def flood() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                heavy.batch(ops)
            except BaseException as e:
                errors.append(e)
                return
            done.append(time.perf_counter() - t)

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        lat = timed_while(good, lambda: not errors, 2.0, 6.0)
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not errors, errors[:1]
    assert len(done) >= 4
    assert served(lat), (p50(lat), max(lat))
    recovered(good, base)


def test_prompts_at_the_token_limit_leave_others_served(good: Client, heavy: Client) -> None:
    """Matches, allocations and inserts of prompts of `server.max_tokens_per_request`
    tokens on 2 threads: the other engine waits at most a few of their ops."""
    base = baseline(good)
    stop = threading.Event()
    errors: list[BaseException] = []
    n = [0]

    def huge(k: int) -> None:
        while not stop.is_set():
            p = tokens(MAX_TOKENS, start=10_000_000 + k * 1_000_000 + n[0] * 7)
            n[0] += 1
            try:
                heavy.match(p)
                m = heavy.match(p[: 16 * PAGE * 4], allocate_tokens=16 * PAGE)
                heavy.insert(p[: 16 * PAGE * 4], lock_id=m.lock_id, allocation_id=m.allocation_id)
            except ResourceExhausted:
                continue
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=huge, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        lat = timed_while(good, lambda: not errors, 2.0, 6.0)
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not errors, errors[:1]
    assert n[0] >= 4
    assert served(lat), (p50(lat), max(lat))
    recovered(good, base)


def test_prefetch_flood_leaves_other_engines_prefetches_running(fair: Daemon, good: Client,
                                                                heavy: Client) -> None:
    """8 threads of one engine start prefetches over 40 prompts only L3 holds (more than
    L2 holds: they keep churning): the other engine's matches stay fast, its prefetches
    still start (the budget is not monopolized) and each ends (DONE or TIMED_OUT) within
    its timeout."""
    base = baseline(good)
    theirs = [tokens(8 * PAGE, start=20_000_000 + k * 10_000) for k in range(40)]
    mine = [tokens(8 * PAGE, start=30_000_000 + k * 10_000) for k in range(10)]
    for p in mine + theirs:
        put(heavy, p)
    heavy.flush(timeout_s=10)
    for k in range(40):  # evict all of them from L1 and L2
        put(heavy, tokens(8 * PAGE, start=40_000_000 + k * 10_000))
    assert all(good.match(p).storage_tokens == 8 * PAGE for p in mine)
    stop = threading.Event()
    errors: list[BaseException] = []
    started = [0]

    def flood(k: int) -> None:
        while not stop.is_set():
            try:
                if heavy.match(theirs[k % len(theirs)], prefetch=True).prefetch_id:
                    started[0] += 1
            except BaseException as e:
                errors.append(e)
                return
            k += 7

    threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    ended: list[tuple[str, float]] = []
    matches: list[float] = []
    try:
        time.sleep(0.3)
        for p in mine:
            t = time.perf_counter()
            m = good.match(p, prefetch=True)
            matches.append(time.perf_counter() - t)
            if not m.prefetch_id:
                continue
            limit = time.monotonic() + 2.0 + 0.1 * 8 * PAGE / 1024 + 1.0  # timeout_for + slack
            state = "RUNNING"
            while state == "RUNNING" and time.monotonic() < limit:
                state = good.prefetch_status(m.prefetch_id).state.name
                time.sleep(0.005)
            ended.append((state, time.perf_counter() - t))
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not errors, errors[:1]
    assert started[0] >= 10, started
    assert served(matches), matches
    assert len(ended) >= 2, (ended, started)
    assert all(state in ("DONE", "TIMED_OUT") for state, _ in ended), ended
    recovered(good, base)


def test_an_engine_pinning_all_of_l1_gets_others_refused_at_once(good: Client,
                                                                 heavy: Client) -> None:
    """An engine whose allocations hold every L1 page: another engine's allocation is
    RESOURCE_EXHAUSTED at once (no hang), its plain matches are served, and once the pages
    are released it allocates again."""
    base = baseline(good)
    held: list[int] = []
    try:
        while True:
            try:
                held.append(heavy.allocate(4 * PAGE).allocation_id)
            except ResourceExhausted:
                break
        assert pool(good, "device")[1] >= L1_PAGES - 3
        for i in range(3):
            t = time.perf_counter()
            with pytest.raises(ResourceExhausted):
                request_life(good, i, base=3_000_000)
            assert time.perf_counter() - t < STALL_S  # refused, not waiting for room
        t = time.perf_counter()
        good.match(tokens(2 * PAGE, start=100_000))
        assert time.perf_counter() - t < STALL_S
    finally:
        for a in held:
            heavy.release(allocation_id=a)
    recovered(good, base)


def test_flush_and_deep_health_under_way_leave_others_served(good: Client,
                                                             heavy: Client) -> None:
    for k in range(60):  # (write-back data for the flush to write)
        put(heavy, tokens(4 * PAGE, start=50_000_000 + k * 10_000))

    def admin() -> None:
        heavy.flush(timeout_s=20)
        for _ in range(40):
            (h,) = heavy.health(deep=True)
            assert h.healthy, h

    served_while(good, admin, 5.0, 10.0)


def test_engines_attaching_and_leaving_in_a_loop_leave_others_served(
        fair: Daemon, good: Client) -> None:
    def churn() -> None:
        for k in range(30):
            with fair.client(engine_id=f"churn-{k}", timeout_s=10) as c:
                c.attach()
                put(c, tokens(PAGE, start=60_000_000 + k * 1000))

    served_while(good, churn, 5.0, 15.0)


def served_while(good: Client, abuse: Callable[[], None], least_s: float, most_s: float) -> None:
    """`abuse()` on a thread while the good engine's request lives are timed (at least
    `least_s` unless it ends first, at most `most_s`): it raises nothing, the good engine
    stays within BOUND_S, and serves as fast as before once it ends."""
    base = baseline(good)
    running = threading.Event()
    running.set()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            abuse()
        except BaseException as e:
            errors.append(e)
        finally:
            running.clear()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    lat = timed_while(good, running.is_set, least_s, most_s)
    t.join(20)
    assert not errors, errors[:1]
    assert served(lat), lat
    recovered(good, base)


def test_idle_and_preface_only_connections_hold_nothing(fair: Daemon, good: Client) -> None:
    """64 connections that send nothing and 64 that send only the HTTP/2 preface and an
    empty SETTINGS frame: the engine is served as before."""
    base = baseline(good)
    socks: list[socket.socket] = []
    try:
        for k in range(128):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(fair.socket))
            if k % 2:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            socks.append(s)
        time.sleep(0.3)
        lat = timed_while(good, lambda: True, 1.0, 5.0)
        assert served(lat), lat
    finally:
        for s in socks:
            s.close()
    recovered(good, base)


# --------------------------------------------------------------------------- limits


def test_half_sent_requests_do_not_stall_other_engines(fair: Daemon, good: Client) -> None:
    """A client (no engine, no token needed) opens 40 MatchPrefix calls whose request
    message never comes (HEADERS sent, no DATA: a slowloris at the HTTP/2 level, or an
    engine stopped mid-send). The sync server reads a unary request on a worker thread,
    waiting for the message there, so each such call holds a thread (until
    `server.message_timeout_s`, 30 s here): the pool grows past its 32 started threads,
    and the other engine's calls must still be answered."""
    base = baseline(good)
    c = fair.client(engine_id="good-2", timeout_s=2.0, retries=0)
    c.attach()
    try:
        with half_sent(fair.target, MATCH, pb.MatchPrefixResponse.FromString) as start:
            for _ in range(WORKERS + 8):
                start()
            time.sleep(0.5)
            lat = [request_life(c, i, base=4_000_000) for i in range(5)]  # (NoAnswer after 2 s)
            assert served(lat), lat
    finally:
        c.close()
        # (the threads come back once the calls are cancelled)
        assert eventually(lambda: request_life(good, 0) < BOUND_S, 10)
    recovered(good, base)


TOKEN = "fairness-review-token-0123456789"


def test_half_sent_requests_without_a_token_hold_no_server_threads(
        make_daemon: Callable[..., Daemon]) -> None:
    """With tokens configured, the same 40 half-sent calls carrying no token are refused
    on their headers (UNAUTHENTICATED, before their message would be read), so they hold
    no worker: an engine with its token is served as usual meanwhile."""
    d = make_daemon(f"server.tokens=[{{token: {TOKEN}, namespaces: ['*']}}]")
    with half_sent(d.target, MATCH, pb.MatchPrefixResponse.FromString) as start, \
            d.client(engine_id="good-3", token=TOKEN, timeout_s=2.0, retries=0) as c:
        calls = [start() for _ in range(WORKERS + 8)]
        c.attach()
        time.sleep(0.5)
        lat = [request_life(c, i) for i in range(5)]
        assert served(lat), lat
        codes = {call.exception(timeout=10).code() for call in calls}
        assert codes == {grpc.StatusCode.UNAUTHENTICATED}
