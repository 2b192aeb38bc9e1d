"""Review: resource leaks of a long-running daemon, measured from outside.

A real `hicache serve` process is measured through /proc (open fds, threads, resident
memory), /dev/shm (its segments), the L3 directory, Redis's `CLIENT LIST` / `DBSIZE` and
the daemon's own Stats, across many repetitions of what engines and operators do: clients
that connect, attach, work and go (closed cleanly or killed with SIGKILL), errors of every
kind, Batch calls with failing ops, sessions, prefetches started and cancelled, Load
streams abandoned halfway, health Watch and reflection streams dropped by dying clients,
Redis restarted under the daemon, deep health checks. After a warm-up round (gRPC's
thread pool and caches fill lazily) each later round must leave the daemon at a plateau:
growth bounded by a fixed slack, not linear in the repetitions. The engine-side Client is
measured the same way in this process (fds, threads, mapped shared memory).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from hicache.client import Client, insert_op, match_op, release_op
from hicache.errors import HicacheError, NotFound

from .daemonkit import PAGE, Daemon, eventually, tokens

# ---------------------------------------------------------------------- measuring


def _proc(pid: int) -> dict[str, int]:
    """Open fds, OS threads, resident MiB and mapped hicache shm segments of `pid`."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "rss_mib": int(status["VmRSS"].split()[0]) // 1024,
        "shm_maps": sum("/dev/shm/hicache-" in line for line in maps),
    }


def _shm_segments(pid: int) -> int:
    return sum(1 for _ in Path("/dev/shm").glob(f"hicache-*-{pid}-*"))


def _idle(c: Client) -> bool:
    """No L1 page locked or allocated, no prefetch running (Stats over the wire)."""
    stats = c.stats()
    return (all(p.locked_pages == 0 for p in stats.pools)
            and stats.counters.get("prefetches_running", 0) == 0)


def _assert_plateau(name: str, samples: list[dict[str, int]], *, fds: int = 6, threads: int = 8,
                    rss_mib: int = 40) -> None:
    """`samples[0]` is after the warm-up round; every later one stays within the slack."""
    base = samples[0]
    for i, s in enumerate(samples[1:], 1):
        assert s["fds"] <= base["fds"] + fds, (name, i, samples)
        assert s["threads"] <= base["threads"] + threads, (name, i, samples)
        assert s["rss_mib"] <= base["rss_mib"] + rss_mib, (name, i, samples)


# ---------------------------------------------------------------------- the engine client


