"""Review (s27) of the L3 write path's landing: `L3Write`, `backup_to_storage`,
`_landed_l3` (which now re-offers a slot L2 replaced while its write ran), `_maybe_l3`,
`_queued_l3`, `_on_split`, `_l2_victim`, and the tree's `slots_for_storage`.

Every L3 write is held at the backend (`_write_from`, `Held`) while the tree changes
under it; every interleaving that matters is forced both ways. Every controller is
audited at the end (`make`)."""

from __future__ import annotations

import threading

import pytest
from engine_sim import Engine, evict_all, seq, tree_path
from l3_kit import Held, in_l3, quiet_and_unwritten, resident, storage_tokens, wait_for

from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
SWA = ComponentKind.SWA
MAMBA = ComponentKind.MAMBA
PB = 16  # bytes of one page of tokens (page size 4, u32 tokens)


def insert_tail(ctl, eng: Engine, tokens: bytes, tail: int):  # type: ignore[no-untyped-def]
    """`Engine.insert_with_swa_tail` for a model with or without MAMBA: every page of
    `tokens` written, all but the last `tail` SWA pages freed (-1), inserted under the
    mutex, then the write policy applied. Returns the end node."""
    n = len(tokens) // PB
    t = ctl.transfers
    with ctl._mu:
        pages = {kind: t.allocate_l1(kind, n) for kind in (FULL, SWA)}
        slot = t.allocate_l1(MAMBA, 1) if MAMBA in ctl._kinds else None
        by_member = {m.name: pages.get(m.component, slot) for m in ctl.cfg.model.members}
        eng.write(by_member, tokens, 0)
        swa = pages[SWA]
        t.free_l1(SWA, swa[: n - tail])
        given = swa.copy()
        given[: n - tail] = -1
        r = ctl.tree.insert("", tokens, {FULL: pages[FULL], SWA: given},
                            mamba_slot=None if slot is None else int(slot[0]))
        t.after_insert(r.end)
        return r.end


