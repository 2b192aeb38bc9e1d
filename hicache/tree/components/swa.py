"""SWA: sliding-window attention KV. Reuse at a boundary needs `window` tokens of SWA data
ending there; data outside every kept window may be dropped alone (a tombstone)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache.tree.components.base import Component
from hicache.tree.components.full import FULL_INDEX
from hicache.tree.node import Node
from hicache.types import ComponentKind


class SwaComponent(Component):
    kind = ComponentKind.SWA

    def __init__(self, index: int, page_size: int, window_tokens: int) -> None:
        super().__init__(index, page_size)
        self.window_pages = -(-window_tokens // page_size)

    def valid(self, path: Sequence[Node], tiers: int) -> list[bool]:
        ci, window = self.index, self.window_pages
        out = [False] * len(path)
        run = 0
        for i, node in enumerate(path):
            run = run + node.npages if node.mask[ci] & tiers else 0
            out[i] = run >= min(window, node.depth)
        return out

    def split_breaks(self, provided: np.ndarray) -> list[int]:
        absent = provided < 0
        if not absent.any():
            return []
        return (np.flatnonzero(absent[1:] != absent[:-1]) + 1).tolist()

    def is_candidate(self, node: Node, tier: int) -> bool:
        # SWA goes alone only from nodes some child continues (in this tier): a leaf's
        # trailing window goes with its FULL slot, never alone.
        ci = self.index
        return bool(node.mask[ci] & (1 << tier)) and node.nres[tier] > 0

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
