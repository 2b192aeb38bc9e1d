"""Mutation review (session 31, second round) of the controller's core paths: match
(counters, the prefetch threshold), allocations (rounding, growth order, where one made
for a lock starts), inserts and releases."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from engine_sim import Engine, in_l2_only, seq, tree_l1_pages, wait_prefetch

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest, PrefetchState
from hicache.errors import InvalidArgument
from hicache.types import ComponentKind

FULL = ComponentKind.FULL
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


def _full_member(ctl) -> str:  # type: ignore[no-untyped-def]
    return ctl.cfg.model.family(FULL)[0].name


def test_a_prefetch_of_exactly_the_threshold_starts(make) -> None:
    """`prefetch.threshold_tokens` is the least L3 hit worth a prefetch: a match whose
    L3 part is exactly that many tokens starts one (and it brings the page back)."""
    # Mutant: match `storage_tokens > threshold_tokens` (not >=).
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    tokens = seq(1)  # one page: 4 tokens, the tiny config's threshold
    eng.request_then_only_in_l3(tokens)
    assert ctl.cfg.prefetch.threshold_tokens == 4
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.storage_tokens == 4
    assert m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)


def test_hit_counters_count_each_tier_of_a_match(make) -> None:
    """`hit_tokens_device` and `hit_tokens_host` count what each match found in L1 and
    in L2 (an operator's hit-rate dashboard reads them per tier)."""
    # Mutant: match counting `m.device_tokens` into hit_tokens_host.
    ctl = make(write__l1_to_l2="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    in_l2_only(ctl, eng, tokens)
    before = dict(ctl.stats().counters)
    m = ctl.match("e1", MatchRequest("", tokens + seq(1, base=900)))
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    after = ctl.stats().counters
    assert after["hit_tokens_host"] - before["hit_tokens_host"] == 16
    assert after["hit_tokens_device"] - before["hit_tokens_device"] == 0
    assert after["lookups"] - before["lookups"] == 1


def test_an_allocation_rounds_a_partial_page_up(make) -> None:
    """An Allocate of 5 tokens on 4-token pages gets 2 pages of every paged member: the
    fifth token needs a page of its own."""
    # Mutant: _new_allocation `n = tokens // page_size` (rounded down).
    ctl = make()
    Engine(ctl)
    info = ctl.allocate("e1", AllocateRequest("", 5))
    for member in ctl.cfg.model.members:
        assert len(info.pages[member.name]) == 2, member.name
    ctl.release("e1", None, info.allocation_id)


def test_growing_an_allocation_appends_the_new_pages_after_the_old_ones(make) -> None:
    """Decode growth hands back every page of the allocation in token order: the pages
    the engine already wrote keep their positions, the new ones follow (the engine's
    block table is this list)."""
    # Mutant: allocate growth `np.concatenate([ids, record.pages[kind]])`.
    ctl = make()
    Engine(ctl)
    first = ctl.allocate("e1", AllocateRequest("", 8))
    name = _full_member(ctl)
    old = first.pages[name].copy()
    grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=first.allocation_id))
    assert grown.allocation_id == first.allocation_id
    assert len(grown.pages[name]) == 4
    assert np.array_equal(grown.pages[name][:2], old)
    assert not set(grown.pages[name][2:].tolist()) & set(old.tolist())
    ctl.release("e1", None, first.allocation_id)


def _whole_prompt_allocated_on_an_l2_prefix(ctl, eng: Engine):  # type: ignore[no-untyped-def]
    """4 pages only L2 holds, a locked match of them plus 2 new pages, and an Allocate for
    the whole prompt naming that lock: (the prompt, the match, the allocation)."""
    prefix = seq(4)
    in_l2_only(ctl, eng, prefix)
    prompt = prefix + seq(2, base=700)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True))
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    info = ctl.allocate("e1", AllocateRequest("", len(prompt) // 4, lock_id=m.lock_id))
    return prompt, m, info


def test_an_allocation_for_a_lock_with_an_l2_part_starts_at_its_device_boundary(make) -> None:
    """An Allocate naming a lock whose prefix is in L2 (not loaded) starts at the lock's
    L1 boundary: an engine that recomputes instead of loading inserts every page from
    that allocation, and the insert is accepted with the bytes where it wrote them."""
    # Mutant: allocate's start() `depth_tokens(lock.end)` (the host boundary).
    ctl = make(write__l1_to_l2="write_through")
    eng = Engine(ctl)
    prompt, m, info = _whole_prompt_allocated_on_an_l2_prefix(ctl, eng)
    assert len(info.pages[_full_member(ctl)]) == 6
    eng.write(info.pages, prompt, 0)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id,
                                          allocation_id=info.allocation_id))
    assert out.inserted_tokens + out.reused_tokens == 24
    eng.assert_cached(prompt)


def test_pages_an_allocation_holds_count_as_locked_in_l1_only(make) -> None:
    """Stats count an allocation's pages as locked in L1 (they are not evictable there);
    L2's locked pages are the tree's own locks only (an allocation holds nothing in L2)."""
    # Mutant: stats adding held and loading pages to every tier's locked_pages.
    ctl = make()
    Engine(ctl)
    info = ctl.allocate("e1", AllocateRequest("", 12))
    name = _full_member(ctl)
    usage = {(p.tier, p.member): p for p in ctl.stats().pools}
    assert usage[("device", name)].locked_pages == 3
    assert usage[("device", name)].used_pages == 3
    assert usage[("host", name)].locked_pages == 0
    ctl.release("e1", None, info.allocation_id)
    usage = {(p.tier, p.member): p for p in ctl.stats().pools}
    assert usage[("device", name)].locked_pages == 0


