"""Review of sessions, leases and multi-rank engines, end to end through a real daemon.

Engines that must not heartbeat (a dead or hung process) or that must send a chosen rank
and instance id (one process per tensor-parallel rank, a restarted process) talk to the
daemon through a raw gRPC stub (`RawEngine`); the others use `hicache.client.Client`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from hicache.client import close_session_op
from hicache.errors import InvalidArgument, NotFound
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import PAGE, Daemon, eventually, free_port, scrape, tokens

MakeDaemon = Callable[..., Daemon]
# Raw engines send no background heartbeat: a lease lapses at the first gap between the
# test's own calls longer than it, which a loaded machine makes now and then. The shared
# daemon's tests never wait for a lapse (a long lease); the lapse tests' own daemons use
# a lease of 2 s.
TP2_LEASE_MS = 60_000
LEASE_MS = 2000
TENANT_A = "token-of-tenant-a-0123456789"
TENANT_B = "token-of-tenant-b-9876543210"



class RawEngine:
    """One engine process as the daemon sees it: a chosen rank and instance id, and
    heartbeats only when the test sends them."""

    def __init__(self, target: str, engine_id: str, token: str | None = None) -> None:
        self.engine_id = engine_id
        self._channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.HiCacheStub(self._channel)
        self._auth: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.md = (*self._auth, ("x-hicache-engine", engine_id))

    def close(self) -> None:
        self._channel.close()

    def attach(self, rank: int = 0, size: int = 1, instance: str = "") -> Any:
        return self.stub.Attach(
            pb.AttachRequest(
                engine_id=self.engine_id, tp_rank=rank, tp_size=size, instance_id=instance
            ),
            metadata=self._auth,
            timeout=10,
        )

    def heartbeat(self, rank: int = 0, instance: str = "") -> Any:
        return self.stub.Heartbeat(
            pb.HeartbeatRequest(engine_id=self.engine_id, tp_rank=rank, instance_id=instance),
            metadata=self._auth,
            timeout=10,
        )

    def match(self, seq: bytes, **kw: Any) -> Any:
        return self.stub.MatchPrefix(
            pb.MatchPrefixRequest(tokens=seq, **kw), metadata=self.md, timeout=10
        )

    def insert(self, seq: bytes, **kw: Any) -> Any:
        return self.stub.Insert(pb.InsertRequest(tokens=seq, **kw), metadata=self.md, timeout=10)

    def release(self, **kw: Any) -> Any:
        return self.stub.Release(pb.ReleaseRequest(**kw), metadata=self.md, timeout=10)

    def allocate(self, n: int, **kw: Any) -> Any:
        return self.stub.Allocate(
            pb.AllocateRequest(num_tokens=n, **kw), metadata=self.md, timeout=10
        )

    def load(self, lock_id: int) -> list[Any]:
        return list(self.stub.Load(pb.LoadRequest(lock_id=lock_id), metadata=self.md, timeout=10))

    def batch(self, *ops: pb.BatchOp) -> Any:
        return self.stub.Batch(pb.BatchRequest(ops=list(ops)), metadata=self.md, timeout=10)

    def close_session(self, session_id: str) -> int:
        r = self.stub.CloseSession(
            pb.CloseSessionRequest(session_id=session_id), metadata=self.md, timeout=10
        )
        return int(r.released_refs)

    def stats(self) -> Any:
        return self.stub.Stats(pb.StatsRequest(), metadata=self.md, timeout=10)


def status(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """The status a call fails with (the test expects it to fail)."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError("the call succeeded")


def device(stats: Any) -> Any:
    """The L1 pool of a Stats reply (raw) or snapshot (the client's)."""
    return next(p for p in stats.pools if p.tier in (pb.DEVICE, "device"))


def host(stats: Any) -> Any:
    return next(p for p in stats.pools if p.tier in (pb.HOST, "host"))


