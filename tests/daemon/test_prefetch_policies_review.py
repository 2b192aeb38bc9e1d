"""Review: prefetch (L3 -> L2, following into L1) end to end against real daemons.

One writer daemon stores prompts in a private redis (write-through); reader daemons, one per
`prefetch.policy`, find them only in L3. Redis is stopped (SIGSTOP) to hold a prefetch's
read in flight: the readers' lookups were answered before (their existence cache), so
MatchPrefix does not wait and the prefetch blocks in its read until SIGCONT (well within
`storage.timeout_s`). Covered: the threshold, wait_complete / best_effort / timeout (its
deadline formula, what arrives late), CancelPrefetch before the read, mid-read, after DONE,
twice and by another engine, a prefetch outliving its lock and its engine (restart, lease
lapse), SIGTERM mid-read; every page a prefetch brought and Load moved into L1 is checked
byte for byte (`KvOracle`), and L2 holds no more than what the tree keeps afterwards.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from services import held as redis_held

from hicache.bench.oracle import KvOracle
from hicache.bench.services import RedisServer
from hicache.client import Client
from hicache.controller.base import PrefetchState
from hicache.errors import NotFound
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import PAGE, Daemon, computed_into_l3, load_and_verify, pool, stored, tokens

MakeDaemon = Callable[..., Daemon]
RUNNING, DONE, CANCELLED, TIMED_OUT = (
    PrefetchState.RUNNING,
    PrefetchState.DONE,
    PrefetchState.CANCELLED,
    PrefetchState.TIMED_OUT,
)
THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through")
# The timeout reader: deadline = min(3, 0.2 + 24 x tokens / 1024): 1 page (64 tokens) 1.7 s,
# 6 pages (384 tokens) 9.2 s capped to 3 s. Reads are held far longer (storage.timeout_s 10).
TIMEOUT_SETS = (
    "prefetch.policy=timeout",
    "prefetch.timeout_base_s=0.2",
    "prefetch.timeout_per_ki_token_s=24",
    "prefetch.timeout_max_s=3",
    "prefetch.threshold_tokens=64",
    "storage.timeout_s=10",
)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def redis(pausable_redis: RedisServer) -> RedisServer:
    return pausable_redis


def _sets(redis: RedisServer) -> tuple[str, ...]:
    return ("storage.backend=redis", f"storage.redis.url={redis.url}", *THROUGH)


def _daemon(factory: pytest.TempPathFactory, name: str, *sets: str) -> Iterator[Daemon]:
    d = Daemon(factory.mktemp(name), *sets).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Daemon]:
    yield from _daemon(tmp_path_factory, "writer", *_sets(redis))


@pytest.fixture(scope="module")
def store(writer: Daemon) -> Iterator[Callable[[bytes], None]]:
    """Computes a prompt on the writer (oracle KV) and waits until it is in L3."""
    with writer.client(engine_id="writer") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)

        yield lambda prompt: computed_into_l3(c, oracle, prompt)


@pytest.fixture(scope="module")
def wc(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Daemon]:
    yield from _daemon(
        tmp_path_factory,
        "wc",
        *_sets(redis),
        "prefetch.policy=wait_complete",
        "storage.timeout_s=10",
    )


@pytest.fixture(scope="module")
def be(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Daemon]:
    yield from _daemon(
        tmp_path_factory,
        "be",
        *_sets(redis),
        "prefetch.policy=best_effort",
        "storage.timeout_s=10",
        "server.lease_ms=3000",
        "prefetch.threshold_tokens=64",
    )


@pytest.fixture(scope="module")
def to(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Daemon]:
    yield from _daemon(tmp_path_factory, "to", *_sets(redis), *TIMEOUT_SETS)


# --------------------------------------------------------------------------- helpers


def restart(d: Daemon, engine_id: str) -> None:
    """Another process attaches under `engine_id` (another instance id): an engine restart,
    which releases what its predecessor held at once."""
    with grpc.insecure_channel(d.target) as channel:
        pb_grpc.HiCacheStub(channel).Attach(
            pb.AttachRequest(engine_id=engine_id, tp_rank=0, tp_size=1, instance_id="next-process"),
            timeout=10,
        )


def reader(c: Client) -> KvOracle:
    att = c.attach()
    return KvOracle(att.info, att.pools)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def wait_state(c: Client, prefetch_id: int, timeout_s: float = 15.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (state := c.prefetch_status(prefetch_id).state) is RUNNING:
        assert time.monotonic() < deadline, "prefetch still running"
        time.sleep(0.03)
    return state


def idle(c: Client) -> None:
    """Every prefetch's worker finished (its reads returned, its pins and pages let go)."""
    wait_for(lambda: c.stats().counters["prefetches_running"] == 0, 20, "prefetches finished")


