"""The controller under a content oracle: every page that comes back from any tier is
compared byte for byte; page ownership is audited after every test."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_sim import Engine, evict_all, flushed, prefetch_back, seq, wait_prefetch

from hicache.controller.base import (
    NO_PAGES,
    AllocateRequest,
    InsertRequest,
    MatchRequest,
    PrefetchState,
)
from hicache.convert import canonical_counters
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound
from hicache.types import ComponentKind, Tier

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA


@pytest.mark.parametrize("hybrid", [False, True])
def test_round_trip_l1_l2_l3_l2_l1_is_bit_exact(make, hybrid: bool) -> None:
    ctl = make(hybrid=hybrid, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request(tokens)
    assert ctl.transfers.drain(10)
    ctl.check_integrity()
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 24)
    puts = ctl.l3.backend.stats().puts
    prefetch_back(ctl, tokens)
    m2 = ctl.match("e1", MatchRequest("", tokens))
    # L1 had free pages: each batch followed the (empty) L1 prefix up from L2.
    assert (m2.device_tokens, m2.host_tokens) == (24, 0)
    assert ctl.stats().counters["prefetch_pages_to_l1"] == 6
    # What came from L3 is known to be there: write-through does not write it back.
    assert ctl.transfers.drain(10) and ctl.l3.backend.stats().puts == puts
    with ctl._mu:
        path = ctl.tree.match("", tokens).path
    assert path and all(ctl.tree.is_resident(n, FULL, Tier.STORAGE) for n in path)
    if hybrid:  # L3 gave SWA for the final window only: one node keeps it as its tail
        assert len(path) == 1 and ctl.tree.resident_pages(Tier.DEVICE, ComponentKind.SWA) == 2
    eng.request(tokens + seq(1, 999))  # verifies every byte the prefetch brought
    assert eng.checked > 0
    again = ctl.match("e1", MatchRequest("", tokens))
    assert again.device_tokens == 24
    counts, _ = canonical_counters(ctl.stats().counters)  # what the wire and metrics show
    assert counts["prefetches_done"] == 1 and counts["prefetches_running"] == 0
    assert counts["evictions_device"] >= 6 and counts["evictions_host"] >= 6


def test_one_model_id_with_another_geometry_shares_no_l3_objects(make) -> None:
    """2 layers of 8 bytes a token and 4 layers of 4 give pages of equal size: an object's
    header checks only its key and size, so with the same keys a daemon configured with
    the other geometry read the first one's pages as its own KV (wrong bytes, no miss)."""
    tokens = seq(6)
    first = make()
    Engine(first).request(tokens)
    flushed(first, tokens)
    same = make()  # the control: the same geometry, another daemon, hits
    assert same.match("e1", MatchRequest("", tokens)).storage_tokens == 24
    other = make(model__components={"full": {"layers": 4, "bytes_per_token_per_layer": 4}})
    assert other.cfg.model.members[0].bytes_per_page == first.cfg.model.members[0].bytes_per_page
    assert other.match("e1", MatchRequest("", tokens)).storage_tokens == 0


def test_pages_another_daemon_stored_count_as_present_not_as_backups(make) -> None:
    """`backups_l3` (and Flush's pages_written) are pages this daemon stored: a page the
    store had already (PRESENT) is `backups_l3_present`. It used to count both."""
    tokens = seq(6)
    first = make()
    Engine(first).request(tokens)
    flushed(first, tokens)
    assert first.stats().counters["backups_l3"] == 6
    second = make()
    Engine(second).request(tokens)  # computed again (no prefetch): the same 6 pages
    assert second.flush(10) == 0
    counters = second.stats().counters
    assert counters["backups_l3"] == 0 and counters["backups_l3_present"] == 6
    assert second.tree.resident_pages(Tier.STORAGE, FULL) == 6


def test_write_back_backs_up_only_on_eviction(make) -> None:
    ctl = make(write__l1_to_l2="write_back", storage__backend="none")
    eng = Engine(ctl)
    eng.request(seq(4))
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    evict_all(ctl, Tier.DEVICE)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 4
    m = ctl.match("e1", MatchRequest("", seq(4)))
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    eng.request(seq(4))  # load + verify


def test_write_through_selective_waits_for_hits(make) -> None:
    ctl = make(write__l1_to_l2="write_through_selective", write__selective_threshold=2,
               storage__backend="none")
    eng = Engine(ctl)
    eng.request(seq(2))
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    ctl.match("e1", MatchRequest("", seq(2)))
    ctl.match("e1", MatchRequest("", seq(2)))
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2


def gate_after_first_layer(ctl) -> threading.Event:
    """L2 -> L1 copies stop after reporting layer 0 until the returned event is set."""
    gate = threading.Event()
    copier = ctl.transfers.copier
    original = copier.host_to_device

    def gated(kind, host, dev, on_layer=None):
        def hook(layer: int) -> None:
            if on_layer is not None:
                on_layer(layer)
            if layer == 0:
                assert gate.wait(5), "layer 1 was copied before the waiter saw layer 0"
        return original(kind, host, dev, on_layer=hook)

    copier.host_to_device = gated
    return gate


