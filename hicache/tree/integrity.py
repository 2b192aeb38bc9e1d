"""`check_integrity()`: every invariant of the tree, recomputed from scratch.

Kept apart from the core so the hot-path module stays small; it reads the tree's private
state on purpose (it is the tree's own auditor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.tree.components import FULL_INDEX
from hicache.tree.node import PAGED_TIERS, PARTIAL, Node
from hicache.types import Tier

if TYPE_CHECKING:
    from hicache.tree.core import HiRadixTree


def _nodes(root: Node) -> list[Node]:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_tree(tree: HiRadixTree) -> None:
    t = tree
    pb = t._pb
    ncomp = t._ncomp
    paged = (1 << PAGED_TIERS) - 1
    resident = [[0] * ncomp for _ in Tier]
    locked = [[0] * ncomp for _ in Tier]
    expect_lock: dict[int, list[int]] = {}
    expect_sref: dict[int, list[int]] = {}

    def bump(table: dict[int, list[int]], node: Node, ci: int, by: int = 1) -> None:
        table.setdefault(id(node), [0] * ncomp)[ci] += by

    for lock in t._locks:
        assert lock.active, "an inactive lock is still registered"
        node = lock.end
        while isinstance(node, Node) and node.parent is not None:
            for comp in t._path_comps:
                bump(expect_lock, node, comp.index)
            node = node.parent
        for point in lock.mamba_nodes:
            assert isinstance(point, Node)
            for comp in t._point_comps:
                bump(expect_lock, point, comp.index)
    for session in t._sessions.sessions():
        end = session.end
        node = end
        while node is not None and node.parent is not None:
            for comp in t._whole_path_comps:
                bump(expect_sref, node, comp.index)
            if node.depth - node.npages >= session.window_top:
                for comp in t._window_comps:
                    bump(expect_sref, node, comp.index)
            else:  # (the node the window begins in was split there: none straddles it)
                assert node.depth <= session.window_top, (
                    f"a node ({node.depth - node.npages}p..{node.depth}p) straddles a "
                    f"session's window start ({session.window_top}p)")
            node = node.parent
        if end is not None:
            for comp in t._point_comps:
                bump(expect_sref, end, comp.index)

    for namespace, root in t._roots.items():
        assert root.parent is None and root.depth == 0 and not any(root.mask)
        assert root.root.namespace == namespace
        assert root.children, f"{namespace!r}: a root with nothing under it is kept"
        for node in _nodes(root):
            parent = node.parent
            assert parent is not None
            where = f"{namespace!r}@{node.depth}p"
            assert node.npages > 0 and len(node.key) == node.npages * pb, where
            assert node.depth == parent.depth + node.npages, f"{where}: depth"
            assert parent.children.get(node.key[:pb]) is node, f"{where}: child key"
            assert node.root is root.root, f"{where}: namespace"
            if node.hashes is not None:
                assert len(node.hashes) == node.npages * 16, f"{where}: hashes"
            full = node.mask[FULL_INDEX]
            assert full & paged, f"{where}: node without FULL in L1 or L2"
            if full & 1 and parent.parent is not None:
                assert parent.mask[FULL_INDEX] & 1, f"{where}: L1 FULL under a parent without it"
            for tier in range(PAGED_TIERS):
                n = sum(1 for c in node.children.values() if c.mask[FULL_INDEX] & (1 << tier))
                assert node.nres[tier] == n, f"{where}: nres[{tier}]={node.nres[tier]} != {n}"
            for comp in t.components:
                ci = comp.index
                mask = node.mask[ci]
                whole = comp.slot_pages(node)
                held = [a for a in node.res[ci * PAGED_TIERS : (ci + 1) * PAGED_TIERS] if a is not None]
                partial = False
                if comp.partial_tail and held:
                    # One length per node, 1..npages; an L3 copy is recorded only whole.
                    lengths = {len(a) for a in held}
                    assert len(lengths) == 1, f"{where}: {comp.kind.value} lengths {lengths} differ by tier"
                    (tail,) = lengths
                    assert 0 < tail <= whole, f"{where}: {comp.kind.value} tail of {tail} pages"
                    partial = tail < whole
                    assert not partial or not mask & (1 << Tier.STORAGE), (
                        f"{where}: {comp.kind.value} partial slot recorded in L3"
                    )
                assert bool(mask & PARTIAL) == partial, f"{where}: {comp.kind.value} PARTIAL bit"
                for tier in Tier:
                    on = bool(mask & (1 << tier))
                    size = whole
                    if tier < PAGED_TIERS:
                        arr = node.res[ci * PAGED_TIERS + tier]
                        assert on == (arr is not None), f"{where}: {comp.kind.value} res/mask {tier.name}"
                        if arr is not None:
                            if comp.partial_tail:
                                size = len(arr)
                            assert len(arr) == size, f"{where}: {comp.kind.value} {len(arr)} ids != {size}"
                            if ci != FULL_INDEX:
                                assert full & (1 << tier), f"{where}: {comp.kind.value} in {tier.name} without FULL"
                    if on:
                        resident[tier][ci] += size
                        if node.lock[t._lock_idx[ci]]:
                            locked[tier][ci] += size
                want_lock = expect_lock.get(id(node), [0] * ncomp)[ci]
                have_lock = node.lock[t._lock_idx[ci]]
                assert have_lock == want_lock, f"{where}: {comp.kind.value} lock {have_lock} != {want_lock}"
                want_sref = expect_sref.get(id(node), [0] * ncomp)[ci]
                assert node.sref[ci] == want_sref, f"{where}: {comp.kind.value} sref {node.sref[ci]} != {want_sref}"
                for tier in range(PAGED_TIERS):
                    if comp.candidate_test(tier, tier in t.backed_up_tiers)(node) and comp.retained_pages(node, tier) < t._slot_len(node, comp, tier):
                        bit = 1 << (tier * ncomp + ci)
                        parked = node.lparked & bit and node.lock[t._lock_idx[ci]]  # (offered at unlock)
                        assert node.qmask & bit or parked, f"{where}: evictable {comp.kind.value}/{tier} not queued"
    assert resident == t._resident, f"resident counters {t._resident} != {resident}"
    assert locked == t._locked, f"locked counters {t._locked} != {locked}"