def nothing_pinned(c: Client) -> None:
    """No page locked in L1 or L2 (waits out a write-through copy still queued: it pins its
    node until it lands, at most 2 x write.l1_to_l2_batch_ms)."""
    wait_for(lambda: pool(c, "device")[1] == pool(c, "host")[1] == 0, 10, "nothing pinned")


def counter(c: Client, name: str) -> int:
    return int(c.stats().counters[name])


def prefetches(c: Client) -> int:
    """Prefetches started so far (every outcome, and those running)."""
    counters = c.stats().counters
    return sum(
        int(counters[f"prefetches_{o}"])
        for o in ("done", "cancelled", "timed_out", "failed", "running")
    )


# --------------------------------------------------------------------------- threshold


def test_a_prefetch_starts_from_exactly_threshold_tokens(wc: Daemon, store) -> None:
    """prefetch.threshold_tokens (256 by default): 192 storage tokens start nothing, 256 do
    (and only with prefetch=true); a prefetch-only match (no lock) returns no lock_id; the
    prefetch ends DONE with tokens_ready == tokens_total == storage_tokens."""
    with wc.client(engine_id="thr") as c:
        oracle = reader(c)
        short = stored(store, c, 3, start=1_000_000)
        enough = stored(store, c, 4, start=1_100_000)
        started = prefetches(c)
        m = c.match(short, prefetch=True)
        assert (m.storage_tokens, m.prefetch_id, m.lock_id) == (3 * PAGE, 0, 0)
        m = c.match(enough, lock=True)  # prefetch=false: nothing starts
        assert m.storage_tokens == 4 * PAGE and m.prefetch_id == 0
        c.release(lock_id=m.lock_id)
        assert prefetches(c) == started
        m = c.match(enough, prefetch=True)
        assert m.storage_tokens == 4 * PAGE and m.prefetch_id and m.lock_id == 0
        assert wait_state(c, m.prefetch_id) is DONE
        info = c.prefetch_status(m.prefetch_id)
        assert (info.tokens_ready, info.tokens_total) == (4 * PAGE, 4 * PAGE)
        idle(c)
        nothing_pinned(c)  # no pin left behind
        assert load_and_verify(c, oracle, enough) == 4 * PAGE
        assert c.match(short).storage_tokens == 3 * PAGE  # never fetched


# --------------------------------------------------------------------------- wait_complete


