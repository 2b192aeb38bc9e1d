"""Review: a daemon that runs for weeks. Unbounded growth and saturation.

Growth checks run the controller in-process (`build_controller`), so that its tables can
be read after thousands of request lives; saturation and the metrics' cardinality are
checked against a real `hicache serve` process.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import Engine, built_controllers, evict_all, seq, wait_prefetch

from hicache.controller.base import InsertRequest, MatchRequest
from hicache.errors import HicacheError
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.types import Tier

from .daemonkit import PAGE, Daemon, scrape, tokens

_instances = itertools.count()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., object]]:
    with built_controllers(tmp_path, "lr") as factory:
        yield factory


def _wait_prefetches_idle(ctl, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while ctl.prefetcher.running:
        assert time.monotonic() < deadline, "prefetches still running"
        time.sleep(0.01)


def _tables(ctl) -> dict[str, int]:  # type: ignore[no-untyped-def]
    e = ctl._engines
    return {
        "engines": len(e._engines),
        "locks": len(e._locks),
        "allocations": len(e._allocations),
        "prefetch_of_lock": len(ctl._prefetch_of_lock),
        "prefetches_running": ctl.prefetcher.running,
        "reserved_pages": ctl.prefetcher._reserved_pages,
        "loads": len(ctl.loads._loads),
        "tree_locks": ctl.tree.active_locks,
        "open_sessions": len(ctl.tree._sessions),
    }


# ---------------------------------------------------------------- growth (in-process)


def test_request_lives_return_every_table_to_baseline(make) -> None:  # type: ignore[no-untyped-def]
    """3,000 request lives: engines that attach and go away (lease lapse), matches with
    locks, allocations and prefetches (completed, cancelled, abandoned with their lock),
    loads, inserts, releases, sessions opened and closed. Afterwards every table is back at
    its baseline, and the bounded ones (lapsed engine ids, finished prefetch ops, closed
    session tombstones, the existence cache) stay within their bounds."""
    ctl = make(l1_tokens=1024, write__l2_to_l3="write_through")
    now = [1000.0]
    ctl._engines._clock = lambda: now[0]  # leases lapse when the test says
    baseline = _tables(ctl)
    unexpected: list[str] = []
    prefetches = 0
    for i in range(3000):
        eid = f"eng{i % 5}-{i // 100}"
        if i % 100 < 5:
            ctl.attach(eid, 0, 1)
        toks = seq(4 + i % 8, base=(i % 37) * 1000)
        sid = f"s{i}"
        try:
            m = ctl.match(eid, MatchRequest("", toks, session_id=sid, lock=True, prefetch=True,
                                            allocate_tokens=len(toks) // 4 + 4))
            prefetches += bool(m.prefetch_id)
            if m.prefetch_id and i % 3 == 0:
                ctl.cancel_prefetch(m.prefetch_id, eid)
            if m.host_tokens and i % 2:
                list(ctl.load(eid, m.lock_id))
            if i % 7 == 0:
                pass  # abandoned: the lease lapse releases it
            elif i % 11 == 0:
                ctl.release(eid, m.lock_id, None)
                ctl.release(eid, None, m.allocation_id)
            else:
                ctl.insert(eid, InsertRequest("", toks, lock_id=m.lock_id,
                                              allocation_id=m.allocation_id, session_id=sid))
        except HicacheError as e:  # (no room while abandoned locks wait for their lapse)
            unexpected.append(type(e).__name__)
        finally:
            with contextlib.suppress(HicacheError):
                ctl.close_session(sid)
        if i % 50 == 0:
            evict_all(ctl, Tier.DEVICE, Tier.HOST)
        if i % 100 == 99:
            now[0] += 100
            ctl.expire_leases()
    now[0] += 100
    ctl.expire_leases()
    assert ctl.transfers.drain(10)
    _wait_prefetches_idle(ctl)
    assert prefetches > 100  # the run did exercise prefetches
    assert set(unexpected) <= {"ResourceExhausted"}, unexpected
    assert _tables(ctl) == baseline
    assert len(ctl._engines._lapsed) <= 4096
    assert len(ctl.prefetcher._ops) <= ctl.prefetcher._keep
    assert sum(map(len, ctl.tree._sessions._closed.values())) <= ctl.cfg.eviction.closed_session_tombstones
    assert ctl.counters["leases_expired"] == 150


def test_abandoned_sessions_do_not_accumulate(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(l1_tokens=1024, storage__backend="none", eviction__max_open_sessions=1024)
    now = [1000.0]
    ctl._engines._clock = lambda: now[0]
    for i in range(2000):
        eid = f"gone-{i}"
        ctl.attach(eid, 0, 1)
        toks = seq(2, base=i * 100)
        m = ctl.match(eid, MatchRequest("", toks, session_id=f"chat-{i}", lock=True,
                                        allocate_tokens=len(toks) // 4))
        ctl.insert(eid, InsertRequest("", toks, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                      session_id=f"chat-{i}"))
        if i % 100 == 99:
            evict_all(ctl, Tier.DEVICE, Tier.HOST)
    now[0] += 3600  # every engine's lease lapsed an hour ago
    ctl.expire_leases()
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert sum(1 for _ in ctl.tree.iter_nodes()) == 0  # the cache holds nothing any more
    # Sessions are bounded (least recently used closed past the cap) and none holds a
    # node no longer in the tree (an evicted end moves up its path).
    detached = sum(1 for s in ctl.tree._sessions.sessions()
                   if s.end is not None and s.end.parent is not None
                   and s.end.parent.children.get(s.end.key[: ctl.tree._pb]) is not s.end)
    assert len(ctl.tree._sessions) == 1024 and detached == 0, (len(ctl.tree._sessions), detached)
    assert ctl.stats().counters["sessions_closed_for_room"] == 2000 - 1024
    ctl.check_integrity()


def test_finished_prefetch_ops_do_not_keep_their_prompts(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(l1_tokens=4096, write__l2_to_l3="write_through")
    e = Engine(ctl, "e1")
    prompt = seq(512)  # 2,048 tokens
    e.request(prompt)
    assert ctl.transfers.drain(10)
    for i in range(60):
        evict_all(ctl, Tier.DEVICE, Tier.HOST)
        m = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
        assert m.prefetch_id
        if i % 2:
            ctl.cancel_prefetch(m.prefetch_id, "e1")
        else:
            wait_prefetch(ctl, m.prefetch_id)
        ctl.release("e1", m.lock_id, None)
    _wait_prefetches_idle(ctl)
    ops = list(ctl.prefetcher._ops.values())
    assert len(ops) == 60 and all(op.finished for op in ops)
    # Their status stays answerable ...
    assert all(ctl.prefetch_status(op.op_id).tokens_total == 2048 for op in ops)
    # ... but what they read is in the tree now: the prompt copies are dead weight.
    kept = sum(len(op.tokens) + sum(len(h) for h in op.hashes) for op in ops)
    assert kept <= 64 * 1024, f"{kept} bytes of prompts kept by 60 finished prefetches"


def test_namespace_roots_leave_with_their_pages(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(l1_tokens=1024, storage__backend="none")
    ctl.attach("e1", 0, 1)
    for i in range(1000):
        ns = f"tenant-{i}"
        m = ctl.match("e1", MatchRequest(ns, seq(1), lock=True, allocate_tokens=4))
        ctl.insert("e1", InsertRequest(ns, seq(1), lock_id=m.lock_id, allocation_id=m.allocation_id))
        if i % 100 == 99:
            evict_all(ctl, Tier.DEVICE, Tier.HOST)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert sum(1 for _ in ctl.tree.iter_nodes()) == 0
    assert len(ctl.tree._roots) <= 16, f"{len(ctl.tree._roots)} empty namespace roots kept"


# ---------------------------------------------------------------- daemon


def _health(target: str, timeout_s: float) -> float:
    """Seconds a grpc.health.v1 Check took on a fresh channel (raises on failure)."""
    with grpc.insecure_channel(target) as ch:
        start = time.monotonic()
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return time.monotonic() - start


def test_idle_reflection_streams_do_not_stall_the_daemon(make_daemon) -> None:  # type: ignore[no-untyped-def]
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    d = make_daemon()
    stop = threading.Event()

    def idle() -> Iterator[object]:  # a client that opened the stream and sends nothing
        stop.wait(30)
        return
        yield

    ch = grpc.insecure_channel(d.target)
    calls = [reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(idle(), timeout=30)
             for _ in range(40)]
    try:
        time.sleep(1.0)  # (the streams reach the server)
        try:
            # (a stalled daemon answers only once the streams end, after 30 s)
            _health(d.target, 15.0)
        except grpc.RpcError as e:
            pytest.fail(f"health Check failed with 40 idle reflection streams open: {e.code()}")
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        ch.close()


class _Raw:
    def __init__(self, target: str, engine_id: str) -> None:
        self.ch = grpc.insecure_channel(target)
        self.stub = pb_grpc.HiCacheStub(self.ch)
        self.md = (("x-hicache-engine", engine_id),)
        self.stub.Attach(pb.AttachRequest(engine_id=engine_id, tp_rank=0, tp_size=1), timeout=10)

    def close(self) -> None:
        self.ch.close()


def _series(text: str) -> set[str]:
    """Every sample's name and labels (not its value)."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _lives(target: str, round_: int, n: int) -> None:
    """`n` request lives, each by a new engine, in a new namespace and session, with the
    errors engines make (a double release, a bad token count, an unknown prefetch)."""
    for i in range(n):
        key = f"{round_}-{i}"
        eng = _Raw(target, f"engine-{key}")
        try:
            seq_ = tokens(2 * PAGE, start=1 + i * 1000)
            m = eng.stub.MatchPrefix(pb.MatchPrefixRequest(
                namespace=f"ns-{key}", tokens=seq_, session_id=f"sess-{key}", lock=True,
                allocate_tokens=2 * PAGE), metadata=eng.md, timeout=10)
            eng.stub.Insert(pb.InsertRequest(
                namespace=f"ns-{key}", tokens=seq_, lock_id=m.lock_id,
                allocation_id=m.allocation_id, session_id=f"sess-{key}"), metadata=eng.md, timeout=10)
            eng.stub.CloseSession(pb.CloseSessionRequest(session_id=f"sess-{key}"), timeout=10)
            for call, request in ((eng.stub.Release, pb.ReleaseRequest(lock_id=m.lock_id)),
                                  (eng.stub.MatchPrefix, pb.MatchPrefixRequest(tokens=b"abc")),
                                  (eng.stub.PrefetchStatus, pb.PrefetchStatusRequest(prefetch_id=7 + i))):
                with pytest.raises(grpc.RpcError):
                    call(request, metadata=eng.md, timeout=10)
        finally:
            eng.close()


