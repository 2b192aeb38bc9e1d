"""FULL: KV for every token. Reuse needs FULL along the whole matched path."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.tree.components.base import Component
from hicache.tree.node import PAGED_TIERS, Node
from hicache.types import ComponentKind

FULL_INDEX = 0  # the tree keeps FULL first: it is the topology's backbone


class FullComponent(Component):
    kind = ComponentKind.FULL

    def valid_at(self, path: Sequence[Node], i: int, tiers: int) -> bool:
        return self.valid_prefix(path[:i], tiers) == i

    def valid_prefix(self, path: Sequence[Node], tiers: int, start: int = 0) -> int:
        """How many leading nodes of `path` are valid (FULL validity is prefix-closed),
        given that the first `start` are."""
        for i in range(start, len(path)):
            if not path[i].mask[FULL_INDEX] & tiers:
                return i
        return len(path)

    def candidate_test(self, tier: int, backed_up: bool = False) -> Callable[[Node], bool]:
        # A FULL slot goes leaf-first per tier. The last copy (no other paged tier holds
        # it) of a node with children may not go at all: that would cut the path. Where
        # the eviction copies it first (`backed_up`, write-back), it is a candidate: the
        # copy makes it not the last (and `evict` keeps it when the copy could not be
        # made). Else an L1 node whose child went to L2 could never leave L1.
        bit = 1 << tier
        other = ((1 << PAGED_TIERS) - 1) & ~bit

        if backed_up:
            return lambda node: bool(node.mask[FULL_INDEX] & bit) and not node.nres[tier]

        def test(node: Node) -> bool:
            mask = node.mask[FULL_INDEX]
            return bool(mask & bit) and not node.nres[tier] and (bool(mask & other) or not node.children)

        return test

    def rank_key(self, lfu: bool) -> Callable[[Node], int]:
        # The reference count itself orders referenced slots (fewer references go first).
        if lfu:
            return lambda n: (n.sref[FULL_INDEX] << 96) | (n.hits << 48) | n.last_access
        return lambda n: (n.sref[FULL_INDEX] << 96) | n.last_access
