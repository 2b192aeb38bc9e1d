"""Review of e7847d0: `Load` lands the L2 part in the request's own allocation.

A locked `MatchPrefix(allocate_tokens=...)` allocates from the device boundary on, the
L2 part included; `Load` now copies that part into the allocation's first pages
(`Loads.plan_load(lock, lend)`, `_borrow`, `give_back`, `LentPages`) and the
allocation goes on after them. Each controller is audited for page ownership at the
end (`built_controllers`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_sim import (
    CopyGate,
    Engine,
    Loader,
    built_controllers,
    evict_all,
    failing_load,
    in_l2_only,
    l1_full,
    l2_prefix_request,
    release_during_load,
    seq,
    tree_l1_pages,
)

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest
from hicache.errors import InvalidArgument, NotFound
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


@pytest.fixture
def make_ctl(tmp_path):
    with built_controllers(tmp_path, "ll") as factory:
        yield factory






class LayerGate:
    """Each L2 -> L1 copy reports layer 0, then waits for `open()`: a stream is then
    suspended at a progress message while its copy runs (what an engine cancelling the
    stream, or timing out, leaves behind)."""

    def __init__(self, ctl) -> None:
        self.ctl = ctl
        self.gate = threading.Event()
        self.reached = threading.Event()
        copier = ctl.transfers.copier
        self.original = copier.host_to_device

        def held(kind, host, dev, on_layer=None):
            if on_layer is not None:
                on_layer(0)
            self.reached.set()
            assert self.gate.wait(10), "layer gate never opened"
            return self.original(kind, host, dev, on_layer=on_layer)

        copier.host_to_device = held

    def open(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        self.ctl.transfers.copier.host_to_device = self.original


def abandon_mid_copy(ctl, engine_id: str, lock_id: int) -> None:
    """Start `ctl.load`, read its layer-0 progress, then drop the stream while the copy
    still runs (the engine cancelled it / its deadline passed); the copy then finishes."""
    gate = LayerGate(ctl)
    stream = ctl.load(engine_id, lock_id)
    try:
        first = next(stream)
        assert first.device_pages is None and first.layers_ready == 1, first
        gate.open()
        stream.close()  # GeneratorExit mid-copy: `run_load`'s abandoned path
    finally:
        gate.restore()


# ---------------------------------------------------------------------- bugs


def test_an_abandoned_load_leaves_the_request_able_to_insert(make_ctl) -> None:
    """The engine gives up on the stream mid-copy (a client deadline, a cancel) and
    computes the L2 part itself into the pages it was given, then inserts: what it
    did before e7847d0, and what README's "a load that fails gives them back" implies."""
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, longer, m = l2_prefix_request(ctl, eng, base=1100, tail_base=9100)
    assert (m.device_tokens, m.host_tokens, len(m.pages["full"])) == (0, 32, 12)
    abandon_mid_copy(ctl, "e1", m.lock_id)
    ctl.check_integrity()
    eng.write(m.pages, longer, 0)  # the engine computed all 12 pages, in its own pages
    try:
        out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id,
                                             allocation_id=m.allocation_id))
    except InvalidArgument as e:
        ctl.release("e1", m.lock_id, m.allocation_id)
        pytest.fail(f"Insert after an abandoned Load: {e}")
    assert out.inserted_tokens + out.reused_tokens == 48
    eng.assert_cached(longer)


def test_an_abandoned_load_leaves_the_engine_its_allocation_pages(make_ctl) -> None:
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, _longer, m = l2_prefix_request(ctl, eng, base=1200, tail_base=9200)
    abandon_mid_copy(ctl, "e1", m.lock_id)
    held = {int(i) for i in m.pages["full"]}
    try:
        assert not held & tree_l1_pages(ctl), (
            "pages of the engine's live allocation are owned by the tree")
    finally:
        ctl.release("e1", m.lock_id, m.allocation_id)


