"""Review of 20e7dff: a `Load` lends the request's allocation when the loaded FULL run
starts past the allocation's start.

A hybrid match's device boundary may lie below FULL pages L1 still holds (no MAMBA
checkpoint there, or an SWA window missing): the allocation (from the boundary on)
covers them, the load does not. `Loads._lendable` now accepts a FULL run starting
at page `lo > 0` of the allocation; `_borrow` takes the allocation's pages up to the
run's end and those before it are `unused` (retired with the allocation at landing).

Layouts built here (page size 4, a hybrid FULL+SWA+MAMBA model with an indexer and a
conv sidecar, L1 of 32 pages, write-through to L2, no L3):

- `head_in_l1`: 8 pages, the first 2 in L1 (FULL and SWA, no checkpoint: the device
  boundary is the root), the other 6 only in L2 (checkpoint at page 8);
- `checkpoint_then_head`: a checkpoint at page 2 (the device boundary), pages 2-3 in
  L1 without one, pages 4-7 only in L2;
- `swa_before_run`: 3 pages, the first 2 FULL in L1 but their SWA only in L2, page 3
  only in L2: the window at page 3 needs an SWA slot lying before the FULL run.

Every controller is audited (`check_integrity`: each L1 page owned once, none leaked)
at the end of its test (`make`), and most tests audit mid-way too.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
from engine_sim import (
    CopyGate,
    Engine,
    Loader,
    failing_load,
    l1_full,
    release_during_load,
    seq,
    tree_l1_pages,
    tree_path,
)

import hicache.controller.loads as loads_mod
from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest
from hicache.errors import InvalidArgument, NotFound
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
SWA = ComponentKind.SWA
MAMBA = ComponentKind.MAMBA
PS = 4
PB = PS * 4  # bytes of a page of tokens


def hybrid(make, policy: str = "lru"):  # type: ignore[no-untyped-def]
    return make(hybrid=True, l1_tokens=128, write__l1_to_l2="write_through",
                storage__backend="none", eviction__policy=policy)


def layout(ctl, tokens: bytes) -> list[tuple[int, bool, bool, bool]]:  # type: ignore[no-untyped-def]
    """(end page, FULL in L1, SWA in L1, checkpoint in L1) of each node along `tokens`."""
    with ctl._mu:
        return [(ctl.tree.depth_tokens(n) // PS,
                 ctl.tree.is_resident(n, FULL, Tier.DEVICE),
                 ctl.tree.is_resident(n, SWA, Tier.DEVICE),
                 ctl.tree.is_resident(n, MAMBA, Tier.DEVICE)) for n in tree_path(ctl, tokens)]


def evict_l1(ctl, kind: ComponentKind, n: int) -> None:  # type: ignore[no-untyped-def]
    assert ctl.transfers.drain(10)
    with ctl._mu:
        ctl.transfers._evict(Tier.DEVICE, kind, n)


def head_in_l1(ctl, eng: Engine, base: int) -> bytes:  # type: ignore[no-untyped-def]
    p = seq(8, base=base)
    eng.request(p)
    eng.request(p[: 2 * PB] + seq(2, base=base + 500))  # splits p at page 2
    evict_l1(ctl, FULL, 8)  # the two leaves (6 + 2 pages)
    assert layout(ctl, p) == [(2, True, True, False), (8, False, False, False)]
    return p


def checkpoint_then_head(ctl, eng: Engine, base: int) -> bytes:  # type: ignore[no-untyped-def]
    p2 = seq(2, base=base)
    eng.request(p2)  # checkpoint at page 2
    p = p2 + seq(6, base=base + 100)
    eng.request(p)
    eng.request(p[: 4 * PB] + seq(2, base=base + 500))  # splits p at page 4
    evict_l1(ctl, FULL, 6)
    assert layout(ctl, p) == [(2, True, True, True), (4, True, True, False),
                              (8, False, False, False)]
    return p


def swa_before_run(ctl, eng: Engine, base: int) -> bytes:  # type: ignore[no-untyped-def]
    p = seq(3, base=base)
    eng.request(p)
    eng.request(p[: 2 * PB] + seq(2, base=base + 500))  # splits p at page 2
    evict_l1(ctl, FULL, 1)  # p's leaf (page 3), the least recently used
    evict_l1(ctl, SWA, 2)  # the shared head's SWA pages
    assert layout(ctl, p) == [(2, True, False, False), (3, False, False, False)]
    return p


def request(ctl, tokens: bytes, engine_id: str = "e1"):  # type: ignore[no-untyped-def]
    return ctl.match(engine_id, MatchRequest("", tokens, lock=True, allocate_tokens=len(tokens) // 4))


def free_counts(ctl) -> dict[ComponentKind, int]:  # type: ignore[no-untyped-def]
    return {k: ctl.device.allocator(k).free_count for k in ctl._kinds}


def finish(ctl, eng: Engine, m, tokens: bytes, reused: int, **insert_kw):  # type: ignore[no-untyped-def]
    """The engine's rest of the request after its load (as `Engine.request`): writes the
    pages past `reused` into the allocation (skipping what the load brought), inserts."""
    skip = max(0, reused // PS - m.device_tokens // PS)
    mamba = {mb.name for mb in ctl.cfg.model.family(MAMBA)}
    alloc = {name: ids if name in mamba else ids[skip:] for name, ids in m.pages.items()}
    eng.write(alloc, tokens, reused // PS)
    out = ctl.insert(eng.id, InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                           mamba_checkpoint=True, **insert_kw))
    assert out.inserted_tokens + out.reused_tokens == len(tokens) // 4
    return out


def allocation(ctl, engine_id: str, alloc_id: int):  # type: ignore[no-untyped-def]
    with ctl._mu:
        return ctl._engines.allocation(engine_id, alloc_id)


class LayerGate:
    """The FULL L2 -> L1 copy (the one reporting layers) reports layer 0, then waits for
    the gate (an engine can then drop the stream mid-copy)."""

    def __init__(self, ctl) -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.gate = threading.Event()
        copier = ctl.transfers.copier
        self.original = copier.host_to_device

        def held(kind, host, dev, on_layer=None):  # type: ignore[no-untyped-def]
            if on_layer is None:  # (SWA, MAMBA: copied before FULL, not held)
                return self.original(kind, host, dev, on_layer=on_layer)
            on_layer(0)
            assert self.gate.wait(10), "layer gate never opened"
            return self.original(kind, host, dev, on_layer=on_layer)

        copier.host_to_device = held

    def restore(self) -> None:
        self.gate.set()
        self.ctl.transfers.copier.host_to_device = self.original


def abandon_mid_copy(ctl, engine_id: str, lock_id: int) -> None:  # type: ignore[no-untyped-def]
    gate = LayerGate(ctl)
    stream = ctl.load(engine_id, lock_id)
    try:
        first = next(stream)
        assert first.device_pages is None, first
        gate.gate.set()
        stream.close()
    finally:
        gate.restore()


# ---------------------------------------------------------------------- the lent load


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_an_offset_run_lands_in_the_allocation_past_the_pages_l1_holds(make, policy: str) -> None:
    """The load copies pages 2-7 into the allocation's pages 2-7; its pages 0-1 (for the
    tokens the tree holds in L1) stay its own, retired, never the tree's; the engine
    reads pages 0-1 from the tree's own pages and writes pages 8-11 after them."""
    ctl = hybrid(make, policy)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 1000)
    head = tree_l1_pages(ctl)
    prompt = p + seq(4, base=9000)
    m = request(ctl, prompt)
    assert (m.device_tokens, m.host_tokens, len(m.pages["full"])) == (0, 8 * PS, 12)
    assert not head & set(m.pages["full"].tolist())
    final = list(ctl.load("e1", m.lock_id))[-1]
    assert final.device_tokens == 8 * PS
    eng.verify(final.device_pages, prompt, 8)
    got = final.device_pages
    assert set(got["full"][:2].tolist()) == head  # the tree's own head
    np.testing.assert_array_equal(got["full"][2:], m.pages["full"][2:8])  # lent
    np.testing.assert_array_equal(got["indexer"], got["full"])  # (the FULL sidecar: same ids)
    np.testing.assert_array_equal(got["swa"][-2:], m.pages["swa"][6:8])  # the window, lent
    rec = allocation(ctl, "e1", m.allocation_id)
    assert rec.start_page == 8
    np.testing.assert_array_equal(rec.pages[FULL], m.pages["full"][8:])
    np.testing.assert_array_equal(np.concatenate(rec.retired[FULL]), m.pages["full"][:2])
    assert not set(np.concatenate(rec.retired[FULL]).tolist()) & tree_l1_pages(ctl)
    assert l1_full(ctl) == (8, 32 - 8 - 4 - 2)
    ctl.check_integrity()
    finish(ctl, eng, m, prompt, final.device_tokens)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (12, 20)  # the 2 retired pages left with the allocation


