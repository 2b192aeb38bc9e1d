"""Mutation review, third round (tiers): behaviour of the L2 host pools that no other
test pinned; each test names the mutant of the product code it kills and passes on the
product as it is. Real `HostBufferPools` (the `make_host` fixture, unpinned)."""

from __future__ import annotations

from tierkit import tiny_config


def test_closing_l2_with_keep_memory_leaves_its_pages_mapped_for_a_late_writer(make_host) -> None:
    """The controller closes L2 with `keep_memory=True` when an L3 call it gave up on may
    still move data into L2 (`Controller.close`): the pools' memory must stay mapped, so
    such a late write lands in it instead of crashing the process. After that close a
    page's object view still reads what was written, and a write through it lands; the
    full close afterwards releases the memory.
    Mutant killed: `close(keep_memory=True)` going on to unmap (the views' buffer dropped:
    `payload_view` then raises FailedPrecondition "host pools are closed")."""
    pools = make_host(tiny_config("page_first"))
    member = pools.members[0].name
    pools.payload_view(member, 3)[:] = 7
    pools.close(keep_memory=True)
    view = pools.payload_view(member, 3)
    assert view.size > 0 and bool((view == 7).all())
    view[:] = 9  # (the late writer)
    assert bool((pools.payload_view(member, 3) == 9).all())
    assert pools.buffer_view().size == pools.buffer_size
