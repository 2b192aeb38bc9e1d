"""Handles an engine holds stay its own: pages a running request reads are never freed
under it, a call that fails commits nothing, and no handle outlives a call that did not
return it (found by a review of the daemon's bad-input paths)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_sim import Engine, evict_all, seq

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest
from hicache.controller.engines import AllocationRecord, EngineRegistry
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


def _allocated(ctl, ids: np.ndarray) -> bool:
    return bool(ctl.device.allocator(FULL).is_allocated(ids).all())


def _only_in_l3(ctl, engine: str, tokens: bytes) -> None:
    """One request's pages, written through to L3, then evicted from L1 and L2."""
    m = ctl.match(engine, MatchRequest("", tokens, lock=True, allocate_tokens=len(tokens) // 4))
    ctl.insert(engine, InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)


def test_keep_lock_insert_keeps_the_pages_a_running_request_reads(make) -> None:
    """Two engines prefill the same prompt at once; A commits first. B's keep_lock Insert
    finds the tokens in the tree, but B goes on decoding from its own pages: they stay
    B's until its final Insert (they were freed at once, and handed to the next Allocate)."""
    ctl = make(storage__backend="none")
    for engine in ("a", "b"):
        ctl.attach(engine, 0, 1)
    prompt = seq(4)
    ma = ctl.match("a", MatchRequest("", prompt, lock=True, allocate_tokens=32))
    mb = ctl.match("b", MatchRequest("", prompt, lock=True, allocate_tokens=32))
    b_pages = mb.pages["full"][:4].copy()
    ctl.insert("a", InsertRequest("", prompt, lock_id=ma.lock_id, allocation_id=ma.allocation_id,
                                  keep_lock=True))
    out = ctl.insert("b", InsertRequest("", prompt, lock_id=mb.lock_id,
                                        allocation_id=mb.allocation_id, keep_lock=True))
    assert out.reused_tokens == 16
    assert _allocated(ctl, b_pages)
    ctl.check_integrity()  # owned by B's allocation, once
    free = ctl.device.allocator(FULL).free_count
    grab = ctl.allocate("a", AllocateRequest("", free * 4))  # everything free now
    assert not set(grab.pages["full"].tolist()) & set(b_pages.tolist())
    ctl.release("a", None, grab.allocation_id)
    done = ctl.insert("b", InsertRequest("", prompt + seq(1, 500), lock_id=mb.lock_id,
                                         allocation_id=mb.allocation_id))
    assert done.reused_tokens == 16
    assert not ctl.device.allocator(FULL).is_allocated(b_pages).any()  # freed with the request
    ctl.insert("a", InsertRequest("", prompt, lock_id=ma.lock_id, allocation_id=ma.allocation_id))


def test_a_released_keep_lock_allocation_frees_its_retired_pages(make) -> None:
    ctl = make(storage__backend="none")
    for engine in ("a", "b"):
        ctl.attach(engine, 0, 1)
    prompt = seq(3)
    ma = ctl.match("a", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    mb = ctl.match("b", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    ctl.insert("a", InsertRequest("", prompt, lock_id=ma.lock_id, allocation_id=ma.allocation_id))
    ctl.insert("b", InsertRequest("", prompt, lock_id=mb.lock_id, allocation_id=mb.allocation_id,
                                  keep_lock=True))
    ctl.release("b", mb.lock_id, mb.allocation_id)
    assert not ctl.device.allocator(FULL).is_allocated(mb.pages["full"]).any()


def test_keep_lock_without_the_lock_id_is_refused_before_anything_changes(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    a = ctl.allocate("e1", AllocateRequest("", 12))
    with pytest.raises(InvalidArgument, match="keep_lock needs the lock_id"):
        ctl.insert("e1", InsertRequest("", seq(2), allocation_id=a.allocation_id, keep_lock=True))
    assert ctl.match("e1", MatchRequest("", seq(2))).device_tokens == 0
    ctl.release("e1", None, a.allocation_id)


def test_keep_lock_checkpoint_without_a_free_mamba_slot_fails_before_committing(make) -> None:
    """The request's private copy of its checkpoint is taken before the tree commits: no
    slot left means RESOURCE_EXHAUSTED with nothing inserted (it used to be reported after
    the commit, with the write policy skipped)."""
    ctl = make(hybrid=True, storage__backend="none")
    ctl.attach("e1", 0, 1)
    prompt = seq(2, 1000)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    held = []
    with pytest.raises(ResourceExhausted):
        while True:  # other requests hold every MAMBA slot left
            held.append(ctl.allocate("e1", AllocateRequest("", 4)).allocation_id)
    with pytest.raises(ResourceExhausted, match="mamba"):
        ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                       keep_lock=True, mamba_checkpoint=True))
    assert ctl.match("e1", MatchRequest("", prompt)).device_tokens == 0
    for allocation in held:
        ctl.release("e1", None, allocation)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         keep_lock=True, mamba_checkpoint=True))
    assert out.inserted_tokens == 8
    ctl.release("e1", m.lock_id, m.allocation_id)


def test_a_prefetch_without_a_lock_returns_no_lock_and_holds_none(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    m = ctl.match("e1", MatchRequest("", seq(3), prefetch=True))
    assert m.lock_id == 0 and m.prefetch_id == 0
    assert ctl.tree.active_locks == 0
    assert ctl.heartbeat("e1").locks == 0


def test_a_prefetch_without_a_lock_still_starts_and_lands(make) -> None:
    ctl = make(write__l2_to_l3="write_through")
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    _only_in_l3(ctl, "e1", tokens)
    p = ctl.match("e1", MatchRequest("", tokens, prefetch=True))
    assert p.lock_id == 0 and p.prefetch_id and p.storage_tokens == 16
    deadline = time.monotonic() + 10
    while ctl.prefetch_status(p.prefetch_id).state.name == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ctl.prefetch_status(p.prefetch_id).state.name == "DONE"
    again = ctl.match("e1", MatchRequest("", tokens))
    assert again.device_tokens + again.host_tokens == 16
    assert ctl.tree.active_locks == 0


def test_handles_are_not_recorded_for_an_engine_that_is_gone() -> None:
    """A lease that lapses while a MatchPrefix waits on L3 (outside the mutex): the
    allocation it then makes is refused and recorded nowhere (it was left orphaned)."""
    registry = EngineRegistry(lease_s=30)
    record = AllocationRecord("gone", "", 0, {FULL: np.arange(2)}, None)
    with pytest.raises(FailedPrecondition):
        registry.add_allocation(record)
    assert not registry._allocations


def test_a_load_whose_lock_is_released_while_copying_answers_not_found(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=16))
    ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert m.host_tokens == 16
    copier = ctl.transfers.copier
    started, go = threading.Event(), threading.Event()
    original = copier.host_to_device

    def held(*args, **kwargs):
        started.set()
        go.wait(10)
        return original(*args, **kwargs)

    copier.host_to_device = held
    out: dict[str, object] = {}

    def load() -> None:
        try:
            out["progress"] = list(ctl.load("e1", m.lock_id))
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=load)
    t.start()
    assert started.wait(10)
    ctl.release("e1", m.lock_id, None)
    go.set()
    t.join(10)
    copier.host_to_device = original
    assert isinstance(out.get("error"), NotFound), out


