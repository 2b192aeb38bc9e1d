"""Prefetch for a hybrid model (FULL+SWA+MAMBA) where the boundary's window or checkpoint
lies only in L3: what the match reports, what the prefetch brings, what it reports ready.
(Found by a review; each test failed before its fix.)"""

from __future__ import annotations

import time

import pytest
from engine_sim import Engine, evict_all, flushed, hold_nth_read, seq, wait_prefetch

import hicache.controller.prefetch as pf
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.types import ComponentKind, Tier

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


def _checkpoint_only_in_l3(ctl, eng: Engine, tokens: bytes) -> None:
    """`tokens` computed, then out of L1, then its MAMBA checkpoint out of L2 alone: the
    tree holds FULL and SWA in L2, the checkpoint only in L3."""
    eng.request(tokens)
    flushed(ctl, tokens)
    evict_all(ctl, Tier.DEVICE)
    with ctl._mu:
        ctl.transfers._evict(Tier.HOST, MAMBA, 1)


def test_a_boundary_whose_checkpoint_only_l3_holds_is_prefetched_and_reusable(make) -> None:
    """API.md: with `prefetch` and storage_tokens >= the threshold a prefetch starts. The
    tree's own storage part (a checkpoint only L3 holds) used to be reported and never
    fetched: the engine recomputed it at every request."""
    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    tokens = seq(8)
    _checkpoint_only_in_l3(ctl, eng, tokens)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 32)
    assert m.prefetch_id, "storage_tokens reported, no prefetch started"
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 32
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert again.device_tokens + again.host_tokens == 32 and again.storage_tokens == 0
    *_, last = ctl.load("e1", again.lock_id)
    eng.verify(last.device_pages, tokens, last.device_tokens // 4)  # byte for byte
    ctl.release("e1", again.lock_id, None)


def test_a_prefetch_never_continues_from_a_node_its_own_reservation_evicted(make) -> None:
    """The storage boundary lies past the match lock (its checkpoint only in L3) and is an
    unlocked L2 leaf: reserving the prefetch's L2 pages could evict it, and the batches
    were then inserted below a node no longer in the tree (leaked L2 pages, wrong
    counters). It is pinned before the reservation: with no room the prefetch is
    refused."""
    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(12))
    flushed(ctl, seq(12))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # seq(12) only in L3
    _checkpoint_only_in_l3(ctl, eng, seq(8))
    with ctl._mu:  # every free L2 page held by someone else (other requests' reservations)
        alloc = ctl.host.allocator(FULL)
        hog = alloc.allocate(alloc.free_count)
    try:
        refused = ctl.counters["prefetch_refused_room"]
        m = ctl.match("e1", MatchRequest("", seq(12), lock=True, prefetch=True))
        assert m.prefetch_id == 0 and ctl.counters["prefetch_refused_room"] == refused + 1
        ctl.release("e1", m.lock_id, None)
        again = ctl.match("e1", MatchRequest("", seq(8)))
        assert again.host_tokens + again.storage_tokens == 32  # the node it would have lost
    finally:
        with ctl._mu:
            alloc.free(hog)
    ctl.check_integrity()  # (and the fixture audits every page's owner)


