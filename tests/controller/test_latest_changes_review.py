"""Review of the latest changes: L1 victims kept for L2 room (write-back), the selective
policy's `_uncopied`, bounded sessions and their ends moved by `_delete`, emptied roots,
finished prefetches without tokens, the file backend's per-key ENOSPC and
`plan_load`'s re-planning."""

from __future__ import annotations

import contextlib

import pytest
from engine_sim import Engine, evict_all, fully_in, seq, tree_path

from hicache.controller.base import MatchRequest
from hicache.errors import NotFound
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


_path, _in = tree_path, fully_in  # (engine_sim's)


# ---------------------------------------------------------------- _uncopied (selective)


def _l2_full_of_locked(ctl, eng, policy: str) -> list[int]:
    """L2 (32 pages) full of pages held by locks; returns the lock ids."""
    held = [seq(4, 1000 * (k + 1)) for k in range(8)]
    for tokens in held:
        eng.request(tokens)
        if policy == "write_through_selective":
            for _ in range(2):
                ctl.match("e1", MatchRequest("", tokens))
        assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 32
    evict_all(ctl, Tier.DEVICE)
    return [ctl.match("e1", MatchRequest("", t, lock=True)).lock_id for t in held]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_a_due_copy_without_room_is_made_when_the_node_leaves_l1(make, policy) -> None:
    ctl = make(l1_tokens=64, write__l1_to_l2=policy, write__l2_to_l3="write_through",
               storage__backend="none")
    eng = Engine(ctl)
    locks = _l2_full_of_locked(ctl, eng, policy)
    hot = seq(4, 90_000)
    eng.request(hot)
    for _ in range(2):  # hot: its selective copy is due now, and finds no room
        ctl.match("e1", MatchRequest("", hot))
    assert ctl.transfers.drain(10)
    assert not _in(ctl, hot, Tier.HOST)
    for lock_id in locks:
        ctl.release("e1", lock_id, None)
    evict_all(ctl, Tier.DEVICE)  # room in L2 now: the copy is made as it leaves L1
    assert _in(ctl, hot, Tier.HOST)


def test_an_uncopied_node_split_by_a_match_is_copied_whole_when_it_leaves_l1(make) -> None:
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               storage__backend="none")
    eng = Engine(ctl)
    locks = _l2_full_of_locked(ctl, eng, "write_through")
    long = seq(4, 90_000)
    eng.request(long)  # its copy finds no room: remembered
    assert ctl.transfers.drain(10)
    assert ctl.transfers._uncopied
    ctl.match("e1", MatchRequest("", long[:32]))  # splits it: 2 pages + 2 pages
    for lock_id in locks:
        ctl.release("e1", lock_id, None)
    evict_all(ctl, Tier.DEVICE)
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 0, "a node stuck in L1"
    assert _in(ctl, long, Tier.HOST)


# ---------------------------------------------------------------- sessions and _delete


def _hybrid_tree(**kw):
    from hicache.tree import HiRadixTree

    return HiRadixTree(4, {FULL: 0, SWA: 8, MAMBA: 0}, **kw)


def _toks(ids) -> bytes:
    import numpy as np

    return np.asarray(ids, dtype="<u4").tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_tree_sessions_locks_and_deletes_keep_integrity_hybrid(seed) -> None:
    """Seeded mix on a FULL+SWA+MAMBA tree: sessions (a cap of 3, closed for room)
    ending at leaves that L1 evictions delete (ends move up), locks held across
    evictions, namespaces emptied (roots go) and used again. Integrity after each step."""
    import random

    import numpy as np

    rng = random.Random(seed)
    tree = _hybrid_tree(max_open_sessions=3)
    ids = iter(range(1, 10**7))
    prefixes = [[rng.randrange(50) for _ in range(4 * rng.randint(1, 3))] for _ in range(4)]
    locks = []
    for _step in range(300):
        op = rng.random()
        ns = rng.choice(["", "a", "b"])
        sid = rng.choice([None, "s1", "s2", "s3", "s4", "s5"])
        if op < 0.45:
            body = rng.choice(prefixes) + [rng.randrange(50) for _ in range(4 * rng.randint(0, 3))]
            tokens = _toks(body)
            m = tree.match(ns, tokens, lock=True, session_id=sid)
            n = len(tokens) // 16 - m.device_tokens // 4
            pages = {kind: np.array([next(ids) for _ in range(n)], dtype=np.int64) for kind in (FULL, SWA)}
            if rng.random() < 0.3:
                locks.append(m.lock)  # the request never finishes: its lock holds
                continue
            tree.insert(ns, tokens, pages, lock=m.lock, mamba_slot=next(ids))
        elif op < 0.75:
            kind = rng.choice([FULL, SWA, MAMBA])
            tree.evict(Tier.DEVICE, kind, rng.randint(1, 12))
        elif op < 0.85 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.92 and sid:
            with contextlib.suppress(NotFound):  # (never opened, or closed already)
                tree.close_session(sid)
        else:
            for lock in locks:
                tree.unlock(lock)
            locks.clear()
            for kind in (MAMBA, SWA, FULL):
                tree.evict(Tier.DEVICE, kind, 10**6)
        tree.check_integrity()
        assert len(tree._sessions) <= 3
    for lock in locks:
        tree.unlock(lock)
    for kind in (MAMBA, SWA, FULL):
        tree.evict(Tier.DEVICE, kind, 10**6)
    tree.check_integrity()
    assert not tree._roots, "emptied namespaces keep their roots"
    assert not tree._sessions._by_end, "sessions still index deleted nodes"