def test_a_timed_out_l3_read_keeps_its_l2_pages_until_it_returns(make, monkeypatch) -> None:
    """A prefetch's read given up on (a hung mount) runs on in the backend's thread and
    writes its objects later: the op's L2 pages stay held until then, so nothing reuses
    them meanwhile (they went to another prompt's write-through, whose later load then
    served the late read's bytes)."""
    import os

    from engine_sim import Engine, wait_prefetch

    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               storage__timeout_s=0.5)
    eng = Engine(ctl)
    a, b = seq(8, base=0), seq(8, base=50_000)
    eng.request(a)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # A only in L3 now
    gate, reached = threading.Event(), threading.Event()
    real_readv = os.readv

    def hung_readv(fd, buffers):
        if threading.current_thread().name.startswith("l3-file") and not gate.is_set():
            reached.set()
            gate.wait(30)
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", hung_readv)
    m = ctl.match("e1", MatchRequest("", a, lock=True, prefetch=True))
    reserved = set(ctl.prefetcher.get(m.prefetch_id).host[FULL].tolist())
    assert wait_prefetch(ctl, m.prefetch_id).name == "FAILED" and reached.wait(10)
    ctl.release("e1", m.lock_id, None)
    eng.request(b)  # write-through: B takes L2 pages
    assert ctl.transfers.drain(10)
    with ctl._mu:
        path = ctl.tree.match("", b).path
        b_host = {int(i) for n in path for i in ctl.tree.pages_of(n, FULL, Tier.HOST)}
    assert not b_host & reserved
    gate.set()  # the stuck read returns and writes now
    deadline = time.monotonic() + 10
    while ctl.l3.backend.stats().stuck_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    evict_all(ctl, Tier.DEVICE)
    eng.request(b)  # B loaded back from L2: every byte checked
    ctl.check_integrity()


