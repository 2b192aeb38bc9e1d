"""The engine client over the daemon's lifetime (a review): a client attached with mapped
L1 pools (shared memory) across a daemon killed and restarted on its socket, two Clients
of one process under one engine id across such a restart, a lease that lapses while the
engine is cut off and then comes back, a Client dropped without `close()`, a Client used
in a forked child, a Client made before its daemon is up, `close()` twice and calls after
it. Real daemons; each test uses its own token range."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.client import Client
from hicache.errors import FailedPrecondition, HicacheError, NotFound, Unavailable

from .daemonkit import PAGE, Daemon, free_port, kv_pattern, tokens
from .faultproxy import FaultProxy

MakeDaemon = Callable[..., Daemon]
SHM = Path("/dev/shm")
SHORT_LEASE_MS = 1500  # (heartbeats every 500 ms: a loaded machine's stalls fit between)
# Heartbeats every 20 s: none runs during a test unless the test calls one.
LONG_LEASE = "server.lease_ms=60000"


def write_pages(pools: dict, pages: np.ndarray, seed: int) -> None:
    for layer, view in enumerate(pools["full"]):
        for i, p in enumerate(pages):
            view[int(p)].numpy()[:] = kv_pattern(seed + i, layer, view.shape[1])


def pages_hold(pools: dict, pages: np.ndarray, seed: int) -> bool:
    return all(
        np.array_equal(view[int(p)].numpy(), kv_pattern(seed + i, layer, view.shape[1]))
        for layer, view in enumerate(pools["full"])
        for i, p in enumerate(pages)
    )


def held(c: Client) -> tuple[int, int]:
    hb = c.heartbeat()
    return hb.locks, hb.allocations


def locked_device_pages(c: Client) -> int:
    return next(p.locked_pages for p in c.stats().pools if p.tier == "device")


def segments(att) -> list[Path]:  # type: ignore[no-untyped-def]
    return [SHM / p.handle.decode() for p in att.info.pools]


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with a short lease on loopback TCP (a `FaultProxy` can stand in front of
    it), shared by the tests below that need no restart (own engine ids and tokens)."""
    d = Daemon(tmp_path_factory.mktemp("short"), f"server.lease_ms={SHORT_LEASE_MS}",
               listen=f"127.0.0.1:{free_port()}").start()
    yield d
    d.close()


def restart_hard(d: Daemon) -> None:
    """SIGKILL (nothing cleaned up), then a new daemon on the same socket."""
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    d.start()


# --------------------------------------------------------------------------- one client, its daemon's whole life


