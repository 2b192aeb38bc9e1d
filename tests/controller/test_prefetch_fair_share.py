"""The prefetch budget between engines: one engine's stream of prefetches kept every
other's from starting (it had all of the budget, taken again as each of its prefetches
ended); once another engine is refused for want of budget, they share it."""

from __future__ import annotations

import pytest
from engine_sim import Engine, evict_all, flushed, hold_nth_read, seq, wait_prefetch

import hicache.controller.prefetch as pf
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.types import Tier

THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


def _prefetch(ctl, engine: str, tokens: bytes):  # type: ignore[no-untyped-def]
    return ctl.match(engine, MatchRequest("", tokens, lock=True, prefetch=True))


def test_an_engine_refused_for_budget_gets_its_share(make, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = make(tiers__l2__prefetch_fraction=0.05, **THROUGH)
    budget = ctl.prefetcher.budget_left()
    per = budget // 2  # pages a prompt: two prefetches fill the budget
    assert per >= 1
    heavy = [seq(per, base=1000 * (k + 1)) for k in range(4)]
    good = seq(per, base=9000)
    eng = Engine(ctl)
    ctl.attach("heavy", 0, 1)
    ctl.attach("good", 0, 1)
    for p in (*heavy, good):
        eng.request(p)
        flushed(ctl, p)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    refused = ctl.counters["prefetch_refused_budget"]

    gate, reached = hold_nth_read(ctl, monkeypatch, 1)  # (one worker: the second op waits too)
    h0, h1 = _prefetch(ctl, "heavy", heavy[0]), _prefetch(ctl, "heavy", heavy[1])
    assert h0.prefetch_id and h1.prefetch_id and reached.wait(5)
    g0 = _prefetch(ctl, "good", good)
    assert g0.prefetch_id == 0  # the budget is full: refused, and noted
    assert ctl.counters["prefetch_refused_budget"] == refused + 1
    gate.set()
    for m in (h0, h1):
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    for engine, m in (("heavy", h0), ("heavy", h1), ("good", g0)):
        ctl.release(engine, m.lock_id, None)

    # While "good" waits, "heavy" may hold half: its second prefetch is refused, and
    # "good"'s next one starts (before, heavy took the whole budget again).
    gate, reached = hold_nth_read(ctl, monkeypatch, 1)
    h2 = _prefetch(ctl, "heavy", heavy[2])
    h3 = _prefetch(ctl, "heavy", heavy[3])
    g1 = _prefetch(ctl, "good", good)
    assert h2.prefetch_id and h3.prefetch_id == 0 and g1.prefetch_id
    gate.set()
    for m in (h2, g1):
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    for engine, m in (("heavy", h2), ("heavy", h3), ("good", g1)):
        ctl.release(engine, m.lock_id, None)


def test_alone_or_once_the_window_passed_an_engine_has_all_of_it(
        make, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = make(tiers__l2__prefetch_fraction=0.05, **THROUGH)
    p = ctl.prefetcher
    budget = p.budget_left()
    assert p.budget_left("heavy") == budget  # no one waits
    with ctl._mu:
        p._note_refused("heavy")
    assert p.budget_left("heavy") == budget  # (its own refusal shares nothing)
    with ctl._mu:
        p._note_refused("good")
    assert p.budget_left("heavy") == budget // 2
    assert p.budget_left("good") == budget // 2  # (heavy holds nothing now)
    monkeypatch.setattr(pf, "FAIR_SHARE_WINDOW_S", 0.0)
    assert p.budget_left("heavy") == budget
