"""Review of f429090..ff71306: SWA session references over the trailing window only
(`_window_top`, `_session_refs`), L3 evictions counted in pages (`count_pages_of`, the file
backend's `_pages`), and L1 allocations that wait for queued write-through copies
(`_l1_victim_after_copies`, `KEEP_THE_REST`). The three bugs it found (a write that
finds its object present never counted as a page, a wait for the copy of a node another
lock holds, a window split's head copied twice) are fixed; the tests pin the fixes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_sim import Engine, seq, session_request
from tree_kit import freed, ids, toks, tree_of

from hicache.config import FileStorageConfig
from hicache.controller.base import MatchRequest
from hicache.tiers.storage import HEADER_BYTES, PutStatus
from hicache.tiers.storage.file import FileBackend
from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
DEV = Tier.DEVICE
WT = {"l1_tokens": 64, "tiers__l2__ratio": 4, "storage__backend": "none",
      "write__l1_to_l2": "write_through"}


def session_insert(tree: HiRadixTree, session: str, tokens: bytes, pages: dict):  # type: ignore[no-untyped-def]
    m = tree.match("", tokens, lock=True, session_id=session)
    start = m.device_tokens // tree.page_size
    return tree.insert("", tokens, {k: v[start:] for k, v in pages.items()}, lock=m.lock)


def _path(tree: HiRadixTree, tokens: bytes) -> list:  # type: ignore[type-arg]
    return tree._walk(tree._roots.get(""), tokens, len(tokens))


# ----------------------------------------------------------------------------- windows


def test_a_window_covering_the_whole_path_references_it_all_then_slides() -> None:
    """Window 3 pages, page size 1. Turn 1 (2 pages) lies inside the window: every page
    referenced. Turn 2 grows the path to 5: the first 2 pages fall out of the window."""
    tree = tree_of(1, swa_window=3)
    a = toks(0, 2)
    session_insert(tree, "s", a, {FULL: ids(1, 2), SWA: ids(11, 12)})
    tree.insert("", toks(100, 3), {FULL: ids(21, 22, 23), SWA: ids(31, 32, 33)})
    tree.insert("", toks(100, 4), {FULL: ids(21, 22, 23, 24), SWA: ids(31, 32, 33, 34)})
    tree.check_integrity()
    assert [n.sref[1] for n in _path(tree, a)] == [1]
    b = a + toks(500, 3)
    session_insert(tree, "s", b, {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    tree.check_integrity()
    path = _path(tree, b)
    assert [(n.depth, n.sref[1]) for n in path] == [(2, 0), (5, 1)]
    # the pages before the window go by LRU like anyone's, the window after them all
    assert freed(tree, DEV, SWA, 3) == [11, 12, 31]
    assert freed(tree, DEV, SWA, 1) == []  # (32 is in U's leaf's window; the session's goes with FULL)
    tree.close_session("s")
    tree.check_integrity()
    assert all(n.sref[1] == 0 for n in _path(tree, b))


def test_two_sessions_on_one_path_keep_their_own_windows() -> None:
    """s1 ends at 6 pages, s2 at 4 of the same path (window 2): s2's window [2, 4) and
    s1's [4, 6); closing s1 leaves s2's references where they were."""
    tree = tree_of(1, swa_window=2)
    long = toks(0, 6)
    session_insert(tree, "s1", long, {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))})
    session_insert(tree, "s2", long[: 4 * 4], {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    tree.check_integrity()
    assert [(n.depth, n.sref[1]) for n in _path(tree, long)] == [(2, 0), (4, 1), (6, 1)]
    tree.close_session("s1")
    tree.check_integrity()
    assert [(n.depth, n.sref[1]) for n in _path(tree, long)] == [(2, 0), (4, 1), (6, 0)]
    tree.close_session("s2")
    tree.check_integrity()


def test_a_reopened_session_starts_with_a_fresh_window() -> None:
    tree = tree_of(4, swa_window=8)
    a = toks(0, 24)
    session_insert(tree, "s", a, {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))})
    tree.close_session("s")
    session_insert(tree, "s", a[: 8 * 4], {FULL: ids(1, 2), SWA: ids(11, 12)})
    tree.check_integrity()
    assert [(n.depth, n.sref[1]) for n in _path(tree, a)] == [(2, 1), (4, 0), (6, 0)]
    tree.close_session("s")
    tree.check_integrity()


# ----------------------------------------------------------------------------- L3 pages


OBJECT = HEADER_BYTES + 4096


def _file_backend(path: Path, capacity_objects: int) -> FileBackend:
    backend = FileBackend(FileStorageConfig(path=str(path), capacity_gb=capacity_objects * OBJECT / (1 << 30)),
                          timeout_s=2.0)
    backend.start()
    assert backend.wait_indexed(5)
    return backend


def _slots(n: int, seed: int = 1) -> list[np.ndarray]:
    from storage_pages import Pool  # (tests/tiers/storage: on sys.path when collected there)

    return Pool(n, seed=seed).slots()


@pytest.fixture
def storage_pages_on_path(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tiers" / "storage"))


def test_a_write_that_finds_its_page_present_counts_its_eviction_as_a_page(
        tmp_path: Path, storage_pages_on_path) -> None:  # type: ignore[no-untyped-def]
    """After a restart the daemon writes a prefix it stored before: the store answers
    PRESENT. The daemon wrote that key: its eviction later is a page's."""
    key = f"hc2/ns/m/{1:032x}/kv/tp0of1"
    first = _file_backend(tmp_path, 2)
    assert first.put_from([key], _slots(1)) == [PutStatus.STORED]
    first.close()
    again = _file_backend(tmp_path, 2)
    again.count_pages_of("/kv/tp0of1")
    assert again.put_from([key], _slots(1)) == [PutStatus.PRESENT]
    others = [f"hc2/ns/m/{i:032x}/kv/tp0of1" for i in range(2, 4)]
    again.put_from(others, _slots(2, seed=5))  # evicts `key`
    stats = again.stats()
    assert stats.evicted == 1
    assert stats.evicted_pages == 1


