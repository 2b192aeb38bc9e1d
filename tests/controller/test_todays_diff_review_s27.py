"""Review (s27) of today's diff: the file backend's walk / eviction / put races
(`_gone_in_walk`, `_writing`, `_evicting` + `_await_eviction`, `close`) and the L3 write
landing by token position (`L3Write.pages`, `_write_covers`, `_landed_l3`, `_l2_victim`).

Races are forced with events and gates (never sleeps); every controller is audited at
the end (`make`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
from engine_sim import Engine, evict_all, seq, tree_path
from l3_kit import Held, in_l3, quiet_and_unwritten, storage_tokens, wait_for

from hicache.config import FileStorageConfig
from hicache.controller.base import MatchRequest
from hicache.tiers.storage import GetStatus, PutStatus
from hicache.tiers.storage.file import FileBackend
from hicache.types import ComponentKind, Tier

# The file backend's race kit and page pools (tests/tiers/storage), as for its own tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers" / "storage"))
from file_kit import OBJECT, WAIT, disk_bytes, disk_objects, gate_call, in_thread, sized_backend
from storage_pages import Pool, keys

FULL = ComponentKind.FULL
SWA = ComponentKind.SWA
MAMBA = ComponentKind.MAMBA
PB = 16  # bytes of one page of tokens (page size 4, u32 tokens)
INDEXER = "hicache-file-index"


# ====================================================================== file backend kit


def fbackend(path: Path, capacity_objects: int | None = None, timeout_s: float = 5.0) -> FileBackend:
    return sized_backend(path, capacity_objects, timeout_s=timeout_s, indexed=True)


# ====================================================================== file backend: bugs


# Found by the review, fixed: FileBackend._write_sync rewrites an object whose stale index
# entry (file removed by another node) stays evictable while it is written: another put's
# eviction unlinks the new file after its rename, yet the put answers STORED and indexes it
def test_a_put_rewriting_an_object_another_node_removed_is_not_unlinked_by_a_concurrent_eviction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two daemons share the store. Node 1 (room for 4 objects) stored a, b, c (a the
    least recent); node 2 deletes a. Node 1 puts a again (a miss made it write): its file
    is renamed into place, not yet recorded, when another put of node 1 needs room and
    evicts a's stale index entry, unlinking the new file. The put still answers STORED
    and records a: the caller records a page in L3 no one can read, and the index counts
    an object not on disk."""
    node1 = fbackend(tmp_path, capacity_objects=4)
    node2 = fbackend(tmp_path)
    a, b, c, d = keys(4, "stale")
    try:
        assert node1.put_from([a, b, c], Pool(3, seed=1).slots()) == [PutStatus.STORED] * 3
        assert node2.delete([a]) == 1  # (another node: node 1's index still holds a)
        renamed, go = gate_call(monkeypatch, os, "replace",
                                 lambda src, dst: dst == node1.path_of(a), after=True)
        writer, out = in_thread(lambda: node1.put_from([a], Pool(1, seed=1).slots()))
        assert renamed.wait(WAIT)  # a's new file is in place, its entry not recorded yet
        assert node1.put_from([d], Pool(1, seed=2).slots()) == [PutStatus.STORED]
        go.set()
        writer.join(WAIT)
        assert out == [[PutStatus.STORED]]
        assert node1.get_into([a], Pool(1, seed=None).slots()) == [GetStatus.HIT], \
            "a put answered STORED, but its object is gone"
        assert node1.used_bytes == disk_bytes(tmp_path)
    finally:
        node1.close()
        node2.close()


