"""MAMBA: recurrent state. Reuse needs a checkpoint at exactly the boundary; a request
that reuses one gets a private copy (copy-on-write), so the checkpoint itself is never
written after insert."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.tree.components.base import Component
from hicache.tree.node import Node
from hicache.types import ComponentKind


class MambaComponent(Component):
    kind = ComponentKind.MAMBA
    per_page = False
    path_scoped = False

    def valid_at(self, path: Sequence[Node], i: int, tiers: int) -> bool:
        return bool(path[i - 1].mask[self.index] & tiers)

    def transfer_nodes(self, path: Sequence[Node], lo: int, hi: int, src: int, dst: int) -> list[Node]:
        # Only the checkpoint at the boundary itself is needed.
        if hi <= lo:
            return []
        end = path[hi - 1]
        ci = self.index
        return [end] if end.mask[ci] & (1 << src) and not end.mask[ci] & (1 << dst) else []

    def candidate_test(self, tier: int, backed_up: bool = False) -> Callable[[Node], bool]:
        ci, bit = self.index, 1 << tier
        return lambda node: bool(node.mask[ci] & bit)
