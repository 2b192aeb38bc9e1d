"""Review of 98db717 (`Transfers._queued_l3` maps each node an L3 write covers, the
heads splits made of it meanwhile included, to that write: `backup_to_storage` skips a
covered node) and ed8036f (the pages a running Load borrowed from
the request's allocation, counted by `Controller._check_growth`).

The L3 writes are held at the backend (`L3Gate`, on `ctl.l3.backend.put_from`) while
the tree changes under them. Every controller is audited at the end (`make`)."""

from __future__ import annotations

import threading
import time

import pytest
from engine_sim import CopyGate, Engine, evict_all, l2_prefix_request, seq, tree_path

from hicache.controller.base import AllocateRequest, MatchRequest
from hicache.errors import BackendUnavailable, InvalidArgument
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
SWA = ComponentKind.SWA
MAMBA = ComponentKind.MAMBA
PB = 16  # bytes of a page of tokens (page size 4)


class L3Gate:
    """Holds every L3 put until `open()` (or fails it, `fail`); keeps the keys put."""

    def __init__(self, ctl) -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.backend = ctl.l3.backend
        self.original = self.backend.put_from
        self.gate = threading.Event()
        self.fail = False
        self.written: list[str] = []

        def held(keys, buffers):  # type: ignore[no-untyped-def]
            assert self.gate.wait(10), "L3 gate never opened"
            if self.fail:
                raise BackendUnavailable("injected put failure")
            self.written.extend(keys)
            return self.original(keys, buffers)

        self.backend.put_from = held

    def wait_queued(self) -> None:
        deadline = time.monotonic() + 10
        while not self.ctl.transfers._queued_l3:
            assert time.monotonic() < deadline, "no L3 write was queued"
            time.sleep(0.005)

    def full_keys(self) -> list[str]:
        return [k for k in self.written if "/full/" in k]

    def open(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        self.backend.put_from = self.original


def hybrid_l3(make):  # type: ignore[no-untyped-def]
    return make(hybrid=True, l1_tokens=128, write__l1_to_l2="write_through",
                write__l2_to_l3="write_through")


def queue_l3_write(ctl, eng: Engine, tokens: bytes, **kw: object) -> None:  # type: ignore[no-untyped-def]
    """One request for `tokens`; its L2 copy lands now and its L3 write is queued (held)."""
    eng.request(tokens, **kw)
    with ctl._mu:
        ctl.transfers._schedule_l2_flush(urgent=True)


def wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def storage_tokens(ctl, tokens: bytes) -> int:  # type: ignore[no-untyped-def]
    return ctl.match("e1", MatchRequest("", tokens)).storage_tokens


# ---------------------------------------------------------------------- bugs


def test_a_checkpoint_committed_at_a_covered_head_is_written_to_l3(make) -> None:
    """Turn 1 (8 pages, checkpoint at 8) is queued for L3 (held). A request for its
    first 4 pages splits the node (the head is covered by the held write, FULL and SWA)
    and commits a checkpoint at the head; write-through copies it to L2 and offers it to
    L3: skipped (the head is "queued"). The held write lands without it; nothing offers
    it again until the path is matched again, and write-through L2 drops it on eviction:
    the 4-page prefix, whose pages and checkpoint L2 held, is lost to L3."""
    ctl = hybrid_l3(make)
    eng = Engine(ctl)
    p = seq(8, base=100)
    gate = L3Gate(ctl)
    try:
        queue_l3_write(ctl, eng, p)
        gate.wait_queued()
        eng.request(p[: 4 * PB])  # splits at page 4, checkpoint committed at the head
        with ctl._mu:
            head = tree_path(ctl, p)[0]
            assert ctl.tree.depth_tokens(head) == 16
            ctl.transfers._schedule_l2_flush(urgent=True)
        wait_for(lambda: ctl.tree.is_resident(head, MAMBA, Tier.HOST))  # (L3 still held)
        gate.open()
        assert ctl.transfers.drain(10)
    finally:
        gate.restore()
    assert not ctl.transfers._queued_l3
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert storage_tokens(ctl, p) == 32  # (turn 1, checkpoint at 8: in L3)
    assert storage_tokens(ctl, p[: 4 * PB]) == 16


def test_a_checkpoint_committed_at_a_node_whose_l3_write_is_queued_is_written_to_l3(make) -> None:
    """The same without a split (older than 98db717, the same check): turn 1 inserts 8
    pages without a checkpoint; its write (FULL, SWA) is held; turn 2 commits the
    checkpoint at the same node, whose L2 copy is offered to L3 and skipped."""
    ctl = hybrid_l3(make)
    eng = Engine(ctl)
    p = seq(8, base=200)
    gate = L3Gate(ctl)
    try:
        queue_l3_write(ctl, eng, p, checkpoint=False)
        gate.wait_queued()
        eng.request(p)  # commits the checkpoint at the node
    finally:
        gate.restore()
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert storage_tokens(ctl, p) == 32


def test_a_node_leaving_l2_while_its_flush_write_is_queued_is_written_once(make) -> None:
    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_back")
    eng = Engine(ctl)
    eng.request(seq(4, base=300))
    assert ctl.transfers.drain(10)
    gate = L3Gate(ctl)
    flusher = threading.Thread(target=ctl.flush, args=(10,), daemon=True)
    try:
        flusher.start()
        gate.wait_queued()
        with ctl._mu:  # the node leaves L1, then L2 (write_back: `_l2_victim` writes it)
            ctl.transfers._evict(Tier.DEVICE, FULL, 100)
            ctl.transfers._evict(Tier.HOST, FULL, 100)
        gate.open()
        flusher.join(10)
        assert ctl.transfers.drain(10)
    finally:
        gate.restore()
    full = gate.full_keys()
    assert len(set(full)) == 4
    assert len(full) == 4, f"{len(full)} FULL puts of 4 pages"


# ---------------------------------------------------------------------- pinned


def test_a_covered_head_is_written_once_and_recorded_when_the_write_lands(make) -> None:
    """The held write covers the head split off its node: the head is not queued again,
    `_queued_l3` empties when the write lands, and head and tail are both recorded in L3
    then (the head's share of the pages written); a later match stores nothing again."""
    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(8, base=400)
    gate = L3Gate(ctl)
    try:
        queue_l3_write(ctl, eng, p)
        gate.wait_queued()
        eng.request(p[: 4 * PB] + seq(2, base=4400))  # splits the node at page 4
        with ctl._mu:
            head, tail = tree_path(ctl, p)
            covered = ctl.transfers._queued_l3[id(tail)]
            assert ctl.transfers._queued_l3[id(head)] is covered
        gate.open()
        assert ctl.transfers.drain(10)
    finally:
        gate.restore()
    assert not ctl.transfers._queued_l3
    assert len(gate.full_keys()) == len(set(gate.full_keys())) == 8 + 2
    with ctl._mu:
        assert ctl.tree.is_resident(tail, FULL, Tier.STORAGE)
        assert ctl.tree.is_resident(head, FULL, Tier.STORAGE)
    stored = ctl.transfers.stats["backups_l3"]
    ctl.match("e1", MatchRequest("", p))
    assert ctl.transfers.drain(10)
    with ctl._mu:
        assert ctl.tree.is_resident(head, FULL, Tier.STORAGE)
    assert ctl.transfers.stats["backups_l3"] == stored
    assert ctl.transfers.unflushed_pages() == 0


def test_a_covering_write_that_fails_leaves_head_and_tail_to_a_later_write(make) -> None:
    """The held write fails (retried, given up): no node stays "queued", none is
    recorded in L3, and the next visit writes head and tail."""
    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(8, base=500)
    ctl.transfers.backup_worker._retries = 0  # (given up at the first failure)
    gate = L3Gate(ctl)
    gate.fail = True
    try:
        queue_l3_write(ctl, eng, p)
        gate.wait_queued()
        eng.request(p[: 4 * PB] + seq(2, base=5500))
        gate.open()
        assert ctl.transfers.drain(10)
    finally:
        gate.restore()
    assert not ctl.transfers._queued_l3
    assert ctl.transfers.stats["backups_l3_failed"] >= 1
    with ctl._mu:
        head, tail = tree_path(ctl, p)
        assert not ctl.tree.is_resident(head, FULL, Tier.STORAGE)
        assert not ctl.tree.is_resident(tail, FULL, Tier.STORAGE)
    ctl.l3.breaker.success()
    ctl.l3.write_breaker.success()
    ctl.match("e1", MatchRequest("", p))
    assert ctl.transfers.drain(10)
    with ctl._mu:
        assert ctl.tree.is_resident(head, FULL, Tier.STORAGE)
        assert ctl.tree.is_resident(tail, FULL, Tier.STORAGE)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert storage_tokens(ctl, p) == 32


def test_a_write_dropped_at_a_full_queue_leaves_nothing_queued(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The backup queue refuses the job: the node is not left "queued" (a later visit
    writes it)."""
    ctl = make(swa_only=True, l1_tokens=128, write__l1_to_l2="write_through",
               write__l2_to_l3="write_through")
    eng = Engine(ctl)
    p = seq(4, base=600)
    worker = ctl.transfers.backup_worker
    monkeypatch.setattr(worker, "submit", lambda job: False)
    eng.request(p)
    assert ctl.transfers.drain(10)
    assert not ctl.transfers._queued_l3
    assert ctl.transfers.stats["backups_dropped"] >= 4
    monkeypatch.undo()
    ctl.match("e1", MatchRequest("", p))
    assert ctl.transfers.drain(10)
    with ctl._mu:
        assert ctl.tree.is_resident(tree_path(ctl, p)[0], FULL, Tier.STORAGE)


# ---------------------------------------------------------------------- lent


def lent_limit_ctl(make):  # type: ignore[no-untyped-def]
    return make(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none",
                server__max_tokens_per_request=64)  # 16 pages


def grow(ctl, m, pages: int):  # type: ignore[no-untyped-def]
    return ctl.allocate("e1", AllocateRequest("", pages * 4, allocation_id=m.allocation_id))


def lent_of(ctl, m) -> int:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return ctl.loads.lent_from(ctl._engines.allocation("e1", m.allocation_id))


@pytest.mark.parametrize("end", ["lands", "lock_released", "fails"])
def test_growth_counts_a_running_loads_borrowed_pages_and_not_after(make, end: str) -> None:
    """12 pages allocated, 8 of them lent to the load: mid-copy the allocation may grow
    by 4 pages, not 5. After the load landed the 8 are the tree's (it may grow by 12);
    given back (lock released, copy failed) they are the allocation's again (by 4)."""
    ctl = lent_limit_ctl(make)
    eng = Engine(ctl)
    _prefix, _prompt, m = l2_prefix_request(ctl, eng, base=700, tail_base=7700)
    assert len(m.pages["full"]) == 12
    gate = CopyGate(ctl)
    gate.fail = end == "fails"
    try:
        loader = gate.held_load("e1", m.lock_id)
        assert lent_of(ctl, m) == 8
        ctl.transfers.check_ownership(ctl._engines)
        with pytest.raises(InvalidArgument, match="would hold 17 pages"):
            grow(ctl, m, 5)
        if end == "lock_released":
            ctl.release("e1", m.lock_id, None)
        gate.open()
        loader.join(10)
        assert not loader.is_alive()
    finally:
        gate.restore()
    assert lent_of(ctl, m) == 0
    ctl.transfers.check_ownership(ctl._engines)
    room = 12 if end == "lands" else 4
    with pytest.raises(InvalidArgument):
        grow(ctl, m, room + 1)
    grow(ctl, m, room)
    ctl.check_integrity()
    ctl.release("e1", m.lock_id if end != "lock_released" else None, m.allocation_id)


def test_an_abandoned_load_settles_its_borrowed_pages(make) -> None:
    """The engine drops the stream mid-copy (after layer 0): the borrowed pages go back
    to the allocation, `lent` is 0 again and the allocation may grow by 4 pages."""
    ctl = lent_limit_ctl(make)
    eng = Engine(ctl)
    _prefix, _prompt, m = l2_prefix_request(ctl, eng, base=800, tail_base=8800)
    copier = ctl.transfers.copier
    original = copier.host_to_device
    gate = threading.Event()

    def held(kind, host, dev, on_layer=None):  # type: ignore[no-untyped-def]
        if on_layer is not None:
            on_layer(0)
        assert gate.wait(10), "layer gate never opened"
        return original(kind, host, dev, on_layer=on_layer)

    copier.host_to_device = held
    stream = ctl.load("e1", m.lock_id)
    try:
        first = next(stream)
        assert first.device_pages is None and first.layers_ready == 1, first
        assert lent_of(ctl, m) == 8
        gate.set()
        stream.close()  # GeneratorExit mid-copy: `run_load`'s abandoned path
    finally:
        gate.set()
        copier.host_to_device = original
    ctl.transfers.check_ownership(ctl._engines)
    assert lent_of(ctl, m) == 0
    with pytest.raises(InvalidArgument):
        grow(ctl, m, 5)
    grow(ctl, m, 4)
    ctl.release("e1", m.lock_id, m.allocation_id)
