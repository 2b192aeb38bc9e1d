"""MAMBA: recurrent state. Reuse needs a checkpoint at exactly the boundary; a request
that reuses one gets a private copy (copy-on-write), so the checkpoint itself is never
written after insert."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tree.components.base import Component
from hicache.tree.node import Node
from hicache.types import ComponentKind


class MambaComponent(Component):
    kind = ComponentKind.MAMBA
    per_page = False
    path_scoped = False

    def valid(self, path: Sequence[Node], tiers: int) -> list[bool]:
        ci = self.index
        return [bool(node.mask[ci] & tiers) for node in path]

    def transfer_nodes(self, path: Sequence[Node], lo: int, hi: int, src: int, dst: int) -> list[Node]:
        # Only the checkpoint at the boundary itself is needed.
        if hi <= lo:
            return []
        end = path[hi - 1]
        ci = self.index
        return [end] if end.mask[ci] & (1 << src) and not end.mask[ci] & (1 << dst) else []

    def is_candidate(self, node: Node, tier: int) -> bool:
        ci = self.index
        return bool(node.mask[ci] & (1 << tier))
