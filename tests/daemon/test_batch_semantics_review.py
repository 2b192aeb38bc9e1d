"""The Batch RPC end to end (a review): every op kind answered like its unary twin, in
order, later ops seeing earlier ones, a failing op mid-batch changing nothing, callers
that give up mid-batch holding nothing, per-op namespace checks, prefetch ops, a hybrid
request's whole life in batches, and engines batching overlapping prefixes at once,
checked byte for byte with the content oracle. Real daemons; own token ranges each."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from hicache.bench.oracle import KvOracle
from hicache.client import Client, allocate_op, close_session_op, insert_op, match_op, release_op
from hicache.controller.base import (
    AllocationInfo,
    HeartbeatInfo,
    InsertOutcome,
    MatchOutcome,
    PrefetchInfo,
    PrefetchState,
    StatsSnapshot,
)
from hicache.errors import (
    FailedPrecondition,
    HicacheError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import PAGE, Daemon, free_port, tokens
from .faultproxy import FaultProxy

MakeDaemon = Callable[..., Daemon]
L1 = ("tiers.l1.tokens=4096",)  # 64 L1 pages, 128 L2 pages


@pytest.fixture(scope="module")
def bd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("batch"), *L1).start()
    yield d
    d.close()


def held(c: Client) -> tuple[int, int]:
    hb = c.heartbeat()
    return hb.locks, hb.allocations


def settled(c: Client, timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
    """tier -> (used, locked) pages once nothing is locked (write-through copies of
    recent inserts pin their pages for a moment), or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = {p.tier: (p.used_pages, p.locked_pages) for p in c.stats().pools}
        if all(locked == 0 for _, locked in pools.values()) or time.monotonic() > deadline:
            return pools
        time.sleep(0.05)


def seq(*parts: tuple[int, int]) -> bytes:
    """Token ids: the concatenated ranges (start, count)."""
    return np.concatenate([np.arange(s, s + n) for s, n in parts]).astype("<u4").tobytes()


def hb_op(engine_id: str) -> pb.BatchOp:
    return pb.BatchOp(heartbeat=pb.HeartbeatRequest(engine_id=engine_id))


def status_op(prefetch_id: int) -> pb.BatchOp:
    return pb.BatchOp(prefetch_status=pb.PrefetchStatusRequest(prefetch_id=prefetch_id))


def cancel_op(prefetch_id: int) -> pb.BatchOp:
    return pb.BatchOp(cancel_prefetch=pb.CancelPrefetchRequest(prefetch_id=prefetch_id))


def unary_error(call: Callable[[], object]) -> HicacheError:
    with pytest.raises(HicacheError) as info:
        call()
    return info.value


# --------------------------------------------------------------------------- twins


def test_each_failing_op_answers_what_its_unary_twin_does_in_order(bd: Daemon) -> None:
    """One Batch of failing ops of every kind: each result, at its index, is the error
    type and message the same request gets as a unary call ("op i (kind): " first)."""
    fresh = tokens(PAGE, start=1_100_000)
    with bd.client(engine_id="twins") as c, bd.client(engine_id="never-attached") as ghost:
        c.attach(map_pools=False)
        cases: list[tuple[pb.BatchOp, Callable[[], object]]] = [
            (match_op(b"\x01\x02\x03"), lambda: c.match(b"\x01\x02\x03")),
            (match_op(fresh, allocate_tokens=10**6), lambda: c.match(fresh, allocate_tokens=10**6)),
            (match_op(tokens(9000)), lambda: c.match(tokens(9000))),
            (
                match_op(fresh, lock=True, allocate_tokens=8000),  # more than all of L1
                lambda: c.match(fresh, lock=True, allocate_tokens=8000),
            ),
            (allocate_op(0), lambda: c.allocate(0)),
            (allocate_op(PAGE, allocation_id=0), lambda: c.allocate(PAGE, allocation_id=0)),
            (allocate_op(PAGE, lock_id=5), lambda: c.allocate(PAGE, lock_id=5)),
            (insert_op(fresh), lambda: c.insert(fresh)),
            (insert_op(fresh, keep_lock=True), lambda: c.insert(fresh, keep_lock=True)),
            (insert_op(fresh, lock_id=7), lambda: c.insert(fresh, lock_id=7)),
            (insert_op(fresh, allocation_id=7), lambda: c.insert(fresh, allocation_id=7)),
            (release_op(lock_id=0), lambda: c.release(lock_id=0)),
            (release_op(allocation_id=12), lambda: c.release(allocation_id=12)),
            (status_op(0), lambda: c.prefetch_status(0)),
            (cancel_op(3), lambda: c.cancel_prefetch(3)),
            (close_session_op(""), lambda: c.close_session("")),
            (close_session_op("never-opened-twin"), lambda: c.close_session("never-opened-twin")),
            (
                pb.BatchOp(attach=pb.AttachRequest(engine_id="twins", tp_size=2)),
                lambda: c.attach(tp_size=2, map_pools=False),
            ),
            (hb_op("never-attached"), ghost.heartbeat),
        ]
        results = c.batch([op for op, _ in cases])
        assert len(results) == len(cases)
        for i, ((op, unary), got) in enumerate(zip(cases, results, strict=True)):
            want = unary_error(unary)
            kind = op.WhichOneof("op")
            assert type(got) is type(want), (i, got, want)
            assert str(got) == f"op {i} ({kind}): {want}", i
        assert held(c) == (0, 0)  # none of them took anything