def test_prefetch_past_an_l2_prefix_then_load_is_byte_exact_and_backs_nothing_up(
    wc: Daemon, store
) -> None:
    """The first 2 pages in the reader's L2 only, 4 more in L3: the prefetch counts from the
    host boundary (tokens_total 256), does not follow into L1 (the prefix is not there), a
    new match then sees 384 host tokens, Load brings them byte-exact. L2 grows by exactly
    the 4 pages; nothing is backed up again (they came from L3, or were in L2)."""
    with wc.client(engine_id="l2p") as c:
        oracle = reader(c)
        prompt = tokens(6 * PAGE, start=1_200_000)
        store(prompt)
        head = prompt[: 2 * PAGE * 4]
        m = c.match(head, lock=True, allocate_tokens=2 * PAGE)  # the reader computes 2 pages
        oracle.write(head, m.pages, start_page=0)
        c.insert(head, lock_id=m.lock_id, allocation_id=m.allocation_id)
        wait_for(lambda: pool(c, "device")[1] == 0, 10, "the copies to L2 landed")
        a = c.allocate(16 * PAGE)  # all of L1: every unlocked page leaves it
        c.release(allocation_id=a.allocation_id)
        probe = c.match(prompt)
        assert (probe.device_tokens, probe.host_tokens, probe.storage_tokens) == (
            0,
            2 * PAGE,
            4 * PAGE,
        )
        host0 = pool(c, "host")[0]
        backups = (counter(c, "backups_host"), counter(c, "backups_storage"))
        with c.matched(prompt, prefetch=True) as m:
            assert m.prefetch_id
            assert wait_state(c, m.prefetch_id) is DONE
            info = c.prefetch_status(m.prefetch_id)
            assert (info.tokens_ready, info.tokens_total) == (4 * PAGE, 4 * PAGE)
        idle(c)
        hit = c.match(prompt)
        assert (hit.device_tokens, hit.host_tokens, hit.storage_tokens) == (0, 6 * PAGE, 0)
        assert pool(c, "host") == (host0 + 4, 0)
        assert load_and_verify(c, oracle, prompt) == 6 * PAGE
        assert (counter(c, "backups_host"), counter(c, "backups_storage")) == backups


# --------------------------------------------------------------------------- cancel


def test_cancel_mid_read_and_while_queued(wc: Daemon, store, redis: RedisServer) -> None:
    """Two prefetches, the first's read held in flight, the second queued behind it (one
    prefetch worker). Both cancelled (the queued one twice): CANCELLED with tokens_ready 0.
    The held read's pages still land once the store answers (late pages are kept, usable,
    byte-exact); the queued one never reads. L2 then holds those 4 pages and nothing else
    of theirs; no pin is left."""
    with wc.client(engine_id="cxl") as c:
        oracle = reader(c)
        first = stored(store, c, 4, start=1_300_000)
        queued = stored(store, c, 4, start=1_400_000)
        idle(c)
        host0 = pool(c, "host")[0]
        with redis_held(redis):
            a = c.match(first, lock=True, prefetch=True)
            b = c.match(queued, prefetch=True)
            assert a.prefetch_id and b.prefetch_id and b.lock_id == 0
            for pid in (a.prefetch_id, b.prefetch_id):
                info = c.prefetch_status(pid)
                assert (info.state, info.tokens_ready, info.tokens_total) == (RUNNING, 0, 4 * PAGE)
            assert c.cancel_prefetch(b.prefetch_id) == 0
            assert c.cancel_prefetch(b.prefetch_id) == 0  # twice: the same answer
            assert c.cancel_prefetch(a.prefetch_id) == 0
            for pid in (a.prefetch_id, b.prefetch_id):
                assert c.prefetch_status(pid).state is CANCELLED
        idle(c)
        for pid in (a.prefetch_id, b.prefetch_id):
            info = c.prefetch_status(pid)
            assert (info.state, info.tokens_ready, info.tokens_total) == (CANCELLED, 0, 4 * PAGE)
        assert c.cancel_prefetch(a.prefetch_id) == 0  # after the worker finished: unchanged
        c.release(lock_id=a.lock_id)
        late = c.match(first)
        assert late.device_tokens + late.host_tokens == 4 * PAGE
        never = c.match(queued)
        assert (never.device_tokens, never.host_tokens, never.storage_tokens) == (0, 0, 4 * PAGE)
        assert pool(c, "host") == (host0 + 4, 0)
        wait_for(lambda: pool(c, "device")[1] == 0, 10, "nothing pinned in L1")
        assert load_and_verify(c, oracle, first) == 4 * PAGE


