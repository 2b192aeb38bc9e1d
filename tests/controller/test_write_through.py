"""L1->L2 write-through on the copy worker: copies queued while it is busy share one flush
(one host allocation, one engine call per family, one landing), flushes stay within
FLUSH_PAGES, copies wait for a batch (write.l1_to_l2_batch_*) and go when an RPC ends
after it is due, an allocation short of L1 room waits for them, and a flush short of L2
room skips whole nodes. Every page that comes back from L2 is checked byte for byte."""

from __future__ import annotations

import threading
import time

import pytest
from engine_sim import Engine, evict_all, seq

from hicache.controller import transfers as transfers_mod
from hicache.controller.base import AllocateRequest, MatchRequest
from hicache.controller.workers import Job
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


@pytest.fixture
def make(make):
    """Controllers with write-through L1->L2 and no L3, unless a test says otherwise."""
    def factory(**kw):
        return make(**{"storage__backend": "none", "write__l1_to_l2": "write_through", **kw})

    return factory


def gate_copies(ctl) -> threading.Event:
    """Hold the copy worker until the returned event is set: copies queue up behind it."""
    gate = threading.Event()
    assert ctl.transfers.copy_worker.submit(Job("gate", lambda: gate.wait(10), lambda _e: None))
    return gate


def count_copies(ctl) -> list[tuple[ComponentKind, int]]:
    """(family, pages) of every L1->L2 engine call from now on."""
    calls: list[tuple[ComponentKind, int]] = []
    copier = ctl.transfers.copier
    inner = copier.device_to_host

    def spy(kind, device_ids, host_ids, on_layer=None):
        calls.append((kind, len(device_ids)))
        return inner(kind, device_ids, host_ids, on_layer)

    copier.device_to_host = spy
    return calls


def reload_and_verify(ctl, eng: Engine, prompts: list[bytes]) -> None:
    """Drop every L1 copy, then run each prompt again: its pages load back from L2 and
    `Engine` compares every byte with what was written."""
    evict_all(ctl, Tier.DEVICE)
    for tokens in prompts:
        m = eng.request(tokens)
        assert m.device_tokens == 0 and m.host_tokens == len(tokens) // 4


@pytest.mark.parametrize("hybrid", [False, True])
def test_copies_queued_behind_a_busy_worker_land_in_one_flush(make, hybrid: bool) -> None:
    ctl = make(hybrid=hybrid)
    eng = Engine(ctl)
    calls = count_copies(ctl)
    gate = gate_copies(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(6)]
    for tokens in prompts:
        eng.request(tokens)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0  # all six still queued
    assert len(ctl.transfers._pending_l2) == 6
    gate.set()
    assert ctl.transfers.drain(10)
    assert ctl.transfers.stats["l2_flushes"] == 1
    assert ctl.transfers.stats["backups_l2"] >= 12
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 12
    # One engine call per family for the six nodes, FULL first.
    assert [kind for kind, _ in calls] == list(ctl._kinds)
    assert calls[0] == (FULL, 12)
    ctl.check_integrity()  # no host page left in flight, the pins are gone
    reload_and_verify(ctl, eng, prompts)


def test_a_flush_copies_at_most_flush_pages_and_queues_the_rest(make, monkeypatch) -> None:
    monkeypatch.setattr(transfers_mod, "FLUSH_PAGES", 4)
    ctl = make()
    eng = Engine(ctl)
    calls = count_copies(ctl)
    gate = gate_copies(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(5)]  # 10 pages
    for tokens in prompts:
        eng.request(tokens)
    gate.set()
    assert ctl.transfers.drain(10)
    # Queue order is kept: 2+2 pages, 2+2, then the last node alone.
    assert calls == [(FULL, 4), (FULL, 4), (FULL, 2)]
    assert ctl.transfers.stats["l2_flushes"] == 3
    reload_and_verify(ctl, eng, prompts)


