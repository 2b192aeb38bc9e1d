"""Tree factories for the controller directory's tree-level review tests."""

from __future__ import annotations

import numpy as np

from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


def toks(start: int, n: int) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def tree_of(page_size: int = 4, swa_window: int | None = None, mamba: bool = False, **kw) -> HiRadixTree:
    kinds: dict = {FULL: 0}
    if swa_window is not None:
        kinds[SWA] = swa_window
    if mamba:
        kinds[MAMBA] = 0
    return HiRadixTree(page_size, kinds, **kw)


def freed(tree: HiRadixTree, tier: Tier, kind: ComponentKind, n: int, before_drop=None) -> list[int]:
    """The `kind` ids an eviction of `n` frees, sorted (tree integrity checked after)."""
    r = tree.evict(tier, kind, n, before_drop=before_drop)
    tree.check_integrity()
    return sorted(int(x) for x in r.freed[kind])