def test_a_stopped_hybrid_prefetch_reports_only_what_is_reusable(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the final SWA window and the last checkpoint are fetched: an earlier batch end
    is no boundary a hybrid model can resume from, so tokens_ready ("a usable prefix")
    stays 0 until the whole op landed."""
    ctl = make(hybrid=True, prefetch__policy="best_effort", **THROUGH)
    eng = Engine(ctl)
    tokens = seq(8)
    eng.request_then_only_in_l3(tokens)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    gate, second = hold_nth_read(ctl, monkeypatch, 2)  # the second batch's read waits for the cancel
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id and second.wait(5)
    ready = ctl.cancel_prefetch(m.prefetch_id)
    gate.set()
    assert ctl.prefetcher.worker.drain(10)
    info = ctl.prefetch_status(m.prefetch_id)
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", tokens))
    assert info.state is PrefetchState.CANCELLED and ready == info.tokens_ready == 0
    assert again.device_tokens + again.host_tokens == 0


@pytest.mark.parametrize("cache", ["fresh", "stale"])
def test_l3_pages_beyond_the_tree_are_fetched_when_l3_lost_the_trees_own_part(
    make, cache: str
) -> None:
    """The tree's own storage part is asked from the host boundary; when L3 no longer holds
    that part's FULL pages (this node serves them from L2 and never reads them, so an
    aging L3 drops them first), the lookup goes on from the storage boundary as before,
    and the L3 pages past the tree come back. With a stale existence cache the first
    prefetch fails at the lost page (and forgets it); the next request gets them."""
    import os

    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(12))  # L3: pages 0-11, checkpoint at 12
    flushed(ctl, seq(12))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    _checkpoint_only_in_l3(ctl, eng, seq(8))  # tree: pages 0-7 in L2, checkpoint at 8 in L3
    for key in ctl.l3.keys("", eng.hashes(seq(12))[:1], ctl.cfg.model.family(FULL)):
        os.unlink(ctl.l3.backend.path_of(key))  # L3 lost FULL page 0
    if cache == "fresh":
        ctl.l3.cache = type(ctl.l3.cache)()
    for _attempt in range(1 if cache == "fresh" else 2):
        m = ctl.match("e1", MatchRequest("", seq(12), lock=True, prefetch=True))
        if m.prefetch_id:
            wait_prefetch(ctl, m.prefetch_id)
        ctl.release("e1", m.lock_id, None)
    after = ctl.match("e1", MatchRequest("", seq(12)))
    assert after.device_tokens + after.host_tokens == 48


def _two_boundaries_only_in_l3(make, **sets):  # type: ignore[no-untyped-def]
    """A hybrid controller whose L3 alone holds `seq(8)` with checkpoints at pages 4 and 8,
    and a prefetch budget of 6 pages (`prefetch_fraction` of 128 L2 pages)."""
    ctl = make(hybrid=True, tiers__l2__prefetch_fraction=0.05, **THROUGH, **sets)
    eng = Engine(ctl)
    eng.request(seq(4))
    eng.request(seq(8))
    flushed(ctl, seq(8))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.prefetcher.budget_left() == 6
    return ctl, eng


def test_a_hybrid_prefetch_over_the_budget_stops_at_a_boundary_it_can_resume(make) -> None:
    """8 pages in L3, a budget of 6: the prefetch fetches up to the checkpoint at page 4
    (page 6 has none), and that boundary is reusable."""
    ctl, eng = _two_boundaries_only_in_l3(make)
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    assert m.storage_tokens == 32 and m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 16
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", seq(8), lock=True))
    assert again.device_tokens + again.host_tokens == 16
    *_, last = ctl.load("e1", again.lock_id)
    eng.verify(last.device_pages, seq(8), last.device_tokens // 4)
    ctl.release("e1", again.lock_id, None)


def test_a_hybrid_prefetch_whose_budget_shrank_after_the_match_read_it_is_refused(
        make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The match reads the budget without the mutex and picks a boundary under it; when
    another prefetch reserves in between, the op used to be cut to the smaller budget, at
    a page with no checkpoint: every read wasted, FAILED with 0 tokens ready. It is
    refused (`prefetch_refused_budget`) and reads nothing."""
    ctl, _ = _two_boundaries_only_in_l3(make)
    seen = iter([100, 6])  # the match's read, then start_op's under the mutex
    monkeypatch.setattr(ctl.prefetcher, "budget_left", lambda owner=None: next(seen))
    refused = ctl.counters["prefetch_refused_budget"]
    read = ctl.stats().l3[0].bytes_read
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    assert m.storage_tokens == 32
    assert m.prefetch_id == 0
    assert ctl.counters["prefetch_refused_budget"] == refused + 1
    time.sleep(0.2)  # (an op started would read at once)
    assert ctl.stats().l3[0].bytes_read == read
    ctl.release("e1", m.lock_id, None)


def test_a_full_only_prefetch_over_the_budget_fetches_the_budget(make) -> None:
    """FULL alone: any page is a boundary, so the op is cut to the budget (6 of 8 pages)."""
    ctl = make(tiers__l2__prefetch_fraction=0.05, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(8))
    flushed(ctl, seq(8))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    assert m.storage_tokens == 32 and m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 24
    ctl.release("e1", m.lock_id, None)
