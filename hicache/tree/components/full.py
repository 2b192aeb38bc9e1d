"""FULL: KV for every token. Reuse needs FULL along the whole matched path."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tree.components.base import Component
from hicache.tree.node import PAGED_TIERS, Node
from hicache.types import ComponentKind

FULL_INDEX = 0  # the tree keeps FULL first: it is the topology's backbone


class FullComponent(Component):
    kind = ComponentKind.FULL

    def valid(self, path: Sequence[Node], tiers: int) -> list[bool]:
        out = [False] * len(path)
        for i, node in enumerate(path):
            if not node.mask[FULL_INDEX] & tiers:
                break
            out[i] = True
        return out

    def valid_prefix(self, path: Sequence[Node], tiers: int) -> int:
        """How many leading nodes of `path` are valid (FULL validity is prefix-closed)."""
        for i, node in enumerate(path):
            if not node.mask[FULL_INDEX] & tiers:
                return i
        return len(path)

    def is_candidate(self, node: Node, tier: int) -> bool:
        # A FULL slot goes leaf-first per tier. The last copy (no other paged tier holds
        # it) of a node with children may not go at all: that would cut the path.
        if not node.mask[FULL_INDEX] & (1 << tier):
            return False
        if node.nres[tier]:
            return False
        other = node.mask[FULL_INDEX] & ~(1 << tier) & ((1 << PAGED_TIERS) - 1)
        return bool(other) or not node.children

    def rank(self, node: Node, base: tuple[int, int]) -> tuple[int, ...]:
        refs = node.sref[FULL_INDEX]
        return (1 if refs else 0, refs, *base)