def test_cancel_after_done_and_by_another_engine(wc: Daemon, store, redis: RedisServer) -> None:
    """Another engine's PrefetchStatus / CancelPrefetch (also in a Batch) is NOT_FOUND and
    does not stop it; after DONE a cancel returns tokens_ready and changes nothing (state,
    counters), twice."""
    with wc.client(engine_id="own") as c, wc.client(engine_id="intruder") as other:
        oracle = reader(c)
        other.attach(map_pools=False)
        prompt = stored(store, c, 4, start=1_500_000)
        idle(c)
        cancelled = counter(c, "prefetches_cancelled")
        with redis_held(redis):
            m = c.match(prompt, lock=True, prefetch=True)
            assert m.prefetch_id
            with pytest.raises(NotFound):
                other.prefetch_status(m.prefetch_id)
            with pytest.raises(NotFound):
                other.cancel_prefetch(m.prefetch_id)
            assert c.prefetch_status(m.prefetch_id).state is RUNNING
        assert wait_state(c, m.prefetch_id) is DONE
        for _ in range(2):
            assert c.cancel_prefetch(m.prefetch_id) == 4 * PAGE
            info = c.prefetch_status(m.prefetch_id)
            assert (info.state, info.tokens_ready, info.tokens_total) == (DONE, 4 * PAGE, 4 * PAGE)
        with pytest.raises(NotFound):
            other.cancel_prefetch(m.prefetch_id)
        assert counter(c, "prefetches_cancelled") == cancelled
        c.release(lock_id=m.lock_id)
        assert load_and_verify(c, oracle, prompt) == 4 * PAGE


# --------------------------------------------------------------------------- lock, engine gone


def test_wait_complete_outlives_its_released_lock_and_its_restarted_engine(
    wc: Daemon, store, redis: RedisServer
) -> None:
    """wait_complete: a prefetch whose lock the engine released at once, and one whose
    engine restarted (another process attached under its id: its locks released) both run
    on; their pages all land, byte-exact, and nothing stays pinned."""
    with wc.client(engine_id="gone") as c:
        oracle = reader(c)
        released_early = stored(store, c, 4, start=1_600_000)
        restarted = stored(store, c, 4, start=1_700_000)
        idle(c)
        with redis_held(redis):
            a = c.match(released_early, lock=True, prefetch=True)
            c.release(lock_id=a.lock_id)
            b = c.match(restarted, lock=True, prefetch=True)
            restart(wc, "gone")
            with pytest.raises(NotFound):
                c.release(lock_id=b.lock_id)  # released with the old process
            assert c.prefetch_status(b.prefetch_id).state is RUNNING  # the engine's still
        with wc.client(engine_id="gone-watch") as w:
            w.attach(map_pools=False)
            assert (
                "engine gone: attached again by another process (rank 0); released its "
                "predecessor's 1 locks" in wc.log()
            )
            idle(w)
            nothing_pinned(w)
        for prompt in (released_early, restarted):
            hit = c.match(prompt)
            assert hit.device_tokens + hit.host_tokens == 4 * PAGE
    with wc.client(engine_id="gone-reader") as r:
        oracle = reader(r)
        assert load_and_verify(r, oracle, released_early) == 4 * PAGE
        assert load_and_verify(r, oracle, restarted) == 4 * PAGE