def test_successful_ops_answer_like_their_unary_twins(bd: Daemon) -> None:
    prompt = tokens(3 * PAGE, start=1_200_000)
    with bd.client(engine_id="twins-ok") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=3 * PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        unary = c.match(prompt[: 2 * PAGE * 4 + 40])  # 2 pages and a partial one
        hb = c.heartbeat()
        batched = c.batch(
            [
                match_op(prompt[: 2 * PAGE * 4 + 40]),
                hb_op("twins-ok"),
                pb.BatchOp(stats=pb.StatsRequest()),
            ]
        )
        assert isinstance(batched[0], MatchOutcome)
        assert (
            (batched[0].device_tokens, batched[0].lock_id, batched[0].allocation_id)
            == (unary.device_tokens, 0, 0)
            == (2 * PAGE, 0, 0)
        )
        assert np.array_equal(batched[0].device_pages["full"], unary.device_pages["full"])
        assert batched[1] == hb
        assert isinstance(batched[2], StatsSnapshot)


# --------------------------------------------------------------------------- order and effects


def test_later_ops_see_what_earlier_ops_of_the_same_batch_did(bd: Daemon) -> None:
    """Insert then match the same prompt, allocate then see it counted and locked, release
    then release again (NOT_FOUND), close a session the batch's insert referenced."""
    a_prompt, b_prompt = tokens(2 * PAGE, start=1_300_000), tokens(2 * PAGE, start=1_310_000)
    with bd.client(engine_id="ordered") as c:
        c.attach(map_pools=False)
        a, b = c.batch(
            [
                match_op(a_prompt, lock=True, allocate_tokens=2 * PAGE, session_id="s1"),
                match_op(b_prompt, lock=True, allocate_tokens=2 * PAGE),
            ]
        )
        assert isinstance(a, MatchOutcome) and isinstance(b, MatchOutcome)
        before = next((p.used_pages, p.locked_pages) for p in c.stats().pools if p.tier == "device")
        r = c.batch(
            [
                match_op(a_prompt),  # 0: not yet
                insert_op(
                    a_prompt, lock_id=a.lock_id, allocation_id=a.allocation_id, session_id="s1"
                ),  # 1
                match_op(a_prompt),  # 2: now
                hb_op("ordered"),  # 3
                allocate_op(3 * PAGE),  # 4
                hb_op("ordered"),  # 5
                pb.BatchOp(stats=pb.StatsRequest()),  # 6
                release_op(lock_id=b.lock_id),  # 7
                release_op(lock_id=b.lock_id),  # 8
                insert_op(b_prompt, lock_id=b.lock_id, allocation_id=b.allocation_id),  # 9
                release_op(allocation_id=b.allocation_id),  # 10
                hb_op("ordered"),  # 11
                close_session_op("s1"),  # 12
                close_session_op("s1"),  # 13
            ]
        )
        assert r[0].device_tokens == 0
        assert r[1] == InsertOutcome(inserted_tokens=2 * PAGE, reused_tokens=0)
        assert r[2].device_tokens == 2 * PAGE
        assert r[3] == HeartbeatInfo(lease_ms=r[3].lease_ms, locks=1, allocations=1)
        assert isinstance(r[4], AllocationInfo) and len(r[4].pages["full"]) == 3
        assert r[5] == HeartbeatInfo(lease_ms=r[5].lease_ms, locks=1, allocations=2)
        device = next(p for p in r[6].pools if p.tier == "device")
        # b's 2 pages, the new 3, a's 2 (pinned by their queued copy or committed)
        assert device.used_pages == before[0] + 3
        assert device.locked_pages >= 2 + 3
        assert r[7] is None and isinstance(r[8], NotFound)
        assert isinstance(r[9], NotFound) and "lock" in str(r[9])
        assert r[10] is None
        assert r[11] == HeartbeatInfo(lease_ms=r[11].lease_ms, locks=0, allocations=1)
        assert isinstance(r[12], int) and r[12] >= 1 and r[13] == r[12]
        c.release(allocation_id=r[4].allocation_id)
        assert held(c) == (0, 0)
        assert c.match(b_prompt).device_tokens == 0  # the failed insert committed nothing


