"""A prefetch whose request's prefix is in L1 follows it there: each batch that lands in
L2 is copied on into free L1 pages (never by evicting), so the request's load has nothing
left to copy. Every page is checked byte for byte; page ownership is audited after each
test (the `make` fixture)."""

from __future__ import annotations

import threading
import time

import pytest
from engine_sim import Engine, prefetch_back, seq

import hicache.controller.prefetch as pf
from hicache.controller.base import AllocateRequest, MatchRequest, PrefetchState
from hicache.types import ComponentKind

FULL = ComponentKind.FULL


def _in_l3_only_with_copier(make, pages: int):  # type: ignore[no-untyped-def]
    """A controller writing through to L3, a request of `pages` pages now only in L3,
    and the copy engine with its real `host_to_device` (for the test to wrap)."""
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(pages)
    eng.request_then_only_in_l3(tokens)
    copier = ctl.transfers.copier
    return ctl, eng, tokens, copier, copier.host_to_device


def _hog_free_l1(ctl) -> int:
    """An allocation holding every free L1 page; returns its id."""
    free = ctl.device.allocator(FULL).free_count
    return ctl.allocate("e1", AllocateRequest("", free * ctl.cfg.model.page_size)).allocation_id


@pytest.mark.parametrize("hybrid", [False, True])
def test_batches_follow_into_free_l1_and_the_load_copies_nothing(make, monkeypatch, hybrid) -> None:
    ctl = make(hybrid=hybrid, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(7)
    eng.request_then_only_in_l3(tokens)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)  # batches 1-3 go to the L1 worker, the 4th inline
    prefetch_back(ctl, tokens)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert (m.device_tokens, m.host_tokens) == (28, 0)
    eng.verify(m.device_pages, tokens, 7)
    *_, last = ctl.load("e1", m.lock_id)  # nothing left to copy
    assert last.device_tokens == 28
    ctl.release("e1", m.lock_id, None)
    counters = ctl.stats().counters
    assert counters["prefetch_pages_to_l1"] == 7 and counters["loaded_pages"] == 0
    assert ctl.prefetcher.reserved_l1(FULL) == []


def test_without_free_l1_the_prefetch_stays_in_l2_and_the_load_brings_it(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request_then_only_in_l3(tokens)
    hog = _hog_free_l1(ctl)
    prefetch_back(ctl, tokens)
    counters = ctl.stats().counters
    assert counters["prefetch_to_l1_no_room"] == 1 and counters.get("prefetch_pages_to_l1", 0) == 0
    ctl.release("e1", None, hog)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert (m.device_tokens, m.host_tokens) == (0, 24)  # nothing was evicted for it either
    eng.request(tokens + seq(1, 999))  # loads from L2 and verifies every byte
    assert ctl.stats().counters["loaded_pages"] == 6


def test_below_a_prefix_that_only_l2_holds_the_prefetch_stays_in_l2(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(8))
    hog = _hog_free_l1(ctl)
    prefetch_back(ctl, seq(3))  # pages 0-2 come to L2 only: L1 has no room
    ctl.release("e1", None, hog)
    prefetch_back(ctl, seq(8))  # L1 has room now, but the prefix above these pages is not there
    m = ctl.match("e1", MatchRequest("", seq(8)))
    assert (m.device_tokens, m.host_tokens) == (0, 32)
    assert ctl.stats().counters.get("prefetch_pages_to_l1", 0) == 0
    eng.request(seq(8) + seq(1, 999))


def test_a_node_split_while_its_copy_to_l1_runs_lands_in_both_halves(make) -> None:
    ctl, eng, tokens, copier, real = _in_l3_only_with_copier(make, 6)
    copying, go = threading.Event(), threading.Event()

    def gated(kind, host, dev, on_layer=None):
        copying.set()
        assert go.wait(5)
        return real(kind, host, dev, on_layer=on_layer)

    copier.host_to_device = gated  # type: ignore[method-assign]
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert copying.wait(5)
    # A prompt that leaves the path after page 2 splits the 6-page node under the copy.
    ctl.match("e1", MatchRequest("", seq(2) + seq(1, 999)))
    with ctl._mu:
        assert len(ctl.tree.match("", tokens).path) == 2
    go.set()
    assert ctl.prefetcher.worker.drain(10)
    assert ctl.prefetch_status(m.prefetch_id).state is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)
    copier.host_to_device = real  # type: ignore[method-assign]
    again = ctl.match("e1", MatchRequest("", tokens))
    assert (again.device_tokens, again.host_tokens) == (24, 0)
    eng.verify(again.device_pages, tokens, 6)