def test_closing_the_session_mid_prefetch_stops_nothing(
    wc: Daemon, store, redis: RedisServer
) -> None:
    """CloseSession drops references, not data: a prefetch started by a match of that
    session runs on to DONE, the match's lock stays the engine's to release, and the pages
    are byte-exact; nothing stays pinned."""
    with wc.client(engine_id="sess") as c:
        oracle = reader(c)
        head = tokens(PAGE, start=1_800_000)
        prompt = head + tokens(4 * PAGE, start=1_800_000 + PAGE)
        store(prompt)
        m = c.match(head, lock=True, allocate_tokens=PAGE, session_id="s-pf")
        oracle.write(head, m.pages, start_page=0)
        c.insert(head, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="s-pf")
        assert c.match(prompt).storage_tokens == 4 * PAGE
        idle(c)
        with redis_held(redis):
            m = c.match(prompt, lock=True, prefetch=True, session_id="s-pf")
            assert m.device_tokens == PAGE and m.prefetch_id
            c.close_session("s-pf")
            assert c.prefetch_status(m.prefetch_id).state is RUNNING
        assert wait_state(c, m.prefetch_id) is DONE
        c.release(lock_id=m.lock_id)
        idle(c)
        nothing_pinned(c)
        hit = c.match(prompt)
        assert hit.device_tokens + hit.host_tokens == 5 * PAGE
        assert load_and_verify(c, oracle, prompt) == 5 * PAGE


# --------------------------------------------------------------------------- best_effort


def test_best_effort_stops_when_the_request_moves_on(be: Daemon, store, redis: RedisServer) -> None:
    """best_effort (threshold 64 here: four 2-page prefetches fit the 8-page budget):
    Release, Load or Insert of the match's lock (the engine scheduled the request) cancels
    its prefetch; a prefetch-only match (no lock) is not stopped by them.
    The read in flight (the lock-free one's) still lands byte-exact; the cancelled ones
    queued behind it never read."""
    with be.client(engine_id="be") as c:
        oracle = reader(c)
        p_release, p_load, p_insert, p_free = (
            stored(store, c, 2, start=s) for s in (2_000_000, 2_100_000, 2_200_000, 2_300_000)
        )
        idle(c)
        with redis_held(redis):
            free = c.match(p_free, prefetch=True)  # no lock: nothing schedules it
            r = c.match(p_release, lock=True, prefetch=True)
            c.release(lock_id=r.lock_id)
            assert c.prefetch_status(r.prefetch_id).state is CANCELLED
            ld = c.match(p_load, lock=True, prefetch=True)
            steps = list(c.load(ld.lock_id))  # nothing in L2: the lock's own part only
            assert steps[-1].device_tokens == 0
            assert c.prefetch_status(ld.prefetch_id).state is CANCELLED
            c.release(lock_id=ld.lock_id)
            ins = c.match(p_insert, lock=True, prefetch=True, allocate_tokens=2 * PAGE)
            oracle.write(p_insert, ins.pages, start_page=0)  # the engine recomputes it
            c.insert(p_insert, lock_id=ins.lock_id, allocation_id=ins.allocation_id)
            assert c.prefetch_status(ins.prefetch_id).state is CANCELLED
            assert c.prefetch_status(free.prefetch_id).state is RUNNING
        assert wait_state(c, free.prefetch_id) is DONE
        idle(c)
        for pid in (r.prefetch_id, ld.prefetch_id, ins.prefetch_id):
            assert c.prefetch_status(pid).state is CANCELLED
        nothing_pinned(c)
        assert load_and_verify(c, oracle, p_free) == 2 * PAGE  # the read in flight
        assert load_and_verify(c, oracle, p_insert) == 2 * PAGE  # what the engine inserted
        for prompt in (p_release, p_load):  # queued behind it, cancelled: never read
            m = c.match(prompt)
            assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 2 * PAGE)


def test_best_effort_prefetch_of_an_engine_whose_lease_lapsed_is_cancelled(
    be: Daemon, store, redis: RedisServer
) -> None:
    """An engine that stops heartbeating (lease 3 s) mid-prefetch: its lock is released with
    the lapse, which cancels its best_effort prefetch; the read in flight still lands."""
    with be.client(engine_id="lapser") as c:
        reader(c)
        prompt = stored(store, c, 4, start=2_400_000)
        idle(c)
        with redis_held(redis):
            m = c.match(prompt, lock=True, prefetch=True)
            assert c.prefetch_status(m.prefetch_id).state is RUNNING
            c.close()  # a dead engine: no more heartbeats, nothing released by it
            wait_for(
                lambda: "engine lapser: lease lapsed; released 1 locks" in be.log(),
                15,
                "the lease lapsed",
            )
    with be.client(engine_id="lapser") as again:
        oracle = reader(again)
        info = again.prefetch_status(m.prefetch_id)
        assert (info.state, info.tokens_ready) == (CANCELLED, 0)
        idle(again)
        nothing_pinned(again)
        assert load_and_verify(again, oracle, prompt) == 4 * PAGE