# ----------------------------------------------------------------------------- waits


def _in_l1(ctl, tokens: bytes) -> int:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return sum(n.npages for n in _path(ctl.tree, tokens) if n.mask[0] & 1)


def test_no_wait_for_the_copy_of_a_node_a_request_keeps_locked(make) -> None:
    """`other`'s copy is queued, and another request holds it locked (a match's lock):
    it cannot leave L1 whatever lands, so waiting for its copy buys nothing: the
    allocation takes the session's path at once (as before the change)."""
    ctl = make(**WT)
    eng = Engine(ctl)
    referenced, other = seq(2), seq(2, 1000)
    session_request(ctl, eng, referenced)
    eng.request(seq(12, 3000))
    assert ctl.transfers.drain(10)
    for _ in range(3):
        ctl.match("e1", MatchRequest("", seq(12, 3000)))
    with ctl._mu:
        assert ctl.transfers.hold_flushes()
    eng.request(other)
    held = ctl.match("e1", MatchRequest("", other, lock=True))
    assert held.device_tokens == 8
    with ctl._mu:
        assert len(ctl.transfers._queued_l2) == 1
    waits = ctl.transfers.stats["allocation_waits"]
    eng.request(seq(14, 5000))
    assert (_in_l1(ctl, referenced), _in_l1(ctl, other)) == (0, 2)
    ctl.release("e1", held.lock_id, None)
    assert ctl.transfers.stats["allocation_waits"] == waits


def test_a_window_split_of_a_node_whose_copy_is_queued_copies_each_page_once(make) -> None:
    """Turn 1 (4 pages) has its L1 -> L2 copy queued (held by an RPC) when turn 2 of its
    session (1 page more, window 2 pages) splits its node at the window's start: the
    queued copy already covers the new head (`_span`), so no page is copied twice (a
    second copy takes L2 pages for nothing, evicting what L2 holds to make room)."""
    ctl = make(swa_only=True, l1_tokens=128, storage__backend="none",
               write__l1_to_l2="write_through")
    eng = Engine(ctl)
    copied: list[int] = []
    copier = ctl.transfers.copier
    original = copier.device_to_host

    def counting(kind, dev, host):  # type: ignore[no-untyped-def]
        if kind is FULL:
            copied.append(len(dev))
        return original(kind, dev, host)

    copier.device_to_host = counting  # type: ignore[method-assign]
    with ctl._mu:
        assert ctl.transfers.hold_flushes()
    turn1 = seq(4)
    session_request(ctl, eng, turn1)
    session_request(ctl, eng, turn1 + seq(1, 500))
    with ctl._mu:
        assert [n.depth for n in _path(ctl.tree, turn1 + seq(1, 500))] == [2, 3, 4, 5]
        ctl.transfers.release_flushes()
    assert ctl.transfers.drain(10)
    assert sum(copied) == 5
    assert ctl.transfers.stats["backups_l2"] == 5


