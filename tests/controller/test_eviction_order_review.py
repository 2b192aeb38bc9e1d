"""Review: is the eviction order exactly what DESIGN §1/§3 and the README's `eviction.*`
and `write.*` rows promise? Tree level (per tier, per component, sessions, tombstones,
locks) and controller level (write-back copies before eviction, counters)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_sim import Engine, seq
from tree_kit import freed, ids, toks, tree_of

from hicache.controller.base import MatchRequest
from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, EvictionPolicy, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
NO_L3 = {"storage__backend": "none"}


def session_insert(tree: HiRadixTree, session: str, tokens: bytes, pages: dict, **kw):
    m = tree.match("", tokens, lock=True, session_id=session)
    start = m.device_tokens // tree.page_size
    return tree.insert("", tokens, {k: v[start:] for k, v in pages.items()}, lock=m.lock, **kw)


def host_copier(tree: HiRadixTree, start: int = 500):
    host = iter(range(start, start + 10_000))

    def back_up(victim) -> None:
        for kind in tree.kinds:  # FULL first: other slots need FULL in the tier
            pages = victim.pages.get(kind)
            if pages is not None and not tree.is_resident(victim.node, kind, Tier.HOST):
                tree.set_resident(victim.node, kind, Tier.HOST, np.array([next(host) for _ in pages]))

    return back_up


# ----------------------------------------------------------------------------- sessions


def test_a_session_references_only_the_trailing_swa_window_of_its_path() -> None:
    """Window 2 pages. Session s ends at X(4 pages) -> Y(1 page): DESIGN's reference
    covers Y and X's last page; X's first 3 pages are out of every window and unreferenced.
    An unreferenced, more recently used U(4) -> V(1) has the same shape. SWA first takes
    unreferenced entries, then by LRU: the session's cold out-of-window pages go first."""
    tree = tree_of(4, swa_window=8)
    x = toks(0, 16)
    session_insert(tree, "s", x, {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    session_insert(tree, "s", x + toks(200, 4),
                   {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    u = toks(1000, 16)
    tree.insert("", u, {FULL: ids(21, 22, 23, 24), SWA: ids(31, 32, 33, 34)})
    tree.insert("", u + toks(1200, 4), {FULL: ids(21, 22, 23, 24, 25), SWA: ids(31, 32, 33, 34, 35)})
    tree.match("", u + toks(1200, 4))  # U/V hot, X/Y cold
    assert freed(tree, Tier.DEVICE, SWA, 3) == [11, 12, 13]


def test_a_session_ending_at_an_inner_node_keeps_its_window_referenced() -> None:
    """The session ends at X(4 pages), which a later request continues (X is inner, so its
    SWA may go alone). Window 2 pages: X's last 2 pages are the session's window and go
    after every unreferenced page; its first 2 go by LRU like anyone's."""
    tree = tree_of(4, swa_window=8)
    x = toks(0, 16)
    session_insert(tree, "s", x, {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    tree.insert("", x + toks(300, 4), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    u = toks(1000, 16)
    tree.insert("", u, {FULL: ids(21, 22, 23, 24), SWA: ids(31, 32, 33, 34)})
    tree.insert("", u + toks(1200, 4), {FULL: ids(21, 22, 23, 24, 25), SWA: ids(31, 32, 33, 34, 35)})
    tree.match("", u + toks(1200, 4))  # U hot, X cold
    assert freed(tree, Tier.DEVICE, SWA, 2) == [11, 12]  # out of the window, coldest
    assert freed(tree, Tier.DEVICE, SWA, 3) == [31, 32, 33]  # unreferenced, though hotter
    # the window: later, not never (14 stays: the continuing request's window needs it)
    assert freed(tree, Tier.DEVICE, SWA, 2) == [13]
    tree.close_session("s")
    tree.check_integrity()


def test_a_sessions_window_moves_with_its_next_turn_and_shrinks_with_its_path() -> None:
    """Turn 2 moves the window down: turn 1's window is ordinary again. When the end's
    node leaves the tree, the session ends at its parent and keeps what of its window is
    left there (references never reach above where the window began)."""
    tree = tree_of(4, swa_window=8)
    a = toks(0, 16)
    session_insert(tree, "s", a, {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    b = a + toks(500, 12)
    session_insert(tree, "s", b, {FULL: ids(1, 2, 3, 4, 5, 6, 7), SWA: ids(11, 12, 13, 14, 15, 16, 17)})
    tree.insert("", toks(1000, 8), {FULL: ids(21, 22), SWA: ids(31, 32)})
    # turn 1's window (13, 14) is no longer referenced: the colder pages go first
    assert freed(tree, Tier.DEVICE, SWA, 4) == [11, 12, 13, 14]
    assert freed(tree, Tier.DEVICE, SWA, 1) == [15]  # out of turn 2's window too
    assert freed(tree, Tier.DEVICE, FULL, 2) == [21, 22]  # unreferenced first
    assert freed(tree, Tier.DEVICE, FULL, 2) == [6, 7]  # the end leaves: it ends at 5 now
    assert freed(tree, Tier.DEVICE, FULL, 1) == [5]  # and at 4 (page 14's node) now
    tree.close_session("s")
    tree.check_integrity()


def test_a_checkpoint_above_a_sessions_boundary_is_not_referenced() -> None:
    """MAMBA references the session's boundary only: a checkpoint at an inner node of the
    session's path is an ordinary one (goes first when coldest), the boundary's goes last."""
    tree = tree_of(4, mamba=True)
    session_insert(tree, "s", toks(0, 8), {FULL: ids(1, 2)}, mamba_slot=40)  # inner X
    session_insert(tree, "s", toks(0, 12), {FULL: ids(1, 2, 3)}, mamba_slot=41)  # end Y
    tree.insert("", toks(500, 4), {FULL: ids(9)}, mamba_slot=42)  # newer, unreferenced
    assert freed(tree, Tier.DEVICE, MAMBA, 1) == [40]
    assert freed(tree, Tier.DEVICE, MAMBA, 1) == [42]
    assert freed(tree, Tier.DEVICE, MAMBA, 1) == [41]


def test_more_session_references_go_later_and_a_close_makes_them_ordinary() -> None:
    """FULL ranks by (reference count, base policy): an older leaf two sessions end at
    outlives a newer one a single session ends at; once all close, plain LRU."""
    tree = tree_of(4)
    a, b = toks(0, 4), toks(100, 4)
    session_insert(tree, "s1", a, {FULL: ids(1)})
    session_insert(tree, "s2", a, {FULL: ids(1)})  # A: 2 references, older
    session_insert(tree, "s3", b, {FULL: ids(2)})  # B: 1 reference, newer
    assert freed(tree, Tier.DEVICE, FULL, 1) == [2]
    tree.insert("", b, {FULL: ids(2)})  # B again, newest (its reference stays on the old node)
    for s in ("s1", "s2", "s3"):
        tree.close_session(s)
    assert freed(tree, Tier.DEVICE, FULL, 1) == [1]


def test_session_retention_applies_to_l2_too() -> None:
    """In L2 too a session-referenced node goes after hotter unreferenced ones, and after
    CloseSession it is ordinary (the coldest goes first)."""
    tree = tree_of(4)
    a, b, c = toks(0, 4), toks(100, 4), toks(200, 4)
    session_insert(tree, "s", a, {FULL: ids(1)})
    tree.insert("", b, {FULL: ids(2)})
    tree.insert("", c, {FULL: ids(3)})
    assert freed(tree, Tier.DEVICE, FULL, 3, host_copier(tree)) == [1, 2, 3]  # all in L2 only
    tree.match("", b)
    tree.match("", c)
    tree.evict(Tier.HOST, FULL, 1)
    assert [tree.match("", t).host_tokens for t in (a, b, c)] == [4, 0, 4]
    tree.close_session("s")
    tree.match("", c)
    tree.evict(Tier.HOST, FULL, 1)
    assert [tree.match("", t).host_tokens for t in (a, c)] == [0, 4]
    tree.check_integrity()


def test_a_reopened_sessions_late_request_does_not_protect_its_old_path() -> None:
    """A request matched under a session's first generation finishes after a close and a
    reopen: its path stays ordinary (LRU), the new generation's is protected."""
    tree = tree_of(4, closed_session_tombstones=1)
    late = tree.match("", toks(0, 4), lock=True, session_id="s")
    tree.close_session("s")
    fresh = tree.match("", toks(100, 4), lock=True, session_id="s")
    tree.insert("", toks(0, 4), {FULL: ids(1)}, lock=late.lock)
    tree.insert("", toks(100, 4), {FULL: ids(2)}, lock=fresh.lock)
    tree.insert("", toks(200, 4), {FULL: ids(3)})
    assert freed(tree, Tier.DEVICE, FULL, 1) == [1]
    assert freed(tree, Tier.DEVICE, FULL, 1) == [3]
    assert freed(tree, Tier.DEVICE, FULL, 1) == [2]


# ----------------------------------------------------------------------------- SWA


def test_a_long_leafs_swa_pages_outside_its_window_can_be_tombstoned() -> None:
    tree = tree_of(4, swa_window=8)  # 2 pages
    tree.insert("", toks(0, 32), {FULL: ids(*range(1, 9)), SWA: ids(*range(11, 19))})
    assert freed(tree, Tier.DEVICE, SWA, 6) == [11, 12, 13, 14, 15, 16]
    m = tree.match("", toks(0, 32))
    assert m.device_tokens == 32


def test_l1_and_l2_keep_separate_orders_leaf_first_in_each() -> None:
    """A parent P with children A (cold) and B (hot), all in L1 and L2. L2 evicts by its
    own candidates: P's L2 copy can go while P is in L1 (it is not the last copy), but
    never P in L1 before both its children left L1."""
    tree = tree_of(4)
    p = toks(0, 8)
    a, b = p + toks(100, 4), p + toks(200, 4)
    tree.insert("", a, {FULL: ids(1, 2, 3)})
    tree.insert("", b, {FULL: ids(1, 2, 4)})
    host = {1: 51, 2: 52, 3: 53, 4: 54}
    for t in (a, b):
        for node in tree.path_to(tree.match("", t).path[-1]):
            if not tree.is_resident(node, FULL, Tier.HOST):
                pages = tree.pages_of(node, FULL, Tier.DEVICE)
                tree.set_resident(node, FULL, Tier.HOST, np.array([host[int(i)] for i in pages]))
    tree.match("", b)  # B (and P) hot, A cold
    assert freed(tree, Tier.DEVICE, FULL, 1) == [3]  # A's leaf, not P (hotter, but a parent)
    assert freed(tree, Tier.DEVICE, FULL, 1) == [4]  # then B
    assert freed(tree, Tier.DEVICE, FULL, 1) == [1, 2]  # P only once a leaf of L1
    assert freed(tree, Tier.HOST, FULL, 1) == [53]  # L2: the coldest leaf there, A
    assert tree.match("", b).host_tokens == 12


@pytest.mark.parametrize("lfu", [False, True])
def test_a_checkpoint_and_a_window_locked_by_a_match_are_never_evicted(lfu: bool) -> None:
    """Locked slots are never evicted, whatever the component: the lock's boundary
    checkpoint and the path's SWA data stay; the unlocked ones go."""
    policy = EvictionPolicy.LFU if lfu else EvictionPolicy.LRU
    tree = tree_of(4, swa_window=4, mamba=True, policy=policy)
    a = toks(0, 8)
    tree.insert("", a, {FULL: ids(1, 2), SWA: ids(11, 12)}, mamba_slot=30)
    tree.insert("", a + toks(100, 4), {FULL: ids(1, 2, 3), SWA: ids(11, 12, 13)}, mamba_slot=31)
    tree.insert("", toks(500, 4), {FULL: ids(9), SWA: ids(19)}, mamba_slot=32)
    held = tree.match("", a + toks(100, 4), lock=True).lock  # locks 31 (the boundary), the path
    assert freed(tree, Tier.DEVICE, MAMBA, 10) == [30, 32]
    assert freed(tree, Tier.DEVICE, SWA, 10) == []  # 11, 12 are out of the window but locked
    assert freed(tree, Tier.DEVICE, FULL, 10) == [9]
    tree.unlock(held)
    assert freed(tree, Tier.DEVICE, SWA, 10) == [11, 12]
    assert freed(tree, Tier.DEVICE, MAMBA, 10) == [31]


def test_lfu_counts_matches_not_inserts_and_breaks_ties_by_recency() -> None:
    """LFU: a match is a use (every node on the matched path); an insert over an existing
    path is not (it refreshes recency only). Equal hits: the least recent goes first."""
    tree = tree_of(4, policy=EvictionPolicy.LFU)
    a, b, c = toks(0, 4), toks(100, 4), toks(200, 4)
    tree.insert("", a, {FULL: ids(1)})
    tree.insert("", b, {FULL: ids(2)})
    tree.insert("", c, {FULL: ids(3)})
    tree.match("", a)
    tree.match("", b)  # a, b: one hit each; b the more recent
    for _ in range(3):
        tree.insert("", c, {FULL: ids(3)})  # c: no hit, most recent
    assert freed(tree, Tier.DEVICE, FULL, 1) == [3]
    assert freed(tree, Tier.DEVICE, FULL, 1) == [1]
    assert freed(tree, Tier.DEVICE, FULL, 1) == [2]


# ----------------------------------------------------------------------------- controller


def _counters(ctl) -> dict[str, int]:
    return {k: v for k, v in ctl.stats().counters.items() if isinstance(v, int)}


def _delta(before: dict[str, int], after: dict[str, int], *keys: str) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _evict_l1_everything(ctl, *tiers: Tier) -> None:
    assert ctl.transfers.drain(10)
    with ctl._mu:
        for tier in tiers:
            pools = ctl.device if tier is Tier.DEVICE else ctl.host
            for kind in ctl._kinds:
                ctl.transfers._evict(tier, kind, pools.allocator(kind).total)


def _load_verify(eng: Engine, tokens: bytes) -> tuple[int, int]:
    ctl = eng.ctl
    m = ctl.match(eng.id, MatchRequest("", tokens, lock=True))
    pages, n = m.device_pages, m.device_tokens
    if m.host_tokens:
        *_, last = list(ctl.load(eng.id, m.lock_id))
        pages, n = last.device_pages, last.device_tokens
    eng.verify(pages, tokens, n // ctl.cfg.model.page_size)
    ctl.release(eng.id, m.lock_id, None)
    return m.device_tokens, m.host_tokens


def test_write_back_l1_eviction_copies_the_whole_family_first_and_counts_full_pages(make) -> None:
    """Under write_back a hybrid node (FULL, SWA, MAMBA and their sidecars) leaving L1 is
    copied to L2 first: every member comes back bit-exact; `evictions_device` counts the
    FULL pages that left L1."""
    ctl = make(hybrid=True, write__l1_to_l2="write_back", **NO_L3)
    eng = Engine(ctl)
    a, b = seq(2), seq(3, 1000)
    eng.request(a)
    eng.request(b)
    before = _counters(ctl)
    _evict_l1_everything(ctl, Tier.DEVICE)
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 0
    assert _delta(before, _counters(ctl), "evictions_device", "evictions_host") == {
        "evictions_device": 5, "evictions_host": 0}
    eng.checked = 0
    assert _load_verify(eng, a) == (0, 8)
    assert _load_verify(eng, b) == (0, 12)
    assert eng.checked > 0


def test_backups_to_l2_count_the_full_pages_that_went_down(make) -> None:
    ctl = make(hybrid=True, write__l1_to_l2="write_back", **NO_L3)
    eng = Engine(ctl)
    eng.request(seq(2))
    eng.request(seq(3, 1000))
    before = _counters(ctl)
    _evict_l1_everything(ctl, Tier.DEVICE)
    d = _delta(before, _counters(ctl), "evictions_device", "backups_l2")
    assert d["backups_l2"] == d["evictions_device"] == 5


def test_swa_windows_leave_l1_before_any_full_path_and_are_counted_apart(make) -> None:
    """An SWA allocation short of room first tombstones SWA data outside every kept window
    (`evictions_device_swa`), leaving every FULL path in L1 (`evictions_device` unchanged)
    and the deep boundary reusable from L1; the shallower one comes back from L2."""
    ctl = make(swa_only=True, **NO_L3)  # window 8 tokens: 2 pages
    eng = Engine(ctl)
    x = seq(4)
    eng.request(x)
    eng.request(x + seq(1, 1000))  # X(4 pages) -> Y(1 page): X's first 3 SWA pages out
    assert ctl.transfers.drain(10)
    before = _counters(ctl)
    with ctl._mu:
        ctl.transfers._evict(Tier.DEVICE, SWA, 3)
    assert _delta(before, _counters(ctl), "evictions_device", "evictions_device_swa") == {
        "evictions_device": 0, "evictions_device_swa": 3}
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 5
    assert ctl.tree.resident_pages(Tier.DEVICE, SWA) == 2
    eng.checked = 0
    assert _load_verify(eng, x + seq(1, 1000)) == (20, 0)
    assert _load_verify(eng, seq(3)) == (0, 12)  # inside the tombstone: L2's window
    assert eng.checked > 0


def _l3_down_at_start(monkeypatch):
    import hicache.controller.controller as cc
    from hicache.errors import BackendUnavailable

    def down(cfg, host):  # type: ignore[no-untyped-def]
        raise BackendUnavailable("not reachable (test)")

    monkeypatch.setattr(cc, "open_l3", down)


def test_l2_write_back_with_the_write_breaker_open_counts_what_it_drops(make, monkeypatch) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_back")
    eng = Engine(ctl)
    eng.request(seq(4))
    monkeypatch.setattr(type(ctl.l3), "takes_writes", property(lambda _s: False))
    before = _counters(ctl)
    _evict_l1_everything(ctl, Tier.DEVICE, Tier.HOST)
    assert _delta(before, _counters(ctl), "evictions_host", "backups_dropped") == {
        "evictions_host": 4, "backups_dropped": 4}


def test_l2_write_back_with_l3_not_connected_yet_counts_what_it_drops(make, monkeypatch) -> None:
    _l3_down_at_start(monkeypatch)
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_back")
    assert ctl.l3 is None and ctl.l3_down
    eng = Engine(ctl)
    eng.request(seq(4))
    before = _counters(ctl)
    _evict_l1_everything(ctl, Tier.DEVICE, Tier.HOST)
    assert _delta(before, _counters(ctl), "evictions_host", "backups_dropped") == {
        "evictions_host": 4, "backups_dropped": 4}