def test_an_allocation_short_of_l1_room_waits_for_the_queued_copies(make) -> None:
    ctl = make(l1_tokens=32)  # 8 L1 pages
    eng = Engine(ctl)
    gate = gate_copies(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(4)]  # fills L1, every page pinned
    for tokens in prompts:
        eng.request(tokens)
    assert ctl.device.allocator(FULL).free_count == 0
    start = time.monotonic()  # (before the timer starts: it fires >= 0.2 s from here)
    threading.Timer(0.2, gate.set).start()
    m = ctl.match("e1", MatchRequest("", seq(2, 9000), lock=True, allocate_tokens=8))
    assert time.monotonic() - start >= 0.15  # it waited for the flush, then evicted
    assert ctl.transfers.stats["allocation_waits"] >= 1
    assert len(m.pages["full"]) == 2
    ctl.release("e1", m.lock_id, m.allocation_id)
    assert ctl.transfers.drain(10)
    assert ctl.transfers.stats["l2_flushes"] == 1  # the four copies went together
    reload_and_verify(ctl, eng, prompts)


def test_a_flush_short_of_l2_room_skips_whole_nodes(make) -> None:
    ctl = make()
    eng = Engine(ctl)
    host = ctl.host.allocator(FULL)
    hog = host.allocate(host.free_count - 3)  # L2 has 3 free pages and nothing to evict
    try:
        gate = gate_copies(ctl)
        first, second = seq(2, 1000), seq(2, 2000)
        eng.request(first)
        eng.request(second)
        gate.set()
        assert ctl.transfers.drain(10)
        # The batch (4 pages) did not fit; node by node, the first fit and the second not.
        assert ctl.transfers.stats["backups_l2_skipped"] == 1
        assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2
        assert host.free_count == 1
        assert ctl.tree.locked_pages(Tier.DEVICE, FULL) == 0  # both unpinned
    finally:
        host.free(hog)
    ctl.check_integrity()
    reload_and_verify(ctl, eng, [first])


def test_a_failed_flush_frees_its_host_pages_and_the_next_one_lands(make) -> None:
    ctl = make()
    eng = Engine(ctl)
    copier = ctl.transfers.copier
    inner = copier.device_to_host
    fail = [True]

    def flaky(kind, device_ids, host_ids, on_layer=None):
        if fail.pop() if fail else False:
            raise RuntimeError("copy engine failed")
        return inner(kind, device_ids, host_ids, on_layer)

    copier.device_to_host = flaky
    gate = gate_copies(ctl)
    lost, kept = seq(2, 1000), seq(2, 2000)
    eng.request(lost)
    gate.set()
    assert ctl.transfers.drain(10)
    assert ctl.transfers.copy_worker.failures == 1 and ctl.transfers.copy_worker.alive
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    assert ctl.tree.locked_pages(Tier.DEVICE, FULL) == 0  # unpinned
    ctl.check_integrity()  # the reserved host pages went back to the pool
    eng.request(kept)
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2
    reload_and_verify(ctl, eng, [kept])


def test_a_stalled_l3_store_never_throttles_the_serving_path(make, monkeypatch) -> None:
    """L2 -> L3 write-through into a store that does not answer: the host pages those
    writes hold fill L2, and L1 -> L2 flushes then skip nodes rather than wait for them,
    so L1 allocations (which wait for flushes) never wait on L3."""
    monkeypatch.setattr(transfers_mod, "BACKPRESSURE_S", 60.0)  # a wait would hang the test
    ctl = make(storage__backend="file", write__l2_to_l3="write_through", l1_tokens=32)
    eng = Engine(ctl)
    gate = threading.Event()
    stalled = threading.Event()
    write = ctl.l3.write

    def stuck(*args, **kwargs):
        stalled.set()
        assert gate.wait(60)
        return write(*args, **kwargs)

    monkeypatch.setattr(ctl.l3, "write", stuck)
    done = threading.Event()

    def serve() -> None:
        for i in range(20):  # 40 pages through 8 L1 and 16 L2 pages
            eng.request(seq(2, 1000 * (i + 1)), load=False)
        done.set()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        # About 2 s here; with flushes waiting on the store it took over 20 s.
        worker.join(10)
        assert done.is_set(), "requests waited on the stalled L3 store"
        assert stalled.is_set() and not gate.is_set()
        assert ctl.transfers.stats["backups_l2_skipped"] > 0
    finally:
        gate.set()
    worker.join(30)
    assert ctl.transfers.drain(30)
    ctl.check_integrity()


