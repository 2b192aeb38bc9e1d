"""One `Client` shared by many threads, the way a serving engine uses it (its scheduler,
its KV-transfer threads and its heartbeat thread share one), and several Clients or
processes under one engine id, against a real daemon.

- Seeded request lives on 12-16 threads at once over heavily overlapping prefixes: match
  with an allocation, deterministic KV written into the mapped L1 pool, insert (unary,
  `matched()` or Batch), reads under a lock (and Loads from L2), releases, sessions,
  Stats, prefetch status; every L1 page a locked match or a Load reports holds the bytes
  written for its tokens, and at the end nothing is held and the whole L1 is allocatable.
- The same with a short lease while another thread closes the client midway: every call
  begun after close() is FailedPrecondition, calls in flight end with a typed error, no
  thread hangs, and the lease releases what the closed client held.
- Two Clients in one process under one engine id share it; a forked child is a new
  instance (the daemon releases what the parent held under that id, and the parent's
  next heartbeat is told so).
- Regression tests of what this review found (`wait_ready` on a closed client).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

import hicache.client as client_module
from hicache.client import Client, close_session_op, insert_op, match_op, release_op
from hicache.controller.base import InsertOutcome, MatchOutcome
from hicache.errors import (
    FailedPrecondition,
    HicacheError,
    NotFound,
    ResourceExhausted,
)
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import PAGE, Daemon, eventually, tokens

MakeDaemon = Callable[..., Daemon]
SEED = 20260311
L1_PAGES = 80  # tiers.l1.tokens below; L2 is twice that
BIG_L1 = (f"tiers.l1.tokens={L1_PAGES * PAGE}",)
JOIN_S = 20.0  # bound on every thread's end


# --------------------------------------------------------------------------- KV and sequences


def page_kv(seq: bytes, page: int, layer: int, nbytes: int) -> np.ndarray:
    """The bytes an engine writes for `page` of `seq` on `layer`: a function of the tokens
    up to the page's end (KV depends on the whole prefix), so every writer of the same
    prefix writes the same bytes."""
    h = hashlib.blake2b(seq[: (page + 1) * PAGE * 4], digest_size=64,
                        person=layer.to_bytes(2, "little")).digest()
    return np.tile(np.frombuffer(h, dtype=np.uint8), nbytes // 64 + 1)[:nbytes]


class Pools:
    """Numpy views of the mapped L1 pools ([layer] -> [num_pages, bytes])."""

    def __init__(self, pools: dict[str, Any]) -> None:
        self.layers = [view.numpy() for view in pools["full"]]

    def write(self, seq: bytes, first_page: int, pages: np.ndarray) -> None:
        for layer, view in enumerate(self.layers):
            for i, p in enumerate(pages):
                view[int(p)] = page_kv(seq, first_page + i, layer, view.shape[1])

    def check(self, seq: bytes, pages: np.ndarray | None, n_tokens: int | None) -> int:
        """Raises when a page of the first `n_tokens` of `seq` holds other bytes; the
        pages checked."""
        n = (n_tokens or 0) // PAGE
        if n == 0:
            return 0
        assert pages is not None and len(pages) >= n, (n_tokens, pages)
        for layer, view in enumerate(self.layers):
            for i in range(n):
                got = view[int(pages[i])]
                want = page_kv(seq, i, layer, view.shape[1])
                if not np.array_equal(got, want):
                    raise AssertionError(f"page {int(pages[i])} (token page {i} of a {len(seq) // 4}-token "
                                         f"sequence, layer {layer}) holds other bytes")
        return n


def prefix_catalogue() -> list[bytes]:
    """Heavily overlapping sequences: 4 shared prefixes (1-2 pages) x 10 suffixes
    (1-3 pages)."""
    seqs = []
    for k in range(4):
        prefix = tokens((1 + k % 2) * PAGE, start=1_000_000 + 100_000 * k)
        for j in range(10):
            seqs.append(prefix + tokens((1 + j % 3) * PAGE, start=5_000_000 + 100_000 * k + 5_000 * j))
    return seqs


# --------------------------------------------------------------------------- request lives


@dataclass
class Tally:
    lives: Counter = field(default_factory=Counter)
    verified_pages: int = 0
    loads: int = 0
    exhausted: int = 0
    failures: list[str] = field(default_factory=list)
    mu: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, verified: int = 0) -> None:
        with self.mu:
            self.lives[kind] += 1
            self.verified_pages += verified


class Abandon(Exception):
    """A request the engine drops inside its `matched()` block."""


class Engine:
    """The request lives one thread of an engine runs on a shared Client."""

    def __init__(self, client: Client, pools: Pools, tally: Tally, seqs: list[bytes]) -> None:
        self.c = client
        self.pools = pools
        self.tally = tally
        self.seqs = seqs

    def pick(self, rng: random.Random, tid: int, n: int) -> bytes:
        if rng.random() < 0.35:  # a fresh sequence on a shared prefix: pushes others out of L1
            base = self.seqs[rng.randrange(len(self.seqs))][: PAGE * 4]
            return base + tokens(rng.randint(1, 2) * PAGE, start=20_000_000 + 100_000 * tid + 1_000 * n)
        return self.seqs[rng.randrange(len(self.seqs))]

    def life(self, rng: random.Random, tid: int, n: int) -> None:
        seq = self.pick(rng, tid, n)
        kind = rng.choices(["matched", "unary", "batch", "read", "release", "misc"],
                           weights=[30, 15, 15, 25, 8, 7])[0]
        try:
            getattr(self, f"life_{kind}")(rng, seq, f"s-{tid}-{n % 3}")
        except ResourceExhausted:
            with self.tally.mu:
                self.tally.exhausted += 1

    def fill(self, seq: bytes, m: MatchOutcome) -> int:
        """Checks the matched L1 prefix and writes the allocation's pages; pages checked."""
        checked = self.pools.check(seq, m.device_pages.get("full"), m.device_tokens)
        if m.allocation_id:
            self.pools.write(seq, m.device_tokens // PAGE, m.pages["full"])
        return checked

    def life_matched(self, rng: random.Random, seq: bytes, session: str) -> None:
        n = len(seq) // 4
        try:
            with self.c.matched(seq, allocate_tokens=n, session_id=session) as m:
                checked = self.fill(seq, m)
                if rng.random() < 0.15:
                    raise Abandon
                if rng.random() < 0.3:  # mid-request insert keeping the lock, then the final one
                    self.c.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                  session_id=session, keep_lock=True)
                out = self.c.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                    session_id=session)
                assert isinstance(out, InsertOutcome)
        except Abandon:
            checked = 0
        self.tally.add("matched", checked)

    def life_unary(self, rng: random.Random, seq: bytes, session: str) -> None:
        m = self.c.match(seq, lock=True, allocate_tokens=len(seq) // 4)
        try:
            checked = self.fill(seq, m)
        except BaseException:
            self.c.release(lock_id=m.lock_id)
            if m.allocation_id:
                self.c.release(allocation_id=m.allocation_id)
            raise
        self.c.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id)
        self.tally.add("unary", checked)

    def life_batch(self, rng: random.Random, seq: bytes, session: str) -> None:
        first = self.c.batch([
            match_op(seq, lock=True, allocate_tokens=len(seq) // 4, session_id=session),
            pb.BatchOp(stats=pb.StatsRequest()),
            release_op(lock_id=12_345),
            close_session_op(f"other-{session}"),
        ])
        m, stats, unknown, closed = first
        assert isinstance(unknown, NotFound), unknown
        assert isinstance(closed, int | NotFound), closed
        assert stats.pools and all(p.locked_pages <= p.capacity_pages for p in stats.pools)
        if isinstance(m, ResourceExhausted):
            raise m
        assert isinstance(m, MatchOutcome), m
        checked = self.fill(seq, m)
        done = self.c.batch([
            insert_op(seq, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=session),
            release_op(lock_id=m.lock_id),  # consumed by the insert
            pb.BatchOp(heartbeat=pb.HeartbeatRequest(engine_id=self.c.engine_id,
                                                     instance_id=self.c.instance_id)),
        ])
        assert isinstance(done[0], InsertOutcome), done[0]
        assert isinstance(done[1], NotFound), done[1]
        self.tally.add("batch", checked)

    def life_read(self, rng: random.Random, seq: bytes, session: str) -> None:
        with self.c.matched(seq, session_id=session) as m:
            checked = self.pools.check(seq, m.device_pages.get("full"), m.device_tokens)
            if m.host_tokens:
                last = list(self.c.load(m.lock_id))[-1]
                assert last.layers_ready == last.layers_total
                assert (last.device_tokens or 0) >= m.device_tokens + m.host_tokens
                assert last.device_pages is not None
                checked = self.pools.check(seq, last.device_pages.get("full"), last.device_tokens)
                with self.tally.mu:
                    self.tally.loads += 1
        self.tally.add("read", checked)

    def life_release(self, rng: random.Random, seq: bytes, session: str) -> None:
        m = self.c.match(seq, lock=True, allocate_tokens=len(seq) // 4)
        checked = self.fill(seq, m)
        handles = [("lock_id", m.lock_id)] + ([("allocation_id", m.allocation_id)] if m.allocation_id else [])
        rng.shuffle(handles)
        for name, handle in handles:
            self.c.release(**{name: handle})
        name, handle = handles[0]
        with pytest.raises(NotFound):
            self.c.release(**{name: handle})
        self.tally.add("release", checked)

    def life_misc(self, rng: random.Random, seq: bytes, session: str) -> None:
        pick = rng.randrange(3)
        if pick == 0:
            with pytest.raises(NotFound):
                self.c.prefetch_status(rng.randrange(1, 1 << 62))  # no L3: none ever runs
        elif pick == 1:
            with contextlib.suppress(NotFound):
                assert self.c.close_session(session) >= 0
        else:
            stats = self.c.stats()
            device = next(p for p in stats.pools if p.tier == "device")
            assert device.capacity_pages == L1_PAGES
        self.tally.add("misc")


def run_threads(n: int, target: Callable[[int], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(tid,), name=f"engine-{tid}", daemon=True)
               for tid in range(n)]
    for t in threads:
        t.start()
    return threads


def join_all(threads: list[threading.Thread], timeout_s: float = JOIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {timeout_s} s: {hung}"


def assert_nothing_held(daemon: Daemon, wait_s: float = 10.0) -> None:
    """No locked page in any tier, and the whole L1 allocatable (no leaked allocation)."""
    with daemon.client(engine_id=f"observer-{time.monotonic_ns()}", timeout_s=10) as c:
        deadline = time.monotonic() + wait_s
        while True:
            pools = c.stats().pools
            locked = [(p.tier, p.locked_pages) for p in pools if p.locked_pages]
            if not locked:
                break
            assert time.monotonic() < deadline, f"still locked: {locked}"
            time.sleep(0.1)
        c.attach(map_pools=False)
        with c.allocation(L1_PAGES * PAGE) as a:
            assert len(a.pages["full"]) == L1_PAGES
    log = daemon.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:2000]


# --------------------------------------------------------------------------- 1. shared client


def test_one_client_shared_by_many_threads_reads_back_every_byte(make_daemon: MakeDaemon) -> None:
    d = make_daemon(*BIG_L1)
    tally = Tally()
    with d.client(engine_id="engine-shared", timeout_s=10) as c:
        engine = Engine(c, Pools(c.attach().pools), tally, prefix_catalogue())

        def work(tid: int) -> None:
            rng = random.Random(SEED * 100 + tid)
            try:
                for n in range(30):
                    engine.life(rng, tid, n)
            except BaseException as e:  # every failure is the test's
                tally.failures.append(f"thread {tid}: {type(e).__module__}.{type(e).__name__}: {e}")

        join_all(run_threads(16, work))
        assert not tally.failures, "\n".join(tally.failures)
        assert sum(tally.lives.values()) + tally.exhausted == 16 * 30
        assert tally.verified_pages > 200 and tally.loads > 0, (tally.verified_pages, tally.loads)
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
        assert c.stats().counters["expired_leases"] == 0
    # (Pages a write-through copy still reads stay locked for a few ms: polled.)
    assert_nothing_held(d)


# --------------------------------------------------------------------------- 2. close midway


LEASE_MS = 1500  # (a heartbeat every 500 ms, among 12 busy threads on a loaded machine)


def test_close_midway_with_a_short_lease_ends_every_thread_with_a_typed_error(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon(*BIG_L1, f"server.lease_ms={LEASE_MS}")
    tally = Tally()
    closing = threading.Event()  # set as close() is called
    after_close: list[tuple[int, str]] = []  # (thread, what the first life begun after it raised)
    in_flight: Counter = Counter()  # errors of lives begun before close() was called
    expired_before: list[int] = []
    c = d.client(engine_id="engine-closing", timeout_s=10)
    engine = Engine(c, Pools(c.attach().pools), tally, prefix_catalogue())
    t0 = time.monotonic()

    def work(tid: int) -> None:
        rng = random.Random(SEED * 200 + tid)
        n = 0
        while n < 10_000:
            begun_after = closing.is_set()
            try:
                engine.life(rng, tid, n)
            except HicacheError as e:
                if begun_after:
                    after_close.append((tid, type(e).__name__))
                    return
                in_flight[type(e).__name__] += 1
                if type(e) is HicacheError:  # an unmapped code
                    tally.failures.append(f"thread {tid}: untyped {e}")
            except BaseException as e:
                tally.failures.append(f"thread {tid}: {type(e).__module__}.{type(e).__name__}: {e}")
                return
            else:
                if begun_after:
                    tally.failures.append(f"thread {tid}: a life begun after close() succeeded")
                    return
            n += 1

    threads = run_threads(12, work)

    def closer() -> None:
        # Past three leases, with lives running: only the heartbeat thread kept the engine.
        while time.monotonic() - t0 < 3 * LEASE_MS / 1e3 or sum(tally.lives.values()) < 60:
            if time.monotonic() - t0 > JOIN_S:
                break
            time.sleep(0.01)
        expired_before.append(c.stats().counters["expired_leases"])
        closing.set()
        c.close()

    closer_thread = threading.Thread(target=closer, name="closer", daemon=True)
    closer_thread.start()
    join_all([closer_thread, *threads])
    heartbeat_thread = c._heartbeat_thread
    assert heartbeat_thread is None or not heartbeat_thread.is_alive()
    assert not tally.failures, "\n".join(tally.failures)
    assert expired_before == [0]  # the heartbeat thread kept the lease under the load
    # No lease lapsed while the client was open: the lives before close() never saw
    # the daemon forget the engine.
    # Only lives under way as close() ran failed (one per thread at most), with a typed error.
    assert not set(in_flight) - {"FailedPrecondition", "ResourceExhausted"}, in_flight
    assert in_flight["FailedPrecondition"] <= 12, in_flight
    assert sum(tally.lives.values()) >= 60
    assert sorted(after_close) == [(tid, "FailedPrecondition") for tid in range(12)]
    with pytest.raises(FailedPrecondition, match="closed"):
        c.stats()
    with pytest.raises(FailedPrecondition, match="closed"):
        list(c.load(1))
    # What the closed client held goes with its lease.
    assert eventually(lambda: "engine engine-closing: lease lapsed" in d.log(), 15), d.log()
    assert_nothing_held(d)


# --------------------------------------------------------------------------- 3. one engine id, two clients / a fork


def test_two_clients_of_one_process_share_the_engine_and_its_handles(make_daemon: MakeDaemon) -> None:
    d = make_daemon(*BIG_L1)
    tally = Tally()
    with d.client(engine_id="engine-twin") as a, d.client(engine_id="engine-twin") as b:
        assert a.instance_id == b.instance_id == client_module._INSTANCE_ID
        pools_a = Pools(a.attach().pools)
        held = a.match(tokens(2 * PAGE, start=90_000_000), lock=True, allocate_tokens=2 * PAGE)
        pools_b = Pools(b.attach().pools)  # the same instance: A's handles stay
        assert (b.heartbeat().locks, b.heartbeat().allocations) == (1, 1)
        seqs = prefix_catalogue()
        engines = [Engine(a, pools_a, tally, seqs), Engine(b, pools_b, tally, seqs)]

        def work(tid: int) -> None:
            rng = random.Random(SEED * 300 + tid)
            try:
                for n in range(12):
                    engines[tid % 2].life(rng, tid, n)
            except BaseException as e:
                tally.failures.append(f"thread {tid}: {type(e).__module__}.{type(e).__name__}: {e}")

        join_all(run_threads(8, work))
        assert not tally.failures, "\n".join(tally.failures)
        # B may release what A made (one engine), and A's insert then finds it gone.
        b.release(allocation_id=held.allocation_id)
        with pytest.raises(NotFound):
            a.insert(tokens(2 * PAGE, start=90_000_000), lock_id=held.lock_id,
                     allocation_id=held.allocation_id)
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 0)  # a failed insert keeps the lock
        b.release(lock_id=held.lock_id)
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
    assert_nothing_held(d)
    assert "predecessor" not in d.log()


def _child(target: str, write_fd: int) -> None:
    """The forked child: attaches under the parent's engine id with its own Client."""
    code = 1
    try:
        with Client(target, engine_id="engine-forked", timeout_s=10) as c:
            c.attach(map_pools=False)
            hb = c.heartbeat()
            os.write(write_fd, f"{c.instance_id} {hb.locks} {hb.allocations}".encode())
        code = 0
    finally:
        os._exit(code)


def test_a_forked_child_is_a_new_instance_of_the_engine(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    with d.client(engine_id="engine-forked", timeout_s=10) as parent:
        parent.attach(map_pools=False)
        prompt = tokens(2 * PAGE, start=91_000_000)
        held = parent.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        before = parent.instance_id
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            os.close(r)
            _child(d.target, w)
        os.close(w)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish in 30 s")
        out = os.read(r, 1000).decode().split()
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0, out
        child_instance, locks, allocations = out[0], int(out[1]), int(out[2])
        assert parent.instance_id == before != child_instance  # only the child re-drew
        assert (locks, allocations) == (0, 0)  # the parent's were released at its attach
        with pytest.raises(NotFound):
            parent.insert(prompt, lock_id=held.lock_id, allocation_id=held.allocation_id)
        # The parent learns it was replaced (its heartbeat renewed the child's lease and
        # reported the child's handles as its own, and its client never detached).
        with pytest.raises(NotFound, match="another process attached it since"):
            parent.heartbeat()
    assert "predecessor's 1 locks, 1 allocations" in d.log()


# --------------------------------------------------------------------------- 4. findings


class _Injected(grpc.RpcError):
    """An UNAVAILABLE as the stub raises it (the daemon away during the call)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: connection reset"


def test_releases_owed_by_many_threads_are_each_made_once(daemon: Daemon) -> None:
    """Eight threads' `matched()` blocks end while their release cannot reach the daemon:
    each is told (Unavailable) and owes its release; heartbeats from several threads at
    once then make every owed release, none twice, none lost."""
    with daemon.client(engine_id="owing", retries=0) as c:
        c.attach(map_pools=False)
        batch = c._stub.Batch
        failing = threading.Event()
        failing.set()

        def flaky_batch(request: Any, **kw: Any) -> Any:
            if failing.is_set() and all(op.WhichOneof("op") == "release" for op in request.ops):
                raise _Injected()
            return batch(request, **kw)

        c._stub.Batch = flaky_batch  # type: ignore[method-assign]
        told: list[str] = []
        ready = threading.Barrier(8)

        def block(tid: int) -> None:
            try:
                with c.matched(tokens(PAGE, start=95_000_000 + 10_000 * tid), allocate_tokens=PAGE):
                    ready.wait(10)  # every block holds its handles at once
            except HicacheError as e:
                told.append(type(e).__name__)

        join_all(run_threads(8, block))
        assert told == ["Unavailable"] * 8
        assert len(c._owed) == 8
        assert (c._call(c._stub.Heartbeat, pb.HeartbeatRequest(engine_id=c.engine_id),
                        repeatable=True).locks) == 8  # (a beat that settles nothing)
        failing.clear()
        join_all(run_threads(4, lambda _tid: c.heartbeat()))
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
        assert c._owed == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_wait_ready_on_a_closed_client_is_failed_precondition_at_once(daemon: Daemon) -> None:
    c = daemon.client(engine_id="closed-then-waited")
    c.close()
    t0 = time.monotonic()
    try:
        with pytest.raises(FailedPrecondition, match="closed"):
            c.wait_ready(timeout_s=10.0)
    finally:
        assert time.monotonic() - t0 < 5.0  # at once, not after the 10 s wait
