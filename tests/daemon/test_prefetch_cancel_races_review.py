"""Review: lifecycle races of prefetches, cancels, leases and loads.

Two halves:
- controller-level (a `HybridCacheController` in this process; L3 reads and copies to L1
  gated so that each interleaving is forced, never timed): a timed-out prefetch and the
  one queued behind it, two prefetches of one prefix, a `Load` racing a prefetch's copy
  to L1, an L3 error and an L3 hang halfway through a multi-batch prefetch. Every page
  reused is checked byte for byte (`engine_sim`) and the fixture audits page ownership;
- daemon-level (real `hicache serve` processes on a private redis, SIGSTOPped to hold a
  read in flight): two engines prefetching one prefix while a third matches it, a cancel
  by one of them, and SIGTERM with prefetches queued behind a held read.

Confirmed bugs are strict xfails (the test asserts the correct behaviour).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from services import held as redis_held

import hicache.controller.prefetch as pf
from hicache.bench.oracle import KvOracle
from hicache.bench.services import RedisServer
from hicache.client import Client
from hicache.controller.base import AllocateRequest, MatchRequest, PrefetchState
from hicache.errors import BackendUnavailable, NotFound
from hicache.types import ComponentKind, Tier

from .daemonkit import PAGE, Daemon, computed_into_l3, pool, run_cli, stored
from .daemonkit import load_and_verify as client_load_and_verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import Engine, Loader, built_controllers, seq, wait_prefetch

FULL = ComponentKind.FULL
RUNNING, DONE, CANCELLED, TIMED_OUT, FAILED = (
    PrefetchState.RUNNING,
    PrefetchState.DONE,
    PrefetchState.CANCELLED,
    PrefetchState.TIMED_OUT,
    PrefetchState.FAILED,
)
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


# ---------------------------------------------------------------------- controller helpers


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., object]]:
    with built_controllers(tmp_path, "pcr") as factory:
        yield factory


class Reads:
    """Counts the L3 reads of a controller (pages per call); the `hold`-th call waits for
    `gate` (set `reached` first); `fail`: the `fail`-th call raises BackendUnavailable."""

    def __init__(self, ctl, monkeypatch: pytest.MonkeyPatch, hold: int = 0, fail: int = 0,  # type: ignore[no-untyped-def]
                 hang: int = 0) -> None:
        """`hang`: the `hang`-th call hangs inside the store's bounded call (the file
        backend's `_read_sync`), so that `storage.timeout_s` gives up on it."""
        self.calls: list[int] = []
        self.gate, self.reached = threading.Event(), threading.Event()
        backend = ctl.l3.backend
        real, real_sync = backend._read_into, backend._read_sync
        hanging = [False]

        def read(keys, buffers):  # type: ignore[no-untyped-def]
            self.calls.append(len(keys))
            n = len(self.calls)
            if n == fail:
                raise BackendUnavailable("injected: the store went away halfway")
            if n == hold:
                self.reached.set()
                assert self.gate.wait(20), "read gate never opened"
            hanging[0] = n == hang
            return real(keys, buffers)

        def read_sync(keys, buffers):  # type: ignore[no-untyped-def]
            if hanging[0]:
                self.reached.set()
                self.gate.wait(20)
            return real_sync(keys, buffers)

        monkeypatch.setattr(backend, "_read_into", read)
        monkeypatch.setattr(backend, "_read_sync", read_sync)


def host_pages(ctl) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(L2 FULL pages allocated, L2 FULL pages the tree holds)."""
    with ctl._mu:
        alloc = ctl.host.allocator(FULL)
        return alloc.total - alloc.free_count, ctl.tree.resident_pages(Tier.HOST, FULL)


def settled(ctl) -> None:  # type: ignore[no-untyped-def]
    """Every worker idle; nothing running, pinned or held; L2 holds the tree's pages only."""
    assert ctl.prefetcher.worker.drain(10) and ctl.prefetcher.l1_worker.drain(10)
    assert ctl.transfers.drain(10)
    stats = ctl.stats()
    assert stats.counters["prefetches_running"] == 0
    assert all(p.locked_pages == 0 for p in stats.pools), stats.pools
    used, resident = host_pages(ctl)
    assert used == resident, (used, resident)
    assert ctl.prefetcher._reserved_pages == 0