def test_closing_a_session_with_an_empty_id_is_invalid(make) -> None:
    """CloseSession with an empty session id is the caller's error (InvalidArgument), not
    an unknown session (NotFound): no request can open a session without an id."""
    # Mutant: controller.close_session without its empty-id check.
    ctl = make()
    with pytest.raises(InvalidArgument, match="session_id"):
        ctl.close_session("")


def test_a_request_of_exactly_the_token_limit_is_served(make) -> None:
    """`server.max_tokens_per_request` is the most tokens one request may name: a Match
    of exactly that many is served, one page more is refused."""
    # Mutant: _check_tokens `len(tokens) // 4 >= limit`.
    ctl = make(server__max_tokens_per_request=64)
    Engine(ctl)
    assert ctl.match("e1", MatchRequest("", seq(16))).device_tokens == 0
    with pytest.raises(InvalidArgument, match="max_tokens_per_request"):
        ctl.match("e1", MatchRequest("", seq(17)))


def test_an_insert_after_a_load_frees_the_allocation_pages_the_load_stood_in_for(make) -> None:
    """A request allocates for its whole prompt (Allocate naming its lock), then Loads
    the L2 part instead of recomputing it: its insert commits only the pages after the
    loaded part and frees the allocation's first pages (loaded instead). The bytes are
    right, and no L1 page is left held by nobody or owned twice."""
    # Mutant: _consume_allocation `lo = 0` (pages before the insert's start kept).
    ctl = make(write__l1_to_l2="write_through")
    eng = Engine(ctl)
    prompt, m, info = _whole_prompt_allocated_on_an_l2_prefix(ctl, eng)
    *_, last = list(ctl.load("e1", m.lock_id))
    assert last.device_tokens == 16
    eng.write({name: ids[4:] for name, ids in info.pages.items()}, prompt, 4)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id,
                                          allocation_id=info.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 16)
    eng.assert_cached(prompt)
    # Every free L1 page handed to a new request: none is a page the tree serves, and
    # that request writing them all leaves the cached prompt intact.
    name = _full_member(ctl)
    free = ctl.device.allocator(FULL).free_count
    other = ctl.allocate("e1", AllocateRequest("", free * 4))
    assert not set(other.pages[name].tolist()) & tree_l1_pages(ctl)
    eng.write(other.pages, seq(free, base=5000), 0)
    eng.assert_cached(prompt)
    ctl.release("e1", None, other.allocation_id)
    with ctl._mu:
        assert ctl.device.allocator(FULL).free_count == free  # nothing leaked either


def test_pages_an_allocation_keeps_retired_count_toward_its_growth_limit(make) -> None:
    """An allocation holds at most one request's tokens of pages: pages it keeps retired
    (its copies of a prefix another request committed first, still in its block table)
    count, so growing past the limit is refused."""
    # Mutant: _check_growth not counting `record.retired`.
    ctl = make(server__max_tokens_per_request=32)  # at most 8 pages
    eng = Engine(ctl)
    prompt = seq(2)
    a = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=8))
    b = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=32))
    assert b.device_tokens == 0 and len(b.pages[_full_member(ctl)]) == 8
    eng.write(a.pages, prompt, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=a.lock_id, allocation_id=a.allocation_id))
    eng.write(b.pages, prompt, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=b.lock_id, allocation_id=b.allocation_id,
                                   keep_lock=True))  # its 2 pages retire: 6 left + 2 retired
    with pytest.raises(InvalidArgument, match="at most 8"):
        ctl.allocate("e1", AllocateRequest("", 4, allocation_id=b.allocation_id))
    ctl.release("e1", b.lock_id, b.allocation_id)


class _Clock:
    """The engine registry's clock (its `clock` parameter), moved by hand: a lease
    lapses when the test says so, not after a sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_lapsed_lease_is_counted_with_what_it_released(make) -> None:
    """`leases_expired` counts engines whose lease lapsed (an operator's alert on dead
    engines), next to the locks and allocations released with them."""
    # Mutant: expire_leases without `counters["leases_expired"] += 1`.
    ctl = make(storage__backend="none", server__lease_ms=1000)
    clock = _Clock()
    ctl._engines._clock = clock
    Engine(ctl)
    ctl.match("e1", MatchRequest("", seq(2), lock=True, allocate_tokens=8))
    clock.now += 5.0
    assert ctl.expire_leases() == 1
    counters = ctl.stats().counters
    assert (counters["leases_expired"], counters["lease_released_locks"],
            counters["lease_released_allocations"]) == (1, 1, 1)


def test_a_best_effort_prefetch_stops_when_its_engines_lease_lapses(make) -> None:
    """best_effort: a prefetch stops once its request moved on; an engine whose lease
    lapsed has moved on for good, so its prefetches are cancelled with its locks (not
    left reading L3 into L2 for a request nobody will serve)."""
    # Mutant: _release_engine without `_request_moves_on(lock_id)` for each lock.
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               prefetch__policy="best_effort", server__lease_ms=1000)
    clock = _Clock()
    ctl._engines._clock = clock
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(8))
    gate = threading.Event()
    real = ctl.l3.backend._read_into

    def held_read(keys, buffers):  # type: ignore[no-untyped-def]
        assert gate.wait(10)
        return real(keys, buffers)

    ctl.l3.backend._read_into = held_read  # type: ignore[method-assign]
    try:
        m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
        assert m.prefetch_id
        clock.now += 5.0
        assert ctl.expire_leases() == 1
    finally:
        gate.set()
    assert ctl.prefetcher.worker.drain(10)
    assert ctl.prefetch_status(m.prefetch_id).state is PrefetchState.CANCELLED
