"""SWA: sliding-window attention KV. Reuse at a boundary needs `window` tokens of SWA data
ending there; data outside every kept window may be dropped alone (a tombstone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.tree.components.base import Component
from hicache.tree.components.full import FULL_INDEX
from hicache.tree.node import PAGED_TIERS, PARTIAL, Node
from hicache.types import ComponentKind


class SwaComponent(Component):
    kind = ComponentKind.SWA
    child_sensitive = True
    partial_tail = True

    def __init__(self, index: int, page_size: int, window_tokens: int) -> None:
        super().__init__(index, page_size)
        self.window_pages = -(-window_tokens // page_size)

    def valid_at(self, path: Sequence[Node], i: int, tiers: int) -> bool:
        # Walk up from the boundary only as far as the window reaches; a slot holding only
        # its node's tail ends the run of SWA data there.
        ci = self.index
        slot = ci * PAGED_TIERS
        need = min(self.window_pages, path[i - 1].depth)
        run = 0
        for j in range(i - 1, -1, -1):
            node = path[j]
            mask = node.mask[ci]
            if not mask & tiers:
                return False
            n = node.npages
            if mask & PARTIAL:  # the paged slot is the node's tail (never recorded in L3)
                held = node.res[slot] if mask & 1 else node.res[slot + 1]
                n = len(held)  # type: ignore[arg-type]
            run += n
            if run >= need:
                return True
            if n < node.npages:
                return False
        return False

    def split_breaks(self, absent: bytes) -> list[int]:
        # A node may hold absent pages then present ones (a tail), so a new node starts
        # only where absent pages follow present ones; found with bytes.find over the
        # mask (usually none: one run of -1, then the window).
        breaks: list[int] = []
        pos = absent.find(b"\x00")
        while pos >= 0:
            pos = absent.find(b"\x01", pos)
            if pos < 0:
                break
            breaks.append(pos)
            pos = absent.find(b"\x00", pos)
        return breaks

    def candidate_test(self, tier: int, backed_up: bool = False) -> Callable[[Node], bool]:
        # SWA goes alone from nodes some child continues (in this tier), and from a leaf
        # longer than the window: what lies before its trailing window (`retained_pages`);
        # the window itself goes with the leaf's FULL slot, never alone.
        ci, bit, window = self.index, 1 << tier, self.window_pages
        return lambda node: bool(node.mask[ci] & bit) and (node.nres[tier] > 0 or node.npages > window)

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
