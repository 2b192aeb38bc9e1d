"""Review: L3 stores that forget what the daemon wrote while it runs.

Redis flushed by an operator (`FLUSHALL`), Redis evicting objects under `maxmemory` with
`allkeys-lru`, Redis restarted without persistence between two calls (no call fails, the
breaker never opens), the Mooncake master restarted (its objects are gone), the file
store's contents wiped or its root removed. The daemon's existence cache (and its tree)
still believe the pages are in L3. Checked: a lookup, prefetch or load never serves wrong
bytes; a prefetch of what is gone ends (FAILED, counted) and never hangs; the next lookup
is exact; the data is written again when it is next computed; `health --deep` reflects
the store; counters say what happened.

Not re-filed here (documented): pages a daemon still holds in L1/L2 stay recorded as in
L3 after the store lost them (README "Failure handling", and the `ttl_s` known limit).

Real daemons through the real client where the behaviour is end to end; in-process
controllers (`tests/controller/engine_sim.py`, its engine writes and checks KV byte for
byte) where the test needs precise control. Tests marked xfail(strict) pin bugs.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from hicache.bench.oracle import KvOracle
from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.client import Client
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.errors import BackendUnavailable
from hicache.types import Tier

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import Engine, built_controllers, evict_all, seq, wait_prefetch

MakeDaemon = Callable[..., Daemon]
MakeRedis = Callable[[], RedisServer]
PAGES = 6  # one daemon prompt: 384 tokens, above the prefetch threshold, within L1
PS = 4  # the controllers' (tiny_config) page size
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


# ------------------------------------------------------------------------- helpers


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """In-process controllers (tiny_config), audited (`check_integrity`) and closed."""
    with built_controllers(tmp_path, prefix="fg") as factory:
        yield factory


def prefetch(
    ctl: Any, tokens_: bytes, engine_id: str = "e1"
) -> tuple[int, PrefetchState | None, int]:
    """Match with a prefetch, wait (bounded: a hang fails) for its end, release the lock:
    (storage_tokens promised, final state or None when none started, tokens_ready)."""
    m = ctl.match(engine_id, MatchRequest("", tokens_, lock=True, prefetch=True))
    try:
        if not m.prefetch_id:
            return m.storage_tokens, None, 0
        state = wait_prefetch(ctl, m.prefetch_id, timeout_s=15)
        info = ctl.prefetch_status(m.prefetch_id)
        assert info.tokens_ready % PS == 0 and info.tokens_ready <= info.tokens_total
        return m.storage_tokens, state, info.tokens_ready
    finally:
        ctl.release(engine_id, m.lock_id, None)


def host_used(ctl: Any) -> int:
    with ctl._mu:
        return sum(
            ctl.host.allocator(k).total - ctl.host.allocator(k).free_count for k in ctl._kinds
        )


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def put(c: Client, oracle: KvOracle, prompt: bytes) -> None:
    """One request computing all of `prompt` past what L1 holds, and inserting it."""
    m = c.match(prompt, lock=True, allocate_tokens=len(prompt) // 4)
    oracle.write(prompt, m.pages, start_page=m.device_tokens // PAGE)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)


def wait_client_prefetch(c: Client, prefetch_id: int, timeout_s: float = 15.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (state := c.prefetch_status(prefetch_id).state) is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, "prefetch still running: it hangs"
        time.sleep(0.02)
    return state


def client_host_used(c: Client) -> int:
    return sum(p.used_pages for p in c.stats().pools if p.tier == "host")


def redis_sets(server: RedisServer) -> tuple[str, ...]:
    return (
        "storage.backend=redis",
        f"storage.redis.url={server.url}",
        "write.l1_to_l2=write_through",
        "write.l2_to_l3=write_through",
        "prefetch.policy=wait_complete",
        "storage.timeout_s=1",
    )


def metric(port: int, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", scrape(port), re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


def kv_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*.kv") if p.is_file()] if store.is_dir() else []


# ------------------------------------------------- real daemons on a flushed Redis


@pytest.mark.timeout(90)
def test_redis_flushall_under_a_daemon_fails_the_prefetch_and_the_recomputed_prompt_is_stored_again(
    redis_factory: MakeRedis, make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A writer stores a prompt and stops; a reader's lookup finds it (known present).
    An operator runs FLUSHALL. The reader's next prefetch of it (promised from what it
    knew) ends FAILED with nothing ready and no L2 page held, counted as a failed
    prefetch and no L3 error; the lookup after it promises nothing; the reader computes
    the prompt again and its write-through stores it (`backups_l3`, not `..._present`);
    health --deep stays 0. A third daemon prefetches and loads it byte-exact."""
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    prompt = tokens(PAGES * PAGE, start=410_000)
    writer = make_daemon(*redis_sets(server), listen=f"unix://{tmp_path}/w.sock")
    with writer.client() as w:
        att = w.attach()
        put(w, KvOracle(att.info, att.pools), prompt)
        assert w.flush(10) == PAGES
    assert writer.stop() == 0
    port = free_port()
    reader = make_daemon(
        *redis_sets(server), f"metrics.port={port}", listen=f"unix://{tmp_path}/r.sock"
    )
    with reader.client() as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        assert c.match(prompt).storage_tokens == PAGES * PAGE  # known present now
        r.flushall()
        before = c.stats().counters
        present_before = metric(port, "hicache_backups_l3_present_total")
        with c.matched(prompt, prefetch=True) as m:
            if m.prefetch_id:  # (promised from the existence cache)
                assert wait_client_prefetch(c, m.prefetch_id) is PrefetchState.FAILED
                assert c.prefetch_status(m.prefetch_id).tokens_ready == 0
        assert client_host_used(c) == 0
        again = c.match(prompt)
        assert (again.device_tokens, again.host_tokens, again.storage_tokens) == (0, 0, 0)
        put(c, oracle, prompt)
        c.flush(10)
        after = c.stats().counters
        changed = delta(after, before)
        assert changed.get("prefetches_failed", 0) == (1 if m.prefetch_id else 0), changed
        assert changed.get("l3_errors", 0) == 0, changed
        assert changed.get("backups_storage", 0) == PAGES, changed
        assert metric(port, "hicache_backups_l3_present_total") == present_before
        assert r.dbsize() == PAGES
        assert run_cli("health", "--target", reader.target, "--deep").returncode == 0
        assert c.serving()
    third = make_daemon(*redis_sets(server), listen=f"unix://{tmp_path}/x.sock")
    with third.client() as x:
        att = x.attach()
        check = KvOracle(att.info, att.pools)
        with x.matched(prompt, prefetch=True) as m:
            assert m.storage_tokens == PAGES * PAGE and m.prefetch_id
            assert wait_client_prefetch(x, m.prefetch_id) is PrefetchState.DONE
        with x.matched(prompt) as hit:
            last = list(x.load(hit.lock_id))[-1]
            assert last.device_tokens == PAGES * PAGE and last.device_pages is not None
            check.verify(prompt, last.device_pages, PAGES)
        assert check.wrong_bytes == 0 and check.pages_checked > 0
    r.close()


