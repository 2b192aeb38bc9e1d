"""Work an RPC's reply does not wait for (`hicache.controller.mutex`): owed under the
controller's mutex, it runs when the reply is sent or before anyone's next use of the
mutex, so every reader sees it done, in the order of the calls."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from engine_sim import seq

from hicache.controller.base import InsertRequest, MatchRequest
from hicache.controller.mutex import OwingMutex
from hicache.errors import NotFound
from hicache.types import ComponentKind

FULL = ComponentKind.FULL


# ---------------------------------------------------------------------- the mutex alone


def test_owed_work_runs_when_the_mutex_is_next_taken_before_the_taker_goes_on() -> None:
    mu = OwingMutex()
    done: list[str] = []
    with mu:
        mu.owe(lambda: done.append("first"))
        mu.owe(lambda: done.append("second"))
        with mu:  # re-entered by its holder: nothing runs
            assert done == []
    assert done == [] and mu.owing
    with mu:
        done.append("taker")
    assert done == ["first", "second", "taker"]
    assert not mu.owing


def test_work_owed_while_paying_runs_in_the_same_payment() -> None:
    mu = OwingMutex()
    done: list[int] = []

    def first() -> None:
        done.append(1)
        with mu:  # owed work may take the mutex again: it does not pay from inside
            mu.owe(lambda: done.append(3))
        done.append(2)

    with mu:
        mu.owe(first)
    with mu:
        pass
    assert done == [1, 2, 3]
    with mu:  # nothing owed: nothing runs
        pass
    assert done == [1, 2, 3]


def test_owed_work_that_raises_is_logged_and_counted_and_the_rest_still_runs(caplog) -> None:
    mu = OwingMutex()
    done: list[str] = []

    def broken() -> None:
        raise RuntimeError("the owed work broke")

    with mu:
        mu.owe(broken)
        mu.owe(lambda: done.append("after"))
    with caplog.at_level(logging.ERROR, logger="hicache.controller"), mu:
        pass
    assert done == ["after"]
    assert mu.failures == 1
    assert "work owed by an answered call failed" in caplog.text
    assert "the owed work broke" in caplog.text
    with mu:  # the mutex is usable afterwards, not left held
        pass
    assert mu.acquire(blocking=False)
    mu.release()


def test_a_busy_mutex_refuses_a_non_blocking_taker_and_pays_nothing_for_it() -> None:
    mu = OwingMutex()
    done: list[str] = []
    held, go = threading.Event(), threading.Event()

    def holder() -> None:
        with mu:
            mu.owe(lambda: done.append("owed"))
            held.set()
            go.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    assert not mu.acquire(blocking=False)
    assert done == []
    go.set()
    t.join(5)
    assert mu.acquire(blocking=False)  # now free: taking it pays
    mu.release()
    assert done == ["owed"]


def test_a_condition_waiter_releases_every_level_and_pays_on_waking() -> None:
    """The controller's conditions (`landed`, the flush wake-up) wait on this mutex, often
    held twice; the waiter must release it wholly and, taking it back, see owed work done."""
    mu = OwingMutex()
    cond = mu.condition()
    seen: list[list[str]] = []
    done: list[str] = []
    waiting = threading.Event()

    def waiter() -> None:
        with mu, mu:
            waiting.set()
            assert cond.wait(5)
            seen.append(list(done))

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(5)
    time.sleep(0.05)  # the waiter is inside wait(): the mutex must be free
    with mu:
        mu.owe(lambda: done.append("owed"))
        cond.notify()
    t.join(5)
    assert seen == [["owed"]]
    with pytest.raises(RuntimeError):
        cond.notify()  # not held: Condition sees that through the mutex


# ---------------------------------------------------------------------- the controller


def _request(ctl, engine: str, tokens: bytes, reply_first: bool = True):
    m = ctl.match(engine, MatchRequest("", tokens, lock=True, allocate_tokens=len(tokens) // 4 + 8))
    pages = m.pages["full"].copy()
    out = ctl.insert(engine, InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id),
                     reply_first=reply_first)
    return m, pages, out


def _allocated(ctl, ids: np.ndarray) -> np.ndarray:
    return ctl.device.allocator(FULL).is_allocated(ids)


def test_a_reply_first_insert_owes_its_bookkeeping_until_the_reply_is_sent(make) -> None:
    """A unary Insert RPC's insert answers after its tree insert; the pages it leaves, its
    lock and allocation go when the RPC's hold is released (the reply sent)."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    m, pages, out = _request(ctl, "e", seq(3))
    assert (out.inserted_tokens, out.reused_tokens) == (12, 0)
    assert ctl._mu.owing
    spare = pages[3:]  # allocated beyond the prompt: the Insert frees them
    assert _allocated(ctl, spare).all()  # not yet: owed
    release()
    assert not ctl._mu.owing
    assert not _allocated(ctl, spare).any()
    assert _allocated(ctl, pages[:3]).all()  # the tree's now
    with pytest.raises(NotFound):
        ctl.release("e", m.lock_id, None)  # the Insert ended it