def test_an_offset_run_above_a_checkpoint_boundary_is_lent_and_the_slot_keeps_its_copy(make) -> None:
    """Device boundary at page 2 (a checkpoint), FULL pages 2-3 in L1 (no checkpoint),
    4-7 in L2: the allocation starts at page 2, the run at its page 2. Its own MAMBA
    slot (a copy of the checkpoint at page 2) is untouched by the load, which brings
    the checkpoint at page 8 into a slot of its own."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = checkpoint_then_head(ctl, eng, 2000)
    prompt = p + seq(4, base=9100)
    m = request(ctl, prompt)
    assert (m.device_tokens, m.host_tokens, len(m.pages["full"])) == (2 * PS, 6 * PS, 10)
    slot = int(m.pages["mamba"][0])
    hs = eng.hashes(prompt)

    def slot_holds(page: int) -> bool:
        for mb in ctl.cfg.model.family(MAMBA):
            for layer in range(mb.layers):
                rows = ctl.device.layer(mb.name, layer).numpy()
                want = eng.pattern(hs[page - 1] + b"state", mb.name, layer, rows.shape[1])
                if not np.array_equal(rows[slot], want):
                    return False
        return True

    assert slot_holds(2)  # copy-on-write at the match
    final = list(ctl.load("e1", m.lock_id))[-1]
    eng.verify(final.device_pages, prompt, 8)
    np.testing.assert_array_equal(final.device_pages["full"][4:], m.pages["full"][2:6])
    assert int(final.device_pages["mamba"][0]) != slot
    assert slot_holds(2)
    assert allocation(ctl, "e1", m.allocation_id).start_page == 8
    ctl.check_integrity()
    finish(ctl, eng, m, prompt, final.device_tokens)
    eng.assert_cached(prompt)


def test_an_swa_slot_before_the_full_run_is_lent_from_the_allocations_head(make) -> None:
    """The window at page 3 needs the SWA slot of pages 0-1 (only in L2) while their FULL
    pages are in L1: it lands in the allocation's pages 0-1 (SWA), whose FULL pages
    go unused; the engine's prompt is byte-exact and every page is owned once."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = swa_before_run(ctl, eng, 3000)
    prompt = p + seq(4, base=9200)
    m = request(ctl, prompt)
    assert (m.device_tokens, m.host_tokens, len(m.pages["full"])) == (0, 3 * PS, 7)
    final = list(ctl.load("e1", m.lock_id))[-1]
    eng.verify(final.device_pages, prompt, 3)
    assert int(final.device_pages["swa"][1]) == int(m.pages["swa"][1])  # lent, before the run
    assert int(final.device_pages["full"][2]) == int(m.pages["full"][2])
    assert not set(final.device_pages["full"][:2].tolist()) & set(m.pages["full"].tolist())
    ctl.check_integrity()
    finish(ctl, eng, m, prompt, final.device_tokens)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (7 + 2, 32 - 9)  # (+ the other branch's 2 pages)