def test_an_unexpected_error_of_the_l3_lookup_leaves_no_lock(make, monkeypatch) -> None:
    ctl = make()
    ctl.attach("e1", 0, 1)

    def broken(*_args, **_kwargs):
        raise RuntimeError("a backend bug")

    monkeypatch.setattr(ctl.prefetcher, "l3_run", broken)
    with pytest.raises(RuntimeError):
        ctl.match("e1", MatchRequest("", seq(4), lock=True))
    with pytest.raises(RuntimeError):
        ctl.match("e1", MatchRequest("", seq(4), prefetch=True))
    assert ctl.tree.active_locks == 0 and ctl.heartbeat("e1").locks == 0


def _stop_prober(ctl) -> None:
    """The L3 prober stopped (as `close` stops it): nothing closes a breaker the test
    trips. (A longer `probe_interval_s` only takes effect after the wait under way.)"""
    ctl._stop.set()
    ctl._prober.join(10)
    assert not ctl._prober.is_alive()


def test_an_open_breaker_reports_nothing_in_l3_and_starts_no_prefetch(make) -> None:
    ctl = make(write__l2_to_l3="write_through")
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    _only_in_l3(ctl, "e1", tokens)
    assert ctl.match("e1", MatchRequest("", tokens)).storage_tokens == 16  # known present
    _stop_prober(ctl)  # (it would close it again)
    for _ in range(10):
        ctl.l3.breaker.failure()
    assert ctl.l3.breaker.is_open
    p = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert (p.storage_tokens, p.prefetch_id) == (0, 0)
    ctl.release("e1", p.lock_id, None)


def test_a_store_refusing_every_write_opens_the_write_breaker_only(make) -> None:
    """Puts the store answers but refuses trip the write breaker: backups stop (each held
    its L2 pages ~6 s retrying), while lookups and reads go on, since a full store still
    serves what it holds; the prober's canary write closes it again."""
    from hicache.tiers.storage.base import PutStatus

    ctl = make(write__l2_to_l3="write_through")
    ctl.attach("e1", 0, 1)
    held = seq(4, 9_000)
    _only_in_l3(ctl, "e1", held)  # in L3 before the store fills up
    ctl.probe_interval_s = 3600
    backend = ctl.l3.backend
    original = backend.put_from
    backend.put_from = lambda keys, buffers: [PutStatus.FAILED] * len(keys)
    try:
        for i in range(4):
            tokens = seq(4, 1000 * i)
            m = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=16))
            ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id))
        assert ctl.transfers.drain(15)
        assert ctl.l3.write_breaker.is_open and not ctl.l3.breaker.is_open
        assert ctl.match("e1", MatchRequest("", held)).storage_tokens == 16  # still served
    finally:
        backend.put_from = original
    assert ctl.l3.probe_writes() and not ctl.l3.write_breaker.is_open


