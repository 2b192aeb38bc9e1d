"""L2 host pools: sizing, both layouts, page objects for L3, and the RAM refusal."""

from __future__ import annotations

import mmap
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tierkit import TINY, tiny_config

from hicache.config import L2_PAGE_HEADER_BYTES, L2_SLOT_ALIGN, build_config
from hicache.errors import ConfigError, FailedPrecondition, InvalidArgument
from hicache.tiers.host import HEADER_BYTES, HostBufferPools, build_host_pools, host_pages
from hicache.tiers.sizing import SLOT_ALIGN, slot_bytes
from hicache.types import ComponentKind, HostLayout

Make = Callable[..., HostBufferPools]


def test_sizes_follow_the_ratio_and_mamba_gets_the_same_multiple() -> None:
    # 16 L1 pages x 2.0 -> 32; mamba 4 slots x 2.0 -> 8.
    assert host_pages(tiny_config()) == {ComponentKind.FULL: 32, ComponentKind.MAMBA: 8}
    # ratio 2.5: 40 pages, ceil(4 x 2.5) = 10 slots.
    assert host_pages(tiny_config(ratio=2.5)) == {ComponentKind.FULL: 40, ComponentKind.MAMBA: 10}


def _buffer(cfg, pages: int, layout: HostLayout) -> int:
    """The L2 buffer `pages` of every member take: each member's region starts on an OS page."""
    return sum(-(-pages * slot_bytes(m, layout) // mmap.PAGESIZE) * mmap.PAGESIZE
               for m in cfg.model.members)


def test_size_gb_splits_the_budget_over_every_member() -> None:
    # One page of every member: full 2x32 + idx 3x8 + mamba 2x24 = 136 bytes. With regions
    # starting on 4 KiB pages, 960 pages take 15 + 6 + 12 of them (135,168 bytes), 961 pages
    # 16 + 6 + 12: over the 136,000-byte budget (1000 pages would fit unrounded).
    assert mmap.PAGESIZE == 4096
    cfg = tiny_config(size_gb=136 * 1000 / (1 << 30))
    assert host_pages(cfg) == {ComponentKind.FULL: 960, ComponentKind.MAMBA: 960}
    assert _buffer(cfg, 960, HostLayout.LAYER_FIRST) <= 136 * 1000 < _buffer(cfg, 961, HostLayout.LAYER_FIRST)


def test_a_ratio_whose_float_product_falls_short_of_a_whole_number_rounds_to_it() -> None:
    """4 x 2.3 is 9.2 and rounds up for both (MAMBA's ceil); 100 x 2.3 is
    229.99999999999997 in floats, and token pages used to truncate it to 229."""
    cfg = build_config({**TINY, "tiers": {**TINY["tiers"], "l1": {**TINY["tiers"]["l1"], "tokens": 4 * 100,
                                                                     "mamba_slots": 100},
                                          "l2": {**TINY["tiers"]["l2"], "ratio": 2.3}}})
    assert host_pages(cfg) == {ComponentKind.FULL: 230, ComponentKind.MAMBA: 230}


def test_a_page_first_size_gb_budget_counts_each_slots_header_and_padding() -> None:
    """page_first slots hold a 64-byte header and pad to a cache line: the budget used to
    be split by payload bytes alone, and the pools overran it (2.8x for this tiny model)."""
    budget = 1 << 20
    cfg = tiny_config("page_first", size_gb=budget / (1 << 30))
    pages = host_pages(cfg)
    n = pages[ComponentKind.FULL]
    assert _buffer(cfg, n, HostLayout.PAGE_FIRST) <= budget < _buffer(cfg, n + 1, HostLayout.PAGE_FIRST)
    assert (HEADER_BYTES, SLOT_ALIGN) == (L2_PAGE_HEADER_BYTES, L2_SLOT_ALIGN)  # the object format


def test_layer_first_is_like_l1_and_has_no_page_objects(make_host: Make) -> None:
    pools = make_host(tiny_config("layer_first"))
    assert pools.layout is HostLayout.LAYER_FIRST and not pools.pinned
    rows = pools.layer("full", 1)
    assert rows.shape == (32, 32) and rows.is_contiguous()
    assert rows.data_ptr() == pools.buffer_address + 32 * 32  # after layer 0
    assert pools.buffer_address % 4096 == 0 and pools.buffer_size % 4096 == 0
    with pytest.raises(FailedPrecondition, match="page_first"):
        pools.object_view("full", 0)


def test_page_first_slots_are_header_then_all_layers(make_host: Make) -> None:
    pools = make_host(tiny_config("page_first"))
    # full: 64 B header + 2 x 32 B payload = 128 B slot; idx: 64 + 24 -> 88, padded to 128.
    assert pools.object_bytes == {"full": 128, "idx": 88, "mamba": 112}
    pools.layer("full", 0)[5] = 1
    pools.layer("full", 1)[5] = 2
    obj = pools.object_view("full", 5)
    assert obj.flags.c_contiguous and obj.nbytes == 128
    assert (obj[:HEADER_BYTES] == 0).all()
    assert obj[HEADER_BYTES:].tolist() == [1] * 32 + [2] * 32
    assert np.array_equal(pools.payload_view("full", 5), obj[HEADER_BYTES:])
    assert pools.object_address("full", 5) == obj.ctypes.data == pools.buffer_address + 5 * 128
    # The sidecar region starts on the next OS page after full's 32 slots.
    idx = pools.object_view("idx", 1)
    assert idx.nbytes == 88 and pools.object_address("idx", 1) == pools.buffer_address + 4096 + 128
    assert pools.layer("idx", 2).stride() == (128, 1)
    obj[0] = 9  # the header area is writable in place (the L3 layer writes it)
    assert pools.object_view("full", 5)[0] == 9
    with pytest.raises(InvalidArgument, match=r"page id 32 out of range \[0, 32\)"):
        pools.payload_view("full", 32)


def test_object_views_are_the_slots_in_order_without_copies(make_host: Make) -> None:
    pools = make_host(tiny_config("page_first"))
    ids = np.array([7, 0, 31, 7], dtype=np.int64)
    views = pools.object_views("idx", ids)
    for view, pid in zip(views, ids.tolist(), strict=True):
        assert view.ctypes.data == pools.object_address("idx", pid) and view.nbytes == 88
        assert np.shares_memory(view, pools.object_view("idx", pid))
    views[0][HEADER_BYTES] = 5  # a view, not a copy
    assert pools.payload_view("idx", 7)[0] == 5
    assert pools.object_views("full", np.empty(0, dtype=np.int64)) == []
    with pytest.raises(InvalidArgument, match=r"page ids \[32, -1\] out of range \[0, 32\)"):
        pools.object_views("full", np.array([1, 32, -1]))
    with pytest.raises(FailedPrecondition, match="page_first"):
        make_host(tiny_config("layer_first")).object_views("full", ids)


def test_refuses_to_start_when_ram_is_short() -> None:
    cfg = tiny_config("page_first", reserve_gb=1.0)
    needed = 4096 * 3  # three members, each region rounded to one OS page
    message = (
        f"tiers.l2: the host pools need {needed} bytes (0.00 GiB) but only 0 bytes (0.00 GiB) "
        f"may be used (MemAvailable, {1 << 29} bytes, minus tiers.l2.reserve_gb 1.0)"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_host_pools(cfg, pin=False, available_bytes=1 << 29)
    pools = build_host_pools(cfg, pin=False, available_bytes=(1 << 30) + needed)
    assert pools.buffer_size == needed
    pools.close()


def test_auto_layout_must_be_resolved_first() -> None:
    cfg = tiny_config()
    with pytest.raises(InvalidArgument, match="resolve layout 'auto'"):
        HostBufferPools(cfg.model.members, host_pages(cfg), HostLayout.AUTO)


def test_the_memory_cgroup_limit_bounds_what_l2_may_use(tmp_path: Path) -> None:
    """In a container /proc/meminfo is the node's: the cgroup's limit less its usage is
    what the pools may take, the tightest level on the way up, v2 or v1."""
    from hicache.tiers.sizing import cgroup_memory_left

    def files(tree: dict[str, str]) -> None:
        for rel, text in tree.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    files({"proc_v2": "0::/kubepods/pod1/ctr\n",
           "cg/kubepods/memory.max": "max\n", "cg/kubepods/memory.current": "1\n",
           "cg/kubepods/pod1/memory.max": str(10 << 30), "cg/kubepods/pod1/memory.current": str(3 << 30),
           "cg/kubepods/pod1/ctr/memory.max": str(8 << 30), "cg/kubepods/pod1/ctr/memory.current": str(2 << 30)})
    assert cgroup_memory_left(tmp_path / "proc_v2", tmp_path / "cg") == 6 << 30
    # Inactive file cache is reclaimed first: not counted against the limit.
    files({"cg/kubepods/pod1/ctr/memory.stat": f"anon 5\ninactive_file {1 << 30}\nactive_file 7\n"})
    assert cgroup_memory_left(tmp_path / "proc_v2", tmp_path / "cg") == 7 << 30
    files({"proc_v1": "5:cpu:/x\n4:memory,foo:/docker/abc\n",
           "v1/memory/docker/abc/memory.limit_in_bytes": str(4 << 30),
           "v1/memory/docker/abc/memory.usage_in_bytes": str(1 << 30),
           "v1/memory/docker/memory.limit_in_bytes": "9223372036854771712",  # (none)
           "v1/memory/docker/memory.usage_in_bytes": "5"})
    assert cgroup_memory_left(tmp_path / "proc_v1", tmp_path / "v1") == 3 << 30
    files({"proc_none": "0::/\n", "none/memory.max": "max\n"})
    assert cgroup_memory_left(tmp_path / "proc_none", tmp_path / "none") is None
    assert cgroup_memory_left(tmp_path / "missing", tmp_path) is None


def test_l2_may_use_the_lesser_of_memavailable_and_what_the_cgroup_leaves(tmp_path: Path) -> None:
    """The L2 fit check takes what the memory cgroup leaves where that is less than the
    node's MemAvailable (a container), and MemAvailable where it is more or there is no
    limit; each time naming which it took."""
    from hicache.tiers.sizing import host_memory_left

    (tmp_path / "meminfo").write_text(f"MemTotal: 1 kB\nMemAvailable: {8 << 20} kB\n")  # 8 GiB
    (tmp_path / "cgroup").write_text("0::/ctr\n")
    (tmp_path / "cg" / "ctr").mkdir(parents=True)
    (tmp_path / "cg" / "ctr" / "memory.current").write_text(str(1 << 30))

    def left(limit: str) -> tuple[int, str]:
        (tmp_path / "cg" / "ctr" / "memory.max").write_text(limit)
        return host_memory_left(tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "cg")

    assert left(str(4 << 30)) == (3 << 30, "what the memory cgroup's limit leaves")
    assert left(str(16 << 30)) == (8 << 30, "MemAvailable")
    assert left("max") == (8 << 30, "MemAvailable")