def test_keep_lock_growth_and_the_final_insert_after_an_offset_load(make) -> None:
    """The retired head pages stay the allocation's (the engine holds their ids) through
    a keep_lock insert and decode growth, and leave with the final insert."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 4000)
    prompt = p + seq(4, base=9300)
    m = request(ctl, prompt)
    final = list(ctl.load("e1", m.lock_id))[-1]
    out = finish(ctl, eng, m, prompt, final.device_tokens, keep_lock=True)
    assert (out.inserted_tokens, out.reused_tokens) == (4 * PS, 8 * PS)
    assert l1_full(ctl) == (12, 32 - 12 - 2)  # the head's 2 pages still retired
    ctl.check_integrity()
    grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    decoded = prompt + seq(2, base=9400)
    eng.write({n: ids for n, ids in grown.pages.items()}, decoded, 12)
    out = ctl.insert("e1", InsertRequest("", decoded, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    assert (out.inserted_tokens, out.reused_tokens) == (2 * PS, 12 * PS)
    eng.assert_cached(decoded)
    assert l1_full(ctl) == (14, 18)


# ---------------------------------------------------------------------- loads that do not land


def test_a_failed_offset_load_gives_every_page_back_in_order(make) -> None:
    """The copy fails: the head's unused pages, the run's and the SWA window's all go back
    to the allocation in their places (it starts at the boundary again); the engine then
    computes the whole prompt there, and the tree's head pages are untouched."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 5000)
    head = tree_l1_pages(ctl)
    prompt = p + seq(4, base=9500)
    m = request(ctl, prompt)
    before = free_counts(ctl)
    with failing_load(ctl, "e1", m.lock_id):
        ctl.check_integrity()
    assert free_counts(ctl) == before
    rec = allocation(ctl, "e1", m.allocation_id)
    assert rec.start_page == 0 and not rec.retired
    for kind in rec.pages:
        np.testing.assert_array_equal(rec.pages[kind], m.pages[ctl.cfg.model.family(kind)[0].name])
    finish(ctl, eng, m, prompt, 0)
    assert head <= tree_l1_pages(ctl)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (12, 20)


