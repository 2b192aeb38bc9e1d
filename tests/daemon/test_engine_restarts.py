"""Engines and daemons that restart: handles never alias across a daemon restart, an
engine restarted under its id does not inherit (and leak) its predecessor's handles, a
call whose answer was lost is not applied twice, and the client says when the daemon
forgot it."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hicache.client import Client
from hicache.errors import FailedPrecondition, NotFound, Unavailable

from .daemonkit import PAGE, Daemon, free_port, tokens
from .faultproxy import FaultProxy

MakeDaemon = Callable[..., Daemon]


def device_pages(c) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(locked, used) L1 pages."""
    pool = next(p for p in c.stats().pools if p.tier == "device")
    return pool.locked_pages, pool.used_pages


DYING_ENGINE = textwrap.dedent(
    """
    import os, sys, numpy as np
    from hicache.client import Client
    c = Client(sys.argv[1], engine_id="engine-0")
    c.attach(map_pools=False)
    m = c.match(np.arange(100, 228, dtype="<u4").tobytes(), lock=True, allocate_tokens=128)
    print(m.allocation_id, flush=True)
    os.kill(os.getpid(), 9)
    """
)


def test_an_engine_restarted_under_its_id_releases_what_its_predecessor_held(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon()
    # The process dies without a word (no release, no close) ...
    out = subprocess.run([sys.executable, "-c", DYING_ENGINE, d.target],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    dead_allocation = int(out.stdout)
    # ... and its successor attaches under the same id at once, long before the lease lapses.
    with d.client(engine_id="engine-0") as second:
        assert device_pages(second) == (2, 2)  # its allocation: held, not evictable
        second.attach(map_pools=False)
        hb = second.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
        assert device_pages(second) == (0, 0)
        with pytest.raises(NotFound):
            second.release(allocation_id=dead_allocation)
        # The same process attaching again (another Client in it, too) keeps what it holds.
        m2 = second.match(tokens(2 * PAGE, start=100), lock=True, allocate_tokens=2 * PAGE)
        second.attach(map_pools=False)
        with d.client(engine_id="engine-0") as sibling:
            sibling.attach(map_pools=False)
        assert second.heartbeat().allocations == 1
        second.release(lock_id=m2.lock_id)
        second.release(allocation_id=m2.allocation_id)
    assert "predecessor's 1 locks, 1 allocations" in d.log()


def test_handles_from_before_a_daemon_restart_name_nothing_after_it(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    with d.client(engine_id="engine-0") as c:
        c.attach(map_pools=False)
        old = c.match(tokens(2 * PAGE, start=300), lock=True, allocate_tokens=2 * PAGE)
        assert d.stop() == 0
        d.start()
        c.attach(map_pools=False)
        new = c.match(tokens(2 * PAGE, start=700), lock=True, allocate_tokens=2 * PAGE)
        # Counted from 1 in each process, the old ids were the new ones: an Insert with
        # them would have committed this request's pages under the old tokens.
        assert {old.lock_id, old.allocation_id}.isdisjoint({new.lock_id, new.allocation_id})
        with pytest.raises(NotFound):
            c.insert(tokens(2 * PAGE, start=300), lock_id=old.lock_id, allocation_id=old.allocation_id)
        c.insert(tokens(2 * PAGE, start=700), lock_id=new.lock_id, allocation_id=new.allocation_id)
        assert c.match(tokens(2 * PAGE, start=300)).device_tokens == 0


@contextlib.contextmanager
def attached_through_a_cut_proxy(make_daemon: MakeDaemon) -> Iterator[tuple[FaultProxy, Client]]:
    """A daemon on TCP, a `FaultProxy` in front of it, a client attached through it."""
    port = free_port()
    # (a lease of 10 min: no background heartbeat goes through the proxy to take its cut)
    make_daemon("server.lease_ms=600000", listen=f"127.0.0.1:{port}")
    proxy = FaultProxy(port)
    try:
        with make_client(proxy.port) as c:
            c.attach(map_pools=False)
            yield proxy, c
    finally:
        proxy.close()


def test_a_call_whose_answer_was_lost_is_not_sent_again(make_daemon: MakeDaemon) -> None:
    with attached_through_a_cut_proxy(make_daemon) as (proxy, c):
        proxy.cut_answers = 1
        with pytest.raises(Unavailable):
            c.match(tokens(2 * PAGE, start=900), lock=True, allocate_tokens=2 * PAGE)
        assert proxy.cuts == 1
        # The daemon ran it once (a retry would have made a second lock and
        # allocation that nobody knows of, kept alive by the heartbeat).
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)

        # A release is safe to repeat: the retry's NotFound means the lost attempt did it.
        m = c.match(tokens(2 * PAGE, start=1900), lock=True, allocate_tokens=2 * PAGE)
        proxy.cut_answers = 1
        c.release(allocation_id=m.allocation_id)
        assert proxy.cuts == 2
        c.release(lock_id=m.lock_id)
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)


def test_a_retry_after_a_lost_answer_answers_as_the_lost_attempt_did(make_daemon: MakeDaemon) -> None:
    """Calls safe to repeat are retried after a lost answer; the retry's answer is the lost
    one's: a Batch's Releases are done (None, not NotFound: the lost attempt released
    them), a CloseSession gives the references the lost attempt released (not 0)."""
    from hicache.client import close_session_op, release_op

    with attached_through_a_cut_proxy(make_daemon) as (proxy, c):
        for session, start in (("chat-a", 3_100), ("chat-b", 3_300)):
            prompt = tokens(2 * PAGE, start=start)
            m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE, session_id=session)
            c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        proxy.cut_answers = 1
        assert c.close_session("chat-a") == 2  # the path's pages, as the lost answer said
        assert proxy.cuts == 1
        held = c.match(tokens(2 * PAGE, start=3_500), lock=True, allocate_tokens=2 * PAGE)
        proxy.cut_answers = 1
        done = c.batch([release_op(lock_id=held.lock_id),
                        release_op(allocation_id=held.allocation_id),
                        close_session_op("chat-b")])
        assert proxy.cuts == 2
        assert done == [None, None, 2]
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
        # Without a lost answer a second Release is still NotFound.
        (again,) = c.batch([release_op(lock_id=held.lock_id)])
        assert isinstance(again, NotFound)