def metric(port: int, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", scrape(port), re.M)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------ daemons


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    """A daemon of a two-rank model, and its metrics port."""
    port = free_port()
    d = Daemon(
        tmp_path_factory.mktemp("tp2"),
        "model.tp_size=2",
        f"server.lease_ms={TP2_LEASE_MS}",
        f"metrics.port={port}",
    ).start()
    yield d, port
    d.close()


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("tenants"),
        f"server.tokens=[{{token: {TENANT_A}, namespaces: ['*']}}, "
        f"{{token: {TENANT_B}, namespaces: ['*']}}]",
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    yield d
    d.close()


@pytest.fixture
def raw(tp2: tuple[Daemon, int]) -> Iterator[Callable[[str], RawEngine]]:
    made: list[RawEngine] = []

    def make(engine_id: str) -> RawEngine:
        e = RawEngine(tp2[0].target, engine_id)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def own_tp2(
    make_daemon: MakeDaemon,
) -> Iterator[Callable[..., tuple[Daemon, Callable[[str], RawEngine]]]]:
    """A private two-rank daemon with a short lease (its lease counters are the test's
    alone: an engine of another test lapsing would count there), and raw engines on it."""
    made: list[RawEngine] = []

    def make(*sets: str) -> tuple[Daemon, Callable[[str], RawEngine]]:
        d = make_daemon("model.tp_size=2", f"server.lease_ms={LEASE_MS}", *sets)

        def engine(engine_id: str) -> RawEngine:
            e = RawEngine(d.target, engine_id)
            made.append(e)
            return e

        return d, engine

    yield make
    for e in made:
        e.close()


# ------------------------------------------------------------------ ranks and leases


def test_attach_with_a_wrong_rank_or_size_names_the_field_and_registers_nothing(
    raw: Callable[[str], RawEngine],
) -> None:
    e = raw("bad-attach")
    for rank, size, field in (
        (2, 2, "tp_rank"),
        (7, 2, "tp_rank"),
        (0, 1, "tp_size"),
        (0, 3, "tp_size"),
        (0, 0, "tp_size"),
    ):
        code, msg = status(lambda r=rank, s=size: e.attach(r, s, "inst"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (rank, size, msg)
        assert field in msg, (rank, size, msg)
    # None of them attached the engine: its calls are still refused as before Attach.
    code, msg = status(lambda: e.heartbeat(0, "inst"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "Attach" in msg
    code, _ = status(lambda: e.match(tokens(PAGE, start=9_000), lock=True))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_one_ranks_restart_releases_the_engines_handles_and_the_living_rank_keeps_going(
    tp2: tuple[Daemon, int],
    raw: Callable[[str], RawEngine],
) -> None:
    _, port = tp2
    rank0, rank1 = raw("tp-group"), raw("tp-group")
    a0 = rank0.attach(0, 2, "r0-a")
    a1 = rank1.attach(1, 2, "r1-a")
    assert {p.tp_rank for p in a0.pools} == {0} and {p.tp_rank for p in a1.pools} == {1}
    assert a0.lease_ms == a1.lease_ms == TP2_LEASE_MS
    locked_before = device(rank0.stats()).locked_pages
    restarts = metric(port, "hicache_engine_restarts_total")
    m0 = rank0.match(tokens(2 * PAGE, start=10_000), lock=True, allocate_tokens=2 * PAGE)
    m1 = rank1.match(tokens(2 * PAGE, start=10_000), lock=True)
    hb = rank0.heartbeat(0, "r0-a")  # handles belong to the engine, not to a rank
    assert (hb.locks, hb.allocations) == (2, 1)
    # Rank 1's process dies and a new one attaches: the group does not outlive it.
    rank1.attach(1, 2, "r1-b")
    hb = rank1.heartbeat(1, "r1-b")
    assert (hb.locks, hb.allocations) == (0, 0)
    for kw in (
        {"lock_id": m0.lock_id},
        {"allocation_id": m0.allocation_id},
        {"lock_id": m1.lock_id},
    ):
        assert status(lambda k=kw: rank0.release(**k))[0] == grpc.StatusCode.NOT_FOUND
    assert metric(port, "hicache_engine_restarts_total") == restarts + 1
    assert device(rank0.stats()).locked_pages == locked_before
    # Rank 0 lives on: its heartbeat is taken; the replaced rank-1 process is told.
    assert rank0.heartbeat(0, "r0-a").lease_ms == TP2_LEASE_MS
    code, msg = status(lambda: rank1.heartbeat(1, "r1-a"))
    assert code == grpc.StatusCode.NOT_FOUND and "another process" in msg
    # Rank 0's own restart later is seen too.
    held = rank0.match(tokens(2 * PAGE, start=10_500), lock=True)
    rank0.attach(0, 2, "r0-b")
    assert status(lambda: rank0.release(lock_id=held.lock_id))[0] == grpc.StatusCode.NOT_FOUND
    assert metric(port, "hicache_engine_restarts_total") == restarts + 2


def test_a_group_restarting_rank_by_rank_is_one_restart_and_keeps_what_the_new_ranks_took(
    tp2: tuple[Daemon, int],
    raw: Callable[[str], RawEngine],
) -> None:
    _, port = tp2
    rank0, rank1 = raw("rolling"), raw("rolling")
    rank0.attach(0, 2, "old-0")
    rank1.attach(1, 2, "old-1")
    old = rank0.match(tokens(2 * PAGE, start=14_000), lock=True)
    restarts = metric(port, "hicache_engine_restarts_total")
    rank0.attach(0, 2, "new-0")  # the group's processes die; rank 0 comes back first ...
    new = rank0.match(tokens(2 * PAGE, start=14_500), lock=True, allocate_tokens=2 * PAGE)
    rank1.attach(1, 2, "new-1")  # ... then rank 1: it joins the restart
    assert metric(port, "hicache_engine_restarts_total") == restarts + 1
    hb = rank1.heartbeat(1, "new-1")
    assert (hb.locks, hb.allocations) == (1, 1)
    assert status(lambda: rank0.release(lock_id=old.lock_id))[0] == grpc.StatusCode.NOT_FOUND
    rank0.release(lock_id=new.lock_id)
    rank0.release(allocation_id=new.allocation_id)


def test_a_silent_group_loses_its_handles_after_the_lease_and_one_rank_keeps_it(
    own_tp2: Callable[..., tuple[Daemon, Callable[[str], RawEngine]]],
) -> None:
    port = free_port()
    _, raw = own_tp2(f"metrics.port={port}")
    rank0, rank1 = raw("silent-group"), raw("silent-group")
    rank0.attach(0, 2, "s0")
    rank1.attach(1, 2, "s1")
    seq = tokens(2 * PAGE, start=11_000)
    m = rank0.match(seq, lock=True, allocate_tokens=2 * PAGE)
    expired = rank0.stats().counters.expired_leases
    expired_metric = metric(port, "hicache_expired_leases_total")
    # Rank 1 alone heartbeats for two leases: the engine's lease holds (one per engine).
    until = time.monotonic() + 2 * LEASE_MS / 1e3
    while time.monotonic() < until:
        hb = rank1.heartbeat(1, "s1")
        time.sleep(LEASE_MS / 3e3 / 2)
    assert (hb.locks, hb.allocations) == (1, 1)
    # Then the whole group falls silent.
    assert eventually(lambda: rank0.stats().counters.expired_leases > expired)
    assert rank0.stats().counters.expired_leases == expired + 1  # one engine, two ranks
    assert metric(port, "hicache_expired_leases_total") == expired_metric + 1
    for call in (lambda: rank0.heartbeat(0, "s0"), lambda: rank1.heartbeat(1, "s1")):
        code, msg = status(call)
        assert code == grpc.StatusCode.NOT_FOUND and "lease expired" in msg
    code, msg = status(lambda: rank0.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert code == grpc.StatusCode.NOT_FOUND
    # Attaching again starts afresh: nothing of before is held or reachable.
    rank0.attach(0, 2, "s0")
    hb = rank0.heartbeat(0, "s0")
    assert (hb.locks, hb.allocations) == (0, 0)
    assert status(lambda: rank0.release(lock_id=m.lock_id))[0] == grpc.StatusCode.NOT_FOUND


def test_heartbeats_of_a_replaced_process_do_not_keep_its_successors_lease(
    own_tp2: Callable[..., tuple[Daemon, Callable[[str], RawEngine]]],
) -> None:
    _, raw = own_tp2()
    old, new = raw("replaced"), raw("replaced")
    old.attach(0, 2, "old-process")
    new.attach(0, 2, "new-process")  # the restart, while the old process still runs
    m = new.match(tokens(2 * PAGE, start=12_000), lock=True, allocate_tokens=2 * PAGE)
    expired = new.stats().counters.expired_leases
    refused = 0
    deadline = time.monotonic() + 15
    # Only the replaced process heartbeats (every lease / 6): the new one is silent.
    while new.stats().counters.expired_leases == expired and time.monotonic() < deadline:
        code, msg = status(lambda: old.heartbeat(0, "old-process"))
        assert code == grpc.StatusCode.NOT_FOUND, msg
        refused += 1
        time.sleep(LEASE_MS / 6e3)
    assert new.stats().counters.expired_leases == expired + 1
    assert refused >= 2
    assert status(lambda: new.release(lock_id=m.lock_id))[0] == grpc.StatusCode.NOT_FOUND
    assert status(lambda: new.heartbeat(0, "new-process"))[0] == grpc.StatusCode.NOT_FOUND


def test_another_engines_handles_are_not_found_and_stay_held(
    raw: Callable[[str], RawEngine],
) -> None:
    owner, other = raw("owner"), raw("intruder")
    owner.attach(0, 2, "o")
    other.attach(0, 2, "x")
    seq = tokens(3 * PAGE, start=13_000)
    m = owner.match(seq, lock=True, allocate_tokens=3 * PAGE)
    attempts: dict[str, Callable[[], Any]] = {
        "release lock": lambda: other.release(lock_id=m.lock_id),
        "release allocation": lambda: other.release(allocation_id=m.allocation_id),
        "insert": lambda: other.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id),
        "insert with the allocation": lambda: other.insert(seq, allocation_id=m.allocation_id),
        "load": lambda: other.load(m.lock_id),
        "grow the allocation": lambda: other.allocate(PAGE, allocation_id=m.allocation_id),
        "allocate past the lock": lambda: other.allocate(PAGE, lock_id=m.lock_id),
    }
    for what, call in attempts.items():
        code, msg = status(call)
        assert code == grpc.StatusCode.NOT_FOUND, (what, code, msg)
    out = other.batch(
        pb.BatchOp(release=pb.ReleaseRequest(lock_id=m.lock_id)),
        pb.BatchOp(release=pb.ReleaseRequest(allocation_id=m.allocation_id)),
    )
    assert [r.status.code for r in out.results] == [grpc.StatusCode.NOT_FOUND.value[0]] * 2
    hb = owner.heartbeat(0, "o")
    assert (hb.locks, hb.allocations) == (1, 1)
    done = owner.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id)
    assert done.inserted_tokens == 3 * PAGE
    hb = owner.heartbeat(0, "o")
    assert (hb.locks, hb.allocations) == (0, 0)


def test_a_rank_the_daemon_forgot_is_told_so_even_after_another_rank_attached_again(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon("model.tp_size=2")
    rank0, rank1 = RawEngine(d.target, "tp-restarted"), RawEngine(d.target, "tp-restarted")
    try:
        before = rank0.attach(0, 2, "r0")
        rank1.attach(1, 2, "r1")
        assert d.stop() == 0
        d.start()  # a daemon restart: new pools, no engines
        assert status(lambda: rank1.heartbeat(1, "r1"))[0] == grpc.StatusCode.FAILED_PRECONDITION
        after = rank1.attach(1, 2, "r1")  # rank 1's client detached and attached again
        assert [p.handle for p in after.pools] != [p.handle for p in before.pools]
        # Rank 0 never attached to this daemon: its pools are gone, it must attach again.
        code, _ = status(lambda: rank0.heartbeat(0, "r0"))
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        rank0.close()
        rank1.close()


# ------------------------------------------------------------------ sessions


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("sessions"), "eviction.closed_session_tombstones=2").start()
    yield d
    d.close()


def life(c: Any, seq: bytes, session: str = "", namespace: str = "") -> None:
    """One request: match with an allocation, insert (within `session`)."""
    m = c.match(seq, namespace, lock=True, allocate_tokens=len(seq) // 4, session_id=session)
    c.insert(seq, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=session)


def test_closing_again_answers_the_same_until_the_tombstones_forget_it(sessions: Daemon) -> None:
    with sessions.client(engine_id="tombstones") as c:
        c.attach(map_pools=False)
        for i, sid in enumerate(("t-1", "t-2", "t-3")):
            life(c, tokens((i + 1) * PAGE, start=20_000 + 1_000 * i), sid)
        assert c.close_session("t-1") == 1
        assert c.close_session("t-1") == 1  # a retry gets the first answer
        assert c.close_session("t-2") == 2
        assert c.close_session("t-3") == 3  # the third close: t-1's tombstone goes
        assert c.close_session("t-3") == 3 and c.close_session("t-2") == 2
        with pytest.raises(NotFound, match="t-1"):
            c.close_session("t-1")
        # In a Batch too, and a closed session used again is a new one.
        life(c, tokens(4 * PAGE, start=20_000), "t-2")
        assert c.batch(
            [close_session_op("t-2"), close_session_op("t-2"), close_session_op("t-3")]
        ) == [4, 4, 3]
        assert c.close_session("t-2") == 4


def test_a_late_insert_of_a_closed_session_does_not_reopen_it(sessions: Daemon) -> None:
    with sessions.client(engine_id="late") as c:
        c.attach(map_pools=False)
        seq = tokens(2 * PAGE, start=21_000)
        m = c.match(seq, lock=True, allocate_tokens=2 * PAGE, session_id="late-1")
        assert c.close_session("late-1") == 0  # nothing referenced yet
        c.insert(seq, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="late-1")
        # The insert matched under the closed generation: no references came back, and
        # the session is still the closed one (its close answers as before).
        assert c.close_session("late-1") == 0
        # A request of the session after the close is a new generation and counts.
        life(c, seq, "late-1")
        assert c.close_session("late-1") == 2


def test_a_late_insert_of_an_allocation_made_before_the_close_does_not_reopen_it(
    sessions: Daemon,
) -> None:
    with sessions.client(engine_id="late-alloc") as c:
        c.attach(map_pools=False)
        life(c, tokens(2 * PAGE, start=21_500), "late-2")
        seq = tokens(3 * PAGE, start=21_800)
        a = c.allocate(3 * PAGE)  # a request of the session starts (nothing to reuse) ...
        assert c.close_session("late-2") == 2  # ... the conversation is closed ...
        c.insert(seq, allocation_id=a.allocation_id, session_id="late-2")  # ... it ends
        assert c.close_session("late-2") == 2  # the close stands: the same answer


@pytest.mark.parametrize("session_id", ["a/b", "üñî cødé ☃", "nul\x00inside", " ", "x" * 1024])
def test_odd_session_ids_open_close_and_answer_again(sessions: Daemon, session_id: str) -> None:
    with sessions.client(engine_id="odd-ids") as c:
        c.attach(map_pools=False)
        life(c, tokens(3 * PAGE, start=22_000), session_id)
        assert c.close_session(session_id) == 3
        assert c.close_session(session_id) == 3
        assert c.batch([close_session_op(session_id)]) == [3]


def test_a_session_id_past_1024_characters_is_refused_naming_the_field(sessions: Daemon) -> None:
    """The daemon keeps session ids (open, and a record of recently closed ones): an id
    of any length would let one caller pin any amount of memory."""
    with sessions.client(engine_id="too-long-id") as c:
        c.attach(map_pools=False)
        with pytest.raises(InvalidArgument, match="session_id: 20000 characters; at most 1024"):
            life(c, tokens(3 * PAGE, start=22_000), "x" * 20_000)
        assert not any(p.locked_pages for p in c.stats().pools)  # nothing held


def test_an_unknown_long_session_id_is_refused_with_a_bounded_message(sessions: Daemon) -> None:
    with sessions.client(engine_id="long-id") as c:
        with pytest.raises(InvalidArgument) as err:
            c.close_session("never-" + "y" * 200_000)
        assert "session_id: 200006 characters" in str(err.value) and len(str(err.value)) < 2_000
        with pytest.raises(NotFound) as missing:
            c.close_session("never-" + "y" * 1_000)
        assert "never-" in str(missing.value) and len(str(missing.value)) < 2_000


def test_two_tenants_using_one_session_id_keep_their_own_sessions(tenants: Daemon) -> None:
    with (
        tenants.client(token=TENANT_A, engine_id="same") as a,
        tenants.client(token=TENANT_B, engine_id="same") as b,
    ):
        a.attach(map_pools=False)
        b.attach(map_pools=False)
        life(a, tokens(2 * PAGE, start=30_000), "conv")
        life(b, tokens(3 * PAGE, start=31_000), "conv")
        # B's later request does not move A's session, nor A's B's.
        life(b, tokens(4 * PAGE, start=32_000), "conv")
        assert b.batch([close_session_op("conv")]) == [4]
        assert a.close_session("conv") == 2
        assert b.close_session("conv") == 4 and a.close_session("conv") == 2
        # A session B opens again under the id is B's alone.
        life(b, tokens(PAGE, start=33_000), "conv")
        assert a.close_session("conv") == 2
        assert b.close_session("conv") == 1


# ------------------------------------------------------------------ sessions and eviction

# The daemons below have the tiny L1 of `daemonkit.TINY`: 16 pages.
L1_PAGES = 16


def in_l1(c: Any, seq: bytes) -> int:
    """Pages of `seq` reusable from L1 now."""
    return int(c.match(seq).device_tokens // PAGE)


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_a_sessions_references_keep_its_path_in_l1_until_it_closes(
    make_daemon: MakeDaemon,
    closed: bool,
) -> None:
    d = make_daemon()
    with d.client(engine_id="pressure") as c:
        c.attach(map_pools=False)
        seqs = [tokens(2 * PAGE, start=40_000 + 1_000 * i) for i in range(4)]
        life(c, seqs[0], "chat")  # the least recently used, but referenced
        for seq in seqs[1:]:
            life(c, seq)
        if closed:
            assert c.close_session("chat") == 2
        # Every path's write-through copy landed: each may leave L1 now.
        assert eventually(lambda: host(c.stats()).used_pages == 8)
        with c.allocation((L1_PAGES - 4) * PAGE):  # 8 free: two paths must leave L1
            pass
        kept = [in_l1(c, seq) for seq in seqs]
    # LRU order, the referenced path last; closed, it is just the oldest.
    assert kept == ([0, 0, 2, 2] if closed else [2, 0, 0, 2])


def test_a_referenced_path_outlives_an_unreferenced_one_whose_copy_is_queued(
    make_daemon: MakeDaemon,
) -> None:
    # Copies wait up to a second for others to share their flush: B's is still queued
    # when the allocation needs room (the allocation flushes it at once).
    d = make_daemon("write.l1_to_l2_batch_ms=1000")
    with d.client(engine_id="queued-copy") as c:
        c.attach(map_pools=False)
        referenced, other = tokens(2 * PAGE, start=50_000), tokens(2 * PAGE, start=51_000)
        life(c, referenced, "chat")
        assert eventually(lambda: host(c.stats()).used_pages == 2)  # its copy landed
        life(c, other)
        with c.allocation((L1_PAGES - 2) * PAGE):  # 12 free: one path must leave L1
            pass
        assert (in_l1(c, referenced), in_l1(c, other)) == (2, 0)