# ------------------------------------------- controllers: Redis evicting, restarted


@pytest.mark.timeout(60)
def test_redis_lru_eviction_under_maxmemory_never_serves_wrong_bytes_and_heals(
    make: Callable[..., Any], redis_factory: MakeRedis
) -> None:
    """Prompts written through, L1/L2 emptied (L3 alone holds them), then Redis at a small
    `maxmemory` with `allkeys-lru` evicts them under other keys. Every prefetch of them
    ends (DONE or FAILED with a page-aligned prefix ready, never running on), every page
    a match or load reports is byte-exact, no L3 error is counted; once the engine has
    computed them again, each prefetch from L3 alone is DONE whole."""
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    ctl = make(backend="redis", storage__redis={"url": server.url}, l1_tokens=256, **THROUGH)
    eng = Engine(ctl)
    prompts = [seq(n, 10_000 * (i + 1)) for i, n in enumerate((3, 5, 8, 6, 4))]
    prompts.append(prompts[2] + seq(3, 99_000))  # shares a prefix with another
    for p in prompts:
        eng.request(p)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    ours = len(r.keys("hc2/*"))
    assert ours == sum(len(p) for p in prompts[:5]) // (PS * 4) + 3
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", used + 64 * 1024)
    filler = b"x" * 4096
    for i in range(400):  # far past maxmemory: LRU evicts (most of) ours
        r.set(f"junk/{i}", filler)
    assert int(r.info("stats")["evicted_keys"]) > 0
    left = len(r.keys("hc2/*"))
    assert left < ours, (left, ours)
    r.config_set("maxmemory", 0)
    r.delete(*r.keys("junk/*"))
    before = ctl.stats().counters
    ended = 0
    for p in prompts:
        promised, state, ready = prefetch(ctl, p)
        assert state in (None, PrefetchState.DONE, PrefetchState.FAILED), state
        ended += state is not None
        eng.request(p)  # verifies what the match and the load report, recomputes the rest
    assert ctl.transfers.drain(10)
    ctl.flush(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    for p in prompts:
        promised, state, ready = prefetch(ctl, p)
        assert state is PrefetchState.DONE and ready == promised > 0, (promised, state, ready)
        m = eng.request(p)
        assert m.device_tokens + m.host_tokens == len(p) // 4
    changed = delta(ctl.stats().counters, before)
    assert changed.get("l3_errors", 0) == 0, changed
    assert changed.get("prefetches_started", 0) == ended + len(prompts), changed
    assert eng.checked > 0
    r.close()


@pytest.mark.timeout(60)
def test_redis_restarted_empty_between_two_calls_prefetch_fails_once_then_heals(
    make: Callable[..., Any], redis_factory: MakeRedis
) -> None:
    """Redis restarted without persistence while the daemon is idle: no call fails, the
    breaker never opens, so what the daemon knew present is still known. A prefetch of it
    ends FAILED (not an L3 error: the store answered), the next lookup is exact, and a
    recomputation stores it again (counted as stored, not as present)."""
    server = redis_factory()
    ctl = make(backend="redis", storage__redis={"url": server.url}, **THROUGH)
    eng = Engine(ctl)
    prompt = seq(6, 1000)
    eng.request(prompt)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 24
    server.stop(kill=True)
    server.start()
    before = ctl.stats().counters
    promised, state, ready = prefetch(ctl, prompt)
    assert (state, ready) in ((PrefetchState.FAILED, 0), (None, 0)), (promised, state, ready)
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 0
    eng.request(prompt)
    assert ctl.transfers.drain(10)
    changed = delta(ctl.stats().counters, before)
    assert changed.get("l3_errors", 0) == 0 and changed.get("l3_breaker_trips", 0) == 0, changed
    assert (changed.get("backups_l3", 0), changed.get("backups_l3_present", 0)) == (6, 0), changed
    assert all(h.healthy for h in ctl.health(True))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert prefetch(ctl, prompt)[1:] == (PrefetchState.DONE, 24)
    eng.request(prompt)


@pytest.mark.timeout(60)
def test_hybrid_model_on_a_redis_that_lost_a_third_of_its_objects_never_serves_wrong_bytes(
    make: Callable[..., Any], redis_factory: MakeRedis
) -> None:
    """FULL+SWA+MAMBA with sidecars: a seeded third of the objects (any member, any page:
    what an LRU leaves) deleted under the controller. Every prefetch ends, every reused
    page and checkpoint is byte-exact, and after the prompts were computed again every
    one comes back from L3 alone whole."""
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    ctl = make(
        hybrid=True, l1_tokens=256, backend="redis", storage__redis={"url": server.url}, **THROUGH
    )
    eng = Engine(ctl)
    rng = random.Random(7)
    prompts = [seq(rng.randint(3, 9), 1000 * (i + 1)) for i in range(5)]
    prompts += [prompts[0] + seq(3, 77_000), prompts[1][: 2 * PS * 4] + seq(4, 88_000)]
    for p in prompts:
        eng.request(p)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    keys = sorted(r.keys("hc2/*"))
    r.delete(*rng.sample(keys, len(keys) // 3))
    for p in prompts:
        _, state, _ = prefetch(ctl, p)
        assert state in (None, PrefetchState.DONE, PrefetchState.FAILED)
        eng.request(p)
    assert ctl.transfers.drain(10)
    ctl.flush(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    for p in prompts:
        promised, state, ready = prefetch(ctl, p)
        assert state is PrefetchState.DONE and ready == promised > 0, (promised, state, ready)
        m = eng.request(p)
        assert m.device_tokens + m.host_tokens == len(p) // 4
    assert eng.checked > 0
    r.close()


# ------------------------------------------------------- controllers: Mooncake


@pytest.mark.timeout(150)  # (the Mooncake client's close after a master restart: up to ~50 s)
def test_mooncake_master_restarted_between_two_calls_prefetch_fails_once_then_heals(
    make: Callable[..., Any], mooncake_factory: Callable[[], MooncakeMaster]
) -> None:
    """The master restarted (its objects' metadata gone) while the controller is idle.
    A prefetch of a prompt it knew present ends FAILED, never hangs, holds no L2 page; the
    next lookup is exact; the recomputed prompt is written again once the segment is
    mounted again, and a prefetch from L3 alone is then DONE whole; health --deep is ok."""
    master = mooncake_factory()
    ctl = make(
        backend="mooncake",
        storage__timeout_s=2.0,
        storage__mooncake={
            "master": master.master,
            "metadata_server": master.metadata_server,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
        },
        **THROUGH,
    )
    eng = Engine(ctl)
    prompt = seq(6, 3000)
    eng.request(prompt)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 24
    master.stop(kill=True)
    master.start()
    # The client reconnects by itself (~1 s, longer on a loaded machine). A prefetch before
    # that fails as "unreachable", which tells nothing of the objects (the existence cache
    # keeps them); the test is about a master that answers and has forgotten them.
    deadline = time.monotonic() + 30
    while True:
        try:
            ctl.l3.backend.exists_prefix(["hicache-test/reconnected"])
            break
        except BackendUnavailable:
            assert time.monotonic() < deadline, "the client never reconnected to the master"
            time.sleep(0.2)
    promised, state, ready = prefetch(ctl, prompt)
    assert state in (None, PrefetchState.FAILED) and ready == 0, (promised, state, ready)
    assert host_used(ctl) == 0
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 0
    deadline = time.monotonic() + 30
    eng.request(prompt)
    while True:
        assert ctl.transfers.drain(10)
        ctl.flush(5)
        if ctl.unflushed_pages() == 0:
            break
        assert time.monotonic() < deadline, "the recomputed prompt never reached L3"
        time.sleep(0.5)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert prefetch(ctl, prompt)[1:] == (PrefetchState.DONE, 24)
    eng.request(prompt)
    deadline = time.monotonic() + 20
    while not all(h.healthy for h in ctl.health(True)):
        assert time.monotonic() < deadline, "health --deep never ok again"
        time.sleep(0.5)


# ------------------------------------------------------- controllers: file store


@pytest.mark.timeout(60)
def test_file_store_contents_wiped_prefetch_fails_once_and_recomputed_pages_are_stored(
    make: Callable[..., Any], tmp_path: Path
) -> None:
    """`rm -rf` of everything under the root (the root stays, as a cleanup job leaves
    it): a prefetch of a prompt known present ends FAILED, the next lookup is exact,
    the engine's recomputation writes every object again (counted stored) and a prefetch
    from L3 alone is DONE whole and byte-exact."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    store = tmp_path / "l3"
    prompt = seq(6, 5000)
    eng.request(prompt)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert len(kv_files(store)) == 6
    for child in store.iterdir():
        shutil.rmtree(child)
    before = ctl.stats().counters
    assert prefetch(ctl, prompt)[1:] in ((PrefetchState.FAILED, 0), (None, 0))
    assert host_used(ctl) == 0
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 0
    eng.request(prompt)
    assert ctl.transfers.drain(10)
    changed = delta(ctl.stats().counters, before)
    assert (changed.get("backups_l3", 0), changed.get("backups_l3_present", 0)) == (6, 0), changed
    assert changed.get("l3_errors", 0) == 0, changed
    assert len(kv_files(store)) == 6
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert prefetch(ctl, prompt)[1:] == (PrefetchState.DONE, 24)
    eng.request(prompt)
    assert eng.checked > 0


@pytest.mark.timeout(60)
def test_a_file_root_the_probe_found_removed_is_not_promised_after_it(
    make: Callable[..., Any], tmp_path: Path
) -> None:
    """The daemon itself noticed (its probe: `hicache health --deep`, or the background
    prober within 5 s) that the root was removed and logged that the objects are gone;
    like a store that came back empty after an outage, its old pages must not be
    promised."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    prompt = seq(6, 7000)
    eng.request(prompt)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 24
    shutil.rmtree(tmp_path / "l3")
    health = ctl.health(True)  # the probe makes the root again and forgets its index
    assert all(h.healthy for h in health) and (tmp_path / "l3").is_dir()
    assert health[0].used_bytes == 0
    # Observed: 24, and a prefetch of them started (FAILED).
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 0


@pytest.mark.timeout(60)
def test_health_used_bytes_of_a_wiped_file_store_is_what_it_holds(
    make: Callable[..., Any], tmp_path: Path
) -> None:
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    store = tmp_path / "l3"
    eng.request(seq(6, 9000))
    assert ctl.transfers.drain(10)
    assert ctl.health(True)[0].used_bytes == sum(p.stat().st_size for p in kv_files(store)) > 0
    for child in store.iterdir():
        shutil.rmtree(child)
    assert kv_files(store) == []
    health = ctl.health(True)
    assert health[0].healthy
    # Observed: 768 (six 128-byte objects), with none on disk.
    assert health[0].used_bytes == 0, health[0]