# --------------------------------------------------------------------------- timeout


def test_timeout_deadline_is_base_plus_per_kib_tokens_capped_and_late_pages_dedupe(
    to: Daemon, store, redis: RedisServer
) -> None:
    """timeout: 1 page -> 0.2 + 24 x 64/1024 = 1.7 s (RUNNING well past the base alone),
    6 pages -> 9.2 s capped at 3 s. Both report TIMED_OUT with the 0 tokens that had
    arrived, frozen after the late pages land. The engine recomputes the 6-page prompt
    meanwhile: the late pages are duplicates and go back (L2 holds each page once), and
    everything reads back byte-exact."""
    with to.client(engine_id="to") as c:
        oracle = reader(c)
        one = stored(store, c, 1, start=3_000_000)
        six = stored(store, c, 6, start=3_100_000)
        idle(c)
        host0 = pool(c, "host")[0]
        timed_out = counter(c, "prefetches_timed_out")
        with redis_held(redis):
            t0 = time.monotonic()
            m1 = c.match(one, lock=True, prefetch=True)
            m6 = c.match(six, lock=True, prefetch=True)
            time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))
            # Past the base (0.2 s): the per-token term counts (m1's deadline is 1.7 s).
            assert c.prefetch_status(m1.prefetch_id).state is RUNNING
            assert c.prefetch_status(m6.prefetch_id).state is RUNNING
            assert wait_state(c, m1.prefetch_id) is TIMED_OUT
            assert wait_state(c, m6.prefetch_id) is TIMED_OUT
            assert time.monotonic() - t0 < 8.0  # capped at 3 s (uncapped: 9.2 s)
            for pid, total in ((m1.prefetch_id, PAGE), (m6.prefetch_id, 6 * PAGE)):
                info = c.prefetch_status(pid)
                assert (info.tokens_ready, info.tokens_total) == (0, total)
            c.release(lock_id=m1.lock_id)
            c.release(lock_id=m6.lock_id)
            r = c.match(six, lock=True, allocate_tokens=6 * PAGE)  # the rest is recomputed
            assert (r.device_tokens, r.host_tokens, r.storage_tokens) == (0, 0, 6 * PAGE)
            oracle.write(six, r.pages, start_page=0)
            c.insert(six, lock_id=r.lock_id, allocation_id=r.allocation_id)
        idle(c)
        for pid in (m1.prefetch_id, m6.prefetch_id):
            info = c.prefetch_status(pid)
            assert (info.state, info.tokens_ready) == (TIMED_OUT, 0)
        assert counter(c, "prefetches_timed_out") == timed_out + 2
        wait_for(lambda: pool(c, "device")[1] == 0, 10, "copies landed")
        assert pool(c, "host") == (host0 + 7, 0)
        assert load_and_verify(c, oracle, one) == PAGE  # the late page, kept for later requests
        assert load_and_verify(c, oracle, six) == 6 * PAGE


