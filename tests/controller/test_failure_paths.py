"""Requests that fail half-way leave nothing held: no lock the engine never learned of,
no page taken for one component when the next could not be, no prefetch continuing from
a node that left the tree, no copy of pages that changed owner."""

from __future__ import annotations

import pytest
from engine_sim import Engine, evict_all, seq

from hicache.controller.base import AllocateRequest, MatchRequest
from hicache.errors import ResourceExhausted
from hicache.types import ComponentKind, Tier

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA


def held(ctl) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return (ctl._engines.lock_count, ctl.tree.active_locks,
                ctl.device.allocator(FULL).free_count)


def test_a_match_whose_allocation_fails_keeps_no_lock_and_no_page(make) -> None:
    ctl = make(l1_tokens=64)  # 16 L1 pages
    eng = Engine(ctl)
    eng.request(seq(4))
    # The request's write-through backups pin their nodes until they ran: a snapshot
    # taken while one is queued would count its lock.
    assert ctl.transfers.drain(10)
    before = held(ctl)
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="the pool has 16"):
            ctl.match("e1", MatchRequest("", seq(4), lock=True, allocate_tokens=4 * 100))
    assert held(ctl) == before
    assert ctl.heartbeat("e1").locks == 0
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 4  # nothing was evicted trying


def test_an_allocation_short_of_one_component_takes_none_of_the_others(make) -> None:
    """Hybrid model, MAMBA slots used up: the FULL/SWA pages taken before the MAMBA slot
    failed go back (they belonged to no allocation, and no lease would ever free them)."""
    ctl = make(hybrid=True, tiers__l1__mamba_slots=2)
    ctl.attach("e1", 0, 1)
    first = ctl.allocate("e1", AllocateRequest("", 8))
    second = ctl.allocate("e1", AllocateRequest("", 8))
    free = ctl.device.allocator(FULL).free_count
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="mamba"):
            ctl.allocate("e1", AllocateRequest("", 40))
        with pytest.raises(ResourceExhausted, match="mamba"):
            ctl.match("e1", MatchRequest("", seq(2, 500), lock=True, allocate_tokens=8))
    assert ctl.device.allocator(FULL).free_count == free
    assert ctl.heartbeat("e1").locks == 0
    # Growing an allocation is all or nothing too: the pages stay as they were.
    record = ctl._engines.allocation("e1", first.allocation_id)
    lengths = {kind: len(ids) for kind, ids in record.pages.items()}
    with pytest.raises(ResourceExhausted):
        ctl.allocate("e1", AllocateRequest("", 4 * 10_000, allocation_id=first.allocation_id))
    assert {kind: len(ids) for kind, ids in record.pages.items()} == lengths
    assert ctl.device.allocator(FULL).free_count == free
    for a in (first, second):
        ctl.release("e1", None, a.allocation_id)


def test_no_prefetch_continues_from_a_node_evicted_while_l3_was_asked(make) -> None:
    """Hybrid model whose MAMBA checkpoint is only in L3: the storage boundary lies past
    the lock. While the mutex is free for the L3 lookup another request empties L2 and
    the boundary node leaves the tree: the match starts no prefetch from it."""
    ctl = make(hybrid=True)
    eng = Engine(ctl)
    eng.request(seq(8))
    assert ctl.flush(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    eng.request(seq(4))
    assert ctl.flush(10)
    evict_all(ctl, Tier.DEVICE)
    with ctl._mu:  # the checkpoint leaves L2 alone; FULL and SWA stay there
        ctl.transfers._evict(Tier.HOST, MAMBA, 1)
    lookup = ctl.prefetcher.l3_run

    def l3_run_while_l2_empties(*args, **kwargs):  # type: ignore[no-untyped-def]
        evict_all(ctl, Tier.HOST)
        return lookup(*args, **kwargs)

    ctl.prefetcher.l3_run = l3_run_while_l2_empties  # type: ignore[method-assign]
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    ctl.prefetcher.l3_run = lookup  # type: ignore[method-assign]
    if m.prefetch_id:  # one that starts continues from the root or a node still in the tree
        op = ctl.prefetcher.get(m.prefetch_id)
        assert op is not None and (op.pin is None or ctl.tree.is_live(op.pin.end))
    ctl.release("e1", m.lock_id, None)
    assert ctl.transfers.drain(10)
    ctl.check_integrity()


def test_a_synchronous_backup_never_waits_for_room_in_l2(make) -> None:
    """Selective write-through copies a hot node's L1 pages during a match. Waiting for
    L2 room would release the mutex while the node (not locked) could leave L1 and its
    pages go to another request: with L2 full it skips the copy (counted) instead."""
    ctl = make(backend="none", storage__backend="none",
               write__l1_to_l2="write_through_selective", write__selective_threshold=2)
    eng = Engine(ctl)
    eng.request(seq(4))
    ctl.match("e1", MatchRequest("", seq(4)))  # one hit below the threshold
    host = ctl.host.allocator(FULL)
    filler = host.allocate(host.free_count)  # L2 full ...
    ctl.transfers._queued_l2.add(-1)  # ... and a copy in flight that could make room
    try:
        ctl.match("e1", MatchRequest("", seq(4)))  # the threshold: a backup now
        assert ctl.transfers.stats["allocation_waits"] == 0
        assert ctl.transfers.stats["backups_l2_skipped"] >= 1
    finally:
        ctl.transfers._queued_l2.discard(-1)
        host.free(filler)