def test_only_the_engine_that_started_a_prefetch_may_ask_about_it(make) -> None:
    """Prefetch ids are random and answered only to their engine (with tokens, engine ids
    are scoped to the tenant): another tenant could read and cancel a prefetch by id."""
    ctl = make(write__l2_to_l3="write_through")
    for engine in ("a", "b"):
        ctl.attach(engine, 0, 1)
    tokens = seq(4)
    _only_in_l3(ctl, "a", tokens)
    p = ctl.match("a", MatchRequest("", tokens, lock=True, prefetch=True))
    assert p.prefetch_id > 1 << 20  # not a counter
    with pytest.raises(NotFound):
        ctl.prefetch_status(p.prefetch_id, "b")
    with pytest.raises(NotFound):
        ctl.cancel_prefetch(p.prefetch_id, "b")
    assert ctl.prefetch_status(p.prefetch_id, "a").tokens_total == 16
    ctl.release("a", p.lock_id, None)


def test_engine_ids_are_bounded_and_a_missing_header_is_named() -> None:
    registry = EngineRegistry(lease_s=30)
    # (the core sees ids with a token's label before them: the servicer holds ids as sent
    # to 256 characters, tests/daemon/test_auth.py)
    with pytest.raises(InvalidArgument, match="300 characters, at most 288"):
        registry.attach("e" * 300, 0, 1)
    with pytest.raises(FailedPrecondition, match="x-hicache-engine"):
        registry.engine("")


def test_an_allocation_extending_a_lock_of_another_namespace_is_refused(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    m = ctl.match("e1", MatchRequest("ns-a", seq(2), lock=True))
    with pytest.raises(InvalidArgument, match="does not match lock"):
        ctl.allocate("e1", AllocateRequest("ns-b", 8, lock_id=m.lock_id))
    ctl.release("e1", m.lock_id, None)


def _fill_and_queue_a_held_copy(ctl, kind: ComponentKind) -> list[int]:
    """Every free page of `kind` taken, and one L1->L2 copy queued but held (an RPC under
    way): an allocation of `kind` then waits for copies with the mutex released."""
    q = ctl.match("e1", MatchRequest("", seq(2, 5000), lock=True, allocate_tokens=8))
    held: list[int] = []
    if kind is ComponentKind.MAMBA:
        with pytest.raises(ResourceExhausted):
            while True:
                held.append(ctl.allocate("e1", AllocateRequest("", 4)).allocation_id)
    else:
        held.append(ctl.allocate("e1", AllocateRequest("", ctl.device.allocator(FULL).free_count * 4))
                    .allocation_id)
    with ctl._mu:
        ctl.transfers.hold_flushes()
    ctl.insert("e1", InsertRequest("", seq(2, 5000), lock_id=q.lock_id, allocation_id=q.allocation_id,
                                   keep_lock=True))
    held.append(q.allocation_id)
    ctl.release("e1", q.lock_id, None)
    return held


def _released_while_waiting(ctl, release_handle, call) -> Exception | None:
    """Run `call` holding the mutex while another thread waits to `release_handle()` (a
    lock or an allocation): it gets in when `call` waits for copies (the engine gave up).
    The queued copy lands only after that release, so room cannot come from it first
    (and the wait cannot end before the release, however the threads are scheduled)."""
    released = threading.Event()
    copier = ctl.transfers.copier
    original = copier.device_to_host

    def gated(*args, **kwargs):
        released.wait(10)
        return original(*args, **kwargs)

    def release() -> None:
        try:
            release_handle()
        finally:
            released.set()

    copier.device_to_host = gated
    ctl._mu.acquire()
    t = threading.Thread(target=release)
    t.start()
    time.sleep(0.2)
    try:
        call()
        return None
    except Exception as e:
        return e
    finally:
        ctl._mu.release()
        t.join()
        copier.device_to_host = original


def test_an_insert_that_waits_for_a_checkpoint_slot_commits_no_released_pages(make) -> None:
    """Taking the request's private MAMBA slot may wait (mutex released); a Release of
    the allocation meanwhile: the insert then finds it gone (it committed pages the
    allocator had freed, which the next allocation handed out again)."""
    ctl = make(hybrid=True, storage__backend="none")
    ctl.attach("e1", 0, 1)
    prompt = seq(2, 1000)
    r = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    held = _fill_and_queue_a_held_copy(ctl, ComponentKind.MAMBA)
    err = _released_while_waiting(
        ctl, lambda: ctl.release("e1", None, r.allocation_id),
        lambda: ctl.insert("e1", InsertRequest("", prompt, lock_id=r.lock_id, allocation_id=r.allocation_id,
                                               keep_lock=True, mamba_checkpoint=True)))
    assert isinstance(err, NotFound), err
    assert ctl.match("e1", MatchRequest("", prompt)).device_tokens == 0
    for allocation in held:
        ctl.release("e1", None, allocation)
    ctl.release("e1", r.lock_id, None)


def test_growth_that_waits_for_room_leaves_no_pages_in_a_released_allocation(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    r = ctl.allocate("e1", AllocateRequest("", 4))
    held = _fill_and_queue_a_held_copy(ctl, FULL)
    err = _released_while_waiting(
        ctl, lambda: ctl.release("e1", None, r.allocation_id),
        lambda: ctl.allocate("e1", AllocateRequest("", 4, allocation_id=r.allocation_id)))
    assert isinstance(err, NotFound), err
    for allocation in held:
        ctl.release("e1", None, allocation)
    assert ctl.transfers.drain(5)  # the fixture's ownership audit finds no orphan


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_lease_that_lapses_during_the_l3_lookup_returns_no_dead_lock(make, prefetch: bool) -> None:
    ctl = make()
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=16))
    ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id))
    lookup = ctl.prefetcher.l3_run

    def lapsing_lookup(*args, **kwargs):  # the lookup runs without the mutex
        with ctl._mu:
            ctl._engines._engines["e1"].expires_at = 0
        ctl.expire_leases()
        return lookup(*args, **kwargs)

    ctl.prefetcher.l3_run = lapsing_lookup
    with pytest.raises(NotFound, match="lease expired"):
        ctl.match("e1", MatchRequest("", tokens + seq(4, 9000), lock=True, prefetch=prefetch))
    ctl.prefetcher.l3_run = lookup
    assert ctl.transfers.drain(5)
    assert ctl.tree.active_locks == 0