def test_metrics_series_stay_flat_over_many_engines_namespaces_sessions(
        daemon: Daemon, metrics_port: int) -> None:
    """No label carries an engine, a namespace or a session: after a first round has used
    every method and status code, a second round of new names adds no series."""
    _lives(daemon.target, 0, 40)
    first = _series(scrape(metrics_port))
    _lives(daemon.target, 1, 150)
    second = _series(scrape(metrics_port))
    assert second == first, sorted(second ^ first)[:20]
    assert len(second) < 2000
    assert not any(f"-1-{i}" in s for s in second for i in range(3))


def test_max_tokens_per_request_exactly_and_one_above(daemon: Daemon) -> None:
    """server.max_tokens_per_request (8192 here) is accepted by MatchPrefix; one token more
    is INVALID_ARGUMENT naming the limit, on every RPC that takes a count."""
    eng = _Raw(daemon.target, "limit-engine")
    try:
        limit = 8192
        at = tokens(limit, start=5_000_000)
        m = eng.stub.MatchPrefix(pb.MatchPrefixRequest(tokens=at, lock=True), metadata=eng.md, timeout=10)
        eng.stub.Release(pb.ReleaseRequest(lock_id=m.lock_id), metadata=eng.md, timeout=10)
        over = tokens(limit + 1, start=5_000_000)
        calls = {
            "match": lambda: eng.stub.MatchPrefix(pb.MatchPrefixRequest(tokens=over), metadata=eng.md,
                                                  timeout=10),
            "insert": lambda: eng.stub.Insert(pb.InsertRequest(tokens=over), metadata=eng.md, timeout=10),
            "allocate": lambda: eng.stub.Allocate(pb.AllocateRequest(num_tokens=limit + 1),
                                                  metadata=eng.md, timeout=10),
            "match_allocate": lambda: eng.stub.MatchPrefix(
                pb.MatchPrefixRequest(tokens=at[:4 * PAGE], allocate_tokens=limit + 1),
                metadata=eng.md, timeout=10),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
            assert "max_tokens_per_request" in (err.value.details() or ""), name
        # At the limit an Allocate is refused for room (16 L1 pages), not as malformed.
        with pytest.raises(grpc.RpcError) as err:
            eng.stub.Allocate(pb.AllocateRequest(num_tokens=limit), metadata=eng.md, timeout=10)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        hb = eng.stub.Heartbeat(pb.HeartbeatRequest(engine_id="limit-engine"), timeout=10)
        assert (hb.locks, hb.allocations) == (0, 0)
    finally:
        eng.close()


def test_batch_too_big_to_answer_keeps_health_and_no_handles(daemon: Daemon) -> None:
    """A Batch as large as a request may be, whose reply is larger than one op's reply
    may be: the daemon keeps answering health meanwhile, and answers every op (gRPC's
    message limit bounds a Batch's reply, which it kept within); the engine releases the
    locks it learned of (here: a restart of the engine releases them all)."""
    ch = grpc.insecure_channel(daemon.target, options=[
        ("grpc.max_send_message_length", 1 << 28), ("grpc.max_receive_message_length", 1 << 28)])
    try:
        stub = pb_grpc.HiCacheStub(ch)
        stub.Attach(pb.AttachRequest(engine_id="batcher", tp_rank=0, tp_size=1), timeout=10)
        md = (("x-hicache-engine", "batcher"),)
        n = 150_000  # 900 KB of request (the limit is ~1 MiB), ~3 MB of reply
        req = pb.BatchRequest(ops=[pb.BatchOp(match_prefix=pb.MatchPrefixRequest(lock=True))] * n)
        out: dict[str, object] = {}

        def run() -> None:
            try:
                out["reply"] = stub.Batch(req, metadata=md, timeout=180)
                out["code"] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                out["code"] = e.code()

        th = threading.Thread(target=run)
        th.start()
        worst = 0.0
        while th.is_alive():
            worst = max(worst, _health(daemon.target, 10.0))
            th.join(0.1)
        assert out["code"] is grpc.StatusCode.OK
        # Not held for the Batch (~20 s on a loaded machine); a loaded machine may take a
        # second or two for a check on a fresh channel.
        assert worst < 8.0, worst
        locks = [r.match_prefix.lock_id for r in out["reply"].results]  # type: ignore[attr-defined]
        assert len(locks) == n and all(locks)
        for i in range(0, n, 20_000):
            stub.Batch(pb.BatchRequest(ops=[pb.BatchOp(release=pb.ReleaseRequest(lock_id=lock))
                                            for lock in locks[i : i + 20_000]]),
                       metadata=md, timeout=60)

        def released() -> bool:
            hb = stub.Heartbeat(pb.HeartbeatRequest(engine_id="batcher"), timeout=10)
            return hb.locks == 0

        deadline = time.monotonic() + 15
        while not released():
            assert time.monotonic() < deadline, "the unanswered Batch's locks are still held"
            time.sleep(0.1)
    finally:
        ch.close()



