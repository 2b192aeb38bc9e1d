"""The HiRadixTree: which prefix lives where, per component and tier (DESIGN §1)."""

from __future__ import annotations

from hicache.tree.core import HiRadixTree
from hicache.tree.results import EvictResult, InsertResult, MatchResult, TreeLock, Victim

__all__ = ["EvictResult", "HiRadixTree", "InsertResult", "MatchResult", "TreeLock", "Victim"]
