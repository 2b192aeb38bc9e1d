"""L1 eviction with write-through copies still queued: a node whose L1 -> L2 copy is
queued is pinned until it lands. An allocation that would otherwise take a victim ranked
after it (session-referenced, hotter) waits for the copy and takes that node first; in
plain LRU order (the queued node is the newest) nothing waits."""

from __future__ import annotations

import threading

from engine_sim import Engine, seq, session_request

from hicache.controller import transfers as transfers_mod
from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
# 16 L1 pages, write-through to L2, no L3.
SETUP = {"l1_tokens": 64, "tiers__l2__ratio": 4, "storage__backend": "none",
         "write__l1_to_l2": "write_through"}


def _in_tier(ctl, tokens: bytes, tier: Tier) -> int:  # type: ignore[no-untyped-def]
    """FULL pages of `tokens` the tier holds (the tree's own view)."""
    with ctl._mu:
        path = ctl.tree._walk(ctl.tree._roots.get(""), tokens, len(tokens))
        return sum(n.npages for n in path if n.mask[0] & (1 << tier))


def _in_l1(ctl, tokens: bytes) -> int:  # type: ignore[no-untyped-def]
    return _in_tier(ctl, tokens, Tier.DEVICE)


def _fill(ctl, eng: Engine, referenced: bytes, other: bytes) -> None:  # type: ignore[no-untyped-def]
    """L1 full: `referenced` (a session's, copied to L2), 12 pages of fillers (copied),
    then `other` (unreferenced, newest, its copy queued: pinned)."""
    session_request(ctl, eng, referenced)
    eng.request(seq(12, 3000))
    assert ctl.transfers.drain(10)
    for _ in range(3):  # the fillers hotter than `referenced`: only the session keeps it
        ctl.match("e1", MatchRequest("", seq(12, 3000)))
    _queued(ctl, eng, other)


def _queued(ctl, eng: Engine, tokens: bytes) -> None:  # type: ignore[no-untyped-def]
    """A request whose copy stays queued (as an RPC's hold keeps it) until someone waits
    for it (an allocation short of room makes it due at once)."""
    with ctl._mu:
        assert ctl.transfers.hold_flushes()
    eng.request(tokens)
    with ctl._mu:
        assert ctl.device.allocator(FULL).free_count == 0
        assert len(ctl.transfers._queued_l2) == 1


def test_an_allocation_waits_for_a_queued_copy_rather_than_take_a_referenced_path(make) -> None:
    ctl = make(**SETUP)
    eng = Engine(ctl)
    referenced, other = seq(2), seq(2, 1000)
    _fill(ctl, eng, referenced, other)
    # The fillers go first (unreferenced, older); the last 2 pages needed are `other`'s
    # (newer, but unreferenced), not the session's, once its copy landed.
    waits = ctl.transfers.stats["allocation_waits"]
    eng.request(seq(14, 5000))
    assert (_in_l1(ctl, referenced), _in_l1(ctl, other)) == (2, 0)
    assert ctl.transfers.stats["allocation_waits"] > waits
    assert _in_tier(ctl, other, Tier.HOST) == 2  # its copy landed before it left L1


def test_in_lru_order_an_allocation_does_not_wait_for_queued_copies(make) -> None:
    """No session: the queued node is the newest, the victims rank before it."""
    ctl = make(**SETUP)
    eng = Engine(ctl)
    eng.request(seq(14))
    assert ctl.transfers.drain(10)
    _queued(ctl, eng, seq(2, 1000))
    waits = ctl.transfers.stats["allocation_waits"]
    eng.request(seq(2, 2000))
    assert ctl.transfers.stats["allocation_waits"] == waits
    assert _in_l1(ctl, seq(2, 1000)) == 2 and len(ctl.transfers._queued_l2) >= 1


def test_a_copy_that_does_not_land_in_time_lets_the_referenced_path_go(make, monkeypatch) -> None:
    """The wait is bounded (`BACKPRESSURE_S`): a copy stuck past it, the allocation takes
    the session's path after all rather than fail."""
    monkeypatch.setattr(transfers_mod, "BACKPRESSURE_S", 0.3)
    ctl = make(**SETUP)
    eng = Engine(ctl)
    referenced, other = seq(2), seq(2, 1000)
    _fill(ctl, eng, referenced, other)
    gate = threading.Event()
    copier = ctl.transfers.copier
    original = copier.device_to_host

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(copier, "device_to_host", held)
    try:
        eng.request(seq(14, 5000))
        assert (_in_l1(ctl, referenced), _in_l1(ctl, other)) == (0, 2)
    finally:
        gate.set()
    assert ctl.transfers.drain(10)
    assert _in_tier(ctl, referenced, Tier.HOST) == 2
