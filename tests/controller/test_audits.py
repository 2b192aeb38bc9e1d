"""The audits most tests end with (`check_integrity`: the tree's invariants and every L1/L2
page owned exactly once) must themselves catch what they exist for: a page leaked, a page
owned twice, a tree whose bookkeeping is off. Without these, a broken audit would make
every test that relies on it pass silently."""

from __future__ import annotations

import numpy as np
import pytest
from engine_sim import Engine, seq

from hicache.controller.engines import AllocationRecord
from hicache.tree.node import Node
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_a_page_nobody_owns_is_a_leak(make, tier: Tier) -> None:
    ctl = make()
    Engine(ctl).request(seq(4))
    assert ctl.transfers.drain(10)
    ctl.check_integrity()
    pools = ctl.device if tier is Tier.DEVICE else ctl.host
    leaked = pools.allocator(FULL).allocate(1)
    try:
        with pytest.raises(AssertionError, match=rf"{tier.name} full: \d+ pages allocated, \d+ owned \(leak\)"):
            ctl.check_integrity()
    finally:
        pools.allocator(FULL).free(leaked)
    ctl.check_integrity()


def test_a_page_with_two_owners_is_caught(make) -> None:
    ctl = make()
    ctl.attach("e1", 0, 1)
    Engine(ctl).request(seq(4))
    assert ctl.transfers.drain(10)
    (node,) = list(ctl.tree.iter_nodes())
    in_tree = ctl.tree.pages_of(node, FULL, Tier.DEVICE)
    record = AllocationRecord("e1", "", 0, {FULL: np.array(in_tree[:1])}, None)
    alloc_id = ctl._engines.add_allocation(record)  # a page the tree owns, handed out again
    try:
        with pytest.raises(AssertionError, match="DEVICE full: a page owned twice"):
            ctl.check_integrity()
    finally:
        ctl._engines.pop_allocation("e1", alloc_id)
    ctl.check_integrity()


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_a_page_freed_while_owned_is_caught_even_where_a_leak_evens_the_count(make, tier: Tier) -> None:
    """A page the tree still serves goes back to the free list (it would be handed to the
    next request, whose KV overwrites the cache) while another page leaks: the counts
    agree, so only a check of each owned page against the allocator sees it (session
    31: a mutant of the insert's allocation bookkeeping did exactly this and passed)."""
    ctl = make()
    Engine(ctl).request(seq(4))
    assert ctl.transfers.drain(10)
    ctl.check_integrity()
    (node,) = list(ctl.tree.iter_nodes())
    owned = ctl.tree.pages_of(node, FULL, tier)
    assert owned is not None
    pools = ctl.device if tier is Tier.DEVICE else ctl.host
    allocator = pools.allocator(FULL)
    leaked = allocator.allocate(1)
    allocator.free(owned[:1])
    try:
        with pytest.raises(AssertionError, match=rf"{tier.name} full: pages \[{int(owned[0])}\] owned but free"):
            ctl.check_integrity()
    finally:
        allocator.free(leaked)  # (LIFO: the next two out are the leaked page and the tree's)
        back = allocator.allocate(2)
        assert sorted(back.tolist()) == sorted([int(leaked[0]), int(owned[0])])
        allocator.free(back[back != owned[0]])
    ctl.check_integrity()


def test_a_tree_whose_bookkeeping_is_off_is_caught(make) -> None:
    ctl = make()
    Engine(ctl).request(seq(4))
    assert ctl.transfers.drain(10)
    (node,) = list(ctl.tree.iter_nodes())
    assert isinstance(node, Node)
    node.nres[Tier.DEVICE] += 1  # a resident count that no slot accounts for
    try:
        with pytest.raises(AssertionError, match=r"nres\[0\]="):
            ctl.check_integrity()
    finally:
        node.nres[Tier.DEVICE] -= 1
    ctl.check_integrity()
