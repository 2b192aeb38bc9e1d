"""Review (session 18) of the controller's prefetch for hybrid models and of SWA windows
under write-back: what `tokens_ready` and `storage_tokens` promise against what a later
match and Load deliver, byte for byte (engine_sim). Confirmed bugs are strict xfails."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_sim import (
    Engine,
    evict_all,
    flushed,
    hold_nth_read,
    prefetch_back,
    seq,
    toks,
    wait_prefetch,
)

import hicache.controller.prefetch as pf
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


def _lose_full_page_0(ctl, eng: Engine, tokens: bytes, page: int = 0) -> None:
    """L3 loses the FULL objects of `tokens`' page `page` (first by default; L2 may still
    hold it); the existence cache forgets what it saw."""
    for key in ctl.l3.keys("", eng.hashes(tokens)[page : page + 1], ctl.cfg.model.family(FULL)):
        os.unlink(ctl.l3.backend.path_of(key))
    ctl.l3.cache = type(ctl.l3.cache)()


def _evict_alone(ctl, tier: Tier, kind: ComponentKind) -> int:
    """Evict `kind`'s own slots (SWA out-of-window data, MAMBA checkpoints) from `tier`,
    never whole leaves (`transfers._evict` falls back to FULL); the pages evicted."""
    with ctl._mu:
        r = ctl.tree.evict(tier, kind, 1000, before_drop=ctl.transfers._victim_callback(tier))
        free = ctl.transfers.free_l1 if tier is Tier.DEVICE else ctl.transfers.free_l2
        for k, ids in r.freed.items():
            free(k, ids)
    return r.evicted_pages


def _only_in_l2(ctl, eng: Engine, tokens: bytes) -> None:
    """A request for `tokens`, flushed to L3, then out of L1: its pages are in L2 and L3."""
    eng.request(tokens)
    flushed(ctl, tokens)
    evict_all(ctl, Tier.DEVICE)


def _drop_checkpoint_from_l2(ctl) -> None:
    with ctl._mu:
        ctl.transfers._evict(Tier.HOST, MAMBA, 1)


# ---------------------------------------------------------------- suspicion 1


@pytest.mark.parametrize("model", ["hybrid", "swa_only"])
def test_no_prefetch_past_the_storage_boundary_that_cannot_bring_its_window(
    make, model: str
) -> None:
    """Tree: seq(8) with FULL in L2, its SWA (and checkpoint) only in L3 (the node is
    interior: a 2-page branch below it lets its window go alone). L3: seq(9) whole but
    FULL page 0 lost. L3 cannot serve the tree's part from the host boundary, and past
    the storage boundary (page 8) one page is not a window of 2: nothing is reachable.
    It used to start that op anyway: DONE, tokens_ready 4 of 4, nothing reusable (and
    36 storage tokens reported at every match)."""
    ctl = make(**{model: True}, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(9))
    flushed(ctl, seq(9))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # seq(9) only in L3
    eng.request(seq(8))
    branch = seq(8) + toks(np.arange(1000, 1008))
    eng.request(branch)
    flushed(ctl, branch)
    evict_all(ctl, Tier.DEVICE)
    assert _evict_alone(ctl, Tier.HOST, SWA) == 8  # seq(8)'s window leaves L2 (it is in L3)
    if model == "hybrid":
        _evict_alone(ctl, Tier.HOST, MAMBA)
    _lose_full_page_0(ctl, eng, seq(9))
    before = ctl.counters["hit_tokens_storage"]
    m = ctl.match("e1", MatchRequest("", seq(9), lock=True, prefetch=True))
    ctl.release("e1", m.lock_id, None)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens, m.prefetch_id) == (0, 0, 0, 0)
    assert ctl.counters["hit_tokens_storage"] == before


def test_a_fallback_prefetch_never_reports_more_than_a_match_then_loads(make) -> None:
    """After the fallback (L3 lost FULL page 0, which L2 holds; the checkpoint at 8 is
    only in L3) the op fetches pages 8-11 with the checkpoint at 12, and counts from the
    host boundary like the match: tokens_ready and tokens_total are the tree's part (32)
    plus the 16 fetched, all of it reusable, every loaded byte right. (It used to count
    from the storage boundary: 16 of 16 against the match's 48.)"""
    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(12))
    flushed(ctl, seq(12))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    _only_in_l2(ctl, eng, seq(8))
    _drop_checkpoint_from_l2(ctl)  # tree: 0-7 in L2, checkpoint at 8 in L3
    _lose_full_page_0(ctl, eng, seq(12))
    m = ctl.match("e1", MatchRequest("", seq(12), lock=True, prefetch=True))
    assert m.prefetch_id and m.storage_tokens == 48
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    info = ctl.prefetch_status(m.prefetch_id)
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", seq(12), lock=True))
    try:
        assert info.tokens_ready == info.tokens_total == 48
        assert again.device_tokens + again.host_tokens == 48
        *_, last = ctl.load("e1", again.lock_id)
        assert last.device_tokens == 48
        eng.verify(last.device_pages, seq(12), 12)
    finally:
        ctl.release("e1", again.lock_id, None)