# Found by the review, fixed: FileBackend._write_sync: puts of one key released together by
# _await_eviction each write it anew and _reserve it (per writer, not per object): the object
# takes room once, yet one other object is evicted per extra writer
def test_two_puts_waiting_on_one_keys_eviction_reserve_its_room_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for 3: a, b, x stored (a the least recent). c's reservation evicts a, whose
    unlink is held; two puts of a wait for it. Released, they used to both write a anew,
    each holding a reservation for it until its rename: a takes one object's room, so one
    of b, x has to go, not both (3 objects fit: c, a and one of them)."""
    backend = fbackend(tmp_path, capacity_objects=3)
    a, b, x, c = keys(4, "twice")
    try:
        assert backend.put_from([a, b, x], Pool(3, seed=1).slots()) == [PutStatus.STORED] * 3
        reached, go = gate_call(monkeypatch, os, "unlink",
                                 lambda path: path == backend.path_of(a))
        evictor, evicted = in_thread(lambda: backend.put_from([c], Pool(1, seed=3).slots()))
        assert reached.wait(WAIT)
        real_replace = os.replace
        both = threading.Barrier(2, timeout=2.0)  # (a fix may make the second wait)

        def replace(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
            if dst == backend.path_of(a):
                with contextlib.suppress(threading.BrokenBarrierError):
                    both.wait()  # (both writers reserved before either renames)
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        putters = [in_thread(lambda: backend.put_from([a], Pool(1, seed=1).slots()))
                   for _ in range(2)]
        wait_for(lambda: len(backend._quiet._waiters) == 2)  # type: ignore[attr-defined]
        go.set()
        evictor.join(WAIT)
        for t, _ in putters:
            t.join(WAIT)
        assert evicted == [[PutStatus.STORED]]
        # One writes it anew; the other waits for that write and finds it present.
        assert sorted(out[0][0].value for _, out in putters) == ["present", "stored"]
        assert backend._writing == {} and backend._reserved == 0
        assert backend.used_bytes == disk_bytes(tmp_path)
        assert [backend.exists_prefix([k]) for k in (a, c)] == [1, 1]
        assert len(disk_objects(tmp_path)) == 3, "two objects evicted for one object's room"
    finally:
        backend.close()


# ====================================================================== controller kit


def family_keys(ctl, eng: Engine, tokens: bytes, kind: ComponentKind, lo: int, hi: int) -> list[str]:  # type: ignore[no-untyped-def]
    return ctl.l3.keys("", eng.hashes(tokens)[lo:hi], ctl.cfg.model.family(kind))


def recorded_but_absent(ctl, eng: Engine, tokens: bytes) -> list[tuple[int, ComponentKind]]:  # type: ignore[no-untyped-def]
    """(page index, kind) of every slot along `tokens` the tree records in STORAGE whose
    objects are not all in the backend (a MAMBA checkpoint: its node's last page)."""
    out = []
    with ctl._mu:
        path = tree_path(ctl, tokens)
        rows = [(node, ctl.tree.depth_tokens(node) // 4, node.npages) for node in path]
        records = [(end, npages, [k for k in ctl._kinds if ctl.tree.is_resident(node, k, Tier.STORAGE)])
                   for node, end, npages in rows]
    for end, npages, kinds in records:
        for kind in kinds:
            lo = end - 1 if kind is MAMBA else end - npages
            for i in range(lo, end):
                if in_l3(ctl, eng, tokens, kind, i, i + 1) != 1:
                    out.append((i, kind))
    return out


def write_through(make, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("l1_tokens", 128)
    return make(write__l1_to_l2="write_through", write__l2_to_l3="write_through", **kw)


# ====================================================================== controller: bugs


# Found by the review, fixed: Transfers._write_covers (controller/transfers.py) answers False
# for every head once the write's node left the tree, so _landed_l3 records no head it wrote
# and re-offers it: the head's pages are written to L3 a second time
def test_a_head_whose_split_tail_left_the_tree_while_the_write_ran_is_recorded_not_written_again(
        make) -> None:
    """An 8-page node's L3 write (FULL) is held; a request for its first 4 pages and 2
    new ones splits it (head: pages 0-3, tail: the write's node, pages 4-7). The tail,
    a leaf, then leaves L1 and L2 (gone from the tree) while the write runs. The write
    lands: it stored the head's 4 pages (keys are the content's), so the head is
    recorded in L3, not written again."""
    ctl = write_through(make)
    eng = Engine(ctl)
    p = seq(8, base=1000)
    held = Held(ctl)
    try:
        eng.request(p)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        held.wait_reached()
        with ctl._mu:
            (node,) = tree_path(ctl, p)
        eng.request(p[: 4 * PB] + seq(2, base=1900))  # splits the node at page 4
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: not ctl.transfers._queued_l2)
        with ctl._mu:
            head, tail = tree_path(ctl, p)
            assert tail is node and ctl.transfers._queued_l3.get(id(head)) is not None
            for tier in (Tier.DEVICE, Tier.HOST):
                while ctl.tree.is_live(tail) and ctl.tree.pages_of(tail, FULL, tier) is not None:
                    ctl.transfers._evict(tier, FULL, 4)
            assert not ctl.tree.is_live(tail) and ctl.tree.is_live(head)
        held.open()
        assert ctl.transfers.drain(10)
        want = family_keys(ctl, eng, p, FULL, 0, 4)
        put = [k for k in held.put_keys() if k in set(want)]
    finally:
        held.restore()
    assert in_l3(ctl, eng, p, FULL, 0, 4) == 4
    with ctl._mu:
        assert ctl.tree.is_resident(head, FULL, Tier.STORAGE)
    assert sorted(put) == sorted(want), f"{len(put)} FULL keys put for the head's {len(want)}"


# Found by the review, fixed: Transfers._landed_l3 renews (storage_renewed) only the write's
# node and heads it records anew: a head split off a renewal write keeps its stale record, so
# the re-offer (slots_for_storage with stale_before) writes the head's pages a second time
def test_a_head_split_off_a_renewal_write_is_renewed_not_written_again(make) -> None:
    """Objects expire (a TTL store: `object_ttl_s`). An 8-page node's record in L3 is
    older than half the TTL: a match writes it again (the renewal write, held). A request
    splits it at page 4; the head inherits the stale record. The renewal write stores
    (renews) all 8 pages, the head's 4 among them: once it landed the head's record is
    renewed, and neither the landing nor the next match writes the head again."""
    ctl = write_through(make)
    ctl.l3.object_ttl_s = 600.0
    eng = Engine(ctl)
    p = seq(8, base=2100)
    eng.request(p)
    assert ctl.transfers.drain(10)
    with ctl._mu:
        (node,) = tree_path(ctl, p)
        assert ctl.tree.is_resident(node, FULL, Tier.STORAGE)
        node.stored_at -= 3600.0  # recorded an hour ago (past half the TTL)
    held = Held(ctl)
    try:
        ctl.match("e1", MatchRequest("", p))  # the renewal: written again
        held.wait_reached()
        eng.request(p[: 4 * PB] + seq(2, base=2900))  # splits the node at page 4
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: not ctl.transfers._queued_l2)
        with ctl._mu:
            head, tail = tree_path(ctl, p)
            assert tail is node and ctl.tree.storage_stale(head, ctl.transfers._stale_before())
        held.open()
        assert ctl.transfers.drain(10)
        ctl.match("e1", MatchRequest("", p))
        assert ctl.transfers.drain(10)
        want = family_keys(ctl, eng, p, FULL, 0, 4)
        put = [k for k in held.put_keys() if k in set(want)]
    finally:
        held.restore()
    with ctl._mu:
        assert not ctl.tree.storage_stale(head, ctl.transfers._stale_before())
    assert sorted(put) == sorted(want), f"{len(put)} FULL keys put for the head's {len(want)}"


# Found by the review, fixed: FileBackend.close (tiers/storage/file.py) returns False while
# the start's walk thread runs although the walk holds no caller buffer: the controller's
# close then keeps the whole L2 pool mapped (keep_memory) and warns that an L3 call still runs
def test_closing_a_controller_while_its_l3_walk_runs_releases_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller on a file L3 closes while the store's start walk is in a slow stat
    (a large store on a shared mount): no L3 call runs and no buffer was handed to the
    walk, so L2 is released as on any close."""
    from engine_sim import tiny_config

    from hicache.controller import controller as controller_mod

    in_stat, go = threading.Event(), threading.Event()
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == INDEXER and not in_stat.is_set():
            in_stat.set()
            go.wait(WAIT)
        return real_lstat(path, *args, **kwargs)

    seed = FileBackend(FileStorageConfig(path=str(tmp_path / "l3")), 1.0)
    seed.start()
    assert seed.wait_indexed(WAIT)
    assert seed.put_from(keys(1, "seed"), Pool(1).slots()) == [PutStatus.STORED]
    seed.close()
    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(controller_mod, "close_wait_s", lambda cfg: 0.3)
    ctl = controller_mod.build_controller(tiny_config(tmp_path), f"s27close{os.getpid()}")
    kept: list[bool] = []
    real_host_close = ctl.host.close

    def host_close(keep_memory: bool = False) -> None:
        kept.append(keep_memory)
        real_host_close(keep_memory=keep_memory)

    try:
        assert in_stat.wait(WAIT)
        ctl.host.close = host_close  # type: ignore[method-assign]
        ctl.close()
    finally:
        go.set()
        if not kept:
            ctl.close()
    assert kept == [False], "L2 kept mapped at close: the walk was taken for an L3 call"


# ====================================================================== file backend: checked


def test_a_put_waiting_on_its_keys_eviction_writes_it_anew_and_counters_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for 2. a and b are stored; c's reservation evicts a, whose unlink is held. A
    put of a meanwhile waits for that unlink (it does not answer PRESENT for a file about
    to go), then writes it anew. Once both ended: a reads back, no write is counted under
    way, nothing is reserved, and the index is what is on disk."""
    backend = fbackend(tmp_path, capacity_objects=2)
    a, b, c = keys(3, "wait")
    try:
        assert backend.put_from([a, b], Pool(2, seed=1).slots()) == [PutStatus.STORED] * 2
        reached, go = gate_call(monkeypatch, os, "unlink",
                                 lambda path: path == backend.path_of(a))
        evictor, evicted = in_thread(lambda: backend.put_from([c], Pool(1, seed=3).slots()))
        assert reached.wait(WAIT)  # a chosen, its file still there
        assert len(backend._evicting) == 1
        putter, put = in_thread(lambda: backend.put_from([a], Pool(2, seed=1).slots([0])))
        wait_for(lambda: len(backend._quiet._waiters) == 1)  # type: ignore[attr-defined]
        assert putter.is_alive() and not put
        go.set()
        evictor.join(WAIT)
        putter.join(WAIT)
        assert evicted == [[PutStatus.STORED]] and put == [[PutStatus.STORED]]
        assert backend.get_into([a], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        assert backend._writing == {} and backend._reserved == 0 and not backend._evicting
        assert backend.used_bytes == disk_bytes(tmp_path) == 2 * OBJECT
    finally:
        backend.close()


def test_failed_writes_leave_no_write_under_way_nor_reservation(tmp_path: Path) -> None:
    """A key whose fan-out folder is a file (ENOTDIR: that key fails) beside keys that
    store: `_writing` and `_reserved` go back to nothing, and the index is the disk."""
    backend = fbackend(tmp_path, capacity_objects=8)
    ks = keys(4, "bad")
    bad = backend.path_of(ks[1])
    os.makedirs(os.path.dirname(os.path.dirname(bad)), exist_ok=True)
    with open(os.path.dirname(bad), "wb") as f:  # a file where its folder belongs
        f.write(b"x")
    try:
        out = backend.put_from(ks, Pool(4, seed=5).slots())
        assert out[1] is PutStatus.FAILED
        assert out.count(PutStatus.STORED) == 3
        assert backend._writing == {} and backend._reserved == 0
        assert backend.used_bytes == disk_bytes(tmp_path) == 3 * OBJECT
    finally:
        backend.close()


# ====================================================================== controller: checked


def test_hybrid_checkpoint_committed_at_a_head_while_the_write_runs_goes_to_l3_once(make) -> None:
    """Hybrid: an 8-page request's L3 write (FULL, SWA, MAMBA at page 8) is held; a
    request for the first 4 pages splits the node and commits a checkpoint at the head.
    Once landed: every slot recorded in L3 has all its objects there, nothing is left to
    write, no key was put twice (the head's FULL and SWA share recorded, its checkpoint
    written by the re-offer), and with L1 and L2 emptied both prefixes are served by L3."""
    ctl = write_through(make, hybrid=True)
    eng = Engine(ctl)
    p = seq(8, base=2000)
    held = Held(ctl)
    try:
        eng.request(p)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        held.wait_reached()
        eng.request(p[: 4 * PB])  # splits the node; a checkpoint at page 4
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: not ctl.transfers._queued_l2)
        with ctl._mu:
            head, _tail = tree_path(ctl, p)
            assert ctl.tree.pages_of(head, MAMBA, Tier.HOST) is not None
            assert not ctl.tree.is_resident(head, MAMBA, Tier.STORAGE)
        held.open()
        assert ctl.transfers.drain(10)
        put = held.put_keys()
    finally:
        held.restore()
    assert len(put) == len(set(put)), "a key was put twice"
    assert recorded_but_absent(ctl, eng, p) == []
    assert quiet_and_unwritten(ctl) == []
    assert in_l3(ctl, eng, p, MAMBA, 3, 4) == 1 and in_l3(ctl, eng, p, MAMBA, 7, 8) == 1
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert storage_tokens(ctl, p[: 4 * PB]) == 16
    assert storage_tokens(ctl, p) == 32