def _checkpoint_in_l1(ctl):
    """Attach e1, commit an 8-token prompt with its MAMBA checkpoint, and lock it again:
    (prompt, the locking match)."""
    ctl.attach("e1", 0, 1)
    prompt = seq(2, 1000)
    r = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=8))
    ctl.insert("e1", InsertRequest("", prompt, lock_id=r.lock_id, allocation_id=r.allocation_id,
                                   mamba_checkpoint=True))
    m = ctl.match("e1", MatchRequest("", prompt, lock=True))  # holds the path, checkpoint in L1
    assert m.device_tokens == 8
    return prompt, m


@pytest.fixture
def no_slot_left(make):
    """A hybrid controller whose path holds a checkpoint in L1 (locked by `m`) and whose
    every MAMBA slot is taken by allocations; yields (ctl, prompt, m), releases after."""
    ctl = make(hybrid=True, storage__backend="none")
    prompt, m = _checkpoint_in_l1(ctl)
    held = []
    with pytest.raises(ResourceExhausted):  # every MAMBA slot taken by allocations
        while True:
            held.append(ctl.allocate("e1", AllocateRequest("", 4)).allocation_id)
    yield ctl, prompt, m
    for a in held:
        ctl.release("e1", None, a)
    ctl.release("e1", m.lock_id, None)


def test_with_no_checkpoint_slot_left_a_stale_allocation_is_still_not_found(no_slot_left) -> None:
    ctl, prompt, m = no_slot_left
    with pytest.raises(NotFound):
        ctl.insert("e1", InsertRequest("", prompt + seq(1, 7), lock_id=m.lock_id,
                                       allocation_id=987654, keep_lock=True,
                                       mamba_checkpoint=True))


def test_with_no_checkpoint_slot_left_an_unattached_engine_is_still_told_so(no_slot_left) -> None:
    ctl, prompt, m = no_slot_left
    with pytest.raises((NotFound, FailedPrecondition)):  # (what renew() raises)
        ctl.insert("nobody", InsertRequest("", prompt, lock_id=m.lock_id, keep_lock=True,
                                           mamba_checkpoint=True))