def matched_in_l2_with_gated_load(make):  # type: ignore[no-untyped-def]
    """A 4-page request only in L2, matched with a lock, its loads gated after layer 0."""
    ctl = make(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    eng.request(seq(4))
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", seq(4), lock=True))
    return ctl, eng, m, gate_after_first_layer(ctl)


def test_load_reports_layers_before_the_next_is_copied(make) -> None:
    ctl, eng, m, gate = matched_in_l2_with_gated_load(make)
    seen: list[int] = []
    stream = ctl.load("e1", m.lock_id)
    first = next(stream)
    seen.append(first.layers_ready)
    gate.set()
    rest = list(stream)
    assert seen == [1] and rest[-1].layers_ready == rest[-1].layers_total == 2
    assert rest[-1].device_tokens == 16
    eng.verify(rest[-1].device_pages, seq(4), 4)
    ctl.release("e1", m.lock_id, None)


def test_only_the_final_load_message_reports_every_layer(make, monkeypatch) -> None:
    """The last layer landed, the copy not yet done: the stream used to send a message of
    all layers then, which an engine reads as the final one (it carries no pages: the
    client makes it device_pages={} and device_tokens=0). Only the final message says so."""
    ctl, eng, m, _gate = matched_in_l2_with_gated_load(make)
    _gate.set()
    real = ctl.loads.copy_to_l1
    landed, finish = threading.Event(), threading.Event()

    def copy_then_linger(moves, on_layer):  # type: ignore[no-untyped-def]
        real(moves, on_layer)  # every layer reported
        landed.set()
        assert finish.wait(10)  # ... before the copy is done

    monkeypatch.setattr(ctl.loads, "copy_to_l1", copy_then_linger)
    messages: list = []
    reader = threading.Thread(target=lambda: messages.extend(ctl.load("e1", m.lock_id)))
    reader.start()
    assert landed.wait(10)
    time.sleep(0.2)  # the stream's chance to send what it would
    finish.set()
    reader.join(10)
    *progress, final = messages
    assert all(p.layers_ready < p.layers_total and p.device_pages is None for p in progress)
    assert final.layers_ready == final.layers_total and final.device_tokens == 16
    eng.verify(final.device_pages, seq(4), 4)
    ctl.release("e1", m.lock_id, None)


def test_a_load_stream_abandoned_midway_still_lands_and_leaks_nothing(make) -> None:
    ctl, eng, m, gate = matched_in_l2_with_gated_load(make)
    stream = ctl.load("e1", m.lock_id)
    assert next(stream).layers_ready == 1
    # The engine goes away mid-stream (gRPC closes the generator); the copy into the
    # reserved L1 pages still finishes, and they land rather than leak.
    closer = threading.Thread(target=stream.close)
    closer.start()
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", seq(4)))
    assert again.device_tokens == 16
    eng.verify(again.device_pages, seq(4), 4)
    ctl.check_integrity()


@pytest.mark.parametrize(("hybrid", "left"), [(False, 8), (True, 0)])
def test_sidecar_object_missing_in_l3_is_a_miss_for_the_page(make, hybrid: bool, left: int) -> None:
    """FULL+indexer: pages 0-1 stay reusable. Hybrid: the boundary after page 2 has no
    MAMBA checkpoint (only the insert's end has one), so nothing is reusable from L3."""
    ctl = make(hybrid=hybrid, sidecar=not hybrid, write__l1_to_l2="write_through",
               write__l2_to_l3="write_through")
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(4))
    assert ctl.match("e1", MatchRequest("", seq(4))).storage_tokens == 16
    # Delete the indexer sidecar of page 2 behind the controller's back.
    hs = eng.hashes(seq(4))
    key = ctl.l3.keys("", [hs[2]], [m for m in ctl.cfg.model.members if m.name == "indexer"])[0]
    assert ctl.l3.backend.delete([key]) == 1
    ctl.l3.cache.forget([key])
    assert ctl.match("e1", MatchRequest("", seq(4))).storage_tokens == left


def test_a_prefix_inside_a_prefetched_swa_tail_becomes_reusable_after_one_recompute(make) -> None:
    """A prefetch from L3 reads SWA for the final window only: one node of 6 pages whose
    SWA slot is its last 2 pages, in L1 and L2. A request for the first 5 pages splits
    it (the head keeps 1 SWA page, less than a window) and recomputes them; its pages then
    extend the head's tail (and the shorter L2 copy is freed), so the next requests reuse
    all 5 pages (found by a review: every request recomputed them)."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(6))
    prefetch_back(ctl, seq(6))
    reused = []
    for _ in range(3):
        reused.append(eng.request(seq(5)).device_tokens)
        assert ctl.transfers.drain(10)
    assert reused == [0, 20, 20]
    assert eng.checked > 0
    with ctl._mu:  # the grown tail went down to L2 again (its shorter L2 copy was freed)
        head = ctl.tree.match("", seq(5)).path[-1]
        swa = ComponentKind.SWA
        assert len(ctl.tree.pages_of(head, swa, Tier.HOST)) == len(ctl.tree.pages_of(head, swa, Tier.DEVICE)) == 5


@pytest.mark.parametrize("split_at", [1, 3, 4, 5])
def test_an_swa_tail_survives_a_split_while_its_copy_waits_and_round_trips_bit_exact(
    make, split_at: int
) -> None:
    """A 6-page node whose SWA slot is its last 2 pages (the window): its L1->L2 copy is
    held while a match splits the node, then lands on the parts that now hold those
    pages; L2 -> L1 load, L3 write, prefetch from L3 and every byte check out."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(6)
    eng.insert_with_swa_tail(tokens, 2, hold_copies=True)
    with ctl._mu:
        ctl.tree.match("", tokens[: split_at * 16])  # splits the node while its copy waits
        ctl.transfers.release_flushes()
    assert ctl.transfers.drain(10)
    ctl.check_integrity()
    assert ctl.tree.resident_pages(Tier.HOST, ComponentKind.SWA) == 2
    evict_all(ctl, Tier.DEVICE)
    assert ctl.match("e1", MatchRequest("", tokens)).host_tokens == 24
    eng.request_then_only_in_l3(tokens + seq(1, 999))  # loads the 6 pages from L2, verified
    m = prefetch_back(ctl, tokens)
    assert m.storage_tokens == 24  # the tail's objects were written under its own pages' keys
    checked = eng.checked
    eng.request(tokens + seq(1, 999))
    assert eng.checked > checked