def test_storage_tokens_the_controller_reports_are_prefetched_or_not_reported(make) -> None:
    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    _only_in_l2(ctl, eng, seq(8))
    _drop_checkpoint_from_l2(ctl)
    assert ctl.l3.has("", eng.hashes(seq(8))[-1], ctl.cfg.model.family(MAMBA))
    _lose_full_page_0(ctl, eng, seq(8))
    refused = ctl.counters["prefetch_refused_room"] + ctl.counters["prefetch_refused_budget"]
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    ctl.release("e1", m.lock_id, None)
    if m.prefetch_id:
        wait_prefetch(ctl, m.prefetch_id)
    refused_now = ctl.counters["prefetch_refused_room"] + ctl.counters["prefetch_refused_budget"]
    # API.md: storage_tokens >= threshold with `prefetch` starts one (or it was refused).
    assert (m.storage_tokens < ctl.cfg.prefetch.threshold_tokens or m.prefetch_id
            or refused_now > refused), m[:3]
    # Here nothing past the checkpoint's page is in L3 and the op reads whole pages: the
    # tree's part is not reachable, so it is not reported (it was, 32, at every match).
    assert (m.storage_tokens, m.prefetch_id) == (0, 0)


def test_pages_l3_lost_one_of_are_reported_and_fetched_up_to_that_page(make) -> None:
    """FULL only: seq(8) is in L3 alone, and L3 lost page 5. What a match reports, and
    its prefetch fetches, is what L3 serves from the host boundary: 5 pages, all of them
    reusable after it, tokens_ready and tokens_total counted alike."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    eng.request(seq(8))
    flushed(ctl, seq(8))
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    _lose_full_page_0(ctl, eng, seq(8), page=5)
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 20) and m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    info = ctl.prefetch_status(m.prefetch_id)
    ctl.release("e1", m.lock_id, None)
    assert info.tokens_ready == info.tokens_total == 20
    again = ctl.match("e1", MatchRequest("", seq(8), lock=True))
    try:
        assert again.device_tokens + again.host_tokens == 20
        *_, last = ctl.load("e1", again.lock_id)
        eng.verify(last.device_pages, seq(8), 5)
    finally:
        ctl.release("e1", again.lock_id, None)


def test_only_a_path_reusable_from_l1_and_l2_counts_as_ready(make) -> None:
    """The tree's checks a prefetch's commit relies on: a path whose FULL pages are all
    in L1/L2 but whose end lacks its checkpoint there is not reusable; with the
    checkpoint back it is; a path with a FULL page only in L3 is neither."""
    ctl = make(hybrid=True, **THROUGH)
    eng = Engine(ctl)
    _only_in_l2(ctl, eng, seq(8))
    with ctl._mu:
        end = ctl.tree.match("", seq(8), lock=False).path[-1]
        assert ctl.tree.full_in_host(end) and ctl.tree.reusable_from_host(end)
    _drop_checkpoint_from_l2(ctl)
    with ctl._mu:
        assert ctl.tree.full_in_host(end) and not ctl.tree.reusable_from_host(end)
    evict_all(ctl, Tier.HOST)
    with ctl._mu:
        assert not ctl.tree.full_in_host(end) and not ctl.tree.reusable_from_host(end)


# ---------------------------------------------------------------- suspicion 2


@pytest.mark.parametrize("l1_to_l2", ["write_back", "write_through"])
def test_swa_windows_and_tails_written_back_from_l2_round_trip_bit_exact(
    make, l1_to_l2: str
) -> None:
    """Not a bug (suspicion 2 refuted): under `l2_to_l3: write_back`, sequences sharing
    prefixes (interior nodes whose SWA leaves L2 alone, split at the retention boundary
    and written back alone), a 1-page SWA tail later grown by a longer request, all
    evicted to L3; each prefetched back, loaded and checked byte for byte."""
    ctl = make(hybrid=True, write__l1_to_l2=l1_to_l2, write__l2_to_l3="write_back")
    eng = Engine(ctl)
    seqs = [seq(6), seq(6) + seq(3, 500), seq(6) + seq(2, 700), seq(3) + seq(4, 900)]
    for s in seqs:
        eng.request(s)
    eng.insert_with_swa_tail(seq(7, 2000), 1)
    # The tail's L1->L2 copy lands first: while it is queued, its pin keeps the tail as
    # it is (`_longer_tail`), and the longer request below would not grow it.
    assert ctl.transfers.drain(10)
    grown = seq(7, 2000) + seq(2, 3000)
    eng.request(grown)
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE)
    assert _evict_alone(ctl, Tier.HOST, SWA) > 0  # windows out of L2 alone: written back
    evict_all(ctl, Tier.HOST)
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    for s in [*seqs, grown, seq(7, 2000)]:
        n = len(s) // 16
        if ctl.match("e1", MatchRequest("", s)).storage_tokens:
            prefetch_back(ctl, s)
        checked = eng.checked
        m = eng.request(s)  # verifies every device and loaded page
        assert m.device_tokens + m.host_tokens == n * 4, (n, m[:3])
        assert eng.checked > checked


# ---------------------------------------------------------------- suspicion 3


def test_tokens_ready_never_decreases_and_a_cancel_leaks_no_page(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FULL-only, batches of 2 pages with their copies to L1: tokens_ready polled while
    the op runs, then cancelled mid-way; it never decreases, cancel_prefetch returns the
    last value, what it reported is reusable byte for byte, and the fixture's audit finds
    every L1/L2 page owned."""
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    tokens = seq(12)
    eng.request_then_only_in_l3(tokens)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    gate, third = hold_nth_read(ctl, monkeypatch, 3)  # the third batch's read waits for the cancel
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id
    seen = [ctl.prefetch_status(m.prefetch_id).tokens_ready]
    while not third.is_set():
        assert third.wait(0.002) or len(seen) < 5000
        seen.append(ctl.prefetch_status(m.prefetch_id).tokens_ready)
    ready = ctl.cancel_prefetch(m.prefetch_id)
    seen.append(ready)
    gate.set()
    assert ctl.prefetcher.worker.drain(10) and ctl.prefetcher.l1_worker.drain(10)
    info = ctl.prefetch_status(m.prefetch_id)
    seen.append(info.tokens_ready)
    assert info.state is PrefetchState.CANCELLED and info.tokens_ready == ready == 16
    assert seen == sorted(seen)
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", tokens, lock=True))
    try:
        assert again.device_tokens + again.host_tokens >= ready
        *_, last = ctl.load("e1", again.lock_id)
        eng.verify(last.device_pages, tokens, last.device_tokens // 4)
    finally:
        ctl.release("e1", again.lock_id, None)
    assert ctl.stats().counters["prefetches_running"] == 0


def test_finished_prefetches_are_kept_per_tenant(make) -> None:
    """With `server.tokens`, each tenant keeps its own `keep_finished` records: one
    tenant's prefetches never push another's out (its `PrefetchStatus` would be
    NOT_FOUND early); a tenant's own oldest finished records go first."""
    from hicache.auth import tenant_of
    from hicache.errors import NotFound

    ctl = make(server__tokens=[{"token": "a" * 16, "namespaces": ["*"]},
                               {"token": "b" * 16, "namespaces": ["*"]}])
    prefetcher = ctl.prefetcher
    prefetcher._keep = 2

    def finished(owner: str) -> int:
        op = pf.PrefetchOp(op_id=prefetcher._new_id(), namespace="", tokens=b"", start_page=0,
                           hashes=[], host={}, deadline=None, owner=owner)
        op.state, op.finished = PrefetchState.DONE, True
        with ctl._mu:
            prefetcher._ops[op.op_id] = op
            prefetcher._forget_finished(tenant_of(owner), op.op_id)
        return op.op_id

    theirs = finished("token#1/e")
    mine = [finished("token#0/e") for _ in range(5)]
    assert ctl.prefetch_status(theirs, "token#1/e").state is PrefetchState.DONE
    for gone in mine[:3]:
        with pytest.raises(NotFound):
            ctl.prefetch_status(gone, "token#0/e")
    assert all(ctl.prefetch_status(kept, "token#0/e").state is PrefetchState.DONE
               for kept in mine[3:])
