"""Review: how one call's cost, and the daemon's memory, grow with state unrelated to it.

A daemon serves for weeks: many engines, locks, sessions, namespaces, tree nodes. A call
must cost what its own request needs, and memory must follow what is live, not how many
calls came before. Measured on real in-process controllers (`engine_sim`), by counting
(deterministic) where possible; the few timings compare medians with a wide margin.
"""

from __future__ import annotations

import statistics
import time

from engine_sim import seq

from hicache.controller.base import InsertRequest, MatchRequest
from hicache.controller.workers import ExistenceCache
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


def _request(ctl, tokens: bytes, session_id: str = "", namespace: str = "", engine: str = "e1"):  # type: ignore[no-untyped-def]
    """Match (lock + allocate), then Insert: one request's life (no KV written: only page
    ownership is audited)."""
    m = ctl.match(engine, MatchRequest(namespace, tokens, session_id=session_id, lock=True,
                                       allocate_tokens=len(tokens) // 4))
    ctl.insert(engine, InsertRequest(namespace, tokens, lock_id=m.lock_id,
                                     allocation_id=m.allocation_id, session_id=session_id))
    return m


def _queue_entries(ctl) -> int:  # type: ignore[no-untyped-def]
    """Entries held by every eviction queue of the tree (heap + pending + parked)."""
    return sum(len(q) for per_tier in ctl.tree._queues for q in per_tier)


# ---------------------------------------------------------------------------- bugs


def test_eviction_queues_stay_bounded_by_the_tree_under_session_churn(make):
    """20 fixed prompts, each served under a fresh session that is then closed (a client
    that names a session per conversation and closes it). The tree stays 20 nodes, L1
    never fills (no eviction), yet every close adds heap entries for its end node."""
    ctl = make(l1_tokens=4 * 4096, backend="none")
    ctl.attach("e1", 0, 1)
    prompts = [seq(4, base=1000 * i) for i in range(20)]

    def churn(first: int, n: int) -> None:
        for j in range(first, first + n):
            sid = f"s{j}"
            _request(ctl, prompts[j % len(prompts)], session_id=sid)
            ctl.close_session(sid)

    churn(0, 200)
    nodes = len(ctl.tree.iter_nodes())
    small = _queue_entries(ctl)
    churn(200, 4000)  # 20x the sessions, the same tree
    assert len(ctl.tree.iter_nodes()) == nodes == 20
    assert ctl.stats().counters.get("evictions_device", 0) == 0  # nothing compacts
    big = _queue_entries(ctl)
    resident = ctl.tree.resident_pages(Tier.DEVICE, FULL)
    # The bound the tree itself compacts a queue to at an eviction, 4 x (resident pages
    # + 64), for this model's two queues (FULL in L1 and in L2).
    bound = 2 * 4 * (resident + 64)
    assert big <= max(bound, 3 * small), (
        f"eviction queues hold {big} entries for a {nodes}-node tree ({resident} resident "
        f"pages) after 4200 sessions closed (after 200: {small})")


def test_eviction_cost_does_not_grow_with_locked_leaves(make):
    """K old single-page leaves stay locked (requests matched and waiting, e.g. in an
    engine's queue); then a stream of requests evicts L1. Counted: lock checks the FULL
    queue makes per `tree.evict` call. With 20x the locks, an eviction must not do ~20x
    the work."""

    def per_eviction(k: int) -> float:
        ctl = make(l1_tokens=4 * 2048, backend="none", write__l1_to_l2="write_back")
        ctl.attach("e1", 0, 1)
        for i in range(k):
            _request(ctl, seq(1, base=10_000_000 + 4 * i))
        for i in range(k):  # held: the lowest-ranked leaves of the tree
            ctl.match("e1", MatchRequest("", seq(1, base=10_000_000 + 4 * i), lock=True))
        queue = ctl.tree._queues[Tier.DEVICE][0]
        checks = [0]
        evictions = [0]
        is_locked, evict = queue._is_locked, ctl.tree.evict

        def counted_is_locked(node):  # type: ignore[no-untyped-def]
            checks[0] += 1
            return is_locked(node)

        def counted_evict(*args, **kwargs):  # type: ignore[no-untyped-def]
            evictions[0] += 1
            return evict(*args, **kwargs)

        queue._is_locked = counted_is_locked
        ctl.tree.evict = counted_evict
        for i in range(1500):
            _request(ctl, seq(4, base=16 * i))
        assert evictions[0] > 50, evictions[0]
        return checks[0] / evictions[0]

    few, many = per_eviction(10), per_eviction(200)
    assert many <= 3 * few, (
        f"lock checks per eviction: {few:.1f} with 10 locked leaves, {many:.1f} with 200")


# ---------------------------------------------------------------------------- fine


def test_request_and_report_paths_never_walk_the_whole_tree(make):
    """Match+Insert, Release, Load, CloseSession, Heartbeat, Attach, Stats,
    Health and the lease sweep touch only their own path (no `iter_nodes` /
    `full_pages_only_above` walk), however large the tree."""
    ctl = make(l1_tokens=4 * 4096, backend="none")
    ctl.attach("e1", 0, 1)
    for i in range(300):
        _request(ctl, seq(3, base=100_000 + 12 * i), namespace=f"ns{i % 7}")
    tree = ctl.tree
    walks = [0]
    iter_nodes, above = tree.iter_nodes, tree.full_pages_only_above

    def counted_iter():  # type: ignore[no-untyped-def]
        walks[0] += 1
        return iter_nodes()

    def counted_above(tier):  # type: ignore[no-untyped-def]
        walks[0] += 1
        return above(tier)

    tree.iter_nodes, tree.full_pages_only_above = counted_iter, counted_above
    try:
        for i in range(20):
            m = _request(ctl, seq(5, base=i * 20), session_id=f"x{i}")
            m = ctl.match("e1", MatchRequest("", seq(5, base=i * 20), lock=True))
            list(ctl.load("e1", m.lock_id))
            ctl.release("e1", m.lock_id, None)
            ctl.close_session(f"x{i}")
            ctl.heartbeat("e1")
            ctl.attach("e2", 0, 1)
            ctl.stats()
            ctl.health(False)
            ctl.expire_leases()
    finally:
        tree.iter_nodes, tree.full_pages_only_above = iter_nodes, above
    assert walks[0] == 0


def _median_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def test_request_cost_independent_of_unrelated_engines_locks_and_namespaces(make):
    """One engine's Match+Insert and Heartbeat cost the same with 20 other engines holding
    20 locks across 20 namespaces as with 400 engines holding 400 locks across 400
    namespaces and 400 open sessions (best of three medians, 3x margin)."""

    def cost(n: int) -> tuple[float, float]:
        ctl = make(l1_tokens=4 * 8192, backend="none")
        ctl.attach("e0", 0, 1)
        for i in range(n):
            engine = f"other{i}"
            ctl.attach(engine, 0, 1)
            tokens = seq(2, base=1_000_000 + 8 * i)
            _request(ctl, tokens, namespace=f"ns{i}", engine=engine, session_id=f"o{i}")
            ctl.match(engine, MatchRequest(f"ns{i}", tokens, lock=True))  # held
        tokens = seq(4, base=7)
        _request(ctl, tokens, engine="e0")

        def one() -> None:
            m = ctl.match("e0", MatchRequest("", tokens, lock=True, allocate_tokens=20))
            ctl.insert("e0", InsertRequest("", tokens, lock_id=m.lock_id,
                                           allocation_id=m.allocation_id))

        req = min(_median_us(one, 300) for _ in range(3))
        beat = min(_median_us(lambda: ctl.heartbeat("e0"), 500) for _ in range(3))
        return req, beat

    (req_small, beat_small), (req_big, beat_big) = cost(20), cost(400)
    assert req_big <= 3 * req_small + 20, (req_small, req_big)
    assert beat_big <= 3 * beat_small + 5, (beat_small, beat_big)


def test_existence_cache_lookup_and_add_cost_independent_of_cache_size():
    """`add_present` / `known_run` of a 64-key run cost the same in a cache of 1K keys as
    in one of 200K (the key-set intersection iterates the run, not the cache)."""

    def cost(size: int) -> tuple[float, float]:
        cache = ExistenceCache(capacity=1 << 20)
        cache.add_present([f"fill-{i}" for i in range(size)])
        run = [f"run-{i}" for i in range(64)]
        add = min(_median_us(lambda: cache.add_present(run), 200) for _ in range(3))
        look = min(_median_us(lambda: cache.known_run(run), 200) for _ in range(3))
        return add, look

    (add_s, look_s), (add_b, look_b) = cost(1000), cost(200_000)
    assert add_b <= 3 * add_s + 10, (add_s, add_b)
    assert look_b <= 3 * look_s + 10, (look_s, look_b)
