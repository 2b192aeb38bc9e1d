"""Review: L3 backends that go down and come back while a real daemon runs.

Redis killed mid-workload and restarted (empty: the fixture's server keeps no data), a
hung store under a prefetch, the file backend's root removed or replaced, the Mooncake
master killed and restarted, SIGTERM with the store dead. During the outage L1/L2 keep
serving byte-exact data and L3 is reported down; afterwards new inserts reach L3 again
and a second daemon reads them; nothing is left reserved in L2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.bench.oracle import KvOracle
from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.client import Attachment, Client
from hicache.config import load_config
from hicache.controller.base import PrefetchState
from hicache.errors import FailedPrecondition
from hicache.server import longest_stop_s

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

MakeDaemon = Callable[..., Daemon]
MakeRedis = Callable[[], RedisServer]

WRITE_THROUGH = (
    "write.l1_to_l2=write_through",
    "write.l2_to_l3=write_through",
    "prefetch.policy=wait_complete",
    "storage.timeout_s=1",
)
PAGES = 6  # one prompt: 384 tokens, above the prefetch threshold (256), within L1 (16 pages)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def redis_sets(redis: RedisServer) -> tuple[str, ...]:
    return ("storage.backend=redis", f"storage.redis.url={redis.url}", *WRITE_THROUGH)


def put(c: Client, oracle: KvOracle, prompt: bytes) -> None:
    """One request computing all of `prompt` (its KV written by the oracle) and inserting it."""
    n = len(prompt) // 4
    m = c.match(prompt, lock=True, allocate_tokens=n)
    oracle.write(prompt, m.pages, start_page=m.device_tokens // PAGE)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)


def host_used(c: Client) -> int:
    return sum(p.used_pages for p in c.stats().pools if p.tier == "host")


def wait_prefetch(c: Client, prefetch_id: int, timeout_s: float = 15.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (state := c.prefetch_status(prefetch_id).state) is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, "prefetch still running"
        time.sleep(0.02)
    return state


def load_and_verify(c: Client, oracle: KvOracle, prompt: bytes) -> int:
    """Match `prompt`, load its L2 part, check every page's bytes; the tokens reused."""
    with c.matched(prompt) as hit:
        reused = hit.device_tokens
        pages = hit.device_pages
        if hit.host_tokens:
            last = list(c.load(hit.lock_id))[-1]
            assert last.device_pages is not None and last.device_tokens is not None
            reused, pages = last.device_tokens, last.device_pages
        oracle.verify(prompt, pages, reused // PAGE)
    return reused


def prefetch_load_and_verify(
    c: Client, oracle: KvOracle, prompt: bytes, *, all_in_l3: bool = True
) -> None:
    """Prefetch `prompt` (every page in L3 when `all_in_l3`) to DONE, then load and verify
    it whole; the oracle has checked pages and found no wrong byte."""
    with c.matched(prompt, prefetch=True) as m:
        assert m.prefetch_id
        if all_in_l3:
            assert m.storage_tokens == PAGES * PAGE
        assert wait_prefetch(c, m.prefetch_id) is PrefetchState.DONE
    assert load_and_verify(c, oracle, prompt) == PAGES * PAGE
    assert oracle.wrong_bytes == 0 and oracle.pages_checked > 0


def breaker_tripped(c: Client, prompt: bytes) -> bool:
    """Lookups of a prompt nobody has (each asks L3) until the circuit breaker opened."""
    c.match(prompt)
    return c.stats().counters["l3_errors"] >= 3  # (the breaker's threshold)


def dropped(port: int) -> float:
    """`hicache_backups_dropped_total`: backups given up (the breaker open, the queue full)."""
    found = re.search(r"^hicache_backups_dropped_total (\S+)$", scrape(port), re.MULTILINE)
    assert found, "hicache_backups_dropped_total not exported"
    return float(found.group(1))


def deep_health_rc(d: Daemon) -> int:
    return run_cli("health", "--target", d.target, "--deep").returncode


def attach(c: Client) -> tuple[Attachment, KvOracle]:
    att = c.attach()
    return att, KvOracle(att.info, att.pools)


# --------------------------------------------------------------------------- redis restart


@pytest.mark.timeout(120)
def test_redis_killed_mid_workload_then_restarted_empty(
    redis_factory: MakeRedis, make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """While redis is down: L1 data is served byte-exact, lookups report nothing in L3 and
    start no prefetch, the backups that fail are counted (nothing dies), `health --deep`
    exits 1, the daemon (L3 not required) stays SERVING. After it is back (empty): health
    0; a prefetch of a prefix the old store held starts nothing or ends FAILED, holding no
    L2 page after; what was inserted during the outage goes down with Flush and another
    daemon prefetches and loads it byte-exact."""
    redis = redis_factory()
    other = make_daemon(*redis_sets(redis), listen=f"unix://{tmp_path}/w.sock")
    port = free_port()
    d = make_daemon(*redis_sets(redis), f"metrics.port={port}", listen=f"unix://{tmp_path}/a.sock")
    old = tokens(PAGES * PAGE, start=90_000)  # in the old store only (the other daemon's)
    hot = tokens(PAGES * PAGE, start=100_000)  # in L1 through the outage
    during = tokens(PAGES * PAGE, start=200_000)  # inserted while redis is down
    with other.client() as w:
        _, writer = attach(w)
        put(w, writer, old)
        assert w.flush(10) == PAGES
    with d.client() as c:
        _, oracle = attach(c)
        put(c, oracle, hot)
        assert c.flush(10) == PAGES
        assert c.match(old).storage_tokens == PAGES * PAGE
        assert deep_health_rc(d) == 0

        redis.stop(kill=True)
        wait_for(
            lambda: breaker_tripped(c, tokens(PAGES * PAGE, start=900_000)), 20, "breaker open"
        )
        put(c, oracle, during)
        assert load_and_verify(c, oracle, hot) == PAGES * PAGE
        assert load_and_verify(c, oracle, during) == PAGES * PAGE
        m = c.match(old, prefetch=True)
        assert (m.storage_tokens, m.prefetch_id) == (0, 0)
        assert deep_health_rc(d) == 1
        wait_for(lambda: dropped(port) >= PAGES, 10, "the backups given up counted")
        assert c.serving("hicache.v1.HiCache") and c.serving()

        redis.start()  # same port, no data
        wait_for(lambda: deep_health_rc(d) == 0, 30, "health --deep 0 again")
        assert c.flush(10) == PAGES  # `during` (`hot` counts as stored: it is not again)
        before = host_used(c)
        with c.matched(old, prefetch=True) as m:
            if m.prefetch_id:
                assert wait_prefetch(c, m.prefetch_id) is PrefetchState.FAILED
                assert c.prefetch_status(m.prefetch_id).tokens_ready == 0
        assert host_used(c) == before
        again = c.match(old, prefetch=True)
        assert (again.storage_tokens, again.prefetch_id) == (0, 0)
        assert load_and_verify(c, oracle, hot) == PAGES * PAGE
        assert oracle.wrong_bytes == 0 and oracle.pages_checked > 0

    with other.client() as r:
        _, reader = attach(r)
        prefetch_load_and_verify(r, reader, during)


def stored_by_another(
    make_daemon: MakeDaemon, redis: RedisServer, tmp_path: Path, prompt: bytes
) -> None:
    """A writer daemon computes `prompt`, writes it through to L3 and stops."""
    writer = make_daemon(*redis_sets(redis), listen=f"unix://{tmp_path}/writer.sock")
    with writer.client() as w:
        _, oracle = attach(w)
        put(w, oracle, prompt)
        assert w.flush(10) == PAGES
    assert writer.stop() == 0


def reader_knowing(
    make_daemon: MakeDaemon, redis: RedisServer, tmp_path: Path, prompt: bytes
) -> Daemon:
    """A second daemon (its L2 empty) whose lookup found `prompt` in L3 (and remembers it)."""
    stored_by_another(make_daemon, redis, tmp_path, prompt)
    d = make_daemon(*redis_sets(redis), listen=f"unix://{tmp_path}/reader.sock")
    with d.client() as c:
        m = c.match(prompt)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, PAGES * PAGE)
        assert host_used(c) == 0
    return d


def outage(c: Client, redis: RedisServer, d: Daemon, probe_start: int) -> None:
    """Kill redis, wait for the breaker to open, restart it (empty), wait for health 0."""
    redis.stop(kill=True)
    wait_for(
        lambda: breaker_tripped(c, tokens(PAGES * PAGE, start=probe_start)), 20, "breaker open"
    )
    redis.start()
    wait_for(lambda: deep_health_rc(d) == 0, 30, "health --deep 0 again")


@pytest.mark.timeout(120)
def test_pages_the_store_lost_in_an_outage_are_not_promised_after_it(
    redis_factory: MakeRedis, make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Redis restarted without its data (no persistence, as here; a Mooncake master
    restarted likewise forgets every object): once the daemon saw the store go down and
    come back, a lookup must not report the pages it knew from before as in L3."""
    redis = redis_factory()
    lost = tokens(PAGES * PAGE, start=300_000)
    d = reader_knowing(make_daemon, redis, tmp_path, lost)
    with d.client() as c:
        outage(c, redis, d, probe_start=900_000)
        assert c.match(lost).storage_tokens == 0


@pytest.mark.timeout(120)
def test_a_prefetch_whose_store_hangs_fails_and_its_l2_pages_come_back_once_it_answers(
    redis_factory: MakeRedis, make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Redis stopped (SIGSTOP) under a prefetch: the read times out, the prefetch ends
    FAILED with nothing ready; its L2 pages (held while a read given up on may still
    land) are all back once redis answers again; the prefix is then prefetched whole
    and byte-exact."""
    redis = redis_factory()
    prompt = tokens(PAGES * PAGE, start=500_000)
    d = reader_knowing(make_daemon, redis, tmp_path, prompt)
    with d.client() as c:
        _, oracle = attach(c)
        assert redis.pid is not None
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            with c.matched(prompt, prefetch=True) as m:  # the lookup: known present, no call
                assert m.storage_tokens == PAGES * PAGE and m.prefetch_id
                assert wait_prefetch(c, m.prefetch_id) is PrefetchState.FAILED
                assert c.prefetch_status(m.prefetch_id).tokens_ready == 0
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        wait_for(lambda: host_used(c) == 0, 15, "the prefetch's L2 pages back")
        wait_for(lambda: deep_health_rc(d) == 0, 30, "health --deep 0 again")
        prefetch_load_and_verify(c, oracle, prompt, all_in_l3=False)


# --------------------------------------------------------------------------- SIGTERM


@pytest.mark.timeout(120)
def test_sigterm_with_the_store_dead_exits_0_in_bound_and_says_what_it_could_not_flush(
    redis_factory: MakeRedis, make_daemon: MakeDaemon
) -> None:
    """10 write-back pages only in L1 and L2, redis killed at SIGTERM (connections refused
    at once, unlike the hung store of test_operator_paths): the flush gives up, the daemon
    unlinks its shared memory and socket and exits 0 within `longest_stop_s`. The pages
    are lost with the process: an operator reading the log must learn that (a warning
    that counts them), not only "flushed 0 pages to L3", what a daemon with nothing
    pending also says."""
    redis = redis_factory()
    d = make_daemon(
        "storage.backend=redis",
        f"storage.redis.url={redis.url}",
        "write.l1_to_l2=write_back",
        "write.l2_to_l3=write_back",
        "storage.timeout_s=1",
        "server.shutdown_flush_s=4",
    )
    with d.client() as c:
        att, oracle = attach(c)
        segments = [Path("/dev/shm") / p.handle.decode() for p in att.info.pools]
        for i in range(2):
            put(c, oracle, tokens(5 * PAGE, start=600_000 + 10_000 * i))
    redis.stop(kill=True)
    bound = longest_stop_s(load_config(None, list(d.sets)))
    started = time.monotonic()
    assert d.stop(timeout_s=bound + 10) == 0
    took = time.monotonic() - started
    assert took < bound, (took, bound)
    assert not any(s.exists() for s in segments) and not d.socket.exists()
    log = d.log()
    assert "stopped" in log
    assert "flushed 0 pages to L3" in log, log
    lines = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert any(re.search(r"\b10\b.*\bpages?\b", line) for line in lines), lines


# --------------------------------------------------------------------------- file backend


def file_sets(store: Path) -> tuple[str, ...]:
    return ("storage.backend=file", f"storage.file.path={store}", *WRITE_THROUGH)


def objects(store: Path) -> int:
    return sum(1 for p in store.rglob("*.kv") if p.is_file()) if store.is_dir() else 0


@pytest.mark.timeout(120)
def test_a_file_root_removed_or_replaced_under_a_writing_daemon(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`rm -rf` of the root while engines insert: the next write makes it again. The root
    moved aside and a regular file put in its place: `health --deep` exits 1, L1 serves
    byte-exact, the daemon stays SERVING; once the directory is back in place, health is
    0 and Flush writes what came meanwhile. A second daemon on the directory reads both
    prompts byte-exact."""
    store = tmp_path / "l3"
    d = make_daemon(*file_sets(store), listen=f"unix://{tmp_path}/a.sock")
    removed = tokens(PAGES * PAGE, start=700_000)  # inserted after the rm -rf
    replaced = tokens(PAGES * PAGE, start=740_000)  # inserted while a file is the root
    with d.client() as c:
        _, oracle = attach(c)
        put(c, oracle, tokens(PAGES * PAGE, start=710_000))
        assert c.flush(10) == PAGES and objects(store) == PAGES
        shutil.rmtree(store)
        put(c, oracle, removed)
        assert c.flush(10) == PAGES
        assert objects(store) == PAGES
        wait_for(lambda: deep_health_rc(d) == 0, 20, "health --deep 0")

        aside = store.rename(tmp_path / "aside")
        store.write_bytes(b"not a directory")
        put(c, oracle, replaced)
        with pytest.raises(FailedPrecondition, match="pages L3 lacks"):  # (named, not OK)
            c.flush(3)
        assert deep_health_rc(d) == 1
        assert load_and_verify(c, oracle, replaced) == PAGES * PAGE
        assert c.serving()
        store.unlink()
        aside.rename(store)
        wait_for(lambda: deep_health_rc(d) == 0, 20, "health --deep 0 again")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                c.flush(2)
                break
            except FailedPrecondition:  # (not taking writes yet: the breaker's cool-down)
                time.sleep(0.2)
        assert c.flush(2) == 0 and objects(store) == 2 * PAGES
        assert oracle.wrong_bytes == 0
    second = make_daemon(*file_sets(store), listen=f"unix://{tmp_path}/b.sock")
    with second.client() as r:
        _, reader = attach(r)
        for prompt in (removed, replaced):
            prefetch_load_and_verify(r, reader, prompt)


@pytest.mark.timeout(120)
def test_a_file_root_removed_under_an_idle_daemon_comes_back(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The same `rm -rf` while no insert comes for a while (here: three health probes,
    what the prober does in 15 s idle): the store is writable all along (a write makes
    the root again, as the test before shows), so L3 must come back to health 0 and take
    the next inserts, as it does when a write comes first."""
    store = tmp_path / "l3"
    d = make_daemon(*file_sets(store))
    with d.client() as c:
        _, oracle = attach(c)
        put(c, oracle, tokens(PAGES * PAGE, start=720_000))
        assert c.flush(10) == PAGES
        shutil.rmtree(store)
        for _ in range(3):  # what the prober does in 15 s: a probe that fails counts
            deep_health_rc(d)
        put(c, oracle, tokens(PAGES * PAGE, start=730_000))
        deadline = time.monotonic() + 4  # (with the breaker open it is probed every 0.5 s)
        written = 0
        while written < PAGES and time.monotonic() < deadline:
            written += c.flush(2)
            time.sleep(0.5)
        assert written == PAGES and objects(store) == PAGES
        assert deep_health_rc(d) == 0


# --------------------------------------------------------------------------- mooncake


@pytest.mark.timeout(120)
def test_mooncake_master_killed_and_restarted_under_a_daemon(
    mooncake_factory: Callable[[], MooncakeMaster], make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The master killed: `health --deep` exits 1, L1 serves byte-exact, the daemon stays
    SERVING. Restarted (same ports, no objects): health 0, a new insert goes down (its
    segment is mounted again) and a second daemon prefetches and loads it byte-exact
    (the first stays up: its segment holds the object)."""
    master = mooncake_factory()
    sets = (
        "storage.backend=mooncake",
        f"storage.mooncake.master={master.master}",
        f"storage.mooncake.metadata_server={master.metadata_server}",
        f"storage.mooncake.global_segment_size={64 << 20}",
        f"storage.mooncake.local_buffer_size={16 << 20}",
        *WRITE_THROUGH,
        "storage.timeout_s=2",  # (the later --set wins)
    )
    d = make_daemon(*sets, listen=f"unix://{tmp_path}/a.sock")
    before = tokens(PAGES * PAGE, start=800_000)
    after = tokens(PAGES * PAGE, start=810_000)
    with d.client() as c:
        _, oracle = attach(c)
        put(c, oracle, before)
        assert c.flush(10) == PAGES
        master.stop(kill=True)
        assert deep_health_rc(d) == 1
        assert load_and_verify(c, oracle, before) == PAGES * PAGE
        assert c.serving()
        master.start()
        wait_for(lambda: deep_health_rc(d) == 0, 30, "health --deep 0 again")
        put(c, oracle, after)
        deadline = time.monotonic() + 20
        written = 0
        while written < PAGES and time.monotonic() < deadline:
            written += c.flush(3)
        assert written == PAGES
        assert oracle.wrong_bytes == 0
    second = make_daemon(*sets, listen=f"unix://{tmp_path}/b.sock")
    with second.client() as r:
        _, reader = attach(r)
        prefetch_load_and_verify(r, reader, after)
    assert d.proc is not None and d.proc.poll() is None