def wait_for_flushes(ctl, n: int) -> None:  # type: ignore[no-untyped-def]
    """Poll (not `drain`, which flushes held copies too) until `n` flushes ran."""
    deadline = time.monotonic() + 10
    while ctl.transfers.stats["l2_flushes"] < n:
        assert time.monotonic() < deadline, f"{ctl.transfers.stats['l2_flushes']} flushes (< {n})"
        time.sleep(0.005)


def test_copies_queued_while_held_go_in_one_flush_after_the_release(make) -> None:
    ctl = make()
    eng = Engine(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(4)]
    release = ctl.hold_background()
    for tokens in prompts:
        eng.request(tokens)
    time.sleep(0.2)  # time enough for a flush, had one been scheduled
    assert ctl.transfers.stats["l2_flushes"] == 0  # held for the end of the call
    release()
    release()  # a second release does nothing
    wait_for_flushes(ctl, 1)
    assert ctl.transfers._flush_holds == 0
    assert ctl.transfers.drain(10)
    assert ctl.transfers.stats["l2_flushes"] == 1
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 8
    reload_and_verify(ctl, eng, prompts)


def test_overlapping_holds_make_copies_wait_for_one_rpc_at_most(make) -> None:
    """RPCs that overlap one after the other: copies wait for the end of the RPC holding
    them, not for a moment when no RPC is under way (that may never come)."""
    ctl = make()
    eng = Engine(ctl)
    first = ctl.hold_background()
    eng.request(seq(2, 1000))
    second = ctl.hold_background()  # another RPC while the first one is under way
    eng.request(seq(2, 2000))
    first()  # the first RPC ends while the second is still under way
    wait_for_flushes(ctl, 1)
    third = ctl.hold_background()
    eng.request(seq(2, 3000))
    second()
    third()
    wait_for_flushes(ctl, 2)
    assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 6
    assert ctl.transfers._flush_holds == 0


def test_drain_sends_every_held_copy_whatever_a_flush_takes(make, monkeypatch) -> None:
    """`drain` (Flush, shutdown) must not return with copies left behind a hold when a
    flush takes fewer than are pending."""
    monkeypatch.setattr(transfers_mod, "FLUSH_PAGES", 2)
    ctl = make()
    eng = Engine(ctl)
    release = ctl.hold_background()
    for i in range(4):
        eng.request(seq(2, 1000 * (i + 1)))
    assert ctl.transfers.drain(10)
    assert not ctl.transfers._pending_l2
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 8
    release()


def test_an_allocation_in_a_batch_that_needs_the_held_copies_releases_them(make, monkeypatch) -> None:
    """L1 full of pages pinned by copies the Batch holds: the next allocation in the same
    Batch must not wait for the end of the Batch (it never comes): it sends them now."""
    monkeypatch.setattr(transfers_mod, "BACKPRESSURE_S", 2.0)
    ctl = make(l1_tokens=32)  # 8 L1 pages
    eng = Engine(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(4)]
    release = ctl.hold_background()
    for tokens in prompts:
        eng.request(tokens)  # every L1 page pinned by a held copy
    assert ctl.device.allocator(FULL).free_count == 0
    m = ctl.match("e1", MatchRequest("", seq(2, 9000), lock=True, allocate_tokens=8))
    assert len(m.pages["full"]) == 2  # (ResourceExhausted after 2 s if it had waited)
    ctl.release("e1", m.lock_id, m.allocation_id)
    release()
    assert ctl.transfers.drain(10)
    reload_and_verify(ctl, eng, prompts)


