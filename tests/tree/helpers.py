"""Factories shared by the tree tests."""

from __future__ import annotations

import numpy as np

from hicache.tree import HiRadixTree
from hicache.types import ComponentKind

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


def toks(*ids: int) -> bytes:
    return np.array(ids, dtype="<u4").tobytes()


def seq(start: int, n: int) -> bytes:
    return toks(*range(start, start + n))


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def make_tree(page_size: int = 4, swa_window: int | None = None, mamba: bool = False, **kw) -> HiRadixTree:
    kinds = {FULL: 0}
    if swa_window is not None:
        kinds[SWA] = swa_window
    if mamba:
        kinds[MAMBA] = 0
    return HiRadixTree(page_size, kinds, **kw)
