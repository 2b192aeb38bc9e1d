"""Mutation review, second round (controller): room-making and flush accounting of
`Transfers` that no other test pinned; each test names the mutant it kills. Real
controllers (`make`), real L3 backends (a Redis address nothing listens on: `free_port`)."""

from __future__ import annotations

from engine_sim import Engine, seq

from hicache.bench.services import free_port
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


def test_allocate_free_l1_takes_exactly_the_free_pages_that_are_left(make) -> None:
    """L1 has 64 FULL pages, 60 of them free after one 4-page request. Asking
    `allocate_free_l1` (every L1 allocation's first try, and all a prefetch's move into
    L1 may take: free pages only, never evicting) for exactly
    the 60 free pages gets them all; asking for 61 gets None and takes nothing.
    Mutant killed: `allocate_free_l1` with `free_count <= n` (an exact fit refused)."""
    ctl = make()
    Engine(ctl).request(seq(4))
    alloc = ctl.device.allocator(FULL)
    with ctl._mu:
        assert (alloc.total, alloc.free_count) == (64, 60)
        assert ctl.transfers.allocate_free_l1({FULL: 61}) is None
        assert alloc.free_count == 60
        got = ctl.transfers.allocate_free_l1({FULL: 60})
        assert got is not None and len(got[FULL]) == 60 and alloc.free_count == 0
        ctl.transfers.free_l1(FULL, got[FULL])


def test_an_l1_eviction_frees_one_sixty_fourth_of_the_pool_ahead(make) -> None:
    """L1 holds 64 FULL pages (EVICT_AHEAD_DIVISOR 64: one page ahead), all cached in 64
    one-page leaves, unlocked, their write-through copies landed. Allocating one page
    evicts the page it needs plus one ahead: two leaves (`evictions_device` +2), one page
    left free after the allocation.
    Mutant killed: `Transfers._ahead` 0 (evicts one leaf only, no page left free)."""
    ctl = make()
    eng = Engine(ctl)
    for i in range(64):
        eng.request(seq(1, base=1000 * (i + 1)))
    assert ctl.transfers.drain(10)
    alloc = ctl.device.allocator(FULL)
    with ctl._mu:
        assert alloc.free_count == 0
        assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 64
        before = ctl.transfers.stats["evictions_device"]
        got = ctl.transfers.allocate_l1(FULL, 1)
        assert len(got) == 1
        assert ctl.transfers.stats["evictions_device"] - before == 2
        assert alloc.free_count == 1
        assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 62
        ctl.transfers.free_l1(FULL, got)


def test_unflushed_pages_counts_everything_while_the_configured_l3_never_connected(make) -> None:
    """An L3 (Redis) is configured but nothing listens at its address: the controller
    serves from L1/L2 (`l3` None, `l3_down` set). After one 4-page request, a flush could
    write none of it: `unflushed_pages` says 4, not 0 (0 is for a daemon with no L3 at
    all; an operator waiting for it to reach 0 before a restart must not be told the
    cache is safe).
    Mutant killed: `unflushed_pages` returning 0 whenever `l3` is None."""
    ctl = make(backend="redis", storage__redis={"url": f"redis://127.0.0.1:{free_port()}",
                                                "ttl_s": None})
    assert ctl.l3 is None and ctl.l3_down
    Engine(ctl).request(seq(4))
    assert ctl.transfers.unflushed_pages() == 4
