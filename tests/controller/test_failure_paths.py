"""Requests that fail half-way leave nothing held: no lock the engine never learned of,
no page taken for one component when the next could not be, no prefetch continuing from
a node that left the tree, no copy of pages that changed owner."""

from __future__ import annotations

import pytest
from engine_sim import Engine, evict_all, seq

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest
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
    counted = {k: ctl.counters[k] for k in ("lookups", "hit_tokens_device", "hit_tokens_host")}
    for _ in range(3):
        with pytest.raises(ResourceExhausted, match="the pool has 16"):
            ctl.match("e1", MatchRequest("", seq(4), lock=True, allocate_tokens=4 * 100))
    assert held(ctl) == before
    assert ctl.heartbeat("e1").locks == 0
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 4  # nothing was evicted trying
    # Not answered, not counted (each used to add a lookup and 16 hit tokens).
    assert {k: ctl.counters[k] for k in counted} == counted


def test_an_allocation_without_room_says_what_holds_the_pool(make) -> None:
    """An operator reading a ResourceExhausted tells a leak (pages held by allocations)
    from a busy cache (locked pages): the message counts each."""
    ctl = make(l1_tokens=64)  # 16 L1 pages
    eng = Engine(ctl)
    eng.request(seq(4))
    assert ctl.transfers.drain(10)
    lock = ctl.match("e1", MatchRequest("", seq(4), lock=True)).lock_id  # 4 cached, locked
    ctl.allocate("e1", AllocateRequest("", 4 * 10))  # 10 held by an allocation
    with pytest.raises(ResourceExhausted) as e:
        ctl.allocate("e1", AllocateRequest("", 4 * 3))
    assert ("3 pages needed, 2 of 16 free: 4 cached and locked, 0 cached and unlocked"
            in str(e.value)), e.value
    assert "10 held by engine allocations and loads" in str(e.value)
    ctl.release("e1", lock, None)


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
    assert ctl.tree.resident_pages(Tier.STORAGE, MAMBA) == 0
    ctl.flush(10)  # (its FULL pages are in L3 already: only the new checkpoint is written)
    assert ctl.tree.resident_pages(Tier.STORAGE, MAMBA) == 1
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
    ctl.transfers._queued_l2[-1] = None  # ... and a copy in flight that could make room
    try:
        ctl.match("e1", MatchRequest("", seq(4)))  # the threshold: a backup now
        assert ctl.transfers.stats["allocation_waits"] == 0
        assert ctl.transfers.stats["backups_l2_skipped"] >= 1
    finally:
        del ctl.transfers._queued_l2[-1]
        host.free(filler)


class CopyFails(RuntimeError):
    pass


def _failing(*_args, **_kwargs):  # type: ignore[no-untyped-def]
    raise CopyFails("simulated copy engine error")


def test_a_failed_selective_backup_fails_no_match_and_leaks_no_l2_page(make, monkeypatch) -> None:
    """The copy engine failing during a match's selective write-through used to fail the
    match with the path's tree lock taken and never registered (no Release could reach
    it) and its L2 pages reserved by nobody. Now the backup is dropped and counted."""
    ctl = make(storage__backend="none", write__l1_to_l2="write_through_selective",
               write__selective_threshold=2)
    eng = Engine(ctl)
    eng.request(seq(4))
    ctl.match("e1", MatchRequest("", seq(4)))  # one hit below the threshold
    monkeypatch.setattr(ctl.transfers.copier, "device_to_host", _failing)
    m = ctl.match("e1", MatchRequest("", seq(4), lock=True))  # the threshold: a backup
    assert m.device_tokens == 16 and ctl.transfers.stats["backups_l2_failed"] == 1
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    ctl.release("e1", m.lock_id, None)
    assert ctl.tree.active_locks == 0
    ctl.check_integrity()
    monkeypatch.undo()
    ctl.match("e1", MatchRequest("", seq(4)))  # the next hit backs it up
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 4
    ctl.check_integrity()


def test_a_failed_write_back_copy_still_evicts_and_leaks_no_l2_page(make, monkeypatch) -> None:
    ctl = make(storage__backend="none", write__l1_to_l2="write_back")
    eng = Engine(ctl)
    eng.request(seq(4))
    monkeypatch.setattr(ctl.transfers.copier, "device_to_host", _failing)
    evict_all(ctl, Tier.DEVICE)
    assert ctl.transfers.stats["backups_l2_failed"] >= 1
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 0
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    ctl.check_integrity()


def test_a_failed_checkpoint_copy_leaves_no_page_of_the_allocation(make, monkeypatch) -> None:
    """A hybrid match continuing a checkpoint copies it into the new allocation's slot
    (copy-on-write); that copy failing used to leave the allocation's pages and slot
    owned by nobody. The keep_lock Insert's copy of the checkpoint (the tree's) likewise:
    taken before the commit, its failure commits nothing and the copy's slot is freed."""
    ctl = make(hybrid=True, storage__backend="none")
    ctl.attach("e1", 0, 1)
    prompt = seq(4)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=16))
    ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   mamba_checkpoint=True))
    before = held(ctl)
    monkeypatch.setattr(ctl.transfers.copier, "copy_within_device", _failing)
    with pytest.raises(CopyFails):
        ctl.match("e1", MatchRequest("", prompt + seq(2, 1000), lock=True, allocate_tokens=24))
    assert held(ctl) == before and ctl.heartbeat("e1").allocations == 0
    ctl.check_integrity()
    monkeypatch.undo()
    longer = prompt + seq(2, 2000)
    m = ctl.match("e1", MatchRequest("", longer, lock=True, allocate_tokens=32))
    monkeypatch.setattr(ctl.transfers.copier, "copy_within_device", _failing)
    with pytest.raises(CopyFails):
        ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                       mamba_checkpoint=True, keep_lock=True))
    monkeypatch.undo()
    ctl.check_integrity()  # the copy's slot was freed
    assert ctl.match("e1", MatchRequest("", longer)).device_tokens == 16  # nothing committed
    ctl.release("e1", m.lock_id, None)
    ctl.release("e1", None, m.allocation_id)
    ctl.check_integrity()


def test_a_start_that_fails_after_the_copy_engine_closes_it_and_the_pools(tmp_path, monkeypatch) -> None:
    """A required L3 that cannot be reached fails the start after the copy engine was
    built: it is closed with the pools (it was left holding views and helper threads)."""
    import time

    from engine_sim import tiny_config

    from hicache.controller import controller as controller_mod
    from hicache.errors import BackendUnavailable
    from hicache.tiers.device import SHM_DIR

    closed: list[object] = []
    real = controller_mod.build_copy_engine

    def spied(device, host):  # type: ignore[no-untyped-def]
        engine = real(device, host)
        close = engine.close
        monkeypatch.setattr(engine, "close", lambda: (closed.append(engine), close()))
        return engine

    def unreachable(cfg, host):  # type: ignore[no-untyped-def]
        raise BackendUnavailable("simulated: the store is down")

    monkeypatch.setattr(controller_mod, "build_copy_engine", spied)
    monkeypatch.setattr(controller_mod, "open_l3", unreachable)
    cfg = tiny_config(tmp_path, storage__required=True)
    instance = f"failstart{int(time.time() * 1000) % 100000}"
    with pytest.raises(BackendUnavailable, match="simulated"):
        controller_mod.build_controller(cfg, instance)
    assert len(closed) == 1
    assert not list(SHM_DIR.glob(f"hicache-{instance}-*"))  # the pools went too
