"""L3 writes queued and not landed yet, while L2 lets go of their pages. Found by the
multi-turn benchmark on a loaded machine (CI): with the store slower than the inserts,
a request found neither the tree nor the store holding the previous turn (L2 had evicted
it, its write was still queued), and a prefetch found L2 full of pages held by those
writes and was refused. Each test failed before its fix."""

from __future__ import annotations

import threading
import time

import pytest
from engine_sim import Engine, evict_all, flushed, seq, wait_prefetch

from hicache.controller.base import MatchRequest, PrefetchState
from hicache.errors import BackendUnavailable
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


class Gate:
    """Holds the backend's writes until `open()`; `writing` is set by the first one."""

    def __init__(self, backend) -> None:
        self.backend, self.real = backend, backend._write_from
        self.writing, self.gate = threading.Event(), threading.Event()
        backend._write_from = self._write

    def _write(self, keys, buffers):
        self.writing.set()
        assert self.gate.wait(10)
        return self.real(keys, buffers)

    def open(self) -> None:
        self.gate.set()


def _out_of_l1_and_l2(ctl) -> None:
    """Evict every page from L1 and L2 without waiting for queued writes (`evict_all`
    drains them first); pages a write holds are parked until it lands."""
    with ctl._mu:
        for tier, pools in ((Tier.DEVICE, ctl.device), (Tier.HOST, ctl.host)):
            for kind in ctl._kinds:
                ctl.transfers._evict(tier, kind, pools.allocator(kind).total)