def test_release_of_held_copies_never_waits_for_a_busy_controller(make) -> None:
    """gRPC's poller thread releases the hold when an RPC ends: with the mutex busy it
    must return at once (the copy worker releases instead), and the copies still go."""
    ctl = make()
    eng = Engine(ctl)
    release = ctl.hold_background()
    eng.request(seq(2, 1000))
    busy, done = threading.Event(), threading.Event()

    def hold_mutex() -> None:
        with ctl._mu:
            busy.set()
            done.wait(10)

    holder = threading.Thread(target=hold_mutex)
    holder.start()
    try:
        assert busy.wait(10)
        releaser = threading.Thread(target=release)
        releaser.start()
        releaser.join(2)
        assert not releaser.is_alive(), "release waited for the busy mutex"
        assert ctl.transfers.stats["l2_flushes"] == 0
    finally:
        done.set()
        holder.join(10)
    wait_for_flushes(ctl, 1)
    assert ctl.transfers._flush_holds == 0
    assert ctl.transfers.drain(10)
    assert ctl.transfers.stats["l2_flushes"] == 1
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2
    release()  # already released: nothing happens


def test_a_closed_copy_worker_leaves_copies_queued_rather_than_copying_inline(make) -> None:
    """Shutting down: the copy worker is closed and the pools go next. A write-through
    copy queued then must not be copied inline (a full queue is copied inline, so that
    backups are not lost while the daemon runs)."""
    ctl = make()
    eng = Engine(ctl)
    ctl.transfers.copy_worker.close()
    assert ctl.transfers.copy_worker.closed
    eng.request(seq(2))
    assert ctl.transfers.stats["l2_flushes"] == 0
    assert ctl.transfers._pending_l2  # still queued, not copied here
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0


# --------------------------------------------------------------------------- batches


def rpc_request(ctl, eng: Engine, tokens: bytes) -> None:
    """One request as the daemon serves an Insert: its copies are held until its end."""
    release = ctl.hold_background()
    eng.request(tokens)
    release()


def test_copies_wait_for_a_batch_of_pages_then_go_in_one_flush_at_an_rpc_end(make) -> None:
    ctl = make(write__l1_to_l2_batch_pages=6, write__l1_to_l2_batch_ms=1000)
    eng = Engine(ctl)
    calls = count_copies(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(3)]  # 2 pages each
    for tokens in prompts[:2]:
        rpc_request(ctl, eng, tokens)
    time.sleep(0.1)
    assert ctl.transfers.stats["l2_flushes"] == 0  # 4 pages: waiting for 6 (or 1 s)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    rpc_request(ctl, eng, prompts[2])
    wait_for_flushes(ctl, 1)
    assert calls == [(FULL, 6)]
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 6
    reload_and_verify(ctl, eng, prompts)


def test_copies_due_by_time_go_when_the_next_rpc_ends_not_in_between(make, monkeypatch) -> None:
    """Past the batch time, copies go at the end of the next RPC (once its reply is
    sent), not on a timer that would fire in the middle of some request."""
    monkeypatch.setattr(transfers_mod, "IDLE_FLUSH_FACTOR", 1000)  # no idle flush here
    ctl = make(write__l1_to_l2_batch_pages=100, write__l1_to_l2_batch_ms=20)
    eng = Engine(ctl)
    calls = count_copies(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(2)]
    rpc_request(ctl, eng, prompts[0])
    time.sleep(0.15)  # due since 20 ms, but no RPC has ended since
    assert ctl.transfers.stats["l2_flushes"] == 0
    rpc_request(ctl, eng, prompts[1])
    wait_for_flushes(ctl, 1)
    assert calls == [(FULL, 4)]  # both requests' copies in one flush
    reload_and_verify(ctl, eng, prompts)


def test_a_flush_is_counted_once_its_pages_have_landed(make) -> None:
    """`l2_flushes` (what `wait_for_flushes` polls) counts a flush when it lands: counted
    when it started, a reader could see it before the pages were in L2 (the idle-timeout
    test below failed that way once in CI)."""
    ctl = make(write__l1_to_l2_batch_pages=2)
    eng = Engine(ctl)
    copier = ctl.transfers.copier
    inner = copier.device_to_host
    copying, go = threading.Event(), threading.Event()

    def slow(kind, device_ids, host_ids, on_layer=None):
        copying.set()
        assert go.wait(10)
        return inner(kind, device_ids, host_ids, on_layer)

    copier.device_to_host = slow
    rpc_request(ctl, eng, seq(2, 1000))
    assert copying.wait(10)  # the flush has started and is copying
    assert ctl.transfers.stats["l2_flushes"] == 0
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 0
    go.set()
    wait_for_flushes(ctl, 1)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2  # counted: landed