def test_a_keep_lock_insert_without_an_allocation_needs_no_checkpoint_slot(no_slot_left) -> None:
    ctl, prompt, m = no_slot_left
    # Nothing new to commit: the previous commit answered (no slot was needed).
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, keep_lock=True,
                                         mamba_checkpoint=True))
    assert out.reused_tokens == 8


def test_allocating_against_a_lock_released_while_waiting_is_not_found(make) -> None:
    """Allocating may wait (mutex released): the lock it extends is looked up again after,
    and its checkpoint read only then (it extended a released lock, copying a checkpoint
    slot nothing held any more)."""
    ctl = make(hybrid=True, storage__backend="none")
    _, m = _checkpoint_in_l1(ctl)
    assert ctl.transfers.drain(5)
    held = _fill_and_queue_a_held_copy(ctl, ComponentKind.MAMBA)
    err = _released_while_waiting(ctl, lambda: ctl.release("e1", m.lock_id, None),
                                  lambda: ctl.allocate("e1", AllocateRequest("", 4, lock_id=m.lock_id)))
    assert isinstance(err, NotFound), err
    for allocation in held:
        ctl.release("e1", None, allocation)


def _both_breakers_tripped(make, read_half_open: bool):
    """An L3 store whose read and write breakers are both open, one of them past its
    cooldown (half-open), the other just tripped; the prober asleep. Returns the store and
    a write/read's arguments (two pages)."""
    from hicache.keys import PAGE_HASH_BYTES

    ctl = make()
    _stop_prober(ctl)
    l3 = ctl.l3
    for breaker in (l3.breaker, l3.write_breaker):
        for _ in range(3):
            breaker.failure()
    half_open, tripped = (l3.breaker, l3.write_breaker) if read_half_open else (l3.write_breaker, l3.breaker)
    half_open._opened_at = time.monotonic() - 10
    tripped._opened_at = time.monotonic()
    args = ("", [bytes([i]) * PAGE_HASH_BYTES for i in range(2)], ctl.cfg.model.family(FULL),
            np.array([0, 1], dtype=np.int64))
    return l3, args


def test_a_refused_write_does_not_spend_the_read_breakers_probe(make) -> None:
    from hicache.controller.workers import BreakerOpen

    l3, args = _both_breakers_tripped(make, read_half_open=True)
    with pytest.raises(BreakerOpen, match="write breaker"):
        l3.write(*args)
    calls = l3.backend.stats().gets
    assert l3.read(*args) == 0  # the read is the probe: it reached the store
    assert l3.backend.stats().gets == calls + 2


def test_a_lease_that_lapses_while_the_prefetch_is_set_up_returns_no_handles(make) -> None:
    """The last check comes after the prefetch and the allocation are set up (either
    could have let the mutex go): a lapse there cancels them and answers NOT_FOUND."""
    ctl = make(write__l2_to_l3="write_through")
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    longer = tokens + seq(4, 9000)
    _only_in_l3(ctl, "e1", longer)
    real = ctl.transfers.allocate_l2
    fired: list[int] = []

    def lapsing_allocate_l2(kind, n, **kwargs):
        if not fired:
            fired.append(1)
            ctl._engines._engines["e1"].expires_at = 0
            ctl.expire_leases()
        return real(kind, n, **kwargs)

    ctl.transfers.allocate_l2 = lapsing_allocate_l2
    try:
        with pytest.raises(NotFound):
            ctl.match("e1", MatchRequest("", longer, lock=True, prefetch=True, allocate_tokens=32))
    finally:
        ctl.transfers.allocate_l2 = real
    assert fired and not ctl._prefetch_of_lock
    assert ctl.transfers.drain(5)


