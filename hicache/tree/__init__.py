"""The HiRadixTree: which prefix lives where, per component and tier (DESIGN §1)."""

from __future__ import annotations

from hicache.tree.core import KEEP_THE_REST, HiRadixTree
from hicache.tree.results import EvictResult, InsertResult, MatchResult, TreeLock, Victim

__all__ = ["KEEP_THE_REST", "EvictResult", "HiRadixTree", "InsertResult", "MatchResult", "TreeLock", "Victim"]