def test_any_core_call_after_such_an_insert_sees_its_effects(make) -> None:
    """A reader that comes before the hold's release (another RPC, a scrape) takes the
    mutex: it finds the owed work done, as if it had run inline."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    m, _, _ = _request(ctl, "e", seq(3))
    snap = ctl.stats()
    assert not ctl._mu.owing
    assert snap.counters["active_locks"] == 0
    assert snap.counters["active_allocations"] == 0
    used = next(p.used_pages for p in snap.pools if p.tier == "device")
    assert used == 3  # the prompt's pages, held by the tree; the spare ones went back
    with pytest.raises(NotFound):  # a Release racing the reply finds the lock gone
        ctl.release("e", m.lock_id, None)
    again = ctl.match("e", MatchRequest("", seq(3), lock=False))
    assert again.device_tokens == 12
    release()
    ctl.check_integrity()


def test_a_keep_lock_insert_commits_inline_even_when_replying_first(make) -> None:
    """A continuing request goes on writing into its pages (and a MAMBA checkpoint's
    private copy) right after the reply: nothing it reads may wait."""
    ctl = make(storage__backend="none", hybrid=True)
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    m = ctl.match("e", MatchRequest("", seq(3), lock=True, allocate_tokens=16))
    ctl.insert("e", InsertRequest("", seq(3), lock_id=m.lock_id, allocation_id=m.allocation_id,
                                  keep_lock=True), reply_first=True)
    assert not ctl._mu.owing
    release()
    ctl.insert("e", InsertRequest("", seq(4), lock_id=m.lock_id, allocation_id=m.allocation_id))
    ctl.check_integrity()


def test_an_insert_not_replying_first_commits_inline_even_under_a_hold(make) -> None:
    """A Batch's inserts (and any in-process caller): the next op would pay at once."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    _, pages, _ = _request(ctl, "e", seq(3), reply_first=False)
    assert not ctl._mu.owing
    assert not _allocated(ctl, pages[3:]).any()
    release()


def test_a_hold_not_granted_still_pays_at_its_release(make) -> None:
    """Two Inserts overlap: the second gets no hold of its own (one at a time), yet its
    end runs what it owed, not only the end of the first."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    first = ctl.hold_background()
    second = ctl.hold_background()  # not granted: the first RPC holds the flushes
    _, pages, _ = _request(ctl, "e", seq(3))
    assert ctl._mu.owing
    second()
    assert not ctl._mu.owing
    assert not _allocated(ctl, pages[3:]).any()
    first()


def test_a_release_that_finds_the_controller_busy_leaves_the_payment_to_the_worker(make) -> None:
    """On gRPC's poller thread the release never waits: with the mutex busy, the copy
    worker runs what is owed (and releases the hold) once it is free."""
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    _request(ctl, "e", seq(3))
    held, go = threading.Event(), threading.Event()

    def busy() -> None:
        with ctl._mu._lock:  # the bare lock: taking it pays nothing
            held.set()
            go.wait(5)

    t = threading.Thread(target=busy)
    t.start()
    assert held.wait(5)
    started = time.monotonic()
    release()
    assert time.monotonic() - started < 0.5  # did not wait for the mutex
    assert ctl._mu.owing
    go.set()
    t.join(5)
    deadline = time.monotonic() + 5
    while ctl._mu.owing or ctl.transfers._flush_holds:
        assert time.monotonic() < deadline, "the copy worker never paid"
        time.sleep(0.005)


def test_owed_work_that_fails_is_counted_in_stats(make) -> None:
    ctl = make(storage__backend="none")
    ctl.attach("e", 0, 1)
    release = ctl.hold_background()
    with ctl._mu:
        ctl._mu.owe(lambda: 1 / 0)
    release()
    assert ctl.stats().counters["owed_work_failures"] == 1


def test_the_end_of_an_insert_rpc_pays_what_it_owed(tmp_path) -> None:
    """Through a real gRPC server in this process: once an Insert has answered, what it
    owed runs without any other call coming (the RPC's end pays it)."""
    from engine_sim import tiny_config

    from hicache.client import Client
    from hicache.controller.controller import build_controller
    from hicache.endpoint import parse_address
    from hicache.server import Daemon

    socket = tmp_path / "owed.sock"
    cfg = tiny_config(tmp_path, backend="none", server__listen=f"unix://{socket}")
    ctl = build_controller(cfg, f"owed{time.monotonic_ns() % 100000}")
    owed: list[object] = []
    owe = ctl._mu.owe
    ctl._mu.owe = lambda work: (owed.append(work), owe(work))  # type: ignore[method-assign]
    daemon = Daemon(cfg, ctl, parse_address(cfg.server.listen))
    daemon.start()
    try:
        with Client(f"unix://{socket}", engine_id="e") as c:
            c.attach(map_pools=False)
            for i in range(20):
                tokens = seq(3, 1000 * i)
                m = c.match(tokens, lock=True, allocate_tokens=16)
                out = c.insert(tokens, lock_id=m.lock_id, allocation_id=m.allocation_id)
                assert out.inserted_tokens == 12
                # Nothing else calls the controller now: only the RPC's end can pay.
                deadline = time.monotonic() + 5
                while ctl._mu.owing:
                    assert time.monotonic() < deadline, "the Insert's owed work never ran"
                    time.sleep(0.002)
                assert ctl._engines.lock_count == 0
                assert ctl._engines.allocation_count == 0
        assert len(owed) == 20  # each Insert owed its commits (none ran inline)
        ctl.check_integrity()
    finally:
        daemon.stop()  # (closes the controller)