@pytest.mark.parametrize("case", ["namespace", "prefix", "beyond_allocation"])
def test_a_malformed_keep_lock_insert_is_invalid_even_with_no_checkpoint_slot_left(make, case: str) -> None:
    """The request is checked in full before its copy-on-write slot is taken (it
    answered RESOURCE_EXHAUSTED for a malformed request when no slot was free)."""
    ctl = make(hybrid=True, storage__backend="none")
    ctl.attach("e1", 0, 1)
    prompt = seq(2, 1000)
    r = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=8))
    ctl.insert("e1", InsertRequest("", prompt, lock_id=r.lock_id, allocation_id=r.allocation_id,
                                   mamba_checkpoint=True))
    a = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=16))
    held: list[int] = []
    with pytest.raises(ResourceExhausted):  # every MAMBA slot left taken by allocations
        while True:
            held.append(ctl.allocate("e1", AllocateRequest("", 4)).allocation_id)
    namespace, tokens = "", prompt + seq(2, 7)
    if case == "namespace":
        namespace = "other"
    elif case == "prefix":
        tokens = seq(4, 5000)
    else:
        tokens = prompt + seq(40, 7)  # 40 pages; the allocation covers 2
    try:
        with pytest.raises(InvalidArgument):
            ctl.insert("e1", InsertRequest(namespace, tokens, lock_id=a.lock_id,
                                           allocation_id=a.allocation_id, keep_lock=True,
                                           mamba_checkpoint=True))
    finally:
        ctl.release("e1", a.lock_id, a.allocation_id)
        for allocation in held:
            ctl.release("e1", None, allocation)


def test_a_write_refused_by_the_read_breaker_keeps_the_write_breakers_probe(make) -> None:
    from hicache.controller.workers import BreakerOpen

    l3, args = _both_breakers_tripped(make, read_half_open=False)
    with pytest.raises(BreakerOpen, match="circuit breaker open"):
        l3.write(*args)
    l3.breaker.success()  # the read side recovers
    assert l3.write(*args).in_l3 == 2  # the write probe was still there


def test_an_insert_pairing_an_allocation_with_another_requests_lock_changes_nothing(make) -> None:
    """Request 1's allocation sent with request 2's lock (which needs no new pages) used to
    be accepted and move the allocation's start back a page: request 1's own Insert then
    committed each of its pages one position off (wrong KV served to later requests). An
    insert may not start before its allocation's first page."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    cached = seq(2)
    m0 = ctl.match("e", MatchRequest("", cached, lock=True, allocate_tokens=8))
    ctl.insert("e", InsertRequest("", cached, lock_id=m0.lock_id, allocation_id=m0.allocation_id))
    prompt = cached + seq(4, 100)  # 6 pages, the first 2 cached
    m1 = ctl.match("e", MatchRequest("", prompt, lock=True, allocate_tokens=24))
    m2 = ctl.match("e", MatchRequest("", seq(1), lock=True))  # another request's lock
    with pytest.raises(InvalidArgument, match=r"covers token pages \[2, 6\); insert needs \[1, 1\)"):
        ctl.insert("e", InsertRequest("", seq(1), lock_id=m2.lock_id,
                                      allocation_id=m1.allocation_id, keep_lock=True))
    with pytest.raises(InvalidArgument, match=r"covers token pages \[2, 6\); insert needs \[0, 2\)"):
        ctl.insert("e", InsertRequest("", cached, allocation_id=m1.allocation_id))  # no lock
    assert ctl.heartbeat("e").locks == 2 and ctl.heartbeat("e").allocations == 1
    ctl.insert("e", InsertRequest("", prompt, lock_id=m1.lock_id, allocation_id=m1.allocation_id))
    again = ctl.match("e", MatchRequest("", prompt))
    assert again.device_tokens == 24
    assert np.array_equal(again.device_pages["full"][2:], m1.pages["full"])  # in place
    ctl.release("e", m2.lock_id, None)
    ctl.check_integrity()


def test_an_allocation_without_a_lock_is_not_consumed_backwards(make) -> None:
    """An allocation made without a lock, advanced by a keep_lock Insert, refuses a later
    Insert whose lock starts before what it already committed."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    prompt = seq(4, 300)
    m = ctl.match("e", MatchRequest("", prompt, lock=True))
    a = ctl.allocate("e", AllocateRequest("", 16))
    ctl.insert("e", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=a.allocation_id,
                                  keep_lock=True))
    short = ctl.match("e", MatchRequest("", prompt[: 2 * 16], lock=True))
    with pytest.raises(InvalidArgument, match=r"covers token pages \[4, 4\); insert needs \[2, 2\)"):
        ctl.insert("e", InsertRequest("", prompt[: 2 * 16], lock_id=short.lock_id,
                                      allocation_id=a.allocation_id, keep_lock=True))
    for lock in (m.lock_id, short.lock_id):
        ctl.release("e", lock, None)
    ctl.release("e", None, a.allocation_id)
    assert ctl.heartbeat("e").locks == 0 and ctl.heartbeat("e").allocations == 0
    ctl.check_integrity()