def _load_and_verify(ctl, eng: Engine, tokens: bytes) -> None:
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert m.device_tokens + m.host_tokens == len(tokens) // 4
    *_, last = ctl.load("e1", m.lock_id)
    eng.verify(last.device_pages, tokens, last.device_tokens // 4)  # byte for byte
    ctl.release("e1", m.lock_id, None)


def test_a_page_l2_let_go_of_while_its_write_was_queued_is_found_and_prefetched(make) -> None:
    ctl = make(sidecar=True, **THROUGH)
    eng = Engine(ctl)
    tokens = seq(8)
    gate = Gate(ctl.l3.backend)
    eng.request(tokens)
    assert gate.writing.wait(10)  # the L2 copy landed; its L3 write waits at the gate
    _out_of_l1_and_l2(ctl)
    assert ctl.match("e1", MatchRequest("", tokens)).host_tokens == 0  # the tree lost it
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.storage_tokens == 32, "a page being written to L3 counts as L3's"
    assert m.prefetch_id
    time.sleep(0.1)
    assert ctl.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING  # reads wait
    gate.open()
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 32
    ctl.release("e1", m.lock_id, None)
    _load_and_verify(ctl, eng, tokens)
    assert not ctl.l3._writing


def test_a_prefetch_finding_l2_full_of_pages_writes_hold_waits_for_them(make) -> None:
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    wanted, other = seq(8), seq(8, base=10_000)
    eng.request(wanted)
    flushed(ctl, wanted)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # `wanted` only in L3
    gate = Gate(ctl.l3.backend)
    eng.request(other)
    assert gate.writing.wait(10)
    _out_of_l1_and_l2(ctl)  # `other`'s L2 pages are parked until its write lands
    with ctl._mu:  # every other L2 page taken (other requests' reservations)
        alloc = ctl.host.allocator(FULL)
        hog = alloc.allocate(alloc.free_count)
    try:
        deferred = ctl.counters["prefetch_deferred_room"]
        m = ctl.match("e1", MatchRequest("", wanted, lock=True, prefetch=True))
        assert m.prefetch_id, "refused: L2 had no room but what the queued write held"
        assert ctl.counters["prefetch_deferred_room"] == deferred + 1
        time.sleep(0.1)
        assert ctl.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING
        gate.open()  # the write lands, its pages free, the prefetch reserves them
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
        assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 32
        ctl.release("e1", m.lock_id, None)
    finally:
        with ctl._mu:
            alloc.free(hog)
    _load_and_verify(ctl, eng, wanted)


def test_a_deferred_prefetch_gives_up_when_no_room_comes_and_leaks_nothing(make, monkeypatch) -> None:
    """The write it waits for holds pages a request has locked: nothing frees in time."""
    import hicache.controller.prefetch as pf

    monkeypatch.setattr(pf, "WRITES_WAIT_S", 0.2)
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    wanted = seq(8)
    eng.request(wanted)
    flushed(ctl, wanted)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    gate = Gate(ctl.l3.backend)
    eng.request(seq(8, base=10_000))
    assert gate.writing.wait(10)
    # L2 full: the queued write's pages locked by a request in the tree, the rest taken.
    locked = ctl.match("e1", MatchRequest("", seq(8, base=10_000), lock=True))
    with ctl._mu:
        assert ctl.tree.locked_pages(Tier.HOST, FULL) == 8
        alloc = ctl.host.allocator(FULL)
        hog = alloc.allocate(alloc.free_count)
    try:
        refused = ctl.counters["prefetch_refused_room"]
        m = ctl.match("e1", MatchRequest("", wanted, lock=True, prefetch=True))
        assert m.prefetch_id
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.FAILED
        assert ctl.counters["prefetch_refused_room"] == refused + 1
        ctl.release("e1", m.lock_id, None)
    finally:
        gate.open()
        ctl.release("e1", locked.lock_id, None)
        with ctl._mu:
            alloc.free(hog)
    assert ctl.transfers.drain(10)
    ctl.check_integrity()  # no reserved page left behind (and the fixture audits owners)


@pytest.mark.parametrize("how", ["given_up", "dropped"])
def test_writes_given_up_or_dropped_are_no_longer_in_flight(make, how: str) -> None:
    ctl = make(**THROUGH)
    eng = Engine(ctl)
    if how == "given_up":
        def refuse(keys, buffers):
            raise BackendUnavailable("store down")

        ctl.l3.backend._write_from = refuse
    else:  # the backup queue is full
        ctl.transfers.backup_worker.submit = lambda job: False
    dropped = ctl.transfers.stats["backups_dropped"]
    eng.request(seq(4))
    assert ctl.transfers.drain(10)
    assert not ctl.l3._writing
    if how == "dropped":
        assert ctl.transfers.stats["backups_dropped"] == dropped + 4
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    # Neither stored nor in flight: L3 has nothing of it (counted as L3's, a request
    # would have been promised pages no read could bring).
    assert ctl.match("e1", MatchRequest("", seq(4))).storage_tokens == 0


def test_a_wait_for_a_write_in_flight_ends_when_it_lands_or_times_out(make) -> None:
    ctl = make()
    l3 = ctl.l3
    eng = Engine(ctl)
    hashes = eng.hashes(seq(4))
    members = ctl.cfg.model.family(FULL)
    writing = l3.begin_write("", hashes[:2], members)
    assert l3.present_run("", hashes, members) == 2  # in flight counts; the rest is absent
    t0 = time.monotonic()
    assert not l3.wait_written("", hashes[:1], members, 0.1)
    assert time.monotonic() - t0 >= 0.1
    with ctl._mu:
        ids = ctl.transfers.allocate_l2(FULL, 2)
    try:
        t0 = time.monotonic()  # (before the timer starts: it fires >= 0.1 s from here)
        threading.Timer(0.1, l3.end_write, args=(writing,)).start()
        assert l3.wait_written("", hashes[:2], members, 5)  # until the write ends ...
        assert 0.05 <= time.monotonic() - t0 < 4
        assert l3.read("", hashes[:2], members, ids) == 0  # ... never stored: a miss
    finally:
        with ctl._mu:
            ctl.transfers.free_l2(FULL, ids)
    assert not l3._writing and l3.present_run("", hashes, members) == 0


def test_a_prefetch_waits_for_writes_in_flight_once_not_per_read(make, monkeypatch) -> None:
    """A hybrid batch reads FULL, SWA and the checkpoint apart, and each read waits for
    the writes in flight of its pages: each used to get a fresh `WRITES_WAIT_S` (3x as
    long for one batch, the one prefetch worker held meanwhile). Now the op gets it once."""
    import hicache.controller.prefetch as pf
    from hicache.controller import storage_io
    from hicache.controller.workers import Job

    monkeypatch.setattr(pf, "WRITES_WAIT_S", 0.3)
    waits: list[float] = []
    real = storage_io.L3Store.wait_written

    def timed(self, namespace, hashes, members, timeout_s):  # type: ignore[no-untyped-def]
        waits.append(timeout_s)
        return real(self, namespace, hashes, members, timeout_s)

    monkeypatch.setattr(storage_io.L3Store, "wait_written", timed)
    ctl = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request_then_only_in_l3(tokens)  # its objects in L3, the tree empty
    gate = threading.Event()
    ctl.transfers.backup_worker.submit(Job("gate", lambda: gate.wait(30), lambda _e: None))
    try:
        eng.request(tokens)  # recomputed: its L3 write waits behind the gate
        assert ctl.transfers.copy_worker.drain(10)
        _out_of_l1_and_l2(ctl)
        m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE  # (L3 has the objects)
        ctl.release("e1", m.lock_id, None)
    finally:
        gate.set()
    assert waits and sum(waits) <= 0.3 + 1e-6, waits  # it was 0.3 for each of three reads
    assert ctl.transfers.drain(10)
    ctl.check_integrity()


def test_slow_reads_do_not_spend_the_wait_for_writes_in_flight(make, monkeypatch) -> None:
    """The op's budget for waiting on writes in flight counts time spent waiting only: a
    long prefetch on a slow store whose last page is still being written gets its wait.
    (A budget counted from the first read left that read none: FAILED, 12 of 16 tokens.)"""
    import hicache.controller.prefetch as pf

    monkeypatch.setattr(pf, "WRITES_WAIT_S", 1.0)
    monkeypatch.setattr(pf, "BATCH_PAGES", 1)
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    eng.request(seq(3))
    assert ctl.transfers.drain(10)  # pages 1-3 in L3
    backend = ctl.l3.backend
    real_write, real_get = backend._write_from, backend.get_into
    gate, writing = threading.Event(), threading.Event()

    def held_write(keys, buffers):  # type: ignore[no-untyped-def]
        writing.set()
        assert gate.wait(10)
        return real_write(keys, buffers)

    def slow_get(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_get(*args, **kwargs)
        time.sleep(0.3)  # the store answers late
        return out

    monkeypatch.setattr(backend, "_write_from", held_write)
    eng.request(seq(4))
    assert writing.wait(10)  # page 4's write is in flight
    _out_of_l1_and_l2(ctl)
    monkeypatch.setattr(backend, "get_into", slow_get)
    lands = threading.Timer(1.2, gate.set)  # after the three slow reads, within the wait
    lands.start()
    try:
        m = ctl.match("e1", MatchRequest("", seq(4), lock=True, prefetch=True))
        assert m.storage_tokens == 16
        assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
        assert ctl.prefetch_status(m.prefetch_id).tokens_ready == 16
        ctl.release("e1", m.lock_id, None)
    finally:
        gate.set()
        lands.cancel()
    assert ctl.transfers.drain(10)
