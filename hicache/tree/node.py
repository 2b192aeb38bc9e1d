"""The radix node: one span of page-aligned tokens, one slot per component per tier.

Internal to hicache.tree: callers hold nodes only as opaque handles inside results.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Tiers whose residency carries page ids (DEVICE, HOST); STORAGE is a bit in `mask` only.
PAGED_TIERS = 2
LOW_TIERS = (0b001, 0b011, 0b111)  # tier bits of "this tier or any closer one"
# A `mask` bit beside the tiers': the slot's page ids (DEVICE/HOST) cover only the node's
# last pages (a `partial_tail` component); set only while some paged tier holds the slot.
PARTIAL = 0b1000


class Node:
    """`key` holds the node's tokens as little-endian uint32 bytes (a whole number of pages).

    Per component index `ci`:
      res[ci * PAGED_TIERS + tier]  page ids (np.ndarray) in DEVICE/HOST, or None
      mask[ci]                      bit `tier` set when resident in that tier (incl. STORAGE);
                                    PARTIAL when the paged slot is only the node's tail
      lock[ci]                      lock references (a locked slot is never evicted)
      sref[ci]                      session references (reorder eviction, never pin)
    `qmask` has a bit per eviction queue (tier, component) the slot is queued in; `lparked`
    one per queue it left because it was locked when popped: offered to them again when
    its lock count drops to 0.
    `stored_at`: when the FULL slot was last recorded in STORAGE or renewed there (a store
    whose objects expire, Redis's `ttl_s`: a record that old may name expired objects).
    `nres[tier]` counts children whose FULL slot is resident in DEVICE/HOST: a FULL slot is
    an eviction candidate of a tier only when no child holds that tier.
    """

    __slots__ = (
        "children",
        "depth",
        "hashes",
        "hits",
        "key",
        "last_access",
        "lock",
        "lparked",
        "mask",
        "npages",
        "nres",
        "parent",
        "qmask",
        "res",
        "root",
        "sref",
        "stored_at",
    )

    def __init__(self, key: bytes, npages: int, parent: Node | None, ncomp: int) -> None:
        self.key = key
        self.npages = npages
        self.parent = parent
        self.root: Any = parent.root if parent is not None else None
        self.depth: int = (parent.depth if parent is not None else 0) + npages
        self.children: dict[bytes, Node] = {}
        self.res: list[np.ndarray | None] = [None] * (ncomp * PAGED_TIERS)
        self.mask = [0] * ncomp
        self.lock = [0] * ncomp
        self.sref = [0] * ncomp
        self.nres = [0] * PAGED_TIERS
        self.hashes: bytes | None = None
        self.hits = 0
        self.last_access = 0
        self.qmask = 0
        self.lparked = 0
        self.stored_at = 0.0  # (time.monotonic) FULL last recorded in, or renewed in, STORAGE

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}p, npages={self.npages}, mask={self.mask})"
