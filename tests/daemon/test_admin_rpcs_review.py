"""Review: the Admin service (Health, Flush) and the operator RPCs under real conditions.

A real daemon over a real redis-server (stopped with SIGSTOP for a hung store, at
`maxmemory` with `noeviction` for a full one), the real `Client` and the CLI: Flush with
tiny, huge and concurrent timeouts, with nothing to write and with a hung store; deep
health on a full store; Stats while pools churn; the CLI's `--json` schemas.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from hicache.bench.oracle import KvOracle
from hicache.bench.services import RedisServer
from hicache.client import Client
from hicache.errors import HicacheError

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

MakeDaemon = Callable[..., Daemon]
MakeRedis = Callable[[], RedisServer]

WRITE_BACK = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_back")
WRITE_THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through")


def redis_sets(server: RedisServer, *extra: str) -> tuple[str, ...]:
    return ("storage.backend=redis", f"storage.redis.url={server.url}", *extra)


def put(c: Client, oracle: KvOracle, prompt: bytes) -> None:
    """One request computing all of `prompt` (KV written by the oracle) and inserting it."""
    n = len(prompt) // 4
    m = c.match(prompt, lock=True, allocate_tokens=n)
    oracle.write(prompt, m.pages, start_page=m.device_tokens // PAGE)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)


def fill(c: Client, prompts: int, pages: int = 2, base: int = 1000) -> None:
    att = c.attach()
    oracle = KvOracle(att.info, att.pools)
    for i in range(prompts):
        put(c, oracle, tokens(pages * PAGE, base * (i + 1)))


class Stopped:
    """redis-server stopped (SIGSTOP) for the `with` block: a hung store."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def __enter__(self) -> Stopped:
        assert self.server.pid is not None
        os.kill(self.server.pid, signal.SIGSTOP)
        return self

    def resume(self) -> None:
        assert self.server.pid is not None
        os.kill(self.server.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        self.resume()


def metric(port: int, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", scrape(port), re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


# ------------------------------------------------------------------ Flush


@pytest.mark.timeout(60)
def test_a_sub_millisecond_flush_timeout_is_not_the_daemon_default(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_BACK, "storage.timeout_s=2",
                                "server.shutdown_flush_s=4"))
    with d.client(timeout_s=15) as c:
        fill(c, 2)
        with Stopped(server):
            # (a flush that leaves pages behind answers FAILED_PRECONDITION saying so)
            t0 = time.monotonic()
            with pytest.raises(HicacheError, match="4 pages L3 lacks are not written"):
                c.flush(0.002)  # 2 ms: sent as 2, bounded as asked
            two_ms = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(HicacheError, match="4 pages L3 lacks are not written"):
                c.flush(0.0004)  # 0.4 ms: was sent as 0 = the daemon's 4 s default
            sub_ms = time.monotonic() - t0
    assert two_ms < 2.5, two_ms
    assert sub_ms < 2.5, f"flush(timeout_s=0.0004) took {sub_ms:.1f} s (the 4 s default)"


@pytest.mark.timeout(30)
def test_a_flush_timeout_past_the_wire_field_is_capped_not_a_protobuf_error(
    make_daemon: MakeDaemon
) -> None:
    d = make_daemon()
    with d.client(timeout_s=5) as c:
        try:
            written = c.flush(5e6)
        except HicacheError:
            return  # a typed, named refusal would do too
        assert written == 0  # (no L3 configured)


@pytest.mark.timeout(60)
def test_two_flushes_at_once_do_not_both_claim_the_same_pages(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_BACK, "storage.timeout_s=8"))
    with d.client(timeout_s=30) as a, d.client(timeout_s=30) as b:
        fill(a, 3)  # 6 FULL pages pending (write-back)
        before = a.stats().counters["backups_storage"]
        with ThreadPoolExecutor(2) as pool, Stopped(server) as hung:
            # Both flushes start while the store holds the first write; it answers after.
            fa = pool.submit(a.flush, 30)
            time.sleep(0.5)
            fb = pool.submit(b.flush, 30)
            time.sleep(0.5)
            hung.resume()
            written_a, written_b = fa.result(), fb.result()
        stored = a.stats().counters["backups_storage"] - before
    assert stored == 6
    assert written_a + written_b == stored, (written_a, written_b, stored)