def test_a_failed_copy_to_l1_frees_its_l1_pages_and_the_pages_stay_in_l2(make) -> None:
    ctl, eng, tokens, copier, real = _in_l3_only_with_copier(make, 6)

    def broken(kind, host, dev, on_layer=None):
        raise RuntimeError("copy engine fault")

    copier.host_to_device = broken  # type: ignore[method-assign]
    free = ctl.device.allocator(FULL).free_count
    prefetch_back(ctl, tokens)  # the prefetch itself succeeds
    assert ctl.device.allocator(FULL).free_count == free
    assert ctl.stats().counters["prefetch_to_l1_failed"] == 1
    copier.host_to_device = real  # type: ignore[method-assign]
    m = ctl.match("e1", MatchRequest("", tokens))
    assert (m.device_tokens, m.host_tokens) == (0, 24)
    eng.request(tokens + seq(1, 999))  # loads from L2 and verifies every byte


def test_batches_land_in_order_when_the_worker_is_slower_than_the_last_batch(make, monkeypatch) -> None:
    """The last batch is copied inline while earlier ones are still on the worker: it
    waits for them, so no node ever sits in L1 below one that is not (checked at every
    landing)."""
    ctl, eng, tokens, copier, real = _in_l3_only_with_copier(make, 7)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)

    def slow_on_the_worker(kind, host, dev, on_layer=None):
        if threading.current_thread().name == "hicache-prefetch-to-l1":
            time.sleep(0.2)
        return real(kind, host, dev, on_layer=on_layer)

    monkeypatch.setattr(copier, "host_to_device", slow_on_the_worker)
    land = ctl.loads.land_in_l1

    def audited(moves, unlanded=None):
        landed = land(moves, unlanded)
        ctl.tree.check_integrity()  # raises on an L1 node under a parent outside L1
        return landed

    monkeypatch.setattr(ctl.loads, "land_in_l1", audited)
    prefetch_back(ctl, tokens)
    assert ctl.stats().counters["prefetch_pages_to_l1"] == 7
    m = ctl.match("e1", MatchRequest("", tokens))
    assert m.device_tokens == 28
    eng.verify(m.device_pages, tokens, 7)


def test_after_a_failed_copy_later_batches_stay_in_l2(make, monkeypatch) -> None:
    """The first batch's copy to L1 fails: the later ones must not land below it (their
    L1 pages are freed); the whole prefix stays in L2 and a load brings it up."""
    ctl, eng, tokens, copier, real = _in_l3_only_with_copier(make, 7)
    monkeypatch.setattr(pf, "BATCH_PAGES", 2)
    calls = []

    def first_fails(kind, host, dev, on_layer=None):
        calls.append(len(dev))
        if len(calls) == 1:
            raise RuntimeError("injected copy failure")
        return real(kind, host, dev, on_layer=on_layer)

    monkeypatch.setattr(copier, "host_to_device", first_fails)
    prefetch_back(ctl, tokens)
    monkeypatch.setattr(copier, "host_to_device", real)
    counters = ctl.stats().counters
    assert counters["prefetch_to_l1_failed"] == 1
    assert counters.get("prefetch_pages_to_l1", 0) == 0
    ctl.check_integrity()
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert (m.device_tokens, m.host_tokens) == (0, 28)
    last = list(ctl.load("e1", m.lock_id))[-1]
    eng.verify(last.device_pages, tokens, 7)
    ctl.release("e1", m.lock_id, None)