@pytest.mark.parametrize("copy_lands_first", [False, True])
def test_an_l3_write_of_an_swa_tail_grown_meanwhile_records_no_whole_l3_copy(make, copy_lands_first: bool) -> None:
    """The L3 write of a node's 2-page SWA tail is under way when a longer tail replaces
    it (and its L2 copy): the write covered 2 pages, so the tree must not record the
    (now whole) slot as in L3. The grown slot is written next, whichever lands first: its
    L2 copy (which then finds no L3 write queued) or the 2-page write (which offers the
    slot L2 replaced meanwhile; a CI run once saw that order, which wrote nothing more)."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    backend = ctl.l3.backend
    real, gate, writing = backend._write_from, threading.Event(), threading.Event()
    second, writing_second = threading.Event(), threading.Event()
    objects = ctl.l3.keys("", eng.hashes(tokens), ctl.cfg.model.family(ComponentKind.SWA))

    def slow(keys, buffers):
        if objects[0] in keys:  # (the grown slot's write: the tail's has pages 2-3 only)
            writing_second.set()
            assert second.wait(10)
        else:
            writing.set()
            assert gate.wait(10)
        return real(keys, buffers)

    backend._write_from = slow  # type: ignore[method-assign]
    node = eng.insert_with_swa_tail(tokens, 2)
    assert writing.wait(10)  # the L1->L2 copy landed; the L3 write now waits
    with ctl._mu:
        ids = ctl.transfers.allocate_l1(ComponentKind.SWA, 4)
        r = ctl.tree.insert("", tokens, {FULL: ctl.tree.pages_of(node, FULL, Tier.DEVICE), ComponentKind.SWA: ids})
        assert r.released[ComponentKind.SWA].size == 2  # the tail's own 2 pages stay
        for kind, gone in r.dropped.items():
            ctl.transfers.free_l2(kind, gone)  # held by the L3 write: parked until it ends
        ctl.transfers.refill_host(node)  # the grown slot goes to L2 again (as Insert does)
        for kind, back in r.released.items():
            ctl.transfers.free_l1(kind, back)
        if copy_lands_first:
            ctl.transfers._schedule_l2_flush(urgent=True)
    deadline = time.monotonic() + 10
    while copy_lands_first and ctl.tree.pages_of(node, ComponentKind.SWA, Tier.HOST) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    assert writing_second.wait(10)  # (the first write landed and was recorded)
    swa_family = len(ctl.cfg.model.family(ComponentKind.SWA))
    with ctl._mu:
        assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
        # L3 holds the SWA objects of the 2 pages written; the whole slot is not recorded.
        assert backend.exists_prefix(objects[::-1]) == 2 * swa_family
        assert not ctl.tree.is_resident(node, ComponentKind.SWA, Tier.STORAGE)
        ctl.check_integrity()
    second.set()
    assert ctl.transfers.drain(10)
    assert len(ctl.tree.pages_of(node, ComponentKind.SWA, Tier.HOST)) == 4
    assert backend.exists_prefix(objects[::-1]) == 4 * swa_family
    assert ctl.tree.is_resident(node, ComponentKind.SWA, Tier.STORAGE)
    ctl.check_integrity()


@pytest.mark.parametrize("shorter", [False, True])
def test_a_tail_whose_l1_to_l2_copy_waits_does_not_grow(make, shorter: bool) -> None:
    """A node's 2-page SWA tail waits (pinned) for its L1->L2 copy when another request
    inserts the same pages with all SWA pages present (or, `shorter`, a request for the
    first 5 pages splits it and recomputes them). The tail must not grow meanwhile: the
    copy would land 2 pages on a longer slot (found by a review: the flush worker failed
    half-way and left pins and L2 pages behind)."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(6)
    if shorter:
        eng.insert_with_swa_tail(tokens, 2, hold_copies=True)
        eng.request(seq(5))
    else:
        mb = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=24))
        eng.write(mb.pages, tokens, 0)
        eng.insert_with_swa_tail(tokens, 2, hold_copies=True)
        ctl.insert("e1", InsertRequest("", tokens, lock_id=mb.lock_id, allocation_id=mb.allocation_id,
                                       mamba_checkpoint=True))
    with ctl._mu:
        ctl.transfers.release_flushes()
    assert ctl.transfers.drain(10)
    assert ctl.transfers.copy_worker.failures == 0 and not ctl.transfers.stats["l2_landings_refused"]
    assert ctl.tree.active_locks == 0 and not ctl.transfers._queued_l2
    ctl.check_integrity()


def test_an_l1_to_l2_landing_the_tree_refuses_leaves_the_rest_of_the_batch_landed(make) -> None:
    """Should the tree refuse one slot of a flush (a bug), that slot's L2 pages are freed
    and counted, and the batch's other slots land and its pins are released."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_back")
    eng = Engine(ctl)
    real = ctl.tree.set_resident

    def refuse_swa(node, kind, tier, pages=None):
        if kind is ComponentKind.SWA and tier is Tier.HOST:
            raise InvalidArgument("refused for the test")
        return real(node, kind, tier, pages)

    ctl.tree.set_resident = refuse_swa  # type: ignore[method-assign]
    eng.request(seq(3))
    eng.request(seq(3) + seq(2, 100))
    assert ctl.transfers.drain(10)
    ctl.tree.set_resident = real  # type: ignore[method-assign]
    assert ctl.transfers.stats["l2_landings_refused"] >= 2
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 5  # FULL landed
    assert ctl.tree.resident_pages(Tier.HOST, ComponentKind.SWA) == 0
    assert ctl.tree.active_locks == 0 and not ctl.transfers._queued_l2
    ctl.check_integrity()


def test_a_load_that_leaves_a_window_behind_fails_instead_of_reporting_the_boundary(make) -> None:
    """Should a load land FULL but not the SWA window the matched boundary needs (a race
    the tree's rules exclude, simulated here), the load fails and reports nothing: an
    engine told the boundary is in L1 would compute with SWA KV that is not there."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request(tokens)
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert m.host_tokens == 16
    real = ctl.loads.land_in_l1

    def without_swa(moves, unlanded=None):
        for _, kind, _, dev in moves:
            if kind is ComponentKind.SWA:
                (unlanded or ctl.transfers.free_l1)(kind, dev)
        return real([move for move in moves if move[1] is not ComponentKind.SWA], unlanded)

    ctl.loads.land_in_l1 = without_swa  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="match again"):
        list(ctl.load("e1", m.lock_id))
    ctl.loads.land_in_l1 = real  # type: ignore[method-assign]
    ctl.release("e1", m.lock_id, None)
    assert ctl.match("e1", MatchRequest("", tokens)).device_tokens == 0  # never claimed
    ctl.check_integrity()


