"""Review: `Load` (L2 -> L1, layer by layer) under concurrency and pressure.

Two halves:
- controller-level (a `HybridCacheController` in this process, copies gated so that the
  interleavings are deterministic): concurrent loads of one path, a lock released / its
  lease lapsed / its session closed mid-copy, an abandoned stream, pressure from other
  engines, loads that cannot fit, and the page-ownership audit after each;
- daemon-level (a real `hicache serve`, one per module, with a geometry whose loads take
  measurable time): a stream cancelled or timed out by the client, two engines loading one
  path at once, a load without room, and what each leaves behind (the lock, the pages,
  the bytes, L1 fully allocatable again once every handle is released).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.client import Client
from hicache.controller.base import InsertRequest, MatchRequest
from hicache.errors import DeadlineExceeded, NotFound, ResourceExhausted, Unavailable
from hicache.types import ComponentKind, Tier

from .daemonkit import Daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import (
    CopyGate,
    Engine,
    Loader,
    built_controllers,
    failing_load,
    in_l2_only,
    l1_full,
    l2_prefix_request,
    seq,
)

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
_instances = itertools.count()


# ---------------------------------------------------------------------- controller helpers


@pytest.fixture
def make_ctl(tmp_path: Path) -> Iterator[Callable[..., object]]:
    with built_controllers(tmp_path, "lc") as factory:
        yield factory






# ---------------------------------------------------------------------- controller: bugs


def test_a_hybrid_load_without_a_mamba_slot_evicts_nothing(make_ctl) -> None:
    """plan_load allocates per component in order (FULL, SWA, MAMBA), each allocation
    evicting on its own: FULL evicts B from L1, then MAMBA finds every slot held by
    allocations and the load fails RESOURCE_EXHAUSTED. The code says "a load that cannot
    fit fails before evicting anything"; B left L1 anyway."""
    ctl = make_ctl(hybrid=True, l1_tokens=32, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4)
    in_l2_only(ctl, eng, a)  # A: 4 pages and its checkpoint, in L2 only
    eng.request(seq(8, base=1000), checkpoint=False)  # B fills L1's 8 FULL pages (no slot)
    assert ctl.transfers.drain(10)
    assert l1_full(ctl) == (8, 0)
    holds = []  # every MAMBA slot held by an allocation (0 tokens: a slot, no pages)
    while ctl.device.allocator(MAMBA).free_count:
        holds.append(ctl.match("e1", MatchRequest("", seq(1, base=5000 + 10 * len(holds)),
                                                  lock=True, allocate_tokens=0)))
    m = ctl.match("e1", MatchRequest("", a, lock=True))
    assert m.host_tokens == 16
    evicted = ctl.stats().counters["evictions_device"]
    with pytest.raises(ResourceExhausted, match="mamba"):
        list(ctl.load("e1", m.lock_id))
    try:
        assert ctl.stats().counters["evictions_device"] == evicted
        assert l1_full(ctl) == (8, 0), "B was evicted from L1 by a load that then failed"
    finally:
        ctl.release("e1", m.lock_id, None)
        for h in holds:
            ctl.release("e1", h.lock_id, h.allocation_id)


def test_two_engines_loading_one_path_evict_for_one_copy_only(make_ctl) -> None:
    ctl = make_ctl(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4)
    in_l2_only(ctl, eng, a)
    for k in range(8):  # 8 unlocked 4-page leaves fill L1's 32 pages
        eng.request(seq(4, base=1000 * (k + 1)))
    assert ctl.transfers.drain(10)
    assert l1_full(ctl) == (32, 0)
    x = Engine(ctl, "x")
    Engine(ctl, "y")
    mx = ctl.match("x", MatchRequest("", a, lock=True))
    my = ctl.match("y", MatchRequest("", a, lock=True))
    gate = CopyGate(ctl)
    try:
        lx = gate.held_load("x", mx.lock_id)
        ly = Loader(ctl, "y", my.lock_id)
        ly.start()
        time.sleep(0.3)  # (a copy of its own would reach the gate meanwhile)
        assert gate.reached == 1, "the second load copies the slots the first is copying"
        gate.open()
        fx, fy = lx.result()[-1], ly.result()[-1]
    finally:
        gate.restore()
    # One copy landed, both engines read it.
    np.testing.assert_array_equal(fx.device_pages["full"], fy.device_pages["full"])
    x.verify(fx.device_pages, a, 4)
    ctl.release("x", mx.lock_id, None)
    ctl.release("y", my.lock_id, None)
    # One 4-page leaf had to go for the one copy that stays; the second went for nothing.
    assert ctl.stats().counters["evictions_device"] == 4 + 4  # (4: evict_all of A)
    assert l1_full(ctl) == (32, 0)