def test_a_load_failing_for_a_released_lock_gives_the_allocation_its_pages_back(make_ctl) -> None:
    """README: "a load that fails gives them back to the allocation, for the engine to
    compute the part there itself". Here the engine released the lock (its allocation it
    keeps: a handle of its own until Insert or Release), the load fails NOT_FOUND. The
    allocation's first 8 pages stayed with the tree, unlocked: evicted, they went to
    another request while the engine still wrote them. Now they go back to it."""
    ctl = make_ctl(l1_tokens=64, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, longer, m = l2_prefix_request(ctl, eng, base=1300, tail_base=9300)
    release_during_load(ctl, "e1", m.lock_id)
    # The engine computes the request itself into its allocation (as README says a
    # failed load leaves it to); meanwhile L1 pressure evicts and another request
    # allocates: only the 4 pages no one holds.
    assert l1_full(ctl) == (0, 4)  # the 12 are the allocation's again
    evict_all(ctl, Tier.DEVICE)
    other = Engine(ctl, "other")
    b = seq(4, base=40000)
    mb = ctl.match("other", MatchRequest("", b, lock=True, allocate_tokens=len(b) // 4))
    assert not set(mb.pages["full"].tolist()) & set(m.pages["full"].tolist())
    other.write(mb.pages, b, 0)
    eng.write(m.pages, longer, 0)  # e1 writes the pages its live allocation was given
    ctl.insert("other", InsertRequest("", b, lock_id=mb.lock_id, allocation_id=mb.allocation_id))
    out = ctl.insert("e1", InsertRequest("", longer, allocation_id=m.allocation_id))
    assert out.inserted_tokens + out.reused_tokens == 48
    hit = ctl.match("other", MatchRequest("", b))
    assert hit.device_tokens == 16
    other.verify(hit.device_pages, b, 4)  # (e1's bytes went where they belong)
    mine = ctl.match("e1", MatchRequest("", longer))
    assert mine.device_tokens == 48
    eng.verify(mine.device_pages, longer, 12)


def test_lent_pages_another_copy_beat_stay_the_allocations_until_it_ends(make_ctl) -> None:
    """Another engine inserts the same prefix while this load copies: the tree holds the
    slot already and the lent pages do not land. The final message's pages are the tree's
    (README: those are the ones to use); the lent ones stay the allocation's, retired
    (freed with it), never another request's while the engine may still hold their ids."""
    ctl = make_ctl(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a, longer, m = l2_prefix_request(ctl, eng, base=1400, tail_base=9400)
    z = Engine(ctl, "z")
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load("e1", m.lock_id)
        mz = ctl.match("z", MatchRequest("", a, lock=True, allocate_tokens=len(a) // 4))
        z.write(mz.pages, a, 0)
        ctl.insert("z", InsertRequest("", a, lock_id=mz.lock_id, allocation_id=mz.allocation_id))
        gate.open()
        final = loader.result()[-1]
    finally:
        gate.restore()
    eng.verify(final.device_pages, a, 8)  # the message is right ...
    assert not set(final.device_pages["full"].tolist()) & set(m.pages["full"][:8].tolist())
    assert l1_full(ctl) == (8, 32 - 8 - 12)  # z's 8 in the tree; e1's 12 all still its own
    ctl.check_integrity()
    eng.write({"full": m.pages["full"][8:]}, longer, 8)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (16, 32)
    assert l1_full(ctl) == (12, 20)  # ... and the retired 8 left with the allocation


# ---------------------------------------------------------------------- behaviour


def test_a_failed_load_gives_back_in_order_after_the_allocation_grew_mid_copy(make_ctl) -> None:
    """Allocate(allocation_id) grows the allocation while its first pages are lent; the
    copy fails: the lent pages go back in front, the grown ones after, and the engine's
    whole request (prefix recomputed, decode growth) inserts byte-exact."""
    ctl = make_ctl(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, longer, m = l2_prefix_request(ctl, eng, base=1500, tail_base=9500)
    with failing_load(ctl, "e1", m.lock_id):
        grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
        ctl.check_integrity()
    assert grown.pages["full"].tolist()[:4] == m.pages["full"][8:].tolist()  # (mid-load view)
    now = ctl._engines.allocation("e1", m.allocation_id)
    assert now.start_page == 0
    np.testing.assert_array_equal(now.pages[FULL][:12], m.pages["full"])
    assert len(now.pages[FULL]) == 14
    full = longer + seq(2, base=9600)
    eng.write({"full": now.pages[FULL]}, full, 0)
    out = ctl.insert("e1", InsertRequest("", full, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert out.inserted_tokens + out.reused_tokens == 56
    eng.assert_cached(full)


def test_after_a_lent_load_keep_lock_insert_growth_and_final_insert_are_byte_exact(make_ctl) -> None:
    """The request's life after a Load that lent: a keep_lock Insert after prefill, decode
    growth, the final Insert; every page owned once throughout."""
    ctl = make_ctl(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(8, base=1600)
    in_l2_only(ctl, eng, a)
    prefill = a + seq(4, base=9600)
    m = ctl.match("e1", MatchRequest("", prefill, lock=True, allocate_tokens=len(prefill) // 4))
    final = list(ctl.load("e1", m.lock_id))[-1]
    np.testing.assert_array_equal(final.device_pages["full"], m.pages["full"][:8])
    eng.verify(final.device_pages, a, 8)
    eng.write({"full": m.pages["full"][8:]}, prefill, 8)
    out = ctl.insert("e1", InsertRequest("", prefill, lock_id=m.lock_id,
                                         allocation_id=m.allocation_id, keep_lock=True))
    assert (out.inserted_tokens, out.reused_tokens) == (16, 32)
    ctl.check_integrity()
    grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    assert len(grown.pages["full"]) == 2
    decoded = prefill + seq(2, base=9700)
    eng.write({"full": grown.pages["full"]}, decoded, 12)
    out = ctl.insert("e1", InsertRequest("", decoded, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 48)
    eng.assert_cached(decoded)
    assert l1_full(ctl) == (14, 18)


def test_two_loads_of_one_lock_the_lending_one_failing_the_other_lands(make_ctl) -> None:
    """Two streams of one lock (e.g. two ranks): the first lends and its copy fails, the
    second (which waited LOAD_WAIT_S, then copied into pages of its own) lands; the
    allocation has its pages back and the request inserts byte-exact."""
    ctl = make_ctl(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a, longer, m = l2_prefix_request(ctl, eng, base=1700, tail_base=9700)
    gate = CopyGate(ctl)
    gate.fail = True
    first = Loader(ctl, "e1", m.lock_id)
    first.start()
    try:
        gate.wait_reached(1)
        second = Loader(ctl, "e1", m.lock_id)
        second.start()
        gate.wait_reached(2)  # (after LOAD_WAIT_S, a copy of its own)
        ctl.check_integrity()
        gate.open()
        with pytest.raises(OSError, match="injected copy failure"):
            first.result()
        got = second.result()[-1]
    finally:
        gate.restore()
    eng.verify(got.device_pages, a, 8)
    assert not set(got.device_pages["full"].tolist()) & set(m.pages["full"].tolist())
    eng.write({"full": m.pages["full"][8:]}, longer, 8)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (16, 32)
    assert l1_full(ctl) == (12, 20)  # the allocation's 8 given-back pages freed as loaded instead


def test_a_hybrid_load_that_fails_gives_back_every_lent_page(make_ctl) -> None:
    """FULL+SWA+MAMBA: the lent FULL pages, the SWA window's and the SWA pages outside it
    (unused) all go back to the allocation; its own MAMBA slot is untouched, the load's
    checkpoint slot freed; the engine then computes the whole request, byte-exact."""
    ctl = make_ctl(hybrid=True, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    _a, longer, m = l2_prefix_request(ctl, eng, base=1800, tail_base=9800)
    assert (m.device_tokens, m.host_tokens) == (0, 32)
    before = {k: ctl.device.allocator(k).free_count for k in ctl._kinds}
    with failing_load(ctl, "e1", m.lock_id):
        ctl.check_integrity()
    assert {k: ctl.device.allocator(k).free_count for k in ctl._kinds} == before
    rec = ctl._engines.allocation("e1", m.allocation_id)
    for kind in rec.pages:
        np.testing.assert_array_equal(rec.pages[kind], m.pages[ctl.cfg.model.family(kind)[0].name])
    eng.write(m.pages, longer, 0)
    out = ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    assert out.inserted_tokens + out.reused_tokens == 48
    eng.assert_cached(longer)


def test_a_lease_lapsing_during_a_lent_load_frees_each_page_once(make_ctl) -> None:
    """The lapse frees the allocation (less the lent pages); the copy lands them in the
    tree, the unused rest freed: L1 then holds the prefix and nothing else."""
    ctl = make_ctl(hybrid=True, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(8, base=1900)
    in_l2_only(ctl, eng, a)
    Engine(ctl, "doomed")
    longer = a + seq(4, base=9900)
    m = ctl.match("doomed", MatchRequest("", longer, lock=True, allocate_tokens=len(longer) // 4))
    gate = CopyGate(ctl)
    loader = Loader(ctl, "doomed", m.lock_id)
    loader.start()
    try:
        gate.wait_reached(1)
        now = time.monotonic()
        ctl._engines._clock = lambda: now + 3600.0
        ctl.expire_leases()
        ctl.check_integrity()
        gate.open()
        with pytest.raises(NotFound, match="released while its load was copying"):
            loader.result()
    finally:
        gate.restore()
    ctl._engines._clock = time.monotonic
    ctl.check_integrity()
    hit = ctl.match("e2", MatchRequest("", a))
    assert hit.device_tokens == 32
    eng.verify(hit.device_pages, a, 8)
    assert l1_full(ctl) == (8, 56)