def test_with_no_rpc_ending_a_batch_goes_after_the_idle_timeout(make) -> None:
    ctl = make(write__l1_to_l2_batch_pages=100, write__l1_to_l2_batch_ms=20)
    eng = Engine(ctl)
    start = time.monotonic()
    rpc_request(ctl, eng, seq(2, 1000))
    wait_for_flushes(ctl, 1)
    # Not before the batch time, then by the idle timer (2 x 20 ms); nothing else ran.
    assert time.monotonic() - start >= 0.02
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2


def test_an_allocation_needing_the_pinned_pages_flushes_a_waiting_batch_at_once(
        make, monkeypatch) -> None:
    monkeypatch.setattr(transfers_mod, "IDLE_FLUSH_FACTOR", 10)  # (an idle timer of 10 s)
    ctl = make(l1_tokens=32, write__l1_to_l2_batch_pages=100, write__l1_to_l2_batch_ms=1000)
    eng = Engine(ctl)
    prompts = [seq(2, 1000 * (i + 1)) for i in range(4)]  # fills L1, every page pinned
    for tokens in prompts:
        rpc_request(ctl, eng, tokens)
    assert ctl.transfers.stats["l2_flushes"] == 0  # 8 pages waiting for 100 (or 1 s)
    assert ctl.device.allocator(FULL).free_count == 0
    start = time.monotonic()
    m = ctl.match("e1", MatchRequest("", seq(2, 9000), lock=True, allocate_tokens=8))
    assert time.monotonic() - start < 5.0  # it did not wait for the batch (idle timer: 10 s)
    assert len(m.pages["full"]) == 2
    assert ctl.transfers.stats["l2_flushes"] == 1
    ctl.release("e1", m.lock_id, m.allocation_id)
    reload_and_verify(ctl, eng, prompts)


def test_drain_and_close_send_a_waiting_batch(make, monkeypatch) -> None:
    monkeypatch.setattr(transfers_mod, "IDLE_FLUSH_FACTOR", 10)  # (an idle timer of 10 s)
    ctl = make(write__l1_to_l2_batch_pages=100, write__l1_to_l2_batch_ms=1000)
    eng = Engine(ctl)
    rpc_request(ctl, eng, seq(2, 1000))
    start = time.monotonic()
    assert ctl.transfers.drain(10)
    assert time.monotonic() - start < 5.0  # not the idle timer's 10 s
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 2
    rpc_request(ctl, eng, seq(2, 2000))  # a flush job now waits for its batch
    start = time.monotonic()
    ctl.transfers.close()
    assert time.monotonic() - start < 5.0  # closing woke it: nothing hangs for 10 s
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 4


# Write-back L1 -> L2, from a fuzz of the controller's API: each failed before its fix.


def test_write_back_l1_evicts_an_interior_node_whose_child_went_to_l2(make) -> None:
    """Nothing held, 4 of 12 L1 pages cached (a 2-page node and its 2-page child): an
    allocation of 11 pages must evict both. The child went to L2 and left L1; its parent,
    L1's only copy of a node with a child, was no eviction candidate, though its eviction
    would have copied it to L2 too: ResourceExhausted, L1 pages stuck for good."""
    ctl = make(l1_tokens=48, write__l1_to_l2="write_back", storage__backend="none")
    eng = Engine(ctl)
    eng.request(seq(2))
    eng.request(seq(4))
    a = ctl.allocate("e1", AllocateRequest("", 44))
    ctl.release("e1", None, a.allocation_id)
    m = ctl.match("e1", MatchRequest("", seq(4)))
    assert (m.device_tokens, m.host_tokens) == (0, 16)  # both in L2, nothing lost


