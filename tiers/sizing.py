"""How large the L2 pools are, computed from the configuration alone (no torch, no pools):
what the host pools allocate and what `hicache config check` reports are the same numbers.

Token families get ``cfg.l2_pages(cfg.l1_pages)`` pages each. MAMBA gets ``ratio`` times
its L1 slots, or, with ``tiers.l2.size_gb``, as many slots as the token families have
pages. A page's L2 slot is its header and payload rounded up to a cache line
(`page_first`, the layout L3 objects need), or its payload (`layer_first`).
"""

from __future__ import annotations

from pathlib import Path

from hicache.config import L2_SLOT_ALIGN, OS_PAGE, GiB, HicacheConfig, l2_slot_bytes
from hicache.errors import ConfigError, FailedPrecondition
from hicache.types import ComponentKind

SLOT_ALIGN = L2_SLOT_ALIGN  # page_first slots start on a cache line (and an int64 boundary)
# Bytes one page of a member takes in L2: the configuration's rule, which also splits a
# `size_gb` budget (one rule for both).
slot_bytes = l2_slot_bytes


def host_pages(cfg: HicacheConfig) -> dict[ComponentKind, int]:
    """Pages (MAMBA: slots) of each family's L2 pools (`HicacheConfig.l2_pages_for`)."""
    return {kind: cfg.l2_pages_for(kind) for kind in cfg.model.component_kinds}


def round_up(value: int, to: int) -> int:
    return -(-value // to) * to


def check_host_fit(cfg: HicacheConfig, available_bytes: int | None = None) -> None:
    """Raise `ConfigError` naming the needed and the allowed byte counts when the L2 pools
    do not fit in this host's ``available - tiers.l2.reserve_gb`` (`available_bytes`:
    MemAvailable, or what the memory cgroup's limit leaves when that is less)."""
    pages = host_pages(cfg)
    layout = cfg.host_layout
    needed = sum(round_up(pages[m.component] * slot_bytes(m, layout), OS_PAGE)
                 for m in cfg.model.members)
    if available_bytes is None:
        available, source = host_memory_left()
    else:
        available, source = available_bytes, "MemAvailable"
    reserve = int(cfg.tiers.l2.reserve_gb * GiB)
    allowed = available - reserve
    if needed > allowed:
        raise ConfigError(
            f"tiers.l2: the host pools need {needed} bytes ({needed / GiB:.2f} GiB) but only "
            f"{max(allowed, 0)} bytes ({max(allowed, 0) / GiB:.2f} GiB) may be used "
            f"({source}, {available} bytes, minus tiers.l2.reserve_gb {cfg.tiers.l2.reserve_gb}); "
            f"lower tiers.l2.ratio / tiers.l2.size_gb or the reserve"
        )


def host_memory_left(meminfo: Path = Path("/proc/meminfo"),
                     proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """(bytes this process may still take, what says so): MemAvailable, or what the
    memory cgroup's limit leaves where that is less (`cgroup_memory_left`)."""
    available = mem_available_bytes(meminfo)
    in_cgroup = cgroup_memory_left(proc_cgroup, root)
    if in_cgroup is not None and in_cgroup < available:
        return in_cgroup, "what the memory cgroup's limit leaves"
    return available, "MemAvailable"


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable of this machine, in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise FailedPrecondition(f"{meminfo}: no MemAvailable line")


# A cgroup v1 "no limit" reads as a page-rounded 2^63: anything this large is none.
_NO_LIMIT = 1 << 60


def cgroup_memory_left(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup may still charge (its limit less its usage), the
    tightest on the way up to the root, from cgroup v2 or v1's memory controller; None
    where no limit is set or readable. In a container, /proc/meminfo shows the node's
    memory: a pool sized by it alone passes the check and is then OOM-killed."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            base, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            left = _limit_left(here / limit_file, here / usage_file)
            if left is not None:
                best = left if best is None else min(best, left)
            if here == base or base not in here.parents:
                break
            here = here.parent
    return best


def _limit_left(limit_file: Path, usage_file: Path) -> int | None:
    """The limit less the working set: the usage less the inactive file cache (what the
    kernel reclaims first, as the kubelet counts it), read from `memory.stat` beside."""
    try:
        limit_text = limit_file.read_text().strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= _NO_LIMIT:
            return None
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (limit_file.parent / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):  # (v2, v1)
                inactive = int(value)
                if key == "total_inactive_file":
                    break
    except (OSError, ValueError):
        pass
    return max(0, limit - max(0, usage - inactive))