def test_one_clients_life_before_across_a_kill_of_and_after_its_daemon(make_daemon: MakeDaemon) -> None:
    """Made before its daemon is up: a failed attach starts nothing, one once it is up
    heartbeats. The daemon killed and restarted: the heartbeat tells the engine
    (FailedPrecondition, once); until it attaches again no call of its is served (nothing
    lands in pages its stale mapping cannot see); the new daemon removed the dead one's
    segments; the new mapping round-trips bytes. Closed twice: the heartbeat thread ends,
    every call is FailedPrecondition, and the mapping goes with the attachment."""
    d = make_daemon(f"server.lease_ms={SHORT_LEASE_MS}", start=False)
    told: list[HicacheError] = []
    detached = threading.Event()

    def on_detached(e: HicacheError) -> None:
        told.append(e)
        detached.set()

    c = d.client(engine_id="killed-under-me", timeout_s=10, retries=1, on_detached=on_detached)
    try:
        with pytest.raises(Unavailable):
            c.attach()
        assert c._heartbeat_thread is None  # a failed attach starts no heartbeat
        d.start()
        c.retries = 3
        old = c.attach()
        old_segments = segments(old)
        prompt = tokens(2 * PAGE, start=10_000)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        write_pages(old.pools, m.pages["full"], seed=11)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        time.sleep(2.5 * SHORT_LEASE_MS / 1e3)  # heartbeats keep it
        assert c.detached is None and held(c) == (0, 0)

        restart_hard(d)
        assert detached.wait(15)
        # (the heartbeat names the killed daemon's run: refused as from an earlier run)
        assert isinstance(c.detached, FailedPrecondition) and "restarted" in str(c.detached)
        assert len(told) == 1
        # The new daemon unlinked the killed one's segments (the old mapping lives on in
        # this process only).
        assert not any(s.exists() for s in old_segments)
        # Calls before the new attach are refused, not served into the new pools.
        with pytest.raises(FailedPrecondition, match="attach again"):
            c.match(tokens(2 * PAGE, start=11_000), lock=True, allocate_tokens=2 * PAGE)
        with pytest.raises(FailedPrecondition, match="attach again"), c.allocation(PAGE):
            pass
        new = c.attach()
        assert c.detached is None
        assert set(segments(new)).isdisjoint(old_segments) and all(s.exists() for s in segments(new))
        assert c.match(prompt).device_tokens == 0  # the killed daemon's L1 is gone
        prompt2 = tokens(2 * PAGE, start=12_000)
        with c.matched(prompt2, allocate_tokens=2 * PAGE) as m2:
            write_pages(new.pools, m2.pages["full"], seed=21)
            c.insert(prompt2, lock_id=m2.lock_id, allocation_id=m2.allocation_id)
        with c.matched(prompt2) as hit:
            assert hit.device_tokens == 2 * PAGE
            assert pages_hold(new.pools, hit.device_pages["full"], seed=21)
        assert held(c) == (0, 0)
        beat = c._heartbeat_thread
        assert beat is not None and beat.is_alive()
    finally:
        c.close()
    c.close()  # twice: nothing raised
    assert not beat.is_alive() and len(told) == 1
    calls: list[Callable[[], object]] = [
        c.attach, c.heartbeat, c.stats, lambda: c.match(prompt),
        lambda: list(c.load(1)), lambda: c.release(lock_id=1),
    ]
    for call in calls:
        with pytest.raises(FailedPrecondition, match="closed"):
            call()
    with pytest.raises(FailedPrecondition, match="closed"), c.matched(prompt):
        pass
    with pytest.raises(FailedPrecondition, match="closed"), c.allocation(PAGE):
        pass
    # The mapping outlives the client (the engine may still read it) ...
    assert pages_hold(new.pools, hit.device_pages["full"], seed=21)
    # ... and goes with the attachments: nothing of either daemon's segments stays mapped.
    names = [s.name for s in (*old_segments, *segments(new))]
    del old, new, hit, m, m2
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert not [n for n in names if n in maps]
    d.close()
    assert not [n for n in names if (SHM / n).exists()]


# --------------------------------------------------------------------------- two clients, one engine id


def test_a_twin_client_is_not_served_through_a_dead_daemons_mapping(make_daemon: MakeDaemon) -> None:
    d = make_daemon(LONG_LEASE)
    with d.client(engine_id="twin", timeout_s=10) as a, d.client(engine_id="twin", timeout_s=10) as b:
        a.attach()
        pools_b = b.attach().pools
        restart_hard(d)
        pools_a = a.attach().pools  # A noticed first (its heartbeat, or a failed call)
        prompt = tokens(2 * PAGE, start=20_000)
        try:
            # What B's heartbeat thread would do next, then B's next request.
            b.heartbeat()
            m = b.match(prompt, lock=True, allocate_tokens=2 * PAGE)
            write_pages(pools_b, m.pages["full"], seed=31)
            b.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        except (FailedPrecondition, NotFound):
            return  # B was told its attachment is gone: nothing it wrote is served
        with a.matched(prompt) as hit:
            assert hit.device_tokens == 2 * PAGE
            # The bytes B wrote are in the dead segment; the new one holds zeros there.
            assert pages_hold(pools_a, hit.device_pages["full"], seed=31), (
                "the daemon serves bytes B never wrote for B's tokens")


# --------------------------------------------------------------------------- a lease lapsing while cut off


