"""Mutation review, third round (tiers): behaviour of the L2 host pools and of an engine's
attach to L1 segments that no other test pinned; each test names the mutant of the
product code it kills and passes on the product as it is. Real `HostBufferPools` (the
`make_host` fixture, unpinned) and real shm segments (`make_device`)."""

from __future__ import annotations

import dataclasses

import pytest
from tierkit import tiny_config

from hicache.errors import InvalidArgument
from hicache.tiers.device import attach_device_pools


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


def test_an_engine_descriptor_reaching_one_byte_past_its_segment_is_refused(make_device) -> None:
    """An engine maps the L1 segment its descriptor names up to the last byte its views
    reach. The daemon's own descriptor fits exactly and attaches; one whose offset puts
    that last byte one past the segment's end is InvalidArgument naming both sizes (a
    mapping past the end of a shared-memory file faults with SIGBUS when the engine's
    kernel writes there).
    Mutant killed: the attach's size check `st_size < size` -> `st_size < size - 1`."""
    pools = make_device(tiny_config())
    full = pools.descriptors()[0]
    size = full.layers * full.layer_stride_bytes
    views = attach_device_pools([full])[full.member]
    assert len(views) == full.layers
    with pytest.raises(InvalidArgument, match=f"holds {size} bytes, the descriptor needs {size + 1}"):
        attach_device_pools([dataclasses.replace(full, offset_bytes=full.offset_bytes + 1)])