def load_and_verify(ctl, eng: Engine, tokens_: bytes) -> int:  # type: ignore[no-untyped-def]
    """Match, load, check every reused page's bytes, release; tokens reused."""
    m = ctl.match(eng.id, MatchRequest("", tokens_, lock=True))
    try:
        reused, pages = m.device_tokens, m.device_pages
        if m.host_tokens:
            *_, last = ctl.load(eng.id, m.lock_id)
            reused, pages = last.device_tokens, last.device_pages
        eng.verify(pages, tokens_, reused // eng.ps)
        return reused
    finally:
        ctl.release(eng.id, m.lock_id, None)


def only_in_l3(ctl, eng: Engine, tokens_: bytes) -> None:  # type: ignore[no-untyped-def]
    eng.request_then_only_in_l3(tokens_)
    m = ctl.match(eng.id, MatchRequest("", tokens_))
    assert (m.device_tokens, m.host_tokens) == (0, 0) and m.storage_tokens == len(tokens_) // 4


# ---------------------------------------------------------------------- controller: bugs


def test_a_timed_out_prefetch_reads_no_further_batch_while_another_waits(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timeout policy, deadline 0.3 s. Op A (12 pages, 6 batches of 2) has its first read
    held until both A and op B (2 pages, queued behind A on the one prefetch worker) are
    TIMED_OUT. The engines recompute what did not arrive by then (DESIGN §3: "what arrived
    by then is used, the rest is recomputed"): once the held read returns, A reads no
    further batch while B waits for the worker (it used to read all 5, holding the worker
    and both ops' L2 budget). B, alone then, reads its pages: late pages are still
    inserted for later requests (DESIGN §3) while no other prefetch waits."""
    ctl = make(prefetch__policy="timeout", prefetch__timeout_base_s=0.3,
               prefetch__timeout_per_ki_token_s=0, prefetch__timeout_max_s=1, **THROUGH)
    eng = Engine(ctl)
    long_, short = seq(12), seq(2, base=50_000)
    only_in_l3(ctl, eng, long_)
    only_in_l3(ctl, eng, short)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    reads = Reads(ctl, monkeypatch, hold=1)
    a = ctl.match("e1", MatchRequest("", long_, prefetch=True))
    b = ctl.match("e1", MatchRequest("", short, prefetch=True))
    assert a.prefetch_id and b.prefetch_id
    assert reads.reached.wait(10)
    deadline = time.monotonic() + 10
    while not all(ctl.prefetch_status(p).state is TIMED_OUT for p in (a.prefetch_id, b.prefetch_id)):
        assert time.monotonic() < deadline, "never timed out"
        time.sleep(0.01)
    reads.gate.set()
    settled(ctl)
    for pid in (a.prefetch_id, b.prefetch_id):
        info = ctl.prefetch_status(pid)
        assert (info.state, info.tokens_ready) == (TIMED_OUT, 0)
    # What the held read brought is kept (late pages land) and byte-exact.
    assert load_and_verify(ctl, eng, long_) >= 8
    assert reads.calls == [2, 2], reads.calls


def test_a_second_prefetch_of_a_prefix_in_flight_does_not_read_it_again(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine e1's prefetch of a 4-page prefix is reading (held); engine e2 matches the same
    prompt with prefetch=true. Both end DONE with everything ready, and the pages are
    byte-exact for both engines. But the second op reserves 4 more L2 pages (the budget,
    evicting for them under pressure) and, once it runs, reads all 4 pages from L3 again
    although the first committed them to the tree meanwhile: the commit then frees them as
    duplicates. Two engines loading one path copy it once (README); two prefetching it
    should read it once (the second skips pages the tree holds when its batch comes up)."""
    ctl = make(**THROUGH)
    e1, e2 = Engine(ctl), Engine(ctl, "e2")
    prompt = seq(4)
    only_in_l3(ctl, e1, prompt)
    reads = Reads(ctl, monkeypatch, hold=1)
    a = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert reads.reached.wait(10)
    mid = ctl.match("e3", MatchRequest("", prompt))  # a lookup meanwhile: nothing half-written
    assert (mid.device_tokens, mid.host_tokens, mid.storage_tokens) == (0, 0, 16)
    b = ctl.match("e2", MatchRequest("", prompt, lock=True, prefetch=True))
    assert b.prefetch_id and b.prefetch_id != a.prefetch_id
    reads.gate.set()
    for pid in (a.prefetch_id, b.prefetch_id):
        assert wait_prefetch(ctl, pid) is DONE
        info = ctl.prefetch_status(pid)
        assert (info.tokens_ready, info.tokens_total) == (16, 16)
    ctl.release("e1", a.lock_id, None)
    ctl.release("e2", b.lock_id, None)
    settled(ctl)
    assert host_pages(ctl)[0] == 4
    assert load_and_verify(ctl, e1, prompt) == 16
    assert load_and_verify(ctl, e2, prompt) == 16
    assert sum(reads.calls) == 4, reads.calls


def test_a_load_during_a_prefetchs_copy_to_l1_evicts_nothing_for_a_second_copy(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-page prefix in L1, 4 more pages in L3; L1 has exactly 4 free pages (another
    prompt's 8 pages cached and unlocked, the rest held by an allocation). The prefetch
    (batches of 2) commits both batches to L2 and reserves the 4 free L1 pages for their
    copies, held at the prefetch-to-l1 worker. Meanwhile engine e2 matches the prompt
    (8 device + 16 host tokens) and loads it. The bytes it gets are right. But the Load
    copies those 4 pages a second time into L1 pages it evicts the other prompt for,
    instead of waiting for the prefetch's copy as it waits for another load's; the
    prefetch's copy is then thrown away. Expected: no eviction, nothing loaded twice."""
    ctl = make(**THROUGH)
    eng, e2 = Engine(ctl), Engine(ctl, "e2")
    prompt, other = seq(6), seq(8, base=100_000)
    only_in_l3(ctl, eng, prompt)
    eng.request(prompt[: 2 * 16])  # the prefix computed again: in L1
    eng.request(other)
    assert ctl.transfers.drain(10)
    with ctl._mu:
        free = ctl.device.allocator(FULL).free_count
    hog = ctl.allocate("e1", AllocateRequest("", (free - 4) * 4)).allocation_id
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    gate, held = threading.Event(), threading.Event()
    real = ctl.loads.copy_to_l1

    def copy(moves, on_layer=None):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "hicache-prefetch-to-l1":
            held.set()
            assert gate.wait(20), "copy gate never opened"
        return real(moves, on_layer)

    monkeypatch.setattr(ctl.loads, "copy_to_l1", copy)
    a = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert a.prefetch_id and held.wait(10)
    deadline = time.monotonic() + 10
    while True:  # both batches committed, their 4 L1 pages reserved
        with ctl._mu:
            if sum(len(ids) for ids in ctl.prefetcher.reserved_l1(FULL)) == 4:
                break
        assert time.monotonic() < deadline, "the prefetch never reserved its L1 pages"
        time.sleep(0.005)
    before = ctl.stats().counters
    b = ctl.match("e2", MatchRequest("", prompt, lock=True))
    assert (b.device_tokens, b.host_tokens) == (8, 16)
    loader = Loader(ctl, "e2", b.lock_id)
    loader.start()
    loader.join(1.0)  # fixed, it waits for the prefetch's copy: let that go now
    gate.set()
    *_, last = loader.result()
    assert wait_prefetch(ctl, a.prefetch_id) is DONE
    assert last.device_tokens == 24
    e2.verify(last.device_pages, prompt, 6)
    ctl.release("e2", b.lock_id, None)
    ctl.release("e1", a.lock_id, None)
    ctl.release("e1", None, hog)
    settled(ctl)
    after = ctl.stats().counters
    load_and_verify(ctl, eng, other)  # (the bytes of what stayed are right)
    evicted = after["evictions_device"] - before["evictions_device"]
    loaded = after["loaded_pages"] - before["loaded_pages"]
    assert (evicted, loaded, after["prefetch_pages_to_l1"]) == (0, 0, 4)


# ---------------------------------------------------------------------- controller: correct


def test_an_l3_error_halfway_fails_with_the_batches_that_arrived_usable_and_nothing_held(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 pages in batches of 2, the second read fails (the store went away): FAILED with
    tokens_ready 8 (the first batch, usable, byte-exact), the 4 reserved pages of the
    batches that never came back to L2, the budget back, nothing pinned; the rest is still
    promised by L3 and a later prefetch completes it."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    prompt = seq(6)
    only_in_l3(ctl, eng, prompt)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    reads = Reads(ctl, monkeypatch, fail=2)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert wait_prefetch(ctl, m.prefetch_id) is FAILED
    info = ctl.prefetch_status(m.prefetch_id)
    assert (info.tokens_ready, info.tokens_total) == (8, 24)
    assert ctl.cancel_prefetch(m.prefetch_id) == 8  # after the end: unchanged
    assert ctl.prefetch_status(m.prefetch_id).state is FAILED
    ctl.release("e1", m.lock_id, None)
    settled(ctl)
    assert reads.calls == [2, 2]
    again = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert again.device_tokens + again.host_tokens == 8 and again.storage_tokens == 16
    assert wait_prefetch(ctl, again.prefetch_id) is DONE
    ctl.release("e1", again.lock_id, None)
    settled(ctl)
    assert load_and_verify(ctl, eng, prompt) == 24


def test_an_l3_read_hanging_past_its_timeout_holds_its_pages_until_it_returns(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storage.timeout_s 0.5; the second of three batch reads hangs: the op ends FAILED
    with the first batch ready. Until the hung read returns, the L2 pages it may still
    write into stay allocated (not free, not in the tree); once it returns they are free
    and L2 holds exactly the tree's pages; the first batch is byte-exact."""
    ctl = make(storage__timeout_s=0.5, **THROUGH)
    eng = Engine(ctl)
    prompt = seq(6)
    only_in_l3(ctl, eng, prompt)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    reads = Reads(ctl, monkeypatch, hang=2)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert wait_prefetch(ctl, m.prefetch_id) is FAILED
    assert reads.reached.is_set()
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 8
    ctl.release("e1", m.lock_id, None)
    assert ctl.prefetcher.worker.drain(10) and ctl.prefetcher.l1_worker.drain(10)
    used, resident = host_pages(ctl)
    assert used - resident >= 2  # the hung read's pages: held, neither free nor cached
    reads.gate.set()
    deadline = time.monotonic() + 10
    while (pages := host_pages(ctl))[0] != pages[1]:
        assert time.monotonic() < deadline, f"held pages never freed: {pages}"
        time.sleep(0.01)
    settled(ctl)
    assert load_and_verify(ctl, eng, prompt) == 8


def test_a_cancel_while_the_prefetch_waits_for_room_gives_everything_back(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op queued behind a held read, then cancelled twice, by its engine only (another
    engine's cancel is NOT_FOUND and changes nothing): CANCELLED with 0, its reservation
    and budget back at once; the held op then completes; accounting settles."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    first, queued = seq(4), seq(4, base=70_000)
    only_in_l3(ctl, eng, first)
    only_in_l3(ctl, eng, queued)
    reads = Reads(ctl, monkeypatch, hold=1)
    budget = ctl.prefetcher.budget_left()
    a = ctl.match("e1", MatchRequest("", first, prefetch=True))
    assert reads.reached.wait(10)
    b = ctl.match("e1", MatchRequest("", queued, prefetch=True))
    assert a.prefetch_id and b.prefetch_id and ctl.prefetcher.budget_left() == budget - 8
    used = host_pages(ctl)[0]
    with pytest.raises(NotFound):
        ctl.cancel_prefetch(b.prefetch_id, "intruder")
    assert ctl.prefetch_status(b.prefetch_id).state is RUNNING
    assert ctl.cancel_prefetch(b.prefetch_id, "e1") == 0
    assert ctl.cancel_prefetch(b.prefetch_id, "e1") == 0
    assert host_pages(ctl)[0] == used - 4 and ctl.prefetcher.budget_left() == budget - 4
    reads.gate.set()
    assert wait_prefetch(ctl, a.prefetch_id) is DONE
    settled(ctl)
    assert ctl.prefetch_status(b.prefetch_id).state is CANCELLED
    assert reads.calls == [4]
    assert load_and_verify(ctl, eng, first) == 16
    assert ctl.match("e1", MatchRequest("", queued)).storage_tokens == 16


# ---------------------------------------------------------------------- daemon fixtures


@pytest.fixture(scope="module")
def redis(pausable_redis: RedisServer) -> RedisServer:
    return pausable_redis


def _sets(redis: RedisServer) -> tuple[str, ...]:
    return ("storage.backend=redis", f"storage.redis.url={redis.url}",
            "write.l1_to_l2=write_through", "write.l2_to_l3=write_through")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Callable[[bytes], None]]:
    """A writer daemon: computes a prompt (oracle KV) and flushes it to L3."""
    d = Daemon(tmp_path_factory.mktemp("writer"), *_sets(redis)).start()
    try:
        with d.client(engine_id="writer") as c:
            att = c.attach()
            oracle = KvOracle(att.info, att.pools)

            yield lambda prompt: computed_into_l3(c, oracle, prompt)
    finally:
        d.close()


@pytest.fixture(scope="module")
def wc(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("wc"), *_sets(redis), "prefetch.policy=wait_complete",
               "storage.timeout_s=10").start()
    yield d
    d.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.03)


def reader(c: Client) -> KvOracle:
    att = c.attach()
    return KvOracle(att.info, att.pools)


# ---------------------------------------------------------------------- daemon tests


def test_daemon_two_engines_prefetch_one_prefix_one_cancels_and_a_lookup_sees_no_half_page(
    wc: Daemon, store, redis: RedisServer
) -> None:
    """Engine A's prefetch reads (redis stopped), engine B prefetches the same prompt (queued
    behind it), engine C looks it up meanwhile: nothing of it in L1/L2 yet. A cancels its
    own: CANCELLED 0, and B's runs on to DONE. Both engines then load it byte-exact; after
    everything settles nothing is pinned or running, no lock is left, L2 grew by the 4
    pages only, and `hicache stats` says the same."""
    with wc.client(engine_id="pa") as a, wc.client(engine_id="pb") as b, \
            wc.client(engine_id="pc") as c:
        oa, ob = reader(a), reader(b)
        c.attach(map_pools=False)
        prompt = stored(store, a, 4, start=5_000_000)
        wait_for(lambda: a.stats().counters["prefetches_running"] == 0, 20, "idle")
        host0 = pool(a, "host")[0]
        with redis_held(redis):
            ma = a.match(prompt, lock=True, prefetch=True)
            mb = b.match(prompt, prefetch=True)
            assert ma.prefetch_id and mb.prefetch_id and mb.lock_id == 0
            mc = c.match(prompt)
            assert (mc.device_tokens, mc.host_tokens, mc.storage_tokens) == (0, 0, 4 * PAGE)
            with pytest.raises(NotFound):
                c.cancel_prefetch(mb.prefetch_id)
            assert a.cancel_prefetch(ma.prefetch_id) == 0
            assert b.prefetch_status(mb.prefetch_id).state is RUNNING
            a.release(lock_id=ma.lock_id)
        seen = []
        deadline = time.monotonic() + 20
        while (info := b.prefetch_status(mb.prefetch_id)).state is RUNNING:
            seen.append(info.tokens_ready)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert (info.state, info.tokens_ready, info.tokens_total) == (DONE, 4 * PAGE, 4 * PAGE)
        assert seen == sorted(seen)
        info_a = a.prefetch_status(ma.prefetch_id)
        assert (info_a.state, info_a.tokens_ready) == (CANCELLED, 0)
        wait_for(lambda: a.stats().counters["prefetches_running"] == 0, 20, "idle")
        wait_for(lambda: pool(a, "device")[1] == pool(a, "host")[1] == 0, 10, "nothing pinned")
        assert client_load_and_verify(a, oa, prompt) == 4 * PAGE
        assert client_load_and_verify(b, ob, prompt) == 4 * PAGE
        assert pool(a, "host") == (host0 + 4, 0)
        out = run_cli("stats", "--target", wc.target, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["counters"]["prefetches_running"] == 0
        assert all(p["locked_pages"] == 0 for p in report["pools"])


@pytest.mark.timeout(90)
def test_daemon_sigterm_with_prefetches_queued_behind_a_held_read_exits_0_in_bound(
    tmp_path: Path, store, redis: RedisServer
) -> None:
    """Three prefetches (one reading, held by a stopped redis; two queued behind it) when
    SIGTERM comes: the daemon exits 0 within its bound and leaves no shared memory."""
    d = Daemon(tmp_path, *_sets(redis), "prefetch.policy=wait_complete", "storage.timeout_s=2",
               "prefetch.threshold_tokens=64").start()
    try:
        with d.client(engine_id="term", retries=0) as c:
            reader(c)
            prompts = [stored(store, c, 2, start=s) for s in (6_000_000, 6_100_000, 6_200_000)]
            with redis_held(redis):
                ids = [c.match(p, prefetch=True).prefetch_id for p in prompts]
                assert all(ids)
                assert all(c.prefetch_status(i).state is RUNNING for i in ids)
                t0 = time.monotonic()
                assert d.stop(signal.SIGTERM, timeout_s=40) == 0
                took = time.monotonic() - t0
        assert took < 20, took
        assert d.proc is not None
        assert not list(Path("/dev/shm").glob(f"hicache-*-{d.proc.pid}-*"))
    finally:
        d.close()