def test_the_ownership_audit_holds_while_a_load_copies(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    in_l2_only(ctl, eng, seq(4))
    m = ctl.match("e1", MatchRequest("", seq(4), lock=True))
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        ctl.check_integrity()  # "DEVICE full: 4 pages allocated, 0 owned (leak)"
    finally:
        gate.restore()
        loader.result()
        ctl.release("e1", m.lock_id, None)


def test_stats_count_a_running_loads_pages_as_locked(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    in_l2_only(ctl, eng, seq(4))
    m = ctl.match("e1", MatchRequest("", seq(4), lock=True))
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        (dev,) = [p for p in ctl.stats().pools if p.tier == "device"]
        assert dev.used_pages == 4
        assert dev.locked_pages == dev.used_pages  # nothing in L1 is evictable now
    finally:
        gate.restore()
        loader.result()
        ctl.release("e1", m.lock_id, None)


def test_a_request_that_fits_l1_can_load_its_l2_prefix(make_ctl) -> None:
    """The API's request life: MatchPrefix(lock, allocate_tokens=total) -> Load -> Insert.
    The allocation covers every token past the device match, the L2 part included. Load
    took as many pages again for that part, the allocation's first pages sitting unused
    until Insert freed them: with L1 at 16 pages, a 12-page request whose first 8 pages
    are in L2 failed RESOURCE_EXHAUSTED (12 + 8 > 16). Now the L2 part lands in the
    allocation's own first pages: the page ids the engine already has."""
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a, longer, m = l2_prefix_request(ctl, eng, base=900, tail_base=9300)
    assert (m.host_tokens, len(m.pages["full"])) == (32, 12)
    final = list(ctl.load("e1", m.lock_id))[-1]
    assert final.device_tokens == 32
    np.testing.assert_array_equal(final.device_pages["full"], m.pages["full"][:8])
    eng.verify(final.device_pages, a, 8)
    # The engine computes the 4 new pages into the rest of its allocation, and inserts.
    eng.write({"full": m.pages["full"][8:]}, longer, 8)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (16, 32)
    eng.assert_cached(longer)
    assert l1_full(ctl) == (12, 4)  # nothing taken twice, nothing leaked


def test_a_load_that_fails_gives_the_allocation_its_pages_back(make_ctl) -> None:
    """The engine then computes the L2 part itself, into the pages its allocation had
    for it: they must still be its own (not freed, handed to another request)."""
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, longer, m = l2_prefix_request(ctl, eng, base=700, tail_base=9700)
    with failing_load(ctl, "e1", m.lock_id):
        ctl.check_integrity()  # (lent pages are the load's while it copies)
    assert l1_full(ctl)[1] == 4  # the 12 pages are the allocation's again
    eng.write({"full": m.pages["full"]}, longer, 0)  # all 12 computed, the L2 part too
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert out.inserted_tokens + out.reused_tokens == 48
    eng.assert_cached(longer)


def test_an_allocation_released_during_its_load_leaks_and_double_frees_nothing(make_ctl) -> None:
    """An engine that gives up on the request mid-load (Release of the allocation, then
    of the lock): the pages the load took stay the load's, land (or are freed) once;
    the audit after the test finds every page owned once."""
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a, _longer, m = l2_prefix_request(ctl, eng, base=500, tail_base=9500)
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        ctl.release("e1", None, m.allocation_id)  # the 4 pages the load did not take
        assert l1_full(ctl)[1] == 4 + 4
        ctl.check_integrity()
        gate.open()
        final = loader.result()[-1]
    finally:
        gate.restore()
    eng.verify(final.device_pages, a, 8)
    ctl.release("e1", m.lock_id, None)
    assert ctl.match("e1", MatchRequest("", a)).device_tokens == 32  # what arrived stays


def test_a_hybrid_load_lends_its_paged_slots_and_takes_a_slot_of_its_own(make_ctl) -> None:
    """FULL+SWA+MAMBA: SWA's window lands in the allocation's SWA pages at the same
    token pages, its pages outside the window stay the allocation's (retired), the checkpoint gets an L1 slot
    of its own; the request's life ends byte-exact (the engine simulator verifies)."""
    ctl = make_ctl(hybrid=True, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a, longer, m = l2_prefix_request(ctl, eng, base=300, tail_base=9100)
    assert m.device_tokens == 0 and m.host_tokens == 32
    final = list(ctl.load("e1", m.lock_id))[-1]
    eng.verify(final.device_pages, a, 8)
    for member in ctl.cfg.model.family(FULL):  # (FULL and its sidecars: the same ids)
        np.testing.assert_array_equal(final.device_pages[member.name], m.pages[member.name][:8])
    ctl.release("e1", m.lock_id, m.allocation_id)
    eng.request(longer)  # a whole life again (match, load, write, insert), verified


# ---------------------------------------------------------------------- controller: behaviour


def test_two_engines_loading_one_path_at_once_share_one_landed_copy(make_ctl) -> None:
    """Both copies run at once; the first to land wins, the other's L1 pages are freed:
    both engines get the same, correct pages, and no page is owned twice or leaked."""
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(6, base=100)
    in_l2_only(ctl, eng, a)
    x, y = Engine(ctl, "x"), Engine(ctl, "y")
    mx = ctl.match("x", MatchRequest("", a, lock=True))
    my = ctl.match("y", MatchRequest("", a[: 4 * 16], lock=True))  # a 4-page prefix of it
    assert (mx.host_tokens, my.host_tokens) == (24, 16)
    gate = CopyGate(ctl)
    try:
        lx, ly = Loader(ctl, "x", mx.lock_id), Loader(ctl, "y", my.lock_id)
        lx.start()
        ly.start()
        gate.wait_reached(2)
        assert l1_full(ctl) == (0, 64 - 10)  # both reserved, nothing landed yet
        gate.open()
        fx, fy = lx.result()[-1], ly.result()[-1]
    finally:
        gate.restore()
    assert (fx.device_tokens, fy.device_tokens) == (24, 16)
    np.testing.assert_array_equal(fx.device_pages["full"][:4], fy.device_pages["full"])
    x.verify(fx.device_pages, a, 6)
    y.verify(fy.device_pages, a, 4)
    assert l1_full(ctl) == (6, 64 - 6)  # one copy kept, the other freed
    ctl.check_integrity()
    ctl.release("x", mx.lock_id, None)
    ctl.release("y", my.lock_id, None)


def test_loading_one_lock_twice_at_once_gives_both_streams_the_same_pages(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=200)
    in_l2_only(ctl, eng, a)
    m = ctl.match("e1", MatchRequest("", a, lock=True, allocate_tokens=len(a) // 4 + 8))
    gate = CopyGate(ctl)
    try:
        l1, l2 = Loader(ctl, "e1", m.lock_id), Loader(ctl, "e1", m.lock_id)
        l1.start()
        l2.start()
        gate.wait_reached(2)
        gate.open()
        f1, f2 = l1.result()[-1], l2.result()[-1]
    finally:
        gate.restore()
    np.testing.assert_array_equal(f1.device_pages["full"], f2.device_pages["full"])
    assert f1.device_tokens == f2.device_tokens == 16
    eng.verify(f1.device_pages, a, 4)
    # A third, sequential load copies nothing and answers the same.
    again = list(ctl.load("e1", m.lock_id))
    assert len(again) == 1
    np.testing.assert_array_equal(again[0].device_pages["full"], f1.device_pages["full"])
    # The engine's next step: insert the 2 pages it computed past the loaded prefix.
    longer = a + seq(2, base=9000)
    alloc = {"full": m.pages["full"][4:]}  # the allocation starts at the match's device end
    eng.write(alloc, longer, 4)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 16)
    eng.assert_cached(longer)


def test_a_lease_lapsing_mid_copy_answers_not_found_and_keeps_what_landed(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=300)
    in_l2_only(ctl, eng, a)
    Engine(ctl, "doomed")
    m = ctl.match("doomed", MatchRequest("", a, lock=True, allocate_tokens=32))
    gate = CopyGate(ctl)
    loader = Loader(ctl, "doomed", m.lock_id)
    loader.start()
    try:
        gate.wait_reached(1)
        now = time.monotonic()
        ctl._engines._clock = lambda: now + 3600.0  # every lease has lapsed
        assert ctl.expire_leases() == 2  # (e1 too)
        gate.open()
        with pytest.raises(NotFound, match="released while its load was copying"):
            loader.result()
    finally:
        gate.restore()
    assert ctl.counters["lease_released_locks"] == 1
    assert ctl.counters["lease_released_allocations"] == 1
    hit = ctl.match("e2", MatchRequest("", a))  # (no lock: no engine needed)
    assert hit.device_tokens == 16  # the copy landed, unlocked
    eng.verify(hit.device_pages, a, 4)
    assert l1_full(ctl) == (4, 60)


def test_closing_the_session_mid_copy_leaves_the_lock_and_the_load_alone(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=400)
    in_l2_only(ctl, eng, a)
    m = ctl.match("e1", MatchRequest("", a, session_id="s1", lock=True, allocate_tokens=24))
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        ctl.close_session("s1")
        gate.open()
        final = loader.result()[-1]
    finally:
        gate.restore()
    assert final.device_tokens == 16
    eng.verify(final.device_pages, a, 4)
    longer = a + seq(2, base=9100)
    eng.write({"full": m.pages["full"][4:]}, longer, 4)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 16)
    with pytest.raises(NotFound):
        ctl.release("e1", m.lock_id, None)  # consumed by the insert


def test_another_engines_allocations_mid_copy_neither_evict_the_path_nor_take_its_pages(make_ctl) -> None:
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(8, base=500)
    in_l2_only(ctl, eng, a)
    eng.request(seq(4, base=7000))  # 4 unlocked pages in L1: the only evictable ones
    assert ctl.transfers.drain(10)
    m = ctl.match("e1", MatchRequest("", a, lock=True))
    Engine(ctl, "hog")
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        assert l1_full(ctl) == (4, 4)  # 16 pages: 8 reserved by the load, 4 in the tree
        got = ctl.match("hog", MatchRequest("", seq(1, base=8000), lock=True, allocate_tokens=32))
        assert len(got.pages["full"]) == 8  # the free 4 and the evicted 4
        with pytest.raises(ResourceExhausted):
            ctl.match("hog", MatchRequest("", seq(1, base=8100), lock=True, allocate_tokens=4))
        gate.open()
        final = loader.result()[-1]
    finally:
        gate.restore()
    assert final.device_tokens == 32
    assert not set(final.device_pages["full"].tolist()) & set(got.pages["full"].tolist())
    eng.verify(final.device_pages, a, 8)
    ctl.check_integrity()
    ctl.release("hog", got.lock_id, got.allocation_id)
    ctl.release("e1", m.lock_id, None)


def test_an_abandoned_stream_then_insert_keeps_the_landed_pages_and_frees_the_duplicates(make_ctl) -> None:
    """The engine gives up on the stream (recomputes instead) and inserts its own pages
    for the whole request: the copy lands anyway, the lock still starts at the match's
    device boundary, the engine's duplicate pages are freed, nothing leaks."""
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=600)
    in_l2_only(ctl, eng, a)
    m = ctl.match("e1", MatchRequest("", a, lock=True, allocate_tokens=24))
    assert len(m.pages["full"]) == 6
    stream = ctl.load("e1", m.lock_id)
    gate = CopyGate(ctl)
    try:
        closer = threading.Thread(target=lambda: (next(stream), None))  # starts the copy
        closer.start()
        gate.wait_reached(1)
        gate.open()
        closer.join(10)
        stream.close()
    finally:
        gate.restore()
    longer = a + seq(2, base=9200)
    eng.write(m.pages, longer, 0)  # the engine recomputed all 6 pages
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 16)
    eng.assert_cached(longer)
    assert l1_full(ctl) == (6, 58)  # the 4 duplicates went back


def test_load_messages_are_monotonic_and_the_final_extends_the_matched_device_pages(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none",
                   model__components={"full": {"layers": 5, "bytes_per_token_per_layer": 8}})
    eng = Engine(ctl)
    ab = seq(8, base=700)
    eng.request(ab[: 4 * 16])  # A
    eng.request(ab)  # A then B
    assert ctl.transfers.drain(10)
    with ctl._mu:
        ctl.transfers._evict(Tier.DEVICE, FULL, 4)  # the leaf B leaves L1 (it stays in L2)
    m = ctl.match("e1", MatchRequest("", ab, lock=True))
    assert (m.device_tokens, m.host_tokens) == (16, 16)
    # Each layer waits for the stream to have seen the one before.
    seen = threading.Semaphore(0)
    copier = ctl.transfers.copier
    original = copier.host_to_device

    def stepwise(kind, host, dev, on_layer=None):  # type: ignore[no-untyped-def]
        def hook(layer: int) -> None:
            on_layer(layer)
            if layer < 3:
                assert seen.acquire(timeout=10)
        return original(kind, host, dev, on_layer=hook)

    copier.host_to_device = stepwise
    messages = []
    try:
        for msg in ctl.load("e1", m.lock_id):
            messages.append(msg)
            seen.release()
    finally:
        copier.host_to_device = original
    assert [p.layers_ready for p in messages] == [1, 2, 3, 5]
    assert all(p.layers_total == 5 for p in messages)
    assert all(p.device_pages is None and p.device_tokens is None for p in messages[:-1])
    final = messages[-1]
    assert final.device_tokens == 32
    np.testing.assert_array_equal(final.device_pages["full"][:4], m.device_pages["full"])
    eng.verify(final.device_pages, ab, 8)
    ctl.release("e1", m.lock_id, None)


def test_a_load_of_a_lock_without_a_host_part_answers_the_match_at_once(make_ctl) -> None:
    ctl = make_ctl(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=800)
    eng.request(a)
    m = ctl.match("e1", MatchRequest("", a, lock=True))
    assert (m.device_tokens, m.host_tokens) == (16, 0)
    (only,) = ctl.load("e1", m.lock_id)
    assert (only.layers_ready, only.layers_total, only.device_tokens) == (2, 2, 16)
    np.testing.assert_array_equal(only.device_pages["full"], m.device_pages["full"])
    empty = ctl.match("e1", MatchRequest("", seq(4, base=88_000), lock=True))
    assert empty.lock_id and (empty.device_tokens, empty.host_tokens) == (0, 0)
    (none,) = ctl.load("e1", empty.lock_id)
    assert (none.layers_ready, none.device_tokens) == (2, 0)
    assert len(none.device_pages.get("full", [])) == 0
    ctl.release("e1", m.lock_id, None)
    ctl.release("e1", empty.lock_id, None)
    with pytest.raises(NotFound):
        list(ctl.load("e1", m.lock_id))


# ---------------------------------------------------------------------- daemon level

PAGE = 64
LAYERS = 32
ROW = PAGE * 2048  # bytes per page per layer: 128 KiB, 4 MiB a page over 32 layers
L1_PAGES = 16


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose 8-page load moves 32 MiB over 32 layers (a stream that lasts)."""
    d = Daemon(
        tmp_path_factory.mktemp("load"),
        f"model.components={{full: {{layers: {LAYERS}, bytes_per_token_per_layer: 2048}}}}",
        "write.l1_to_l2=write_through",
        "write.l1_to_l2_batch_ms=0",
        "server.lease_ms=60000",
    ).start()
    yield d
    d.close()


def _fill(pools: dict, pages: np.ndarray, seed: int) -> None:
    for layer, view in enumerate(pools["full"]):
        for i, page in enumerate(pages):
            view[int(page)].fill_((seed * 31 + i * 7 + layer) % 251)


def _check(pools: dict, pages: np.ndarray, seed: int, first: int = 0) -> None:
    for layer, view in enumerate(pools["full"]):
        for i, page in enumerate(pages):
            want = (seed * 31 + (first + i) * 7 + layer) % 251
            row = view[int(page)]
            assert int(row.min()) == int(row.max()) == want, f"page {first + i} layer {layer}"


def _only_in_l2(c: Client, pools: dict, prompt: bytes, seed: int) -> None:
    """Insert `prompt` (its KV from `seed`), then push it out of L1 with an allocation
    of all of L1 (write-through left it in L2)."""
    n = len(prompt) // 4 // PAGE
    m = c.match(prompt, lock=True, allocate_tokens=n * PAGE)
    _fill(pools, m.pages["full"], seed)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
    _l1_allocatable(c)


def _l1_allocatable(c: Client) -> None:
    """All of L1 can be allocated (so nothing leaked and nothing stays locked); it is
    given back at once."""
    deadline = time.monotonic() + 10
    while True:
        try:
            alloc = c.allocate(L1_PAGES * PAGE)
            break
        except ResourceExhausted:  # (a write-through copy still pins some pages)
            assert time.monotonic() < deadline, "L1 not allocatable: pages leaked or locked"
            time.sleep(0.02)
    c.release(allocation_id=alloc.allocation_id)


def _device(c: Client):  # type: ignore[no-untyped-def]
    (dev,) = [p for p in c.stats().pools if p.tier == "device"]
    return dev


def _prompt(start: int, pages: int = 8) -> bytes:
    return np.arange(start, start + pages * PAGE, dtype="<u4").tobytes()


def test_daemon_a_cancelled_load_stream_keeps_the_lock_and_leaks_nothing(big: Daemon) -> None:
    prompt = _prompt(1_000)
    with big.client(engine_id="canceller") as c:
        att = c.attach()
        _only_in_l2(c, att.pools, prompt, seed=1)
        for _ in range(3):
            m = c.match(prompt, lock=True)
            assert (m.device_tokens, m.host_tokens) == (0, 8 * PAGE)
            stream = c.load(m.lock_id)
            first = next(stream)  # (a copy this small may well be final at once)
            assert 0 < first.layers_ready <= first.layers_total == LAYERS
            stream.close()  # the engine goes away from the stream: gRPC cancels it
            # The lock is intact: loading it again answers the whole path, bytes right.
            *_, final = c.load(m.lock_id)
            assert final.device_tokens == 8 * PAGE
            _check(att.pools, final.device_pages["full"], seed=1)
            c.release(lock_id=m.lock_id)
            with pytest.raises(NotFound):
                c.release(lock_id=m.lock_id)
            assert c.heartbeat().locks == 0
            _l1_allocatable(c)  # the path leaves L1 again for the next round
        assert _device(c).locked_pages == 0


def test_daemon_a_load_past_its_deadline_leaves_a_usable_lock(big: Daemon) -> None:
    prompt = _prompt(2_000)
    with big.client(engine_id="hurried") as c, \
            Client(big.target, engine_id="hurried", timeout_s=0.002, retries=0) as hasty:
        att = c.attach()
        _only_in_l2(c, att.pools, prompt, seed=2)
        m = c.match(prompt, lock=True)
        hasty._metadata = c._metadata  # (the attached engine's header)
        hasty._reached = True
        # Either outcome may happen (the client says Unavailable for a deadline); what
        # is left must be right in both.
        with contextlib.suppress(DeadlineExceeded, Unavailable):
            list(hasty.load(m.lock_id))
        *_, final = c.load(m.lock_id)
        assert final.device_tokens == 8 * PAGE
        _check(att.pools, final.device_pages["full"], seed=2)
        # The engine's next steps: pages past the loaded prefix, then the insert.
        alloc = c.allocate(2 * PAGE, lock_id=m.lock_id)
        _fill(att.pools, alloc.pages["full"], seed=3)
        longer = prompt + _prompt(90_000, pages=2)
        out = c.insert(longer, lock_id=m.lock_id, allocation_id=alloc.allocation_id)
        assert (out.inserted_tokens, out.reused_tokens) == (2 * PAGE, 8 * PAGE)
        with c.matched(longer) as hit:
            assert hit.device_tokens == 10 * PAGE
            _check(att.pools, hit.device_pages["full"][:8], seed=2)
            _check(att.pools, hit.device_pages["full"][8:], seed=3)
        assert c.heartbeat().allocations == 0
        _l1_allocatable(c)


def _load_into(finals: dict, start: threading.Barrier, name: str, client: Client,
               lock_id: int) -> None:
    start.wait(5)
    finals[name] = list(client.load(lock_id))[-1]


def test_daemon_two_engines_loading_one_path_at_once_read_the_same_bytes(big: Daemon) -> None:
    prompt = _prompt(3_000)
    with big.client(engine_id="twin-a") as a, big.client(engine_id="twin-b") as b:
        att = a.attach()
        b.attach()
        _only_in_l2(a, att.pools, prompt, seed=4)
        for _ in range(2):
            ma, mb = a.match(prompt, lock=True), b.match(prompt, lock=True)
            assert ma.host_tokens == mb.host_tokens == 8 * PAGE
            finals: dict[str, object] = {}
            start = threading.Barrier(2)
            threads = [threading.Thread(target=_load_into, args=(finals, start, "a", a, ma.lock_id)),
                       threading.Thread(target=_load_into, args=(finals, start, "b", b, mb.lock_id))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            fa, fb = finals["a"], finals["b"]
            np.testing.assert_array_equal(fa.device_pages["full"], fb.device_pages["full"])
            _check(att.pools, fa.device_pages["full"], seed=4)
            a.release(lock_id=ma.lock_id)
            b.release(lock_id=mb.lock_id)
            _l1_allocatable(a)
        assert _device(a).locked_pages == 0


def test_daemon_a_load_without_room_is_exhausted_and_evicts_nothing(big: Daemon) -> None:
    prompt, keep = _prompt(4_000), _prompt(5_000, pages=4)
    with big.client(engine_id="crowded") as c:
        att = c.attach()
        _only_in_l2(c, att.pools, prompt, seed=5)
        k = c.match(keep, lock=True, allocate_tokens=4 * PAGE)  # 4 unlocked pages once inserted
        _fill(att.pools, k.pages["full"], seed=6)
        c.insert(keep, lock_id=k.lock_id, allocation_id=k.allocation_id)
        m = c.match(prompt, lock=True)
        hog = c.allocate(10 * PAGE)  # 12 of 16 pages now: the load needs 8, 2 free + 4 evictable
        with pytest.raises(ResourceExhausted):
            list(c.load(m.lock_id))
        with c.matched(keep) as still:
            assert still.device_tokens == 4 * PAGE  # not evicted for a load that failed
            _check(att.pools, still.device_pages["full"], seed=6)
        c.release(allocation_id=hog.allocation_id)
        *_, final = c.load(m.lock_id)  # the lock survived the failure
        assert final.device_tokens == 8 * PAGE
        _check(att.pools, final.device_pages["full"], seed=5)
        c.release(lock_id=m.lock_id)
        _l1_allocatable(c)


def test_daemon_load_of_another_engines_or_a_released_lock_is_not_found(big: Daemon) -> None:
    prompt = _prompt(6_000, pages=2)
    with big.client(engine_id="owner") as owner, big.client(engine_id="thief") as thief:
        att = owner.attach()
        thief.attach()
        _only_in_l2(owner, att.pools, prompt, seed=7)
        m = owner.match(prompt, lock=True)
        with pytest.raises(NotFound):
            list(thief.load(m.lock_id))
        *_, final = owner.load(m.lock_id)  # untouched by the refused attempt
        _check(att.pools, final.device_pages["full"], seed=7)
        owner.release(lock_id=m.lock_id)
        with pytest.raises(NotFound):
            list(owner.load(m.lock_id))
        _l1_allocatable(owner)