def test_a_prefetch_commit_leaves_an_swa_tail_a_load_is_copying_alone(make) -> None:
    """FULL+SWA. Node X (6 pages, SWA tail of 2) is only in L2. R1 matches all of X and
    loads it; while R1's copy runs outside the mutex, R2 (the first 5 pages: the split
    head keeps 1 SWA page, less than a window) prefetches those pages from L3 and commits
    them into L2. The head is locked by R1's load, so its L2 tail must not change under
    the copy (found by a review: it grew, the load freed the window it had copied and
    still reported the boundary)."""
    ctl = make(swa_only=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request_then_only_in_l3(tokens)
    prefetch_back(ctl, tokens)
    evict_all(ctl, Tier.DEVICE)  # X: 6 pages in L2, its SWA slot the last 2
    m1 = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert m1.host_tokens == 24
    copying, committed = threading.Event(), threading.Event()
    real_copy = ctl.transfers.copier.host_to_device

    def held_copy(kind, host, dev, on_layer=None):
        if threading.current_thread().name.startswith("hicache-load"):
            copying.set()
            assert committed.wait(10)
        return real_copy(kind, host, dev, on_layer=on_layer)

    ctl.transfers.copier.host_to_device = held_copy  # type: ignore[method-assign]
    out: list = []
    load = threading.Thread(target=lambda: out.extend(ctl.load("e1", m1.lock_id)))
    load.start()
    assert copying.wait(10)  # R1's L1 pages are reserved; its copy waits
    with ctl._mu:  # no free L1 left: R2's prefetch cannot follow into L1 and hide the race
        fill = ctl.transfers._allocators[Tier.DEVICE][FULL]
        taken = fill.allocate(fill.free_count)
    m2 = ctl.match("e1", MatchRequest("", seq(5), lock=True, prefetch=True))
    assert wait_prefetch(ctl, m2.prefetch_id) is PrefetchState.DONE
    committed.set()
    load.join(10)
    ctl.transfers.copier.host_to_device = real_copy  # type: ignore[method-assign]
    with ctl._mu:
        ctl.transfers.free_l1(FULL, taken)
    swa = ctl.cfg.model.family(ComponentKind.SWA)[0].name
    assert out and out[-1].device_tokens == 24
    assert (out[-1].device_pages[swa][-2:] >= 0).all()  # the window before the boundary
    ctl.release("e1", m2.lock_id, None)
    ctl.release("e1", m1.lock_id, None)
    eng.request(tokens + seq(1, 999))  # verifies every reused byte
    ctl.check_integrity()


def test_a_corrupt_l3_object_heals_once_the_page_is_computed_again(make) -> None:
    """The read that finds page 2's object corrupt ends the prefetch there and removes the
    object; the engine recomputes pages 2-3, write-through stores page 2 again, and the
    whole prefix comes back from L3 next time, bit exact."""
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request_then_only_in_l3(tokens)
    key = ctl.l3.keys("", [eng.hashes(tokens)[2]], ctl.cfg.model.family(FULL))[0]
    with open(ctl.l3.backend.path_of(key), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))

    m = prefetch_back(ctl, tokens, PrefetchState.FAILED)  # ended short
    assert m.storage_tokens == 16  # presence is not content
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 8
    (l3,) = ctl.stats().l3
    assert (l3.corrupt, l3.corrupt_removed) == (1, 1)
    assert ctl.l3.backend.exists_prefix([key]) == 0

    eng.request_then_only_in_l3(tokens)  # pages 0-1 from L1 (verified), 2-3 recomputed
    assert prefetch_back(ctl, tokens).storage_tokens == 16
    checked = eng.checked
    eng.request(tokens)
    assert eng.checked > checked and ctl.match("e1", MatchRequest("", tokens)).device_tokens == 16


def test_prefetch_timeout_returns_a_prefix_and_late_pages_still_land(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               prefetch__policy="timeout", prefetch__timeout_base_s=1.0,
               prefetch__timeout_per_ki_token_s=0.0, prefetch__timeout_max_s=1.0)
    eng = Engine(ctl)
    tokens = seq(40)
    eng.request_then_only_in_l3(tokens)
    backend = ctl.l3.backend
    real = backend._read_into
    reads: list[int] = []
    late = threading.Event()  # the second batch's read returns only once it is set

    def slow(keys, buffers):
        reads.append(len(keys))
        if len(reads) > 1:  # a slow store: the second batch ends past the deadline
            late.wait(30)
        return real(keys, buffers)

    backend._read_into = slow  # type: ignore[method-assign]
    import hicache.controller.prefetch as pf

    pf.BATCH_PAGES = 16
    try:
        m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
        deadline = time.monotonic() + 20
        while (ctl.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING
               and time.monotonic() < deadline):
            time.sleep(0.01)
        info = ctl.prefetch_status(m.prefetch_id)
        assert info.state is PrefetchState.TIMED_OUT
        # One batch of 16 pages by the deadline; the op covers 32 pages, the prefetch
        # share of L2 (0.25 x 128 pages).
        assert info.tokens_ready == 64 and info.tokens_total == 128
        late.set()
        assert ctl.prefetcher.worker.drain(10)
        assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 64  # frozen at the deadline
        ctl.release("e1", m.lock_id, None)
        later = ctl.match("e1", MatchRequest("", tokens))
        # Late pages were inserted for later requests (and followed into free L1).
        assert later.device_tokens == 128
    finally:
        late.set()
        pf.BATCH_PAGES = 256