def test_flush_writes_what_l2_holds_before_staging_l1_slots_into_it(make) -> None:
    """L1 of 4 pages, L2 of 8, write-back L1 -> L2: three 4-page requests leave the first
    two in L2 and the third in L1, none in L3. Flush staged the third into L2 first,
    evicting the first from L2 unwritten (L2 -> L3 is not write-back): after the flush
    it was nowhere."""
    ctl = make(l1_tokens=16, write__l1_to_l2="write_back", storage__backend="file")
    eng = Engine(ctl)
    prompts = [seq(4, 1000 * (i + 1)) for i in range(3)]
    for tokens in prompts:
        eng.request(tokens)  # each evicts the one before from L1 (written back to L2)
    assert ctl.transfers.drain(10)
    assert (ctl.tree.resident_pages(Tier.DEVICE, FULL),
            ctl.tree.resident_pages(Tier.HOST, FULL)) == (4, 8)
    ctl.flush(10)
    for tokens in prompts:
        m = ctl.match("e1", MatchRequest("", tokens))
        assert m.device_tokens + m.host_tokens + m.storage_tokens == 16


def test_write_back_l1_then_write_through_l3_writes_what_reaches_l2(make) -> None:
    """A node written back to L2 went on to L3 (l2_to_l3: write_through) only when a
    later match touched it: evicted from L2 before that, it was lost."""
    ctl = make(write__l1_to_l2="write_back", write__l2_to_l3="write_through", storage__backend="file")
    Engine(ctl).request(seq(4))
    evict_all(ctl, Tier.DEVICE)  # written back: the node is in L2 now
    assert ctl.transfers.drain(10)
    assert ctl.l3.backend.stats().puts == 4
    evict_all(ctl, Tier.HOST)
    assert ctl.match("e1", MatchRequest("", seq(4))).storage_tokens == 16


def test_a_slot_whose_l1_to_l2_copy_found_no_room_is_copied_as_it_leaves_l1(make) -> None:
    """write_through L1->L2 with write_back L2->L3: while L3 writes are in flight L2's
    evicted pages stay held, so an L1->L2 copy can find no room and is skipped. Once the
    writes landed, the slot's L1 eviction copies it to L2 (as write_back does): it used
    to drop the only copy, so the inserted prompt was in no tier though L3 had room
    (found by the client fault fuzz: 8 of 40 prompts lost through a daemon)."""
    ctl = make(l1_tokens=64, storage__backend="file", write__l2_to_l3="write_back")
    eng = Engine(ctl)  # L1 16 pages, L2 32
    gate = threading.Event()  # L3 writes wait here (the backup worker runs them in order)
    assert ctl.transfers.backup_worker.submit(Job("gate", lambda: gate.wait(10), lambda _e: None))
    prompts = [seq(2, base=1000 * i) for i in range(1, 30)]

    def copies_landed() -> None:  # (L1->L2 only: `drain` would wait for the L3 writes too)
        with ctl._mu:
            ctl.transfers._schedule_l2_flush(urgent=True)
        assert ctl.transfers.copy_worker.drain(10)

    for tokens in prompts[:18]:  # L2 fills with 16 prompts; then copies find its pages held
        eng.request(tokens)
        copies_landed()

    def only_in_l1() -> list[int]:
        out = []
        for i, tokens in enumerate(prompts):
            path = ctl.tree.match("", tokens).path
            if path and ctl.tree.is_resident(path[-1], FULL, Tier.DEVICE) and not any(
                    ctl.tree.is_resident(path[-1], FULL, t) for t in (Tier.HOST, Tier.STORAGE)):
                out.append(i)
        return out

    with ctl._mu:
        unbacked = only_in_l1()
    assert unbacked and ctl.stats().counters["backups_l2_skipped"] >= 1
    gate.set()
    for tokens in prompts[18:]:  # L1 evicts the unbacked prompts' pages meanwhile
        assert ctl.transfers.drain(10)
        eng.request(tokens)
    assert ctl.transfers.drain(10)
    for i in unbacked:
        m = ctl.match("e1", MatchRequest("", prompts[i]))
        assert m.device_tokens + m.host_tokens + m.storage_tokens == 8, f"prompt {i} is in no tier"
    assert ctl.tree.match("", prompts[unbacked[0]]).device_tokens == 0  # it did leave L1