def test_a_failing_insert_mid_batch_changes_nothing_and_its_handles_still_work(bd: Daemon) -> None:
    """An Insert refused mid-batch (tokens not extending the lock's prefix; an allocation
    too short) leaves its lock and allocation as they were: the next op of the same batch
    commits with them; ops around it run."""
    shared = seq((1_400_000, PAGE))
    good = seq((1_400_000, PAGE), (1_401_000, 2 * PAGE))
    wrong = seq((1_402_000, 3 * PAGE))
    other = tokens(PAGE, start=1_403_000)
    with bd.client(engine_id="half") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        m0 = c.match(shared, lock=True, allocate_tokens=PAGE)
        oracle.write(shared, m0.pages, 0)
        c.insert(shared, lock_id=m0.lock_id, allocation_id=m0.allocation_id)
        m, o = c.batch(
            [
                match_op(good, lock=True, allocate_tokens=3 * PAGE),
                match_op(other, lock=True, allocate_tokens=PAGE),
            ]
        )
        assert m.device_tokens == PAGE and len(m.pages["full"]) == 2
        oracle.write(good, m.pages, 1)
        oracle.write(other, o.pages, 0)
        r = c.batch(
            [
                insert_op(other, lock_id=o.lock_id, allocation_id=o.allocation_id),
                insert_op(wrong, lock_id=m.lock_id, allocation_id=m.allocation_id),
                insert_op(
                    seq((1_400_000, PAGE), (1_401_000, 4 * PAGE)),
                    lock_id=m.lock_id,
                    allocation_id=m.allocation_id,
                ),
                hb_op("half"),
                insert_op(good, lock_id=m.lock_id, allocation_id=m.allocation_id),
                hb_op("half"),
            ]
        )
        assert r[0] == InsertOutcome(inserted_tokens=PAGE, reused_tokens=0)
        assert isinstance(r[1], InvalidArgument) and "prefix" in str(r[1])
        assert isinstance(r[2], InvalidArgument) and "covers token pages" in str(r[2])
        assert r[3] == HeartbeatInfo(lease_ms=r[3].lease_ms, locks=1, allocations=1)
        assert r[4] == InsertOutcome(inserted_tokens=2 * PAGE, reused_tokens=PAGE)
        assert r[5] == HeartbeatInfo(lease_ms=r[5].lease_ms, locks=0, allocations=0)
        for t in (good, other):
            got = c.match(t)
            assert got.device_tokens == len(t) // 4
            oracle.verify(t, got.device_pages, got.device_tokens // PAGE)
        assert c.match(wrong).device_tokens == 0
        assert oracle.wrong_bytes == 0 and oracle.pages_checked == 4 * 4


def test_growth_in_a_batch_is_all_or_nothing_and_returns_every_held_page(
    make_daemon: MakeDaemon,
) -> None:
    """Decode growth in batches: each grow answers all pages still held, grown last; a grow
    past `max_tokens_per_request` pages fails alone, taking nothing; a keep_lock insert
    and the final insert of the same allocation in one batch commit it all."""
    d = make_daemon("tiers.l1.tokens=16384", "server.max_tokens_per_request=1024")
    prompt = tokens(16 * PAGE, start=1_500_000)
    with d.client(engine_id="grower") as c:
        c.attach(map_pools=False)
        m = c.match(prompt[: 4 * PAGE * 4], lock=True, allocate_tokens=4 * PAGE)
        used_before = next(p.used_pages for p in c.stats().pools if p.tier == "device")
        r = c.batch(
            [
                allocate_op(8 * PAGE, allocation_id=m.allocation_id),
                allocate_op(5 * PAGE, allocation_id=m.allocation_id),  # 17 pages: over 16
                pb.BatchOp(stats=pb.StatsRequest()),
                insert_op(
                    prompt[: 8 * PAGE * 4],
                    lock_id=m.lock_id,
                    allocation_id=m.allocation_id,
                    keep_lock=True,
                ),
                allocate_op(4 * PAGE, allocation_id=m.allocation_id),
                insert_op(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id),
                hb_op("grower"),
            ]
        )
        assert isinstance(r[0], AllocationInfo)
        grown = r[0].pages["full"]
        assert len(grown) == 12 and np.array_equal(grown[:4], m.pages["full"])
        assert isinstance(r[1], InvalidArgument) and "would hold 17 pages" in str(r[1])
        device = next(p for p in r[2].pools if p.tier == "device")
        assert device.used_pages == used_before + 8  # the failed grow took nothing
        assert r[3] == InsertOutcome(inserted_tokens=8 * PAGE, reused_tokens=0)
        assert isinstance(r[4], AllocationInfo)
        assert np.array_equal(r[4].pages["full"][:4], grown[8:])  # uncommitted, then new
        assert len(r[4].pages["full"]) == 8
        assert r[5] == InsertOutcome(inserted_tokens=8 * PAGE, reused_tokens=8 * PAGE)
        assert r[6] == HeartbeatInfo(lease_ms=r[6].lease_ms, locks=0, allocations=0)
        assert c.match(prompt).device_tokens == 16 * PAGE
        assert settled(c)["device"] == (used_before + 12, 0)


def test_growing_an_allocation_under_another_namespace_is_refused_like_insert(bd: Daemon) -> None:
    with bd.client(engine_id="ns-grow") as c:
        c.attach(map_pools=False)
        a = c.allocate(PAGE, "ns-a")
        try:
            grow, commit = c.batch(
                [
                    allocate_op(PAGE, "ns-b", allocation_id=a.allocation_id),
                    insert_op(tokens(PAGE, start=2_100_000), "ns-b", allocation_id=a.allocation_id),
                ]
            )
            assert isinstance(commit, InvalidArgument) and "does not match allocation" in str(
                commit
            )
            # Observed: AllocationInfo (two pages): grown under a namespace it is not in.
            assert isinstance(grow, InvalidArgument), grow
            assert "does not match allocation" in str(grow)
        finally:
            c.release(allocation_id=a.allocation_id)


# --------------------------------------------------------------------------- callers giving up


def test_a_batch_abandoned_mid_way_holds_nothing(bd: Daemon) -> None:
    """A long Batch of locking matches and allocations whose deadline passes while it
    runs, and one the caller cancels while it runs: every lock and allocation they made
    is released; handles made before (and a lock a kept match holds) are not."""
    prompt = tokens(PAGE, start=1_600_000)
    with bd.client(engine_id="quitter") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        kept = c.match(prompt, lock=True, allocate_tokens=PAGE)
        ops = [
            op
            for _ in range(1500)
            for op in (match_op(prompt, lock=True), allocate_op(1, lock_id=kept.lock_id))
        ]
        request = pb.BatchRequest(ops=ops)
        lookups = c.stats().counters["lookups"]
        metadata = (("x-hicache-engine", "quitter"),)
        channel = grpc.insecure_channel(bd.target)
        try:
            stub = pb_grpc_stub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Batch(request, metadata=metadata, timeout=0.03)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            ran = time.monotonic() + 10  # (the handler did run: its matches were counted)
            while c.stats().counters["lookups"] < lookups + 1500 and time.monotonic() < ran:
                time.sleep(0.05)
            assert c.stats().counters["lookups"] == lookups + 1500
            future = stub.Batch.future(request, metadata=metadata, timeout=30)
            time.sleep(0.02)
            if not future.cancel():  # it ended first: release what it made here
                made = future.result().results
                c.batch(
                    [release_op(lock_id=x.match_prefix.lock_id) for x in made[::2]]
                    + [release_op(allocation_id=x.allocate.allocation_id) for x in made[1::2]]
                )
        finally:
            channel.close()
        deadline = time.monotonic() + 10
        while held(c) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(c) == (1, 1)  # `kept` alone
        c.batch([release_op(lock_id=kept.lock_id), release_op(allocation_id=kept.allocation_id)])
        assert held(c) == (0, 0)


def test_engines_giving_up_on_batches_at_random_hold_nothing(bd: Daemon) -> None:
    """Four engines send Batches (inserts of the last batch's matches, new locking matches
    with allocations) under deadlines of 1-4 ms or 5 s (a deadline past the 5 ms reply
    margin can leak: see the xfail below); after each batch they gave up on
    they release what they knew of. Nothing stays held: what the abandoned batches made
    the daemon released itself."""
    failures: list[object] = []
    gave_up = [0]

    def engine(k: int) -> None:
        rng = random.Random(100 + k)
        try:
            with (
                bd.client(engine_id=f"hasty-{k}") as c,
                bd.client(engine_id=f"hasty-{k}", retries=0) as hasty,
            ):
                c.attach(map_pools=False)
                hasty.attach(map_pools=False)  # (the same process: not a restart)
                pending: list[tuple[bytes, MatchOutcome]] = []
                for rnd in range(40):
                    # (at most REPLY_MARGIN_S: a reply is never sent, or it is in time)
                    hasty.timeout_s = rng.choice([0.001, 0.002, 0.004, 5.0])
                    prompts = [
                        tokens(
                            rng.randrange(1, 4) * PAGE,
                            5_000_000 + 100_000 * k + 1_000 * rnd + 100 * j,
                        )
                        if rng.random() < 0.5
                        else tokens(2 * PAGE, 6_000_000 + 1_000 * rng.randrange(3))
                        for j in range(3)
                    ]
                    ops = [
                        insert_op(p, lock_id=m.lock_id, allocation_id=m.allocation_id)
                        for p, m in pending
                    ]
                    ops += [match_op(p, lock=True, allocate_tokens=len(p) // 4) for p in prompts]
                    try:
                        r = hasty.batch(ops)
                    except HicacheError:
                        gave_up[0] += 1
                        for _, m in pending:  # (consumed, if its insert ran: NOT_FOUND)
                            c.batch(
                                [
                                    release_op(lock_id=m.lock_id),
                                    release_op(allocation_id=m.allocation_id),
                                ]
                            )
                        pending = []
                        continue
                    pending = [
                        (p, m)
                        for p, m in zip(prompts, r[len(pending) :], strict=True)
                        if isinstance(m, MatchOutcome)
                    ]
                for _, m in pending:
                    c.batch(
                        [release_op(lock_id=m.lock_id), release_op(allocation_id=m.allocation_id)]
                    )
                deadline = time.monotonic() + 10
                while held(c) != (0, 0) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if held(c) != (0, 0):
                    failures.append((k, held(c)))
        except BaseException as e:  # (reported by the main thread)
            failures.append((k, repr(e)))

    run_engines(engine, 4)
    assert failures == []
    assert gave_up[0] > 0  # deadlines did pass
    with bd.client() as probe:
        assert all(locked == 0 for _, locked in settled(probe).values())


@pytest.mark.parametrize("call", ["batch", "match", "allocate"])
def test_a_batch_reply_arriving_after_the_deadline_leaves_nothing_held(
    make_daemon: MakeDaemon, call: str
) -> None:
    """Over TCP a reply the daemon sent in time reaches the caller after its deadline: the
    client waits for it and releases what it made (it used to stay held for the engine's
    life: the daemon saw the reply sent, the caller never saw it)."""
    port = free_port()
    make_daemon(*L1, listen=f"127.0.0.1:{port}")
    proxy = FaultProxy(port)
    try:
        with Client(f"127.0.0.1:{proxy.port}", engine_id="late-reply", timeout_s=10.0) as c:
            c.attach(map_pools=False)
            proxy.hold_answers_s = 0.6  # a slow or busy node: the reply comes late
            c.timeout_s = 0.25
            prompt = tokens(PAGE, start=2_200_000)
            with pytest.raises(Unavailable, match="no answer in time"):
                if call == "batch":
                    c.batch([match_op(prompt, lock=True, allocate_tokens=PAGE)])
                elif call == "match":
                    c.match(prompt, lock=True, allocate_tokens=PAGE)
                else:
                    c.allocate(PAGE)
            proxy.disarm()
            c.timeout_s = 10.0
            deadline = time.monotonic() + 5
            while held(c) != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held(c) == (0, 0)  # observed: (1, 1) until the engine goes
    finally:
        proxy.close()


def run_engines(engine: Callable[[int], None], n: int) -> None:
    """`engine(k)` for k in 0..n-1, each on its own thread, until all are done."""
    threads = [threading.Thread(target=engine, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def pb_grpc_stub(channel: grpc.Channel):  # type: ignore[no-untyped-def]
    from hicache.pb.hicache.v1 import hicache_pb2_grpc

    return hicache_pb2_grpc.HiCacheStub(channel)


def test_thousands_of_mixed_ops_answer_in_order(bd: Daemon) -> None:
    prompt = tokens(PAGE, start=1_700_000)
    with bd.client(engine_id="many") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        n = 1000
        ops = [
            op
            for i in range(n)
            for op in (
                match_op(prompt, lock=True),
                release_op(lock_id=1_000_000 + i),
                hb_op("many"),
                pb.BatchOp(),
            )
        ]
        r = c.batch(ops)
        assert len(r) == 4 * n
        for i in range(n):
            match, missing, hb, empty = r[4 * i : 4 * i + 4]
            assert isinstance(match, MatchOutcome) and match.device_tokens == PAGE
            assert isinstance(missing, NotFound) and str(1_000_000 + i) in str(missing)
            assert str(missing).startswith(f"op {4 * i + 1} (release)")
            assert hb.locks == i + 1
            assert isinstance(empty, InvalidArgument) and f"op {4 * i + 3} (None)" in str(empty)
        assert len({x.lock_id for x in r[::4]}) == n
        assert all(x is None for x in c.batch([release_op(lock_id=x.lock_id) for x in r[::4]]))
        assert held(c) == (0, 0)


# --------------------------------------------------------------------------- namespaces

TENANT = "tenant-a-token-0123456789"
ADMIN = "admin-token-0123456789abcdef"


def test_a_restricted_token_is_refused_per_op_and_the_rest_run(make_daemon: MakeDaemon) -> None:
    d = make_daemon(
        f"server.tokens=[{{token: {TENANT}, namespaces: [a]}}, {{token: {ADMIN}, namespaces: ['*']}}]"
    )
    prompt = tokens(PAGE, start=1_800_000)
    with (
        d.client(token=TENANT, engine_id="tenant") as c,
        d.client(token=ADMIN, engine_id="admin") as admin,
    ):
        c.attach(map_pools=False)
        admin.attach(map_pools=False)
        cases: list[tuple[pb.BatchOp, Callable[[], object] | None]] = [
            (match_op(prompt, "a", lock=True, allocate_tokens=PAGE), None),
            (
                match_op(prompt, "b", lock=True, allocate_tokens=PAGE),
                lambda: c.match(prompt, "b", lock=True, allocate_tokens=PAGE),
            ),
            (allocate_op(PAGE), lambda: c.allocate(PAGE)),
            (insert_op(prompt, "b"), lambda: c.insert(prompt, "b")),
            (hb_op("tenant"), None),
            (pb.BatchOp(stats=pb.StatsRequest()), None),
            (close_session_op("nope"), lambda: c.close_session("nope")),
            (release_op(lock_id=42), lambda: c.release(lock_id=42)),
            (hb_op("admin"), None),  # another token's engine of that name: not attached
        ]
        r = c.batch([op for op, _ in cases])
        for i, ((op, unary), got) in enumerate(zip(cases, r, strict=True)):
            if unary is not None:
                want = unary_error(unary)
                assert (
                    type(got) is type(want)
                    and str(got) == f"op {i} ({op.WhichOneof('op')}): {want}"
                )
        assert isinstance(r[0], MatchOutcome) and r[0].lock_id and r[0].allocation_id
        assert all(isinstance(r[i], PermissionDenied) for i in (1, 2, 3))
        assert r[4] == HeartbeatInfo(lease_ms=r[4].lease_ms, locks=1, allocations=1)
        assert isinstance(r[5], PermissionDenied)  # every tenant's figures: an operator's
        assert isinstance(r[6], NotFound) and isinstance(r[7], NotFound)
        assert isinstance(r[8], FailedPrecondition)
        done = c.batch(
            [insert_op(prompt, "a", lock_id=r[0].lock_id, allocation_id=r[0].allocation_id)]
        )
        assert done == [InsertOutcome(inserted_tokens=PAGE, reused_tokens=0)]
        assert admin.match(prompt, "a").device_tokens == PAGE
        assert admin.match(prompt, "b").device_tokens == 0  # the refused ops did nothing
        assert admin.match(prompt).device_tokens == 0
        assert held(c) == (0, 0) and held(admin) == (0, 0)


# --------------------------------------------------------------------------- prefetch


PF = 8 * PAGE  # three prefetches of 8 pages fit the budget (a quarter of 128 L2 pages)


def test_prefetch_ops_through_batches(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """A second daemon on the same L3: matches with `prefetch` in one Batch (with a lock,
    without, with an allocation), their status and a cancel in the next, bytes exact."""
    l3 = tmp_path / "l3"
    sets = (
        *L1,
        "storage.backend=file",
        f"storage.file.path={l3}",
        "write.l2_to_l3=write_through",
        "prefetch.policy=wait_complete",
    )
    prompts = [tokens(PF, start=1_900_000 + 10_000 * i) for i in range(3)]
    first = make_daemon(*sets)
    with first.client(engine_id="writer") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        ms = c.batch([match_op(p, lock=True, allocate_tokens=PF) for p in prompts])
        for p, m in zip(prompts, ms, strict=True):
            oracle.write(p, m.pages, 0)
        c.batch(
            [
                insert_op(p, lock_id=m.lock_id, allocation_id=m.allocation_id)
                for p, m in zip(prompts, ms, strict=True)
            ]
        )
        assert c.flush(10) >= 0
    first.close()
    second = make_daemon(*sets)
    with second.client(engine_id="reader") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        r = c.batch(
            [
                match_op(prompts[0], lock=True, prefetch=True),
                match_op(prompts[1], prefetch=True),
                match_op(prompts[2], lock=True, prefetch=True, allocate_tokens=PF),
            ]
        )
        assert [x.storage_tokens for x in r] == [PF] * 3
        assert all(x.prefetch_id for x in r) and len({x.prefetch_id for x in r}) == 3
        assert r[0].lock_id and not r[1].lock_id and r[2].lock_id and r[2].allocation_id
        ids = [x.prefetch_id for x in r]
        s = c.batch([cancel_op(ids[2]), status_op(ids[2]), *map(status_op, ids), cancel_op(999)])
        assert isinstance(s[0], int) and isinstance(s[1], PrefetchInfo)
        assert s[1].state in (PrefetchState.DONE, PrefetchState.CANCELLED)
        assert s[0] <= s[1].tokens_ready <= s[1].tokens_total == PF
        assert all(isinstance(x, PrefetchInfo) for x in s[2:5]) and isinstance(s[5], NotFound)
        deadline = time.monotonic() + 15
        while True:
            states = c.batch([status_op(i) for i in ids[:2]])
            if all(x.state is PrefetchState.DONE for x in states) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [(x.state, x.tokens_ready) for x in states] == [(PrefetchState.DONE, PF)] * 2
        assert held(c) == (2, 1)
        c.batch(
            [
                release_op(lock_id=r[0].lock_id),
                release_op(lock_id=r[2].lock_id),
                release_op(allocation_id=r[2].allocation_id),
            ]
        )
        for p in prompts[:2]:
            m = c.match(p, lock=True)
            assert m.device_tokens + m.host_tokens == PF
            last = list(c.load(m.lock_id))[-1] if m.host_tokens else None
            pages = last.device_pages if last is not None else m.device_pages
            assert pages is not None
            oracle.verify(p, pages, PF // PAGE)
            c.release(lock_id=m.lock_id)
        assert oracle.wrong_bytes == 0 and oracle.pages_checked == 2 * (PF // PAGE) * 4
        assert held(c) == (0, 0)
        assert all(locked == 0 for _, locked in settled(c).values())


# --------------------------------------------------------------------------- hybrid

HYBRID = (
    "model.page_size=4",
    "model.components={full: {layers: 2, bytes_per_token_per_layer: 8},"
    " swa: {layers: 3, bytes_per_token_per_layer: 4, window_tokens: 8},"
    " mamba: {layers: 2, state_bytes_per_layer: 64}}",
    "model.sidecars={idx: {anchor: full, layers: 1, bytes_per_token_per_layer: 2},"
    " conv: {anchor: mamba, layers: 1, state_bytes_per_layer: 32}}",
    "tiers.l1.tokens=128",
    "tiers.l1.mamba_slots=8",
)


def test_a_hybrid_request_life_in_batches_is_byte_exact(make_daemon: MakeDaemon) -> None:
    """Match, then (one batch) a keep_lock insert with a MAMBA checkpoint and decode
    growth, then (one batch) the final insert: a second engine reads every member of both
    boundaries byte for byte (the checkpoint of the prefill is the copy taken then, not
    the state the engine wrote on in its slot)."""
    d = make_daemon(*HYBRID)
    full = np.arange(2_000_000, 2_000_040, dtype="<u4").tobytes()  # 10 pages of 4
    prefill = full[: 24 * 4]
    with d.client(engine_id="hy-writer") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        (m,) = c.batch([match_op(prefill, lock=True, allocate_tokens=24, session_id="conv")])
        assert isinstance(m, MatchOutcome) and len(m.pages["mamba"]) == 1
        oracle.write(prefill, m.pages, 0)
        mid, grown, hb = c.batch(
            [
                insert_op(
                    prefill,
                    lock_id=m.lock_id,
                    allocation_id=m.allocation_id,
                    keep_lock=True,
                    mamba_checkpoint=True,
                ),
                allocate_op(16, allocation_id=m.allocation_id),
                hb_op("hy-writer"),
            ]
        )
        assert mid == InsertOutcome(inserted_tokens=24, reused_tokens=0)
        assert isinstance(grown, AllocationInfo) and len(grown.pages["full"]) == 4
        assert np.array_equal(grown.pages["mamba"], m.pages["mamba"])  # the engine's slot
        assert (hb.locks, hb.allocations) == (1, 1)
        oracle.write(full, grown.pages, 6)  # decode KV, and the state after it in the slot
        end, hb = c.batch(
            [
                insert_op(
                    full, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True
                ),
                hb_op("hy-writer"),
            ]
        )
        assert end == InsertOutcome(inserted_tokens=16, reused_tokens=24)
        assert (hb.locks, hb.allocations) == (0, 0)
    with d.client(engine_id="hy-reader") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        outs = c.batch([match_op(prefill, lock=True), match_op(full, lock=True)])
        for t, o in zip((prefill, full), outs, strict=True):
            assert isinstance(o, MatchOutcome) and o.device_tokens == len(t) // 4
            oracle.verify(t, o.device_pages, o.device_tokens // 4)
        c.batch([release_op(lock_id=o.lock_id) for o in outs])
        assert oracle.pages_missing == 0 and oracle.pages_checked > 0
        assert oracle.wrong_bytes == 0
        assert held(c) == (0, 0)


# --------------------------------------------------------------------------- concurrency


def test_engines_batching_overlapping_prefixes_at_once_stay_byte_exact(
    make_daemon: MakeDaemon,
) -> None:
    """Four engines, each on its own thread, send Batches of matches (lock + allocation)
    and then Batches of inserts over prompts sharing prefixes, in two namespaces, L1 small
    enough to evict: every reused page holds the bytes its prefix's writer wrote, nothing
    stays held, and every answered match is one lookup."""
    d = make_daemon("tiers.l1.tokens=2048")
    failures: list[object] = []
    answered = [0] * 4

    def engine(k: int) -> None:
        try:
            with d.client(engine_id=f"overlap-{k}") as c:
                att = c.attach()
                oracles = {ns: KvOracle(att.info, att.pools, ns) for ns in ("", "b")}
                rng = random.Random(k)
                for rnd in range(20):
                    reqs = []
                    for j in range(3):
                        ns = rng.choice(["", "b"])
                        shared = rng.randrange(4) * 10_000 + 3_000_000
                        tail = rng.randrange(1, 5) * PAGE + rng.randrange(PAGE)
                        own = 4_000_000 + 100_000 * k + 1_000 * rnd + 100 * j
                        reqs.append(
                            (
                                ns,
                                seq((shared, 2 * PAGE), (own, tail))
                                if rng.random() < 0.5
                                else seq((shared, 2 * PAGE + tail)),
                            )
                        )
                    got = c.batch(
                        [match_op(p, ns, lock=True, allocate_tokens=len(p) // 4) for ns, p in reqs]
                    )
                    inserts = []
                    for (ns, p), m in zip(reqs, got, strict=True):
                        if isinstance(m, ResourceExhausted):  # locked pages fill L1
                            continue
                        assert isinstance(m, MatchOutcome), m
                        answered[k] += 1
                        oracles[ns].verify(p, m.device_pages, m.device_tokens // PAGE)
                        oracles[ns].write(p, m.pages, m.device_tokens // PAGE)
                        inserts.append(
                            insert_op(p, ns, lock_id=m.lock_id, allocation_id=m.allocation_id)
                        )
                    for out in c.batch(inserts):
                        assert isinstance(out, InsertOutcome), out
                for ns, o in oracles.items():
                    if o.wrong_bytes or o.pages_missing:
                        failures.append((k, ns, o.wrong_bytes, o.pages_missing))
                if held(c) != (0, 0):
                    failures.append((k, "held", held(c)))
        except BaseException as e:  # (reported by the main thread)
            failures.append((k, repr(e)))

    with d.client() as probe:
        lookups = probe.stats().counters["lookups"]
        run_engines(engine, 4)
        assert failures == []
        assert sum(answered) > 0
        assert probe.stats().counters["lookups"] - lookups == sum(answered)
        assert all(locked == 0 for _, locked in settled(probe).values())