# ---------------------------------------------------------------- L1 victims kept for L2 room


def _stall_l3_writes(ctl, monkeypatch):
    import threading

    gate = threading.Event()
    real = ctl.l3.backend._write_from

    def write(keys, buffers):  # type: ignore[no-untyped-def]
        gate.wait(20)
        return real(keys, buffers)

    monkeypatch.setattr(ctl.l3.backend, "_write_from", write)
    return gate


def _lost(ctl, prompts: list[bytes]) -> list[int]:
    out = []
    for i, tokens in enumerate(prompts):
        m = ctl.match("e1", MatchRequest("", tokens))
        if m.device_tokens + m.host_tokens + m.storage_tokens != len(tokens) // 4:
            out.append(i)
    return out


def test_kept_l1_victims_with_a_stalled_l3_cost_a_request_at_most_a_moment(make, monkeypatch) -> None:
    """write_back/write_back, L3 writes stalled: L2 fills with pages parked by L3
    write-backs, L1 victims are kept for a moment, then go counted. No request waits much
    longer than L1_VICTIM_WAIT_S, none fails, every lost prompt is counted dropped once
    its write landed, and the tree stays whole."""
    import time

    ctl = make(l1_tokens=64, write__l1_to_l2="write_back", write__l2_to_l3="write_back")
    gate = _stall_l3_writes(ctl, monkeypatch)
    eng = Engine(ctl)
    prompts = [seq(4, 1000 * (k + 1)) for k in range(20)]
    slowest = 0.0
    try:
        for tokens in prompts:
            t0 = time.monotonic()
            eng.request(tokens)
            slowest = max(slowest, time.monotonic() - t0)
        c = ctl.stats().counters
        assert c["l1_evictions_deferred"] > 0, "the scene kept no victim"
        assert slowest < 1.0, slowest
    finally:
        gate.set()
    assert ctl.transfers.drain(20)
    ctl.check_integrity()
    c = ctl.stats().counters
    lost = _lost(ctl, prompts)
    assert c["backups_dropped"] == 4 * len(lost), (c["backups_dropped"], lost)


# ---------------------------------------------------------------- bounded sessions, roots


def test_a_session_closed_for_room_mid_request_stays_closed_and_the_tree_whole(make) -> None:
    """max_open_sessions=2: s1's request matched (lock of s1), then s2 and s3 open and
    s1 is closed for room before s1's Insert: that Insert references nothing (a late
    request), the table stays at its cap, and the audit passes; a next request of s1
    opens it afresh and references its path."""
    from hicache.controller.base import InsertRequest

    ctl = make(hybrid=True, eviction__max_open_sessions=2)
    eng = Engine(ctl)
    tokens = seq(4, 500)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, session_id="s1",
                                     allocate_tokens=len(tokens) // 4))
    eng.write(m.pages, tokens, 0)
    for sid, base in (("s2", 7000), ("s3", 8000)):
        ctl.match("e1", MatchRequest("", seq(2, base), session_id=sid, lock=True))
    assert ctl.stats().counters["sessions_closed_for_room"] >= 1
    ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   mamba_checkpoint=True))
    with ctl._mu:
        assert len(ctl.tree._sessions) <= 2
        assert "s1" not in ctl.tree._sessions._open.get("", {})
        ctl.tree.check_integrity()


def test_an_emptied_namespace_root_goes_and_a_prefetch_from_it_still_commits(make) -> None:
    """A namespace emptied by evictions loses its root; a request matched before (lock at
    the root: nothing in the tree) and inserting after, and a prefetch from L3 whose base
    is the root, find a fresh root and commit."""
    from engine_sim import prefetch_back

    from hicache.controller.base import InsertRequest

    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(4, 0))
    assert "" not in ctl.tree._roots, "an emptied namespace kept its root"
    prefetch_back(ctl, seq(4, 0))  # base: the (absent) root
    assert _in(ctl, seq(4, 0), Tier.HOST)
    other = seq(3, 4000)
    m = ctl.match("e1", MatchRequest("", other, lock=True, allocate_tokens=len(other) // 4))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # the root goes again under the open request
    eng.write(m.pages, other, 0)
    ctl.insert("e1", InsertRequest("", other, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert _in(ctl, other, Tier.DEVICE)
    with ctl._mu:
        assert ctl.tree._roots[""].children
        ctl.tree.check_integrity()