def test_an_l2_allocation_inside_an_l1_eviction_leaves_the_l1_evictions_state(make) -> None:
    """An L1 eviction may allocate in L2 (a victim's write-back copy): that allocation
    must not switch off the L1 eviction's keeping of victims for queued copies."""
    ctl = make(**WT)
    eng = Engine(ctl)
    for i in range(8):  # L2 (32 pages) full of evictable copies
        eng.request(seq(4, 1000 * i))
    assert ctl.transfers.drain(10)
    t = ctl.transfers
    with ctl._mu:
        host = ctl.host.allocator(FULL)
        held = host.allocate(host.free_count)
        t._copies_first, t._kept_for_copies = True, True
        try:
            got = t.allocate_l2(FULL, 2)
            assert (t._copies_first, t._kept_for_copies) == (True, True)
        finally:
            t._copies_first, t._kept_for_copies = False, False
            host.free(got)
            host.free(held)


def test_a_window_split_of_a_node_whose_l3_write_is_queued_writes_each_page_once(make) -> None:
    """The same for L3: turn 1's write-through to L3 is still queued (the store is slow)
    when turn 2 splits its node at the window's start; the head is not written again."""
    import threading
    import time

    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_through")
    eng = Engine(ctl)
    backend = ctl.l3.backend
    original = backend.put_from
    gate = threading.Event()
    written: list[str] = []

    def slow(keys, buffers):  # type: ignore[no-untyped-def]
        assert gate.wait(10)
        written.extend(keys)
        return original(keys, buffers)

    backend.put_from = slow  # type: ignore[method-assign]
    try:
        turn1 = seq(4)
        session_request(ctl, eng, turn1)
        with ctl._mu:  # its L2 copy lands now; its L3 write is then queued (and waits)
            ctl.transfers._schedule_l2_flush(urgent=True)
        deadline = time.monotonic() + 10
        while not ctl.transfers._queued_l3:
            assert time.monotonic() < deadline, "turn 1's L3 write was never queued"
            time.sleep(0.005)
        session_request(ctl, eng, turn1 + seq(1, 500))
    finally:
        gate.set()
    assert ctl.transfers.drain(10)
    full = [k for k in written if "/full/" in k]
    assert len(full) == len(set(full)) == 5


def test_a_multi_kind_allocation_shares_one_bound_on_waiting(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`allocate_l1_all` waits at most `BACKPRESSURE_S` in all: each kind's allocation
    gets what is left of it, not a fresh bound of its own (a hybrid request behind a
    stuck copy would wait once per kind)."""
    import time

    from hicache.controller import transfers as transfers_mod

    monkeypatch.setattr(transfers_mod, "BACKPRESSURE_S", 1.0)
    ctl = make(swa_only=True, l1_tokens=64, storage__backend="none")
    eng = Engine(ctl)
    for i in range(4):
        eng.request(seq(4, 1000 * i))  # L1 full
    t = ctl.transfers
    bounds: list[float] = []
    original = t._allocate

    def slow(tier, kind, n, **kw):  # type: ignore[no-untyped-def]
        if tier is Tier.DEVICE:  # (not the copy worker's L2 allocations)
            bounds.append(kw["wait_s"])
            time.sleep(0.2)  # (as a wait for copies would take)
        return original(tier, kind, n, **kw)

    monkeypatch.setattr(t, "_allocate", slow)
    with ctl._mu:
        got = t.allocate_l1_all({FULL: 2, SWA: 2})
        for kind, ids in got.items():
            t.free_l1(kind, ids)
    assert len(bounds) == 2 and bounds[0] <= 1.0 and bounds[1] <= bounds[0] - 0.2