@pytest.mark.parametrize("call", ["allocate-grow", "allocate-lock", "insert-lock",
                                  "insert-allocation", "release-lock", "release-allocation"])
def test_a_handle_sent_as_0_is_not_found_and_changes_nothing(make, call: str) -> None:
    """0 is never a handle (a response's 0 means none was created): a request that sends
    it gets NOT_FOUND, as the proto says. It used to read as "absent": Allocate made a new
    allocation where the engine meant to grow one, Insert ignored the handle."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    prompt = seq(2, 700)
    m = ctl.match("e", MatchRequest("", prompt, lock=True, allocate_tokens=8))
    calls = {
        "allocate-grow": lambda: ctl.allocate("e", AllocateRequest("", 4, allocation_id=0)),
        "allocate-lock": lambda: ctl.allocate("e", AllocateRequest("", 4, lock_id=0)),
        "insert-lock": lambda: ctl.insert("e", InsertRequest("", prompt, lock_id=0,
                                                             allocation_id=m.allocation_id)),
        "insert-allocation": lambda: ctl.insert("e", InsertRequest("", prompt, lock_id=m.lock_id,
                                                                   allocation_id=0)),
        "release-lock": lambda: ctl.release("e", 0, None),
        "release-allocation": lambda: ctl.release("e", None, 0),
    }
    kind = "allocation" if call.endswith(("grow", "allocation")) else "lock"
    with pytest.raises(NotFound, match=rf"{kind} 0 is unknown .*0 is never a handle"):
        calls[call]()
    assert ctl.heartbeat("e").locks == 1 and ctl.heartbeat("e").allocations == 1
    ctl.insert("e", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert ctl.match("e", MatchRequest("", prompt)).device_tokens == 8
    ctl.check_integrity()


def test_a_request_that_matched_again_deeper_commits_its_allocation_under_the_new_lock(make) -> None:
    """An engine waited (for a prefetch, or another request filling the prefix), released
    its lock and matched again, deeper: its first allocation commits under the new lock,
    the pages before the new match's end going as loaded instead."""
    ctl = make(storage__backend="none")
    ctl.attach("e1", 0, 1)
    tokens = seq(4)
    first = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=16))
    other = Engine(ctl, engine_id="e2")
    other.request(seq(2))  # another request commits the prefix meanwhile
    ctl.release("e1", first.lock_id, None)
    again = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert again.device_tokens == 8
    out = ctl.insert("e1", InsertRequest("", tokens, lock_id=again.lock_id,
                                         allocation_id=first.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 8)
    assert ctl.heartbeat("e1").locks == 0 and ctl.heartbeat("e1").allocations == 0
    assert ctl.match("e1", MatchRequest("", tokens)).device_tokens == 16
    ctl.check_integrity()


def test_a_release_of_two_handles_one_unknown_changes_nothing(make) -> None:
    """A valid lock and an unknown allocation (or the reverse): NotFound, and the valid
    handle still held. The lock used to be released before the allocation was found."""
    ctl = make()
    Engine(ctl).request(seq(4))
    assert ctl.transfers.drain(10)  # (a write-through copy pins its node until it landed)
    m = ctl.match("e1", MatchRequest("", seq(4) + seq(1, 900), lock=True, allocate_tokens=20))
    for lock, alloc in ((m.lock_id, 99_999), (99_999, m.allocation_id)):
        with pytest.raises(NotFound):
            ctl.release("e1", lock, alloc)
    ctl.check_integrity()
    assert ctl.tree.locked_pages(Tier.DEVICE, ComponentKind.FULL) == 4  # the lock still holds
    ctl.release("e1", m.lock_id, m.allocation_id)  # both there: both go
    assert ctl.tree.locked_pages(Tier.DEVICE, ComponentKind.FULL) == 0
