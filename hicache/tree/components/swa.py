"""SWA: sliding-window attention KV. Reuse at a boundary needs `window` tokens of SWA data
ending there; data outside every kept window may be dropped alone (a tombstone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hicache.tree.components.base import Component
from hicache.tree.components.full import FULL_INDEX
from hicache.tree.node import Node
from hicache.types import ComponentKind


class SwaComponent(Component):
    kind = ComponentKind.SWA
    child_sensitive = True

    def __init__(self, index: int, page_size: int, window_tokens: int) -> None:
        super().__init__(index, page_size)
        self.window_pages = -(-window_tokens // page_size)

    def valid_at(self, path: Sequence[Node], i: int, tiers: int) -> bool:
        # Walk up from the boundary only as far as the window reaches.
        ci = self.index
        need = min(self.window_pages, path[i - 1].depth)
        run = 0
        for j in range(i - 1, -1, -1):
            node = path[j]
            if not node.mask[ci] & tiers:
                return False
            run += node.npages
            if run >= need:
                return True
        return False

    def split_breaks(self, provided: np.ndarray) -> list[int]:
        # The runs of present and absent ids, found with bytes.find over the mask: one
        # numpy call, then C searches (usually one run of -1 then the window).
        absent = (provided < 0).tobytes()
        breaks: list[int] = []
        pos = 0
        state = absent[:1]
        while True:
            pos = absent.find(b"\x00" if state == b"\x01" else b"\x01", pos)
            if pos < 0:
                return breaks
            breaks.append(pos)
            state = absent[pos : pos + 1]

    def candidate_test(self, tier: int) -> Callable[[Node], bool]:
        # SWA goes alone only from nodes some child continues (in this tier): a leaf's
        # trailing window goes with its FULL slot, never alone.
        ci, bit = self.index, 1 << tier
        return lambda node: bool(node.mask[ci] & bit) and node.nres[tier] > 0

    def retained_pages(self, node: Node, tier: int) -> int:
        """Pages at the tail of `node` that lie inside the window of a boundary kept below
        it (the nearest descendant leaf of this tier); only the rest may become a tombstone."""
        window = self.window_pages
        bit = 1 << tier
        best = window
        stack = [(node, 0)]
        while stack:
            current, dist = stack.pop()
            resident_children = [
                c for c in current.children.values() if c.mask[FULL_INDEX] & bit
            ]
            if not resident_children:
                best = min(best, dist)
                continue
            for child in resident_children:
                d = dist + child.npages
                if d < best:
                    stack.append((child, d))
        return max(0, window - best)