def test_cancel_returns_what_arrived_and_frees_the_rest(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               prefetch__policy="best_effort")
    eng = Engine(ctl)
    eng.request_then_only_in_l3(seq(8))
    gate = threading.Event()
    real = ctl.l3.backend._read_into
    ctl.l3.backend._read_into = lambda k, b: (gate.wait(5), real(k, b))[1]  # type: ignore[method-assign]
    m = ctl.match("e1", MatchRequest("", seq(8), lock=True, prefetch=True))
    ctl.release("e1", m.lock_id, None)  # best_effort: the request moved on, the prefetch stops
    gate.set()
    assert ctl.prefetcher.worker.drain(10)
    assert ctl.prefetch_status(m.prefetch_id).state is PrefetchState.CANCELLED
    ready = ctl.cancel_prefetch(m.prefetch_id)  # cancelling again: what arrived, unchanged
    assert ready == ctl.prefetch_status(m.prefetch_id).tokens_ready
    assert ctl.prefetcher._reserved_pages == 0  # the rest of the reservation went back
    assert ctl.tree.resident_pages(Tier.HOST, FULL) * 4 >= ready  # what arrived stays in L2
    counts, _ = canonical_counters(ctl.stats().counters)
    assert (counts["prefetches_cancelled"], counts["prefetches_done"], counts["prefetches_running"]) == (1, 0, 0)


def test_a_match_that_allocates_nothing_returns_the_shared_empty_pages(make) -> None:
    """No fresh mapping per request: the outcome's read-only default, which no caller can
    fill by mistake."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    m = ctl.match("e", MatchRequest("", seq(2), lock=True))
    assert m.pages is NO_PAGES and not m.pages
    with pytest.raises(TypeError):
        m.pages["full"] = m.device_pages.get("full")  # type: ignore[index]
    ctl.release("e", m.lock_id, None)
    a = ctl.match("e", MatchRequest("", seq(2), lock=True, allocate_tokens=8))
    assert len(a.pages["full"]) == 2  # (an allocation still gets its own)
    ctl.release("e", a.lock_id, a.allocation_id)


def test_bad_handles_and_inputs(make) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    m = eng.request(seq(2))
    with pytest.raises(NotFound):
        ctl.release("e1", m.lock_id, None)  # consumed by the insert
    with pytest.raises(NotFound):
        ctl.release("e1", None, m.allocation_id)
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        ctl.match("e1", MatchRequest("", b"abc"))
    limit = ctl.cfg.server.max_tokens_per_request
    with pytest.raises(InvalidArgument, match=rf"allocate_tokens: {limit + 1} must be in \[0, {limit}\]"):
        ctl.match("e1", MatchRequest("", seq(1), lock=True, allocate_tokens=limit + 1))
    with pytest.raises(InvalidArgument, match=rf"num_tokens: {limit + 1} must be in \[1, {limit}\]"):
        ctl.allocate("e1", AllocateRequest("", limit + 1))
    assert ctl.device.allocator(FULL).free_count + 2 == ctl.device.allocator(FULL).total  # nothing taken
    from hicache.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="not attached"):
        ctl.match("ghost", MatchRequest("", seq(1), lock=True))
    m2 = ctl.match("e1", MatchRequest("", seq(2), lock=True))
    with pytest.raises(NotFound):
        ctl.release("e2", m2.lock_id, None)  # another engine's lock
    ctl.release("e1", m2.lock_id, None)


def test_lapsed_lease_releases_locks_and_allocations(make) -> None:
    ctl = make(storage__backend="none", server__lease_ms=100)
    Engine(ctl)
    ctl.match("e1", MatchRequest("", seq(2), lock=True, allocate_tokens=8))
    time.sleep(0.15)
    assert ctl.expire_leases() == 1
    with pytest.raises(NotFound, match="lease expired"):
        ctl.heartbeat("e1")
    assert ctl.stats().counters["lease_released_allocations"] == 1
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total


def test_a_rank_attaching_as_another_process_releases_the_engines_handles(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1, instance_id="first")
    m = ctl.match("e1", MatchRequest("", seq(2), lock=True, allocate_tokens=8))
    ctl.attach("e1", 0, 1, instance_id="first")  # the same process again: nothing changes
    ctl.attach("e1", 0, 1)  # (no instance id: an older client, taken over as it is)
    assert (ctl.heartbeat("e1").locks, ctl.heartbeat("e1").allocations) == (1, 1)
    ctl.attach("e1", 0, 1, instance_id="second")  # a new process under the same id
    assert (ctl.heartbeat("e1").locks, ctl.heartbeat("e1").allocations) == (0, 0)
    with pytest.raises(NotFound):
        ctl.release("e1", m.lock_id, None)
    counters = ctl.stats().counters
    assert (counters["engine_restarts"], counters["restart_released_locks"],
            counters["restart_released_allocations"]) == (1, 1, 1)
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total
    ctl.check_integrity()


def test_an_allocate_that_waited_through_an_engine_restart_gets_nothing(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1, instance_id="first")
    allocate_l1_all = ctl.transfers.allocate_l1_all

    def restart_meanwhile(need):  # type: ignore[no-untyped-def]
        # Allocating may wait for queued copies with the mutex free; the restarted
        # process attaches right then (another gRPC thread).
        ctl.transfers.allocate_l1_all = allocate_l1_all
        ctl.attach("e1", 0, 1, instance_id="second")
        return allocate_l1_all(need)

    ctl.transfers.allocate_l1_all = restart_meanwhile
    with pytest.raises(NotFound, match="attached anew while this call waited"):
        ctl.allocate("e1", AllocateRequest("", 8))
    assert ctl.heartbeat("e1").allocations == 0  # not filed under the new process
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total
    ctl.check_integrity()


def test_tensor_parallel_ranks_each_keep_their_own_instance() -> None:
    from hicache.controller.engines import EngineRegistry

    reg = EngineRegistry(lease_s=30)
    assert reg.attach("e", 0, 2, "rank0-pid1")[1] is None
    assert reg.attach("e", 1, 2, "rank1-pid2")[1] is None  # another rank: not a restart
    assert reg.attach("e", 1, 2, "rank1-pid2")[1] is None

    # The whole group restarts, rank by rank: one restart, the others join it.
    gone = reg.attach("e", 0, 2, "rank0-pid3")[1]
    assert gone is not None and gone.instances == {0: "rank0-pid1", 1: "rank1-pid2"}
    assert reg.attach("e", 1, 2, "rank1-pid4")[1] is None

    # Rank 1 restarts alone; rank 0 lives on and says so in its heartbeat ...
    gone = reg.attach("e", 1, 2, "rank1-pid5")[1]
    assert gone is not None
    engine = reg.renew("e")
    reg.heard_from(engine, 0, "rank0-pid3")
    # A process another one replaced (here dead; a forked parent lives on) is told so,
    # and does not take its rank back.
    with pytest.raises(NotFound, match="another process attached it since"):
        reg.heard_from(engine, 1, "rank1-pid2")
    assert engine.instances == {0: "rank0-pid3", 1: "rank1-pid5"} and not engine.inherited
    # ... so its own restart later is seen too (what it held since would leak otherwise).
    gone = reg.attach("e", 0, 2, "rank0-pid6")[1]
    assert gone is not None and gone.instances == {0: "rank0-pid3", 1: "rank1-pid5"}

    # Rank 1 restarts twice before rank 0's next heartbeat: rank 0 is not forgotten.
    reg.heard_from(reg.renew("e"), 1, "rank1-pid5")
    assert reg.attach("e", 1, 2, "rank1-pid7")[1] is not None
    assert reg.attach("e", 1, 2, "rank1-pid8")[1] is not None
    engine = reg.renew("e")
    reg.heard_from(engine, 0, "rank0-pid6")
    assert reg.attach("e", 0, 2, "rank0-pid9")[1] is not None


def test_handle_ids_are_random_nonzero_and_unique() -> None:
    from hicache.controller.engines import EngineRegistry

    a, b = EngineRegistry(lease_s=30), EngineRegistry(lease_s=30)
    ids = [a.new_id() for _ in range(1000)]
    assert all(0 < i < 1 << 63 for i in ids) and len(set(ids)) == len(ids)
    # Another process (a restarted daemon) does not hand out the same ids.
    assert set(ids).isdisjoint(b.new_id() for _ in range(1000))
    assert sorted(ids) != ids


def test_l2_to_l3_write_back_writes_on_eviction_and_frees_after(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_back")
    eng = Engine(ctl)
    eng.request(seq(4))
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.STORAGE, FULL) == 0  # nothing goes down before eviction
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.transfers.drain(10)
    ctl.check_integrity()  # the job freed the host pages it held
    assert ctl.match("e1", MatchRequest("", seq(4))).storage_tokens == 16
    assert ctl.stats().counters["backups_l3"] == 4


def test_l2_to_l3_write_back_writes_a_node_once_and_a_checkpoint_even_when_full_is_there(make) -> None:
    """A node evicted from L2 (still in L1) is written to L3 and recorded there: its next
    eviction from L2 neither writes nor counts it again (it did, every time). A checkpoint
    leaving L2 is written even where its node's FULL pages are in L3 (it was dropped
    unwritten), and adds no pages to `backups_l3` (it added the node's)."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_back")
    eng = Engine(ctl)
    prompt = seq(4)
    eng.request(prompt, checkpoint=False)
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.HOST)  # L1 keeps it
    assert ctl.transfers.drain(10)
    (node,) = [n for n in ctl.tree.iter_nodes() if ctl.tree.depth_tokens(n) == 16]
    assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
    assert ctl.stats().counters["backups_l3"] == 4
    eng.request(prompt, checkpoint=True)  # the same prompt, now with its checkpoint
    assert ctl.transfers.drain(10)
    (node,) = [n for n in ctl.tree.iter_nodes()
               if ctl.tree.depth_tokens(n) == 16 and ctl.tree.is_resident(n, MAMBA, Tier.HOST)]
    evict_all(ctl, Tier.HOST)
    assert ctl.transfers.drain(10)
    assert ctl.l3 is not None and ctl.l3.has("", eng.hashes(prompt)[-1], ctl.cfg.model.family(MAMBA))
    assert ctl.tree.is_resident(node, MAMBA, Tier.STORAGE)
    assert ctl.stats().counters["backups_l3"] == 4  # no FULL page was written twice
    ctl.check_integrity()