def swa_ctl(make, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("l1_tokens", 128)
    return make(swa_only=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through", **kw)


def hybrid_ctl(make, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("l1_tokens", 128)
    return make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through", **kw)


# ---------------------------------------------------------------------- bugs


class CopyHold:
    """Holds the L1->L2 flushes (`copier.device_to_host`) while `hold` is set."""

    def __init__(self, ctl) -> None:  # type: ignore[no-untyped-def]
        self.copier = ctl.transfers.copier
        self.real = self.copier.device_to_host
        self.hold = threading.Event()
        self.gate = threading.Event()
        self.reached = threading.Event()

        def held(*args, **kwargs):  # type: ignore[no-untyped-def]
            if self.hold.is_set():
                self.reached.set()
                assert self.gate.wait(10), "copy gate never opened"
            return self.real(*args, **kwargs)

        self.copier.device_to_host = held

    def restore(self) -> None:
        self.gate.set()
        self.copier.device_to_host = self.real


# Found by the review, fixed: _landed_l3 treats a head's SWA slot as covered by the write it
# was split off (L3Write.covers) even where that write stored only the tail node's SWA tail,
# so a window committed at the head while the write ran is never offered to L3


@pytest.mark.parametrize("copy_lands_first", [True, False])
def test_a_window_grown_whole_at_a_covered_head_is_written_to_l3(make, copy_lands_first: bool) -> None:
    """Turn 1 inserts 8 pages with only a 2-page SWA tail; its L3 write (FULL, the SWA
    tail: pages 6-7) is held. A request for the first 4 pages splits the node: the head
    holds no SWA (the tail lies in the tail node); the request commits the head's whole
    window, which write-through copies to L2 and offers to L3. `copy_lands_first`: the
    offer finds the head "queued" (covered by the held write) and writes nothing; the
    held write then lands and offers the head only what it does not cover, and SWA
    counts as covered for a head although the write stored none of the head's SWA
    pages. Once quiet the window is in L2 only: the 4-page prefix is lost to L3 once L1
    and L2 let it go. (The other order, the write landing first, writes it.)"""
    ctl = swa_ctl(make)
    eng = Engine(ctl)
    p = seq(8, base=100)
    held = Held(ctl)
    copies = CopyHold(ctl)
    try:
        node = insert_tail(ctl, eng, p, 2)
        held.wait_reached()
        if not copy_lands_first:
            copies.hold.set()
        eng.request(p[: 4 * PB])
        with ctl._mu:
            head = tree_path(ctl, p)[0]
            assert ctl.tree.depth_tokens(head) == 16 and head is not node
            assert ctl.transfers._queued_l3.get(id(head)) is ctl.transfers._queued_l3[id(node)]
            ctl.transfers._schedule_l2_flush(urgent=True)
        if copy_lands_first:
            wait_for(lambda: resident(ctl, head, SWA, Tier.HOST))
            held.open()
        else:
            assert copies.reached.wait(10)
            held.open()
            wait_for(lambda: not ctl.transfers._queued_l3)
            assert not resident(ctl, head, SWA, Tier.HOST)
            copies.gate.set()
        assert ctl.transfers.drain(10)
    finally:
        copies.restore()
        held.restore()
    assert not ctl.transfers._queued_l3
    assert in_l3(ctl, eng, p, SWA, 2, 4) == 2, "the head's window is not in L3"
    assert quiet_and_unwritten(ctl) == []
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert storage_tokens(ctl, p[: 4 * PB]) == 16


def full_keys(ctl, eng: Engine, tokens: bytes) -> list[str]:  # type: ignore[no-untyped-def]
    return ctl.l3.keys("", eng.hashes(tokens), ctl.cfg.model.family(FULL))


# Found by the review, fixed: _landed_l3 marks a FULL (or MAMBA) slot `changed` when L2 holds
# it under other host pages than the write's, although its keys are the content's: a slot
# copied to L2 again while its write ran is written to L3 a second time


@pytest.mark.parametrize("copy_lands_first", [True, False])
def test_a_full_slot_copied_to_l2_again_while_its_write_runs_is_written_once(
        make, copy_lands_first: bool) -> None:
    """A node's L3 write (FULL) is held; meanwhile its L2 slot leaves (the held pages
    park) and a second request copies it to L2 again (new host pages, the same
    content). The keys are the content's, so once the write lands the FULL slot is in
    L3 (as `_landed_l3` reasons where the L2 slot is gone: the other order, the write
    landing before the new copy, records it and writes nothing more): recorded, not
    written a second time."""
    ctl = make(l1_tokens=128, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(4, base=300)
    held = Held(ctl)
    copies = CopyHold(ctl)
    try:
        eng.request(p)
        held.wait_reached()
        with ctl._mu:
            (node,) = tree_path(ctl, p)
            ctl.transfers._evict(Tier.HOST, FULL, 100)
            assert not ctl.tree.is_resident(node, FULL, Tier.HOST)
        if not copy_lands_first:
            copies.hold.set()
        eng.request(p)  # copies it to L2 again
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        if copy_lands_first:
            wait_for(lambda: resident(ctl, node, FULL, Tier.HOST))
            held.open()
        else:
            assert copies.reached.wait(10)
            held.open()
            wait_for(lambda: not ctl.transfers._queued_l3)
            copies.gate.set()
        assert ctl.transfers.drain(10)
    finally:
        copies.restore()
        held.restore()
    with ctl._mu:
        assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
        assert ctl.tree.is_resident(node, FULL, Tier.HOST)
    want = full_keys(ctl, eng, p)
    put = [k for k in held.put_keys() if k in set(want)]
    assert sorted(put) == sorted(want), f"{len(put)} FULL keys put for 4 pages"
    assert in_l3(ctl, eng, p, FULL, 0, 4) == 4


def family_keys(ctl, eng: Engine, tokens: bytes, kind: ComponentKind, lo: int, hi: int) -> list[str]:  # type: ignore[no-untyped-def]
    return ctl.l3.keys("", eng.hashes(tokens)[lo:hi], ctl.cfg.model.family(kind))


# Found by the review, fixed: _landed_l3 records only FULL for the heads split off a write's
# node, never their SWA share that the write stored: a head's whole window is written to L3 a
# second time at the next match of its path


def test_a_covered_heads_window_written_by_the_write_is_recorded_not_written_again(make) -> None:
    """An 8-page node with its whole window in L2 is being written (FULL, SWA: all 8
    pages); a request splits it at page 4. The write lands: it stored the head's share
    of both slots. The head's FULL is recorded in L3 (its share of the write), its
    whole SWA slot is not: the next match of the path offers it and writes the head's
    4 SWA pages a second time."""
    ctl = swa_ctl(make)
    eng = Engine(ctl)
    p = seq(8, base=400)
    held = Held(ctl)
    try:
        eng.request(p)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        held.wait_reached()
        eng.request(p[: 4 * PB] + seq(2, base=4400))  # splits the node at page 4
        held.open()
        assert ctl.transfers.drain(10)
        with ctl._mu:
            head, _tail = tree_path(ctl, p)
            assert ctl.tree.is_resident(head, FULL, Tier.STORAGE)
            assert len(ctl.tree.pages_of(head, SWA, Tier.HOST)) == 4  # (whole)
        assert in_l3(ctl, eng, p, SWA, 0, 8) == 8
        ctl.match("e1", MatchRequest("", p))
        assert ctl.transfers.drain(10)
        want = family_keys(ctl, eng, p, SWA, 0, 4)
        put = [k for k in held.put_keys() if k in set(want)]
    finally:
        held.restore()
    assert sorted(put) == sorted(want), f"{len(put)} SWA keys put for the head's {len(want)}"
    assert quiet_and_unwritten(ctl) == []


# Found by the review, fixed: _l2_victim (write_back) leaves out every kind a queued write
# `covers` by name: a head's SWA window that write never stored (it wrote the tail node's SWA
# tail) leaves L2 unwritten, lost to L3


@pytest.mark.parametrize("write_lands_first", [False, True])
def test_a_heads_window_leaving_l2_under_write_back_while_a_flush_write_runs_goes_to_l3(
        make, write_lands_first: bool) -> None:
    """write_back L2 -> L3: a flush writes an 8-page node with a 2-page SWA tail (FULL,
    SWA pages 6-7; held). A request for the first 4 pages splits it and commits the
    head's whole window (L2 gets it by write-through). Then L1 and L2 let go of the
    path: each slot leaving L2 goes to L3 first (`_l2_victim`), except what the queued
    write covers, and the head's SWA counts as covered. Once everything landed the
    4-page prefix is not served from L3 (its window at page 4 was never stored).
    (`write_lands_first`: the eviction comes after the flush's write landed.)"""
    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_back")
    eng = Engine(ctl)
    p = seq(8, base=500)
    insert_tail(ctl, eng, p, 2)
    assert ctl.transfers.drain(10)
    held = Held(ctl)
    flusher = threading.Thread(target=ctl.flush, args=(10,), daemon=True)
    try:
        flusher.start()
        held.wait_reached()
        eng.request(p[: 4 * PB])
        with ctl._mu:
            head = tree_path(ctl, p)[0]
            assert ctl.tree.depth_tokens(head) == 16
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: resident(ctl, head, SWA, Tier.HOST))
        if write_lands_first:
            held.open()
            flusher.join(10)
            assert not flusher.is_alive()
        with ctl._mu:
            assert len(ctl.tree.pages_of(head, SWA, Tier.HOST)) == 4
            ctl.transfers._evict(Tier.DEVICE, FULL, 1000)
            ctl.transfers._evict(Tier.HOST, FULL, 1000)
            assert not ctl.tree.is_live(head)
        held.open()
        flusher.join(10)
        assert not flusher.is_alive()
        assert ctl.transfers.drain(10)
    finally:
        held.restore()
    assert in_l3(ctl, eng, p, FULL, 0, 8) == 8
    assert storage_tokens(ctl, p[: 4 * PB]) == 16


# Found by the review, fixed: _landed_l3 records a head's FULL share only where the head's L2
# pages are the very ones written, and never re-offers a head: a head whose L2 copy left and
# came back while the write ran is left unrecorded and unoffered (its copy landing first) or
# written to L3 a second time (the write landing first)


@pytest.mark.parametrize("copy_lands_first", [True, False])
def test_a_covered_head_copied_to_l2_again_while_the_write_runs_is_recorded_once(
        make, copy_lands_first: bool) -> None:
    """An 8-page node's L3 write (FULL) is held; a request splits it at page 4. L2 lets
    go of the path (the held pages park); a request for the 8 pages copies both nodes
    to L2 again (other host pages, the same content). Keys are the content's: once
    quiet both nodes must be recorded in L3 (an L3 write would add nothing), and the
    head's 4 FULL pages put once only."""
    ctl = make(l1_tokens=128, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(8, base=800)
    held = Held(ctl)
    copies = CopyHold(ctl)
    try:
        eng.request(p)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        held.wait_reached()
        eng.request(p[: 4 * PB] + seq(2, base=8800))  # splits the node at page 4
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: not ctl.transfers._queued_l2)
        with ctl._mu:
            head, tail = tree_path(ctl, p)
            ctl.transfers._evict(Tier.HOST, FULL, 1000)
            assert not ctl.tree.is_resident(head, FULL, Tier.HOST)
        if not copy_lands_first:
            copies.hold.set()
        eng.request(p)  # copies head and tail to L2 again
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        if copy_lands_first:
            wait_for(lambda: resident(ctl, head, FULL, Tier.HOST) and resident(ctl, tail, FULL, Tier.HOST))
            held.open()
        else:
            assert copies.reached.wait(10)
            held.open()
            wait_for(lambda: not ctl.transfers._queued_l3)
            copies.gate.set()
        assert ctl.transfers.drain(10)
        want = family_keys(ctl, eng, p, FULL, 0, 4)
        put = [k for k in held.put_keys() if k in set(want)]
    finally:
        copies.restore()
        held.restore()
    assert in_l3(ctl, eng, p, FULL, 0, 8) == 8
    with ctl._mu:
        assert ctl.tree.is_resident(head, FULL, Tier.HOST) and ctl.tree.is_resident(tail, FULL, Tier.HOST)
    assert quiet_and_unwritten(ctl) == []
    assert sorted(put) == sorted(want), f"{len(put)} FULL keys put for the head's {len(want)}"


# ---------------------------------------------------------------------- pinned


@pytest.mark.parametrize("copy_lands_first", [True, False])
def test_a_tail_grown_to_a_longer_tail_while_its_write_runs_is_not_offered_again(
        make, copy_lands_first: bool) -> None:
    """A 4-page node's 2-page SWA tail is being written (held) when a longer tail (3
    pages, still partial) replaces it in L1 and L2. Once quiet: FULL is recorded, SWA
    is not (a partial slot never is), and the 3-page tail is not written again and
    again (one write of the node after the first at most, none looping): nothing is
    queued, and a second drain after a match writes nothing more."""
    ctl = hybrid_ctl(make)
    eng = Engine(ctl)
    p = seq(4, base=900)
    held = Held(ctl)
    copies = CopyHold(ctl)
    try:
        node = insert_tail(ctl, eng, p, 2)
        held.wait_reached()
        if not copy_lands_first:
            copies.hold.set()
        with ctl._mu:
            ids = ctl.transfers.allocate_l1(SWA, 4)
            given = ids.copy()
            given[0] = -1
            ctl.transfers.free_l1(SWA, ids[:1])
            r = ctl.tree.insert("", p, {FULL: ctl.tree.pages_of(node, FULL, Tier.DEVICE), SWA: given})
            assert len(ctl.tree.pages_of(node, SWA, Tier.DEVICE)) == 3
            for kind, gone in r.dropped.items():
                ctl.transfers.free_l2(kind, gone)
            ctl.transfers.refill_host(node)
            for kind, back in r.released.items():
                ctl.transfers.free_l1(kind, back)
            ctl.transfers._schedule_l2_flush(urgent=True)
        if copy_lands_first:
            wait_for(lambda: ctl.tree.pages_of(node, SWA, Tier.HOST) is not None)
            held.open()
        else:
            assert copies.reached.wait(10)
            held.open()
            wait_for(lambda: not ctl.transfers._queued_l3)
            copies.gate.set()
        assert ctl.transfers.drain(10)
        calls = len(held.calls)
        ctl.match("e1", MatchRequest("", p))
        assert ctl.transfers.drain(10)
        assert len(held.calls) == calls
    finally:
        copies.restore()
        held.restore()
    with ctl._mu:
        assert len(ctl.tree.pages_of(node, SWA, Tier.HOST)) == 3
        assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
        assert not ctl.tree.is_resident(node, SWA, Tier.STORAGE)
        assert not ctl.transfers._queued_l3
    assert in_l3(ctl, eng, p, SWA, 2, 4) == 2
    assert quiet_and_unwritten(ctl) == []


def l2_free(ctl) -> dict[ComponentKind, tuple[int, int]]:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return {k: (ctl.host.allocator(k).free_count, ctl.host.allocator(k).total) for k in ctl._kinds}


@pytest.mark.parametrize("outcome", ["lands", "gives_up"])
def test_a_path_leaving_l1_and_l2_while_its_write_runs_frees_every_held_page(make, outcome: str) -> None:
    """Hybrid (FULL, SWA, MAMBA and sidecars): a request's writes are held while L1 and
    L2 let go of the whole path (its held host pages park). Whether the write lands or
    is given up, once it ended no node is left queued or in flight, every L2 page is
    free again, and L3 holds every object (or, given up, the failure is counted)."""
    ctl = hybrid_ctl(make)
    eng = Engine(ctl)
    p = seq(6, base=600)
    if outcome == "gives_up":
        ctl.transfers.backup_worker._retries = 0
    fail = outcome == "gives_up"
    held = Held(ctl)
    real = held.real

    def failing(keys, buffers):  # type: ignore[no-untyped-def]
        from hicache.tiers.storage.base import PutStatus
        return [PutStatus.FAILED] * len(keys) if fail else real(keys, buffers)

    held.real = failing
    try:
        eng.request(p)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        held.wait_reached()
        with ctl._mu:
            ctl.transfers._evict(Tier.DEVICE, FULL, 1000)
            ctl.transfers._evict(Tier.HOST, FULL, 1000)
            assert not ctl.tree.iter_nodes()
            assert any(ctl.transfers._parked_l2.values())
        held.open()
        assert ctl.transfers.drain(10)
    finally:
        held.restore()
    assert not ctl.transfers._queued_l3
    assert not ctl.l3.writing_any()
    assert not any(ctl.transfers._parked_l2.values()) and not any(ctl.transfers._held_l2.values())
    assert all(free == total for free, total in l2_free(ctl).values()), l2_free(ctl)
    if fail:
        assert ctl.transfers.stats["backups_l3_failed"] >= 1
        assert ctl.transfers.stats["backups_l3"] == 0
    else:
        assert ctl.transfers.stats["backups_l3"] == 6
        assert in_l3(ctl, eng, p, FULL, 0, 6) == 6
        assert storage_tokens(ctl, p) == 24
    ctl.check_integrity()


def test_a_write_refused_in_part_is_retried_and_recorded_once(make) -> None:
    """The store refuses the last FULL page of a write's first attempt: the job is
    retried, stores it, and only then is the node recorded in L3; the FULL pages are
    counted stored once each, and no other write of the node follows."""
    from hicache.tiers.storage.base import PutStatus

    ctl = make(l1_tokens=128, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(4, base=700)
    want = full_keys(ctl, eng, p)
    held = Held(ctl)
    real = held.real
    attempts = [0]
    recorded_at_retry: list[bool] = []

    def refusing(keys, buffers):  # type: ignore[no-untyped-def]
        attempts[0] += 1
        if attempts[0] == 1:
            out = real(keys[:-1], buffers[:-1])
            return [*out, PutStatus.FAILED]
        with ctl._mu:
            recorded_at_retry.append(ctl.tree.is_resident(tree_path(ctl, p)[0], FULL, Tier.STORAGE))
        return real(keys, buffers)

    held.real = refusing
    held.open()
    try:
        eng.request(p)
        assert ctl.transfers.drain(10)
    finally:
        held.restore()
    assert attempts[0] == 2 and recorded_at_retry == [False]
    with ctl._mu:
        assert ctl.tree.is_resident(tree_path(ctl, p)[0], FULL, Tier.STORAGE)
    assert ctl.transfers.stats["backups_l3"] == 4
    assert ctl.transfers.stats["backups_l3_present"] == 0
    assert sorted(held.put_keys()) == sorted(want + want)  # (each attempt writes every page)
    assert in_l3(ctl, eng, p, FULL, 0, 4) == 4