def test_a_failed_load_with_an_swa_slot_before_the_run_gives_it_back(make) -> None:
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = swa_before_run(ctl, eng, 5500)
    prompt = p + seq(4, base=9550)
    m = request(ctl, prompt)
    before = free_counts(ctl)
    with failing_load(ctl, "e1", m.lock_id):
        pass
    assert free_counts(ctl) == before
    rec = allocation(ctl, "e1", m.allocation_id)
    np.testing.assert_array_equal(rec.pages[SWA], m.pages["swa"])
    np.testing.assert_array_equal(rec.pages[FULL], m.pages["full"])
    finish(ctl, eng, m, prompt, 0)
    eng.assert_cached(prompt)


def test_an_abandoned_offset_load_leaves_the_engine_its_whole_allocation(make) -> None:
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 6000)
    prompt = p + seq(4, base=9600)
    m = request(ctl, prompt)
    abandon_mid_copy(ctl, "e1", m.lock_id)
    ctl.check_integrity()
    rec = allocation(ctl, "e1", m.allocation_id)
    assert rec.start_page == 0
    np.testing.assert_array_equal(rec.pages[FULL], m.pages["full"])
    assert not set(m.pages["full"].tolist()) & tree_l1_pages(ctl)
    assert not set(m.pages["swa"].tolist()) & tree_l1_pages(ctl, SWA)
    finish(ctl, eng, m, prompt, 0)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (12, 20)


def test_a_lock_released_during_an_offset_load_gives_the_pages_back(make) -> None:
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 6500)
    prompt = p + seq(4, base=9650)
    m = request(ctl, prompt)
    release_during_load(ctl, "e1", m.lock_id)
    ctl.check_integrity()
    rec = allocation(ctl, "e1", m.allocation_id)
    assert rec.start_page == 0
    np.testing.assert_array_equal(rec.pages[FULL], m.pages["full"])
    assert l1_full(ctl) == (2, 32 - 2 - 12)
    eng.write(m.pages, prompt, 0)
    out = ctl.insert("e1", InsertRequest("", prompt, allocation_id=m.allocation_id, mamba_checkpoint=True))
    assert out.inserted_tokens + out.reused_tokens == 12 * PS
    eng.assert_cached(prompt)