@pytest.mark.parametrize("flush", [False, True])
def test_a_checkpoint_committed_after_its_nodes_full_pages_went_down_reaches_l2_and_l3(
    make, flush: bool
) -> None:
    """Write-through, hybrid: a prompt first committed without its checkpoint (FULL and
    SWA go to L2 and L3), then again with it. The checkpoint used to stay in L1 only
    (every write path looked at FULL alone), and Flush skipped it too: once L1 let go, no
    node could resume from that boundary out of L3."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through",
               write__l2_to_l3="write_back" if flush else "write_through")
    eng = Engine(ctl)
    prompt = seq(4)
    eng.request(prompt, checkpoint=False)
    assert ctl.transfers.drain(10)
    if flush:
        ctl.flush(10)
    eng.request(prompt, checkpoint=True)
    assert ctl.transfers.drain(10)
    (node,) = [n for n in ctl.tree.iter_nodes() if ctl.tree.depth_tokens(n) == 16]
    assert ctl.tree.is_resident(node, MAMBA, Tier.HOST)
    before = ctl.stats().counters["backups_l3"]
    if flush:
        ctl.flush(10)
    assert ctl.tree.is_resident(node, MAMBA, Tier.STORAGE)
    assert ctl.l3 is not None and ctl.l3.has("", eng.hashes(prompt)[-1], ctl.cfg.model.family(MAMBA))
    assert ctl.stats().counters["backups_l3"] == before  # FULL was not written again
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.match("e1", MatchRequest("", prompt)).storage_tokens == 16  # resumable from L3
    ctl.check_integrity()


def test_a_partial_window_is_not_written_to_l3_again_and_again(make) -> None:
    """An SWA tail shorter than its node is written with the node's FULL pages but never
    recorded in L3: once FULL is there, later matches must not offer it again."""
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    prompt = seq(6)
    eng.insert_with_swa_tail(prompt, 1)  # a 1-page tail of the window (2 pages here)
    assert ctl.transfers.drain(10)
    (node,) = [n for n in ctl.tree.iter_nodes() if ctl.tree.depth_tokens(n) == 24]
    assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
    assert len(ctl.tree.pages_of(node, ComponentKind.SWA, Tier.HOST)) == 1  # partial
    assert ctl.l3 is not None
    written: list[object] = []
    real = ctl.l3.write
    ctl.l3.write = lambda *a, **k: (written.append(a[2]), real(*a, **k))[1]  # type: ignore[method-assign]
    for _ in range(3):  # what a match does with its path, and a landing with its nodes
        with ctl._mu:
            ctl.transfers._maybe_l3([node])
        assert ctl.transfers.drain(10)
    assert written == []
    ctl.check_integrity()


def test_l2_to_l3_selective_waits_for_hits(make) -> None:
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through_selective",
               write__selective_threshold=3)
    eng = Engine(ctl)
    eng.request(seq(2))
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.STORAGE, FULL) == 0
    for _ in range(3):
        ctl.match("e1", MatchRequest("", seq(2)))
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.STORAGE, FULL) == 2


def test_load_without_room_fails_cleanly_and_changes_nothing(make) -> None:
    from hicache.errors import ResourceExhausted

    ctl = make(write__l1_to_l2="write_through", storage__backend="none", l1_tokens=32)
    eng = Engine(ctl)
    eng.request(seq(4))
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", seq(4), lock=True))
    hog = ctl.match("e1", MatchRequest("", seq(1, 777), lock=True, allocate_tokens=28))  # 7 of 8 pages
    before = (ctl.tree.resident_pages(Tier.DEVICE, FULL), ctl.tree.resident_pages(Tier.HOST, FULL))
    with pytest.raises(ResourceExhausted, match="L1 full"):
        list(ctl.load("e1", m.lock_id))
    assert before == (ctl.tree.resident_pages(Tier.DEVICE, FULL), ctl.tree.resident_pages(Tier.HOST, FULL))
    ctl.release("e1", m.lock_id, None)
    ctl.release("e1", hog.lock_id, hog.allocation_id)


def test_async_write_through_lands_on_a_node_split_meanwhile(make) -> None:
    from hicache.controller.workers import Job

    ctl = make(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    gate = threading.Event()
    ctl.transfers.copy_worker.submit(Job("gate", lambda: gate.wait(5), lambda _e: None))
    eng.request(seq(6))  # its L1->L2 copy waits behind the gate
    ctl.match("e1", MatchRequest("", seq(2) + seq(1, 5000)))  # splits the node after page 2
    gate.set()
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 6  # head and tail both backed up
    ctl.check_integrity()
    evict_all(ctl, Tier.DEVICE)
    eng.request(seq(6))  # loads the 6 pages back from L2 and checks every byte


def test_a_decoding_request_inserts_mid_way_grows_its_allocation_and_closes_its_session(make) -> None:
    """Prefill, insert with keep_lock (the tree takes a copy of the MAMBA state; the request
    goes on writing its own slot), decode growth of the same allocation, final insert, close the session:
    every page of both boundaries comes back byte for byte, nothing is left held."""
    ctl = make(hybrid=True, storage__backend="none")
    eng = Engine(ctl)
    prompt, full = seq(4), seq(6)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=24, session_id="s"))
    assert {len(ids) for name, ids in m.pages.items() if name not in ("mamba", "conv")} == {6}
    eng.write(m.pages, prompt, 0)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True, keep_lock=True))
    assert (out.inserted_tokens, out.reused_tokens) == (16, 0)
    # Decode growth: two more pages on the same allocation (two were left after the insert).
    grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    assert {len(ids) for name, ids in grown.pages.items() if name not in ("mamba", "conv")} == {4}
    assert grown.pages["mamba"][0] == m.pages["mamba"][0]  # its own slot (the tree has a copy)
    eng.write(grown.pages, full, 4)  # the two decoded pages and the state after them
    out = ctl.insert("e1", InsertRequest("", full, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 16)
    assert ctl.heartbeat("e1").locks == 0 and ctl.heartbeat("e1").allocations == 0
    for tokens, pages in ((full, 6), (prompt, 4)):  # the prompt's checkpoint was not overwritten
        again = ctl.match("e1", MatchRequest("", tokens, lock=True))
        assert again.device_tokens == pages * 4
        eng.verify(again.device_pages, tokens, pages)
        ctl.release("e1", again.lock_id, None)
    closed = ctl.close_session("s")
    assert closed > 0
    assert ctl.close_session("s") == closed  # recently closed: the same answer, nothing changed


def test_growing_an_allocation_is_bounded_by_one_requests_tokens_in_total(make) -> None:
    """Each Allocate call is checked against server.max_tokens_per_request; so are the pages
    an allocation holds after growing, however many calls grew it (one allocation could
    otherwise take all of L1, a page per call). Pages an insert consumed count no more."""
    ctl = make(storage__backend="none", server__max_tokens_per_request=16)  # 4 pages
    eng = Engine(ctl)
    a = ctl.match("e1", MatchRequest("", seq(3), lock=True, allocate_tokens=12))
    grown = ctl.allocate("e1", AllocateRequest("", 4, allocation_id=a.allocation_id))
    assert len(grown.pages["full"]) == 4
    pools = ctl.stats().pools
    with pytest.raises(InvalidArgument, match=r"allocation \d+ by 1 pages would hold 5 pages; "
                                              r"at most 4 \(16 tokens"):
        ctl.allocate("e1", AllocateRequest("", 1, allocation_id=a.allocation_id))
    assert ctl.stats().pools == pools  # refused: nothing taken
    assert ctl.heartbeat("e1").allocations == 1
    eng.write(grown.pages, seq(2), 0)
    ctl.insert("e1", InsertRequest("", seq(2), lock_id=a.lock_id, allocation_id=a.allocation_id,
                                   keep_lock=True))  # consumes 2 pages
    again = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=a.allocation_id))
    assert len(again.pages["full"]) == 4
    ctl.release("e1", a.lock_id, a.allocation_id)
    ctl.check_integrity()


def test_growth_is_checked_again_after_a_wait_for_room(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocating may wait for copies with the mutex released: another growth of the same
    allocation may land meanwhile, so the bound is checked again before these pages join
    (two growths each within it passed it together; found by a review)."""
    ctl = make(storage__backend="none", server__max_tokens_per_request=16)  # 4 pages
    ctl.attach("e1", 0, 1)
    a = ctl.match("e1", MatchRequest("", seq(2), lock=True, allocate_tokens=8))
    real = ctl._allocate_family
    raced: list[bool] = []

    def racing(n: int, *args: object) -> tuple:
        out = real(n, *args)
        if not raced:  # another growth of two pages landed during this one's wait
            raced.append(True)
            record = ctl._engines.allocation("e1", a.allocation_id)
            other, _ = real(2, *args)
            full = ComponentKind.FULL
            record.pages[full] = np.concatenate([record.pages[full], other[full]])
        return out

    monkeypatch.setattr(ctl, "_allocate_family", racing)
    free = ctl.device.allocator(ComponentKind.FULL).free_count
    with pytest.raises(InvalidArgument, match="would hold 6 pages; at most 4"):
        ctl.allocate("e1", AllocateRequest("", 8, allocation_id=a.allocation_id))
    monkeypatch.undo()
    assert len(ctl._engines.allocation("e1", a.allocation_id).pages[ComponentKind.FULL]) == 4
    assert ctl.device.allocator(ComponentKind.FULL).free_count == free - 2  # the other's two only
    ctl.release("e1", a.lock_id, a.allocation_id)