def test_a_cancel_after_the_deadline_does_not_undo_the_timeout(
    to: Daemon, store, redis: RedisServer
) -> None:
    """README: with `timeout` a prefetch gets a deadline and PrefetchStatus *then* reports
    TIMED_OUT. A cancel that comes after the deadline cannot make it a cancelled prefetch
    (and count it so) just because nobody polled it before: polled once first, the very
    same history answers TIMED_OUT."""
    with to.client(engine_id="to-cancel") as c:
        reader(c)
        polled_prompt = stored(store, c, 1, start=3_200_000)
        quiet_prompt = stored(store, c, 1, start=3_300_000)
        idle(c)
        with redis_held(redis):
            polled = c.match(polled_prompt, prefetch=True)
            quiet = c.match(quiet_prompt, prefetch=True)
            time.sleep(2.6)  # past both deadlines (1.7 s)
            assert c.prefetch_status(polled.prefetch_id).state is TIMED_OUT
            c.cancel_prefetch(polled.prefetch_id)
            c.cancel_prefetch(quiet.prefetch_id)
            assert c.prefetch_status(polled.prefetch_id).state is TIMED_OUT
            states = c.prefetch_status(quiet.prefetch_id).state
        idle(c)
        assert states is TIMED_OUT


def test_a_prefetch_that_ends_after_its_deadline_reports_timed_out(
    to: Daemon, store, redis: RedisServer
) -> None:
    """Its read held past the deadline (1.7 s), then let go: asked after that, PrefetchStatus
    must say TIMED_OUT (README: after the deadline it reports TIMED_OUT with the tokens that
    arrived by then), as it does when asked once in between; observed DONE with all tokens."""
    with to.client(engine_id="to-late") as c:
        reader(c)
        prompt = stored(store, c, 1, start=3_400_000)
        idle(c)
        timed_out = counter(c, "prefetches_timed_out")
        with redis_held(redis):
            m = c.match(prompt, prefetch=True)
            time.sleep(2.6)
        idle(c)
        info = c.prefetch_status(m.prefetch_id)
        assert (info.state, counter(c, "prefetches_timed_out")) == (TIMED_OUT, timed_out + 1)


# --------------------------------------------------------------------------- SIGTERM


@pytest.mark.timeout(60)
def test_sigterm_mid_prefetch_exits_0_in_bound_and_unlinks(
    make_daemon: MakeDaemon, store, redis: RedisServer
) -> None:
    """SIGTERM while a prefetch's read hangs (storage.timeout_s 2): the daemon stops within
    its bound, exits 0 and leaves no shared memory."""
    d = make_daemon(*_sets(redis), "prefetch.policy=wait_complete", "storage.timeout_s=2")
    with d.client(engine_id="term", retries=0) as c:
        reader(c)
        prompt = stored(store, c, 4, start=4_000_000)
        with redis_held(redis):
            m = c.match(prompt, lock=True, prefetch=True)
            assert m.prefetch_id and c.prefetch_status(m.prefetch_id).state is RUNNING
            t0 = time.monotonic()
            assert d.stop(signal.SIGTERM, timeout_s=30) == 0
            took = time.monotonic() - t0
    assert took < 15, took
    assert d.proc is not None
    assert not list(Path("/dev/shm").glob(f"hicache-*-{d.proc.pid}-*"))
    assert "daemon stopped" in d.log()


def test_a_cancelled_queued_prefetch_gives_its_reservation_back(
    be: Daemon, store, redis: RedisServer
) -> None:
    """Budget 8 pages (0.25 x 32): one 4-page prefetch reading (held), one queued behind it.
    Cancelling the queued one stops it before it read anything: its 4 reserved L2 pages and
    its budget are free again, so another engine's 4-page prefetch can start. Observed: the
    new match starts none (prefetch_id 0) and L2 still holds the cancelled reservation."""
    with be.client(engine_id="budget") as c:
        reader(c)
        reading, queued, third = (
            stored(store, c, 4, start=s) for s in (2_500_000, 2_600_000, 2_700_000)
        )
        idle(c)
        with redis_held(redis):
            a = c.match(reading, prefetch=True)
            b = c.match(queued, prefetch=True)
            assert a.prefetch_id and b.prefetch_id
            held = pool(c, "host")[0]
            assert c.cancel_prefetch(b.prefetch_id) == 0
            freed = held - pool(c, "host")[0]
            m = c.match(third, prefetch=True)
            started = m.prefetch_id != 0
        idle(c)
        assert (freed, started) == (4, True)
