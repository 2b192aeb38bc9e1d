"""How large the L2 pools are, computed from the configuration alone (no torch, no pools):
what the host pools allocate and what `hicache config check` reports are the same numbers.

Token families get ``cfg.l2_pages(cfg.l1_pages)`` pages each. MAMBA gets ``ratio`` times
its L1 slots, or, with ``tiers.l2.size_gb``, as many slots as the token families have
pages. A page's L2 slot is its header and payload rounded up to a cache line
(`page_first`, the layout L3 objects need), or its payload (`layer_first`).
"""

from __future__ import annotations

from hicache.config import L2_SLOT_ALIGN, HicacheConfig, l2_slot_bytes
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