def prompts_in_l3_with_held_reads(make, n: int) -> tuple:  # type: ignore[no-untyped-def]
    """(controller, `n` prompts only in L3, gate, reading): the controller keeps one finished
    prefetch; its L3 reads wait for `gate` (`reading` is set when one starts)."""
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(n)]
    for tokens in prompts:
        eng.request(tokens)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    ctl.prefetcher._keep = 1
    gate, reading = threading.Event(), threading.Event()
    backend = ctl.l3.backend
    real = backend._read_into

    def held(keys, buffers):  # type: ignore[no-untyped-def]
        reading.set()
        assert gate.wait(10)
        return real(keys, buffers)

    backend._read_into = held  # type: ignore[method-assign]
    return ctl, prompts, gate, reading


def test_finished_prefetches_are_forgotten_oldest_first_but_never_a_running_one(make) -> None:
    ctl, prompts, gate, _ = prompts_in_l3_with_held_reads(make, 3)
    try:
        a = ctl.match("e1", MatchRequest("", prompts[0], lock=True, prefetch=True))
        b = ctl.match("e1", MatchRequest("", prompts[1], lock=True, prefetch=True))
        # Over the limit, but both run: neither is forgotten.
        assert ctl.prefetch_status(a.prefetch_id).state is PrefetchState.RUNNING
        assert ctl.prefetch_status(b.prefetch_id).state is PrefetchState.RUNNING
    finally:
        gate.set()
    assert ctl.prefetcher.worker.drain(10)
    c = ctl.match("e1", MatchRequest("", prompts[2], lock=True, prefetch=True))
    assert ctl.prefetcher.worker.drain(10)
    with pytest.raises(NotFound):
        ctl.prefetch_status(a.prefetch_id)  # finished and oldest: forgotten
    assert ctl.prefetch_status(c.prefetch_id).state is PrefetchState.DONE
    for m in (a, b, c):
        ctl.release("e1", m.lock_id, None)