@pytest.mark.timeout(60)
def test_a_flush_that_leaves_pending_pages_unwritten_does_not_answer_ok(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_BACK, "storage.timeout_s=2"))
    with d.client(timeout_s=15) as c:
        fill(c, 2)  # 4 pages pending
        outcome: object
        with Stopped(server):
            t0 = time.monotonic()
            try:
                outcome = c.flush(1.0)
            except HicacheError as e:
                outcome = e
            took = time.monotonic() - t0
            at_return = c.stats().counters["backups_storage"]
        assert took < 1.0 + 2.5, took  # bounded by its timeout (plus slack): that part holds
        # Once the store answers, the rest is written: it was pending when Flush returned.
        c.flush(10)
        unwritten = c.stats().counters["backups_storage"] - at_return
    assert at_return < 4 and unwritten > 0, (at_return, unwritten)
    assert isinstance(outcome, HicacheError), (
        f"Flush answered OK with pages_written={outcome} while {unwritten} pages were unwritten")


@pytest.mark.timeout(60)
def test_a_flush_with_a_hung_store_blocks_no_other_rpc_and_nothing_pending_is_quick(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    """While a Flush waits on a hung store, Stats, shallow Health and a match of L1 data
    answer in milliseconds; a flush with nothing pending returns 0 at once; the pages
    come down once the store answers."""
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_BACK, "storage.timeout_s=3"))
    with d.client(timeout_s=20) as c, d.client(timeout_s=5) as other:
        fill(c, 2)
        with ThreadPoolExecutor(1) as pool, Stopped(server):
            flushing = pool.submit(c.flush, 2.0)
            time.sleep(0.3)
            for call in (other.stats, lambda: other.health(False),
                         lambda: other.match(tokens(2 * PAGE, 1000))):
                t0 = time.monotonic()
                call()
                assert time.monotonic() - t0 < 1.5  # (not the flush's 2 s)
            assert other.match(tokens(2 * PAGE, 1000)).device_tokens == 2 * PAGE
            with pytest.raises(HicacheError, match="pages L3 lacks are not written"):
                flushing.result()
        c.flush(10)
        assert c.stats().counters["backups_storage"] == 4
        t0 = time.monotonic()
        assert c.flush(10) == 0  # nothing left
        assert time.monotonic() - t0 < 3.0


def test_flush_without_l3_returns_zero_and_zero_timeout_is_the_default(
    make_daemon: MakeDaemon
) -> None:
    d = make_daemon()
    with d.client(timeout_s=5) as c:
        fill(c, 1)
        assert c.flush() == 0
        assert c.flush(0.001) == 0
        assert c.health(True) == () and c.health(False) == ()
    rc = run_cli("health", "--target", d.target, "--deep", "--json")
    assert rc.returncode == 0 and json.loads(rc.stdout)["backends"] == []


# ------------------------------------------------------------------ Health


