"""The engine client's edges, found by a review of hicache.client: a long Flush, a failed
device sync on the way out of a lock block, growing inside an allocation block, and a
re-attach to a daemon whose lease changed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from hicache.client import Client

from .daemonkit import PAGE, Daemon, tokens

MakeDaemon = Callable[..., Daemon]


def test_a_flush_call_waits_as_long_as_its_flush(tmp_path) -> None:
    """Flush(timeout_s) sent its budget to the daemon but kept the call's own deadline at
    Client.timeout_s: a longer flush was cut off here while the daemon went on."""
    seen: dict[str, Any] = {}

    class Reply:
        pages_written = 7

    def flush(request: Any, metadata: Any = None, timeout: float | None = None) -> Reply:
        seen.update(budget_ms=request.timeout_ms, deadline_s=timeout)
        return Reply()

    with Client(f"unix://{tmp_path}/nobody.sock", timeout_s=30.0) as c:
        c._admin.Flush = flush  # type: ignore[method-assign]
        assert c.flush(timeout_s=120) == 7
        assert seen == {"budget_ms": 120_000, "deadline_s": 125.0}
        c.flush()  # the daemon's own default (10 s): the client's deadline
        assert seen["deadline_s"] == 30.0


def test_a_lock_block_releases_even_when_the_device_sync_fails_too(daemon: Daemon) -> None:
    """The body fails and the sync before the release fails as well (a CUDA fault stays
    set): the sync's error used to escape before the release was sent, hiding the body's
    error, and the heartbeats kept the lock and allocation for the process's life."""
    with daemon.client(engine_id="sync-fails") as c:
        c.attach(map_pools=False)

        def broken_sync() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        c.sync_device = broken_sync  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="engine kernel failed"), \
                c.matched(tokens(2 * PAGE, start=8_000_000), allocate_tokens=2 * PAGE):
            raise RuntimeError("engine kernel failed")
        held = c.heartbeat()
        assert (held.locks, held.allocations) == (0, 0)


def test_growing_inside_an_allocation_block_releases_nothing_it_did_not_make(daemon: Daemon) -> None:
    """`allocation(n, allocation_id=A)` grows A and returns A itself: on exit it used to
    release A, the enclosing request's, whose final Insert then found it gone."""
    prompt = tokens(3 * PAGE, start=8_100_000)
    with daemon.client(engine_id="grower") as c:
        c.attach(map_pools=False)
        with c.matched(prompt[: 4 * PAGE], allocate_tokens=PAGE) as m:
            with c.allocation(2 * PAGE, allocation_id=m.allocation_id) as grown:
                assert grown.allocation_id == m.allocation_id
                assert len(grown.pages["full"]) == 3
            done = c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert done.inserted_tokens == 3 * PAGE
        assert (c.heartbeat().locks, c.heartbeat().allocations) == (0, 0)


@pytest.mark.timeout(120)
def test_a_reattach_to_a_daemon_with_a_shorter_lease_heartbeats_at_its_interval(
    make_daemon: MakeDaemon, tmp_path
) -> None:
    """The daemon restarted with a shorter lease and the engine attached again before its
    heartbeat noticed: the thread went on beating at the old interval (lease_ms / 3 of
    the first daemon) and the new lease lapsed, releasing the engine's handles."""
    listen = f"unix://{tmp_path}/lease.sock"
    first = make_daemon("server.lease_ms=9000", listen=listen)
    with Client(listen, engine_id="leased") as c:
        assert c.attach(map_pools=False).info.lease_ms == 9000
        assert first.stop() == 0
        second = make_daemon("server.lease_ms=1500", listen=listen)
        assert c.attach(map_pools=False).info.lease_ms == 1500
        c.match(tokens(2 * PAGE, start=8_200_000), lock=True, allocate_tokens=2 * PAGE)
        time.sleep(4)  # over two of the new leases; one beat of the old interval is 3 s
        held = c.heartbeat()
        assert (held.locks, held.allocations) == (1, 1)
    assert "lease lapsed" not in second.log()