def test_a_cancelled_prefetch_whose_worker_still_runs_is_not_forgotten(make) -> None:
    """Cancelling ends a prefetch's state at once, while its worker still holds the L2
    pages it reserved. Such an op was forgotten like a finished one: its status became
    NotFound and the page audit saw its pages as leaked until the worker returned."""
    ctl, prompts, gate, reading = prompts_in_l3_with_held_reads(make, 2)
    try:
        a = ctl.match("e1", MatchRequest("", prompts[0], lock=True, prefetch=True))
        assert reading.wait(10)
        ctl.cancel_prefetch(a.prefetch_id, "e1")
        b = ctl.match("e1", MatchRequest("", prompts[1], lock=True, prefetch=True))  # over the limit
        assert ctl.prefetch_status(a.prefetch_id).state is PrefetchState.CANCELLED
        ctl.check_integrity()  # a's reserved pages are still a's
    finally:
        gate.set()
    assert ctl.prefetcher.worker.drain(10)
    for m in (a, b):
        ctl.release("e1", m.lock_id, None)
    ctl.check_integrity()


def test_a_reused_checkpoint_is_copied_by_the_copy_engine_before_the_match_returns(make) -> None:
    """MAMBA copy-on-write goes through the copy engine (on CUDA: its own stream, complete
    on return); the engine's new slot holds the checkpoint's bytes when it gets it."""
    ctl = make(hybrid=True)
    eng = Engine(ctl)
    eng.request(seq(8))  # checkpoint at page 8
    copies: list[tuple[object, int, int]] = []
    real = ctl.transfers.copier.copy_within_device

    def spy(kind, src, dst):  # type: ignore[no-untyped-def]
        copies.append((kind, src, dst))
        real(kind, src, dst)

    ctl.transfers.copier.copy_within_device = spy
    eng.request(seq(12))  # resumes from the checkpoint: a copy of it in a new slot
    assert len(copies) == 1 and copies[0][0] is ComponentKind.MAMBA and copies[0][1] != copies[0][2]