def make_client(port: int) -> Client:
    return Client(f"127.0.0.1:{port}", engine_id="engine-0", timeout_s=5)


def test_the_client_says_when_the_daemon_forgot_it_and_attaches_again(make_daemon: MakeDaemon) -> None:
    # (a heartbeat every lease / 3: a lease of 2 s outlasts a loaded machine's stalls)
    d = make_daemon("server.lease_ms=2000")
    seen: list[Exception] = []
    called = threading.Event()

    def on_detached(e: Exception) -> None:
        seen.append(e)
        called.set()

    with d.client(engine_id="engine-0", on_detached=on_detached) as c:
        c.attach(map_pools=False)
        assert d.stop() == 0
        d.start()
        assert called.wait(10)
        assert isinstance(c.detached, FailedPrecondition) and "not attached" in str(c.detached)
        time.sleep(1.5)  # heartbeats stopped: one report, not one per beat (~2 beats)
        assert len(seen) == 1
        c.attach(map_pools=False)
        assert c.detached is None
        time.sleep(2.6)  # past the lease: the restarted heartbeat keeps the engine
        assert c.heartbeat().lease_ms == 2000


def test_attaching_again_from_on_detached_keeps_the_engine_alive(make_daemon: MakeDaemon) -> None:
    d = make_daemon("server.lease_ms=2000")
    reattached = threading.Event()
    with d.client(engine_id="engine-0") as c:
        def on_detached(_e: Exception) -> None:  # runs on the heartbeat thread
            c.attach(map_pools=False)
            reattached.set()

        c.on_detached = on_detached
        c.attach(map_pools=False)
        assert d.stop() == 0
        d.start()
        assert reattached.wait(10) and c.detached is None
        m = c.match(tokens(2 * PAGE, start=2500), lock=True, allocate_tokens=2 * PAGE)
        time.sleep(5.0)  # 2.5 leases: only a live heartbeat keeps the handles
        c.insert(tokens(2 * PAGE, start=2500), lock_id=m.lock_id, allocation_id=m.allocation_id)


def test_a_call_not_safe_to_repeat_is_not_sent_while_the_daemon_is_down(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hicache.client import Client

    with Client(f"unix://{tmp_path}/nobody.sock", engine_id="engine-0", timeout_s=60) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="was not sent"):
            c.match(tokens(PAGE), lock=True)
        assert time.monotonic() - t0 < 20  # a short wait for a connection, not timeout_s


def test_clients_dropped_without_close_are_collected(make_daemon: MakeDaemon) -> None:
    import gc
    import weakref

    d = make_daemon()
    refs = []
    for _ in range(3):
        c = d.client(engine_id="engine-0")
        c.serving()
        refs.append(weakref.ref(c))
        del c
    gc.collect()
    assert all(r() is None for r in refs)