def test_an_allocation_released_during_an_offset_load_frees_its_head_pages_once(make) -> None:
    """The engine releases the allocation (keeps the lock) mid-copy: the run lands in the
    tree, the head's unused pages are freed (no allocation holds them now), once."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 7000)
    prompt = p + seq(4, base=9700)
    m = request(ctl, prompt)
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        ctl.release("e1", None, m.allocation_id)
        ctl.check_integrity()
        gate.open()
        final = loader.result()[-1]
    finally:
        gate.restore()
    eng.verify(final.device_pages, prompt, 8)
    ctl.check_integrity()
    assert l1_full(ctl) == (8, 24)
    ctl.release("e1", m.lock_id, None)


def test_a_lease_lapsing_during_an_offset_load_frees_each_page_once(make) -> None:
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 7500)
    Engine(ctl, "doomed")
    prompt = p + seq(4, base=9750)
    m = request(ctl, prompt, "doomed")
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("doomed", m.lock_id)
        now = time.monotonic()
        ctl._engines._clock = lambda: now + 3600.0
        ctl.expire_leases()
        ctl._engines._clock = time.monotonic
        ctl.check_integrity()
        gate.open()
        with pytest.raises(NotFound):
            loader.result()
    finally:
        ctl._engines._clock = time.monotonic
        gate.restore()
    ctl.check_integrity()
    assert l1_full(ctl) == (8, 24)
    eng.assert_cached(p)


def test_an_offset_load_failing_after_the_allocation_grew_gives_back_in_order(make) -> None:
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 8000)
    prompt = p + seq(4, base=9800)
    m = request(ctl, prompt)
    with failing_load(ctl, "e1", m.lock_id):
        grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
        ctl.check_integrity()
    rec = allocation(ctl, "e1", m.allocation_id)
    assert rec.start_page == 0
    np.testing.assert_array_equal(rec.pages[FULL][:12], m.pages["full"])
    np.testing.assert_array_equal(rec.pages[FULL][12:], grown.pages["full"][-2:])
    whole = prompt + seq(2, base=9900)
    eng.write({mb.name: (m.pages[mb.name] if mb.component is MAMBA else rec.pages[mb.component])
               for mb in ctl.cfg.model.members}, whole, 0)
    out = ctl.insert("e1", InsertRequest("", whole, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    assert out.inserted_tokens + out.reused_tokens == 14 * PS
    eng.assert_cached(whole)


def test_an_allocation_never_outgrows_the_request_limit_through_a_lent_load(make) -> None:
    """`_check_growth`: "an allocation holds at most the pages of one request's tokens at
    once, however many calls grew it". The offset load borrows 8 pages (2 of them the
    unused head), the engine grows the allocation mid-copy, the copy fails."""
    ctl = make(hybrid=True, l1_tokens=128, write__l1_to_l2="write_through",
               storage__backend="none", server__max_tokens_per_request=64)  # 16 pages
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 8500)
    prompt = p + seq(4, base=9850)
    m = request(ctl, prompt)
    with pytest.raises(InvalidArgument):  # 12 + 12 pages: refused before the load
        ctl.allocate("e1", AllocateRequest("", 48, allocation_id=m.allocation_id))
    # (refusing the growth mid-copy is one right answer)
    with failing_load(ctl, "e1", m.lock_id), contextlib.suppress(InvalidArgument):
        ctl.allocate("e1", AllocateRequest("", 48, allocation_id=m.allocation_id))
    rec = allocation(ctl, "e1", m.allocation_id)
    held = len(rec.pages[FULL]) + sum(len(ids) for ids in rec.retired.get(FULL, []))
    with ctl._mu:
        assert ctl.loads.lent_from(rec) == 0  # (the failed load gave its pages back)
    try:
        assert held <= 16, f"the allocation holds {held} pages, at most 16"
    finally:
        ctl.release("e1", m.lock_id, m.allocation_id)


# ---------------------------------------------------------------------- more than one load


def test_two_requests_loading_one_offset_path_copy_it_once_and_share_no_page(make) -> None:
    """R1's load lends (its copy held); R2 matches the same path and loads: it waits for
    R1's copy, copies nothing, and reads the pages R1's allocation lent (now the tree's);
    its own allocation is untouched and its head pages go as loaded at its insert."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 10000)
    one, two = p + seq(4, base=20000), p + seq(4, base=21000)
    m1 = request(ctl, one)
    gate = CopyGate(ctl)
    try:
        first = gate.held_load("e1", m1.lock_id)
        m2 = request(ctl, two)
        assert (m2.device_tokens, m2.host_tokens) == (0, 8 * PS)
        assert not set(m1.pages["full"].tolist()) & set(m2.pages["full"].tolist())
        second = Loader(ctl, "e1", m2.lock_id)
        second.start()
        time.sleep(0.05)
        ctl.check_integrity()
        gate.open()
        f1 = first.result()[-1]
        f2 = second.result()[-1]
    finally:
        gate.restore()
    assert gate.reached == 3  # one load's copies (MAMBA, SWA, FULL): R2 copied nothing
    for name in f1.device_pages:
        np.testing.assert_array_equal(f1.device_pages[name], f2.device_pages[name])
    np.testing.assert_array_equal(f1.device_pages["full"][2:], m1.pages["full"][2:8])
    rec2 = allocation(ctl, "e1", m2.allocation_id)
    assert rec2.start_page == 0 and not rec2.retired
    np.testing.assert_array_equal(rec2.pages[FULL], m2.pages["full"])
    finish(ctl, eng, m1, one, f1.device_tokens)
    finish(ctl, eng, m2, two, f2.device_tokens)
    eng.assert_cached(one)
    eng.assert_cached(two)
    assert l1_full(ctl) == (16, 16)


def test_a_second_load_of_the_lock_during_an_offset_lent_load(make, monkeypatch) -> None:
    """Two streams of one lock (e.g. a retry): the first lends, the second (after the
    wait for the first's copy) copies into pages of its own; whichever lands first, the
    request inserts byte-exact and every page is freed once."""
    monkeypatch.setattr(loads_mod, "LOAD_WAIT_S", 0.05)
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 11000)
    prompt = p + seq(4, base=22000)
    m = request(ctl, prompt)
    gate = CopyGate(ctl)
    try:
        first = gate.held_load("e1", m.lock_id)
        second = gate.held_load("e1", m.lock_id)
        ctl.check_integrity()
        gate.open()
        f1, f2 = first.result()[-1], second.result()[-1]
    finally:
        gate.restore()
    eng.verify(f1.device_pages, prompt, 8)
    eng.verify(f2.device_pages, prompt, 8)
    ctl.check_integrity()
    finish(ctl, eng, m, prompt, f1.device_tokens)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (12, 20)


def test_allocate_then_load_over_an_offset_path(make) -> None:
    """The two-step request: a locked match without an allocation, Allocate(lock_id=),
    then Load. The allocation is not the match's (nothing is lent): byte-exact, and
    every page freed once."""
    ctl = hybrid(make)
    eng = Engine(ctl)
    p = head_in_l1(ctl, eng, 12000)
    prompt = p + seq(4, base=23000)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True))
    a = ctl.allocate("e1", AllocateRequest("", len(prompt) // 4, lock_id=m.lock_id))
    final = list(ctl.load("e1", m.lock_id))[-1]
    eng.verify(final.device_pages, prompt, 8)
    assert not set(final.device_pages["full"].tolist()) & set(a.pages["full"].tolist())
    ctl.check_integrity()
    alloc = {n: ids if n in ("mamba", "conv") else ids[8:] for n, ids in a.pages.items()}
    eng.write(alloc, prompt, 8)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=a.allocation_id,
                                         mamba_checkpoint=True))
    assert (out.inserted_tokens, out.reused_tokens) == (4 * PS, 8 * PS)
    eng.assert_cached(prompt)
    assert l1_full(ctl) == (12, 20)