@pytest.mark.timeout(60)
def test_deep_health_on_a_full_store_does_not_trip_the_read_breaker(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    server = redis_factory()
    port = free_port()
    d = make_daemon(*redis_sets(server, *WRITE_THROUGH, "storage.timeout_s=1"),
                    f"metrics.port={port}")
    r = redis.Redis.from_url(server.url)
    try:
        r.config_set("maxmemory-policy", "noeviction")
        # Well under what it uses: at just that, a moment's drop (a client's buffer freed)
        # let a canary's few bytes in, and the store looked writable (a CI failure).
        r.config_set("maxmemory", max(64 << 10, int(r.info("memory")["used_memory"]) // 2))
        assert r.ping()  # reads still served
        with d.client(timeout_s=10) as c:
            for _ in range(3):  # rounds: a periodic healthy probe in between resets a round
                reports = [c.health(True)[0] for _ in range(3)]
                assert not any(h.healthy for h in reports)  # (refusing page writes: fair)
                assert "canary write refused" in reports[0].detail
                if metric(port, "hicache_l3_breaker_trips_total"):
                    break
        assert metric(port, "hicache_l3_breaker_trips_total") == 0
    finally:
        r.config_set("maxmemory", 0)
        r.close()


@pytest.mark.timeout(60)
def test_deep_health_with_a_hung_store_is_bounded_and_the_cli_exits_1(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    """A hung store: a deep Health answers unhealthy within storage.timeout_s (plus
    slack), a shallow one at once, and `hicache health --deep --json` exits 1 with every
    documented key."""
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_THROUGH, "storage.timeout_s=1"))
    with d.client(timeout_s=10) as c, Stopped(server):
        t0 = time.monotonic()
        (deep,) = c.health(True)
        assert time.monotonic() - t0 < 4.0
        assert not deep.healthy and deep.name == "redis"
        t0 = time.monotonic()
        (shallow,) = c.health(False)
        assert time.monotonic() - t0 < 1.5 and not shallow.healthy
        out = run_cli("health", "--target", d.target, "--deep", "--json")
        assert out.returncode == 1, out
        report = json.loads(out.stdout)
        assert {"target", "reachable", "serving", "backends"} <= set(report)
        assert report["reachable"] is True
        (b,) = report["backends"]
        assert set(b) == {"name", "healthy", "latency_ms", "detail", "capacity_bytes",
                          "used_bytes"}
        assert b["healthy"] is False


def test_health_and_stats_cli_json_schemas_on_a_healthy_redis_daemon(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    server = redis_factory()
    d = make_daemon(*redis_sets(server, *WRITE_THROUGH, "storage.required=true"))
    with d.client(timeout_s=10) as c:
        fill(c, 1)
        c.flush(5)
    out = run_cli("health", "--target", d.target, "--deep", "--json")
    assert out.returncode == 0, out
    report = json.loads(out.stdout)
    assert report["reachable"] is True and report["serving"] is True
    (b,) = report["backends"]
    assert set(b) == {"name", "healthy", "latency_ms", "detail", "capacity_bytes", "used_bytes"}
    assert b["healthy"] is True and b["name"] == "redis" and b["latency_ms"] >= 0
    assert "canary" in b["detail"]
    out = run_cli("stats", "--target", d.target, "--json")
    assert out.returncode == 0, out
    stats = json.loads(out.stdout)
    assert {"target", "reachable", "pools", "counters"} <= set(stats)
    assert {(p["tier"], p["member"]) for p in stats["pools"]} == {("device", "full"),
                                                                  ("host", "full")}
    for p in stats["pools"]:
        assert set(p) == {"tier", "member", "capacity_pages", "used_pages", "locked_pages"}
    counters = stats["counters"]
    for key in ("lookups", "l3_errors", "expired_leases", "hit_tokens_device",
                "evictions_device", "backups_storage", "prefetches_done"):
        assert key in counters, key
    assert counters["backups_storage"] >= 2


# ------------------------------------------------------------------ Stats


@pytest.mark.timeout(60)
def test_stats_while_pools_churn_stay_within_bounds_and_counters_are_monotone(
    make_daemon: MakeDaemon
) -> None:
    """Two engine threads fill L1 (16 pages) and L2 (32) past capacity with random
    prompts while a third polls Stats: used <= capacity, locked <= used, and every
    counter but the gauges never goes down."""
    d = make_daemon(*WRITE_THROUGH)
    stop = threading.Event()
    errors: list[BaseException] = []

    def engine(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with d.client(timeout_s=10, engine_id=f"churn-{seed}") as c:
                att = c.attach()
                oracle = KvOracle(att.info, att.pools)
                i = 0
                while not stop.is_set() and i < 400:
                    pages = int(rng.integers(1, 4))
                    start = int(rng.integers(0, 40)) * 10_000 + seed * 1_000_000
                    try:
                        put(c, oracle, tokens(pages * PAGE, start))
                    except HicacheError as e:
                        if "RESOURCE_EXHAUSTED" not in repr(e) and "room" not in str(e):
                            raise
                    i += 1
        except BaseException as e:
            errors.append(e)

    gauges = {"prefetches_running"}
    threads = [threading.Thread(target=engine, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    try:
        with d.client(timeout_s=10) as c:
            last: dict[str, int] = {}
            deadline = time.monotonic() + 8.0
            polls = 0
            while time.monotonic() < deadline and any(t.is_alive() for t in threads):
                snap = c.stats()
                polls += 1
                for p in snap.pools:
                    assert 0 <= p.used_pages <= p.capacity_pages, p
                    assert 0 <= p.locked_pages <= p.used_pages, p
                for k, v in snap.counters.items():
                    if k not in gauges:
                        assert v >= last.get(k, 0), (k, last.get(k), v)
                last = {k: v for k, v in snap.counters.items()}
                time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert polls > 10
    assert last["lookups"] > 0 and last["evictions_device"] > 0