def test_a_lease_that_lapsed_while_cut_off_detaches_once_and_the_engine_attaches_again(
    short: Daemon,
) -> None:
    """The engine is cut off longer than its lease, inside a `matched()` block: the block's
    own error surfaces (the release answers the lapse, quietly), the heartbeat detaches it
    once with NotFound, its calls say the lease expired, and a new attach serves it with
    nothing of before held."""
    proxy = FaultProxy(int(short.listen.rpartition(":")[2]))
    told: list[HicacheError] = []
    detached = threading.Event()

    def on_detached(e: HicacheError) -> None:
        told.append(e)
        detached.set()

    try:
        with Client(f"127.0.0.1:{proxy.port}", engine_id="cut-off", timeout_s=5,
                    on_detached=on_detached) as c:
            att = c.attach()
            prompt = tokens(2 * PAGE, start=30_000)
            with pytest.raises(RuntimeError, match="forward failed"), \
                    c.matched(prompt, allocate_tokens=2 * PAGE):
                proxy.go_down()
                time.sleep(4 * SHORT_LEASE_MS / 1e3)  # the daemon's sweep lapses the lease
                proxy.disarm()
                raise RuntimeError("forward failed")
            assert detached.wait(15)
            assert isinstance(c.detached, NotFound) and "lease expired" in str(c.detached)
            with pytest.raises(NotFound, match="lease expired"):
                c.match(prompt, lock=True)
            time.sleep(2 * SHORT_LEASE_MS / 1e3)
            assert len(told) == 1  # heartbeats stopped: one report
            c.attach()
            assert c.detached is None
            assert held(c) == (0, 0)
            assert locked_device_pages(c) == 0
            with c.matched(prompt, allocate_tokens=2 * PAGE) as m:
                write_pages(att.pools, m.pages["full"], seed=41)  # the same daemon: same pools
                c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
            time.sleep(2.5 * SHORT_LEASE_MS / 1e3)  # the new heartbeat keeps the engine
            with c.matched(prompt) as hit:
                assert pages_hold(att.pools, hit.device_pages["full"], seed=41)
            assert len(told) == 1
    finally:
        proxy.close()
    assert "engine cut-off: lease lapsed; released 1 locks, 1 allocations" in short.log()


# --------------------------------------------------------------------------- a Client dropped without close()


def test_an_attached_client_dropped_without_close_lets_its_lease_lapse(short: Daemon) -> None:
    d = short

    def engine_that_forgets_to_close() -> tuple[weakref.ref, int]:
        c = d.client(engine_id="forgetful", timeout_s=10)
        c.attach(map_pools=False)
        c.match(tokens(PAGE, start=40_000), lock=True, allocate_tokens=PAGE)
        assert c._heartbeat_thread is not None
        return weakref.ref(c), c._heartbeat_thread.ident  # type: ignore[return-value]

    ref, beat_ident = engine_that_forgets_to_close()
    try:
        gc.collect()
        time.sleep(4 * SHORT_LEASE_MS / 1e3)
        gc.collect()
        with d.client(timeout_s=10) as probe:
            locked = locked_device_pages(probe)
        alive = [t for t in threading.enumerate() if t.ident == beat_ident and t.is_alive()]
        assert (ref() is None, alive, locked) == (True, [], 0)
    finally:
        leaked = ref()
        if leaked is not None:  # (its thread would beat on for the rest of the session)
            leaked.close()


# --------------------------------------------------------------------------- a Client used in a forked child


def _child_with_the_parents_client(c: Client, write_fd: int) -> None:
    """The forked child goes on with the Client its parent made (an engine forking
    workers after connecting): attach, lock, idle past the lease, then use the lock."""
    out = "?"
    try:
        try:
            c.attach(map_pools=False)
        except HicacheError as e:
            out = f"refused {type(e).__name__}: {e}"
        else:
            prompt = tokens(PAGE, start=50_000)
            m = c.match(prompt, lock=True, allocate_tokens=PAGE)
            time.sleep(3 * SHORT_LEASE_MS / 1e3)
            try:
                c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
                out = "served"
            except HicacheError as e:
                out = f"lost {type(e).__name__}: {e}"
    except BaseException as e:  # (anything else: the test reads it)
        out = f"crashed {type(e).__name__}: {e}"
    finally:
        os.write(write_fd, out.encode()[:4000])
        os._exit(0)


def test_a_forked_child_using_the_parents_client_keeps_its_lease_or_is_told_at_once(
    short: Daemon,
) -> None:
    d = short
    with d.client(engine_id="forking", timeout_s=10) as c:
        c.attach(map_pools=False)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            os.close(r)
            _child_with_the_parents_client(c, w)
        os.close(w)
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish in 30 s")
            time.sleep(0.05)
        out = os.read(r, 4000).decode()
        os.close(r)
    # Either it works (heartbeats in the child keep the lease), or the child is told at
    # its first call that this Client belongs to its parent.
    assert out == "served" or (out.startswith("refused") and "fork" in out.lower()), out