def test_client_connect_attach_work_close_leaves_nothing_in_this_process(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """80 Clients, one after another, each attaching (mapping the L1 pools), writing a
    page, matching, inserting and closing; then clients that only fail (unknown handles, a
    daemon that is not there). This process's fds, threads and hicache mappings come back
    to where they were."""
    d = make_daemon("server.lease_ms=1500")
    me = os.getpid()
    # (Threads other test modules of this worker process left, an L3 pipeline's say.)
    before = set(threading.enumerate())

    def round_(r: int) -> None:
        for i in range(20):
            c = d.client(engine_id=f"cl-{r}-{i}")
            att = c.attach()
            t = tokens(PAGE, start=1 + (r * 20 + i) * 100)
            with c.matched(t, allocate_tokens=PAGE) as m:
                att.pools["full"][0][int(m.pages["full"][0])].fill_(i % 251)
                c.insert(t, lock_id=m.lock_id, allocation_id=m.allocation_id)
            with pytest.raises(NotFound):
                c.release(lock_id=987_654_321)
            c.close()
            del att, c
        gc.collect()

    round_(0)
    warm = _proc(me)
    assert warm["shm_maps"] == 0, warm
    samples = [warm]
    for r in range(1, 4):
        round_(r)
        samples.append(_proc(me))
    for _ in range(10):  # a daemon that is not there: each call fails fast
        with Client(f"unix://{d.workdir}/nobody.sock", retries=0, timeout_s=0.3) as gone, \
                pytest.raises(HicacheError):
            gone.stats()
    gc.collect()
    samples.append(_proc(me))
    _assert_plateau("client process", samples, fds=4, threads=2, rss_mib=40)
    assert all(s["shm_maps"] == 0 for s in samples), samples
    left = [t for t in threading.enumerate() if t not in before]
    assert len(left) <= 1, left  # no heartbeat thread left (one of gRPC's may stay)


def test_one_client_attaching_again_and_again_keeps_one_mapping(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """An engine that re-attaches (after a detach, say) maps the pools anew each time: the
    mappings of attachments it dropped go, one heartbeat thread beats."""
    d = make_daemon("server.lease_ms=1500")
    me = os.getpid()
    with d.client(engine_id="reattacher") as c:
        att = c.attach()
        first = _proc(me)
        for _ in range(15):
            att = c.attach()
        gc.collect()
        again = _proc(me)
        assert again["shm_maps"] == first["shm_maps"] == 1, (first, again)
        assert again["fds"] <= first["fds"] + 2 and again["threads"] <= first["threads"] + 1
        del att
        gc.collect()
        assert _proc(me)["shm_maps"] == 0


# ---------------------------------------------------------------------- engines against the daemon


def _engine_life(d: Daemon, key: str, att_pools: bool) -> None:
    """One engine's life with the errors engines make: attach, a request with a session,
    a Batch with failing ops, bad requests, close."""
    with d.client(engine_id=f"life-{key}") as c:
        c.attach(map_pools=att_pools)
        n = sum(map(ord, key)) % 20
        t = tokens(2 * PAGE, start=1 + n * 1000)
        sid = f"sess-{key}"
        m = c.match(t, lock=True, allocate_tokens=2 * PAGE, session_id=sid)
        c.insert(t, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=sid)
        c.close_session(sid)
        results = c.batch([
            match_op(t, lock=True),
            release_op(lock_id=123_456_789),              # unknown lock
            insert_op(b"abc"),                            # malformed tokens
            match_op(t, namespace="x" * 10_000),          # a huge namespace (either answer)
            release_op(allocation_id=55_555),             # unknown allocation
        ])
        lock = results[0].lock_id
        assert sum(isinstance(r, HicacheError) for r in results) >= 3, results
        c.release(lock_id=lock)
        for bad in (lambda: c.release(lock_id=lock),                  # twice
                    lambda: c.prefetch_status(424_242),
                    lambda: c.cancel_prefetch(424_243),
                    lambda: c.allocate(10 ** 6),
                    lambda: c.insert(t, lock_id=999, allocation_id=998)):
            with pytest.raises(HicacheError):
                bad()


def test_daemon_plateaus_over_engine_lives_errors_and_batches(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """4 rounds of 20 engine lives (mapping or not), each with sessions, failing Batch ops
    and the usual mistakes: the daemon's fds, threads, memory and shm segments stay flat,
    and it holds no lock or allocation once they are gone."""
    d = make_daemon("server.lease_ms=1500")
    pid = d.proc.pid  # type: ignore[union-attr]
    segments = _shm_segments(pid)
    samples = []
    for r in range(4):
        for i in range(20):
            _engine_life(d, f"{r}-{i}", att_pools=i % 3 == 0)
        with d.client() as probe:
            assert eventually(lambda probe=probe: _idle(probe), 10, 0.1)
        samples.append(_proc(pid))
    _assert_plateau("engine lives", samples)
    assert _shm_segments(pid) == segments


KILLED_ENGINE = r"""
import sys, time
from hicache.client import Client
target, engine_id, mode = sys.argv[1:4]
c = Client(target, engine_id=engine_id)
c.attach(map_pools=False)
toks = bytes.fromhex(sys.argv[4])
m = c.match(toks, lock=True, allocate_tokens=128 if mode == "held" else None)
print("ready", flush=True)
time.sleep(60)
"""


def test_engines_killed_holding_handles_leave_the_daemon_flat(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Engine processes SIGKILLed while holding a lock (and an allocation): once their
    leases lapse the daemon holds nothing, and its fds and threads are back at the
    plateau."""
    d = make_daemon("server.lease_ms=3000")  # (the kills and a Stats fit in it when loaded)
    pid = d.proc.pid  # type: ignore[union-attr]
    prompt = tokens(2 * PAGE, start=77)
    with d.client(engine_id="seeder") as c:  # (the killed engines' locks pin its pages)
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
    samples = []
    held = 0
    for r in range(3):
        procs = []
        for i in range(3):
            p = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, d.target, f"k-{r}-{i}",
                                  "held" if i % 2 else "lock", prompt.hex()], stdout=subprocess.PIPE,
                                 text=True)
            procs.append(p)
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            p.kill()
            p.wait()
            p.stdout.close()
        with d.client() as probe:
            held += not _idle(probe)  # (their leases have not lapsed yet)
            assert eventually(lambda probe=probe: _idle(probe), 20, 0.1)
        samples.append(_proc(pid))
    assert held == 3  # the kills did leave handles held, until the lapse
    _assert_plateau("killed engines", samples)


# ---------------------------------------------------------------------- long-lived streams

STREAMS_THEN_DIE = r"""
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
calls = []
for _ in range(4):
    c = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    next(c); calls.append(c)
def asks():
    yield reflection_pb2.ServerReflectionRequest(list_services="")
    time.sleep(60)
for _ in range(2):
    c = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(asks(), timeout=60)
    next(c); calls.append(c)
print("ready", flush=True)
time.sleep(60)
"""


def _open_streams(target: str) -> int:
    """How many of 4 Watch and 2 reflection streams the daemon accepts now (all closed)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ch = grpc.insecure_channel(target)
    calls = []
    try:
        for _ in range(4):
            calls.append(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5))
        for _ in range(2):
            calls.append(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        ok = 0
        for call in calls:
            try:
                next(call)
                ok += 1
            except grpc.RpcError:
                pass
        return ok
    finally:
        for call in calls:
            call.cancel()
        ch.close()


def test_watch_and_reflection_streams_of_killed_and_cancelling_clients_free_their_slots(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    """The daemon serves at most 4 Watch and 2 reflection streams at once: streams whose
    client process was SIGKILLed, or which the client cancelled, give their slot back
    (6 rounds each way), and the threads they held end."""
    d = make_daemon()
    pid = d.proc.pid  # type: ignore[union-attr]
    samples = []
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", STREAMS_THEN_DIE, d.target],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.kill()
        p.wait()
        p.stdout.close()
        assert eventually(lambda: _open_streams(d.target) == 6, 5, 0.2), "a dead client's slot kept"
        samples.append(_proc(pid))
    _assert_plateau("streams", samples)


# ---------------------------------------------------------------------- L3


def test_redis_restarts_and_deep_checks_leave_no_connections_keys_or_threads(
        make_daemon, redis_factory) -> None:  # type: ignore[no-untyped-def]
    """Redis killed / stopped and started again under the daemon 5 times (the breaker
    trips and closes each time), 60 deep health checks between: the daemon's connections
    to Redis stay within its pool, no canary object stays in the store, the daemon's fds
    and threads stay flat."""
    import redis

    server = redis_factory()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={server.url}",
                    "storage.timeout_s=1", "write.l2_to_l3=write_through")
    pid = d.proc.pid  # type: ignore[union-attr]
    with d.client(engine_id="writer") as c:
        c.attach(map_pools=False)
        for i in range(8):
            t = tokens(2 * PAGE, start=1 + i * 1000)
            m = c.match(t, lock=True, allocate_tokens=2 * PAGE)
            c.insert(t, lock_id=m.lock_id, allocation_id=m.allocation_id)
        c.flush(10)
    samples = []
    for r in range(5):
        server.stop(kill=r % 2 == 0)
        with d.client() as c:
            assert not any(h.healthy for h in c.health(deep=True))
        server.start()
        with d.client() as c:
            assert eventually(lambda c=c: all(h.healthy for h in c.health(deep=True)), 10, 0.2)
            for _ in range(12):
                c.health(deep=True)
        r_ = redis.Redis.from_url(server.url)
        try:
            clients = r_.client_list()
            assert len(clients) <= 1 + 8, clients  # this one and at most the daemon's pool
            canaries = list(r_.scan_iter(match="hc*canary*", count=1000))
            assert canaries == [], canaries
        finally:
            r_.close()
        samples.append(_proc(pid))
    # (its L3 worker threads, up to the pool's 8, start as calls overlap: bounded)
    _assert_plateau("redis restarts", samples, threads=16)


def test_prefetches_cancelled_and_loads_abandoned_leave_nothing_held(make_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A file L3 behind a small L1 (16 pages) and L2 (32): prompts pushed down to L3 and
    matched with prefetch (cancelled at once, or left to run); the prompt just inserted,
    pushed out of L1 by an allocation of all of it, loaded with its Load stream abandoned
    after the first message. 4 rounds: nothing stays held, fds and threads stay flat."""
    l3 = tmp_path / "l3"
    d = make_daemon("storage.backend=file", f"storage.file.path={l3}",
                    "write.l2_to_l3=write_through", "write.l1_to_l2_batch_ms=0",
                    "prefetch.threshold_tokens=64", "server.lease_ms=3000")
    pid = d.proc.pid  # type: ignore[union-attr]
    prompts = [tokens(6 * PAGE, start=1 + i * 10_000) for i in range(8)]
    prefetched = loads = 0
    samples = []
    with d.client(engine_id="pf") as c:
        c.attach(map_pools=False)
        for r in range(4):
            for i, p in enumerate(prompts):
                m = c.match(p, lock=True, allocate_tokens=6 * PAGE)
                c.insert(p, lock_id=m.lock_id, allocation_id=m.allocation_id)
                m = c.match(prompts[(i + 3) % len(prompts)], lock=True, prefetch=True)
                if m.prefetch_id:
                    prefetched += 1
                    if (r + i) % 2:
                        c.cancel_prefetch(m.prefetch_id)
                c.release(lock_id=m.lock_id)
                if i % 2:
                    continue
                try:  # L1 emptied (its pages are in L2: write-through)
                    c.release(allocation_id=c.allocate(16 * PAGE).allocation_id)
                except HicacheError:
                    continue  # (a copy still pins a page)
                m = c.match(p, lock=True)
                if m.host_tokens:
                    stream = c.load(m.lock_id)
                    next(stream)
                    stream.close()  # abandoned halfway
                    loads += 1
                c.release(lock_id=m.lock_id)
            assert eventually(lambda: _idle(c), 15, 0.1), c.stats().counters
            samples.append(_proc(pid))
    assert prefetched >= 4 and loads >= 4, (prefetched, loads)
    _assert_plateau("prefetch/load", samples)


def test_deep_health_checks_leave_no_directories_in_the_file_store(make_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`hicache health --deep` (or Admin.Health(deep=True)) writes, reads and deletes a
    canary object under a fresh random key: the file backend puts it at
    `<root>/<d0d1>/<d2d3>/<digest>.bin`, creating the two fan-out folders, and the delete
    unlinks only the file. A probe every 10 s leaves ~17,000 empty folders a day (up to
    65,792) in the shared L3 mount, each an inode and a directory block, walked by every
    daemon's start. A deep check must leave the store as it found it."""
    l3 = tmp_path / "l3"
    d = make_daemon("storage.backend=file", f"storage.file.path={l3}")

    def folders() -> int:
        return sum(len(dirs) for _, dirs, _ in os.walk(l3))

    before = folders()
    with d.client() as c:
        for _ in range(30):
            (h,) = c.health(deep=True)
            assert h.healthy, h
    files = sum(len(names) for _, _, names in os.walk(l3))
    assert files == 0  # the canary objects themselves are removed ...
    assert folders() <= before + 4, f"{folders() - before} folders left by 30 deep checks"
