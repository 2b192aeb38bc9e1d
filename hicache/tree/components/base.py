"""The component contract: one strategy object per kind of state (DESIGN §1).

The tree core walks one FULL-keyed topology and calls these hooks; it never asks which
kind a component is. Adding a component means adding a subclass here, nothing in the core.

Terms used below:
  path      the nodes from the namespace root (exclusive) to the walk's end, top down
  boundary  the end of path[i]; boundary index i+1 means "after path[i]", 0 is the root
  tiers     a bit mask of tiers whose data may be used (LOW_TIERS[t] = tier t or closer)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from hicache.tree.node import Node
from hicache.types import ComponentKind


class Component(ABC):
    kind: ComponentKind
    #: True when a slot holds one page per token page (FULL, SWA); False for one state
    #: slot per boundary (MAMBA).
    per_page: bool = True
    #: True when locks and session references cover the whole path to the root (and a
    #: split's head inherits them); False when they cover the boundary node only.
    path_scoped: bool = True
    #: Pages before a boundary whose data reuse needs (SWA's window); 0 = not windowed.
    window_pages: int = 0
    #: True when whether a slot may be evicted depends on the node's children (SWA goes
    #: alone only where a child continues the path): a child's arrival re-offers the
    #: parent, and a new node (no children yet) is not offered.
    child_sensitive: bool = False
    #: True when a slot in L1/L2 may hold only the last pages of its node (SWA: what an
    #: engine kept of a long prefill is the window before its end). Such a slot has the
    #: same length in every paged tier that holds it; an L3 copy is recorded (the STORAGE
    #: bit) only for a whole slot.
    partial_tail: bool = False

    def __init__(self, index: int, page_size: int) -> None:
        self.index = index
        self.page_size = page_size

    def slot_pages(self, node: Node) -> int:
        """Pages a resident slot of this component occupies at `node`."""
        return node.npages if self.per_page else 1

    @abstractmethod
    def valid_at(self, path: Sequence[Node], i: int, tiers: int) -> bool:
        """May a request reuse the prefix ending at path[i-1] (boundary `i`) using only data
        in `tiers`? Pure. Match asks it deepest-first and stops at the first boundary every
        component accepts (a rejection moves the boundary up, it does not end the walk), so
        an answer should look at as few nodes as it can."""

    def transfer_nodes(self, path: Sequence[Node], lo: int, hi: int, src: int, dst: int) -> list[Node]:
        """Nodes of path[lo:hi] whose slot must move from tier `src` to `dst` so that the
        boundary at the end of path[hi-1] becomes valid in `dst` (a whole family moves)."""
        bit_src, bit_dst = 1 << src, 1 << dst
        ci = self.index
        return [n for n in path[lo:hi] if n.mask[ci] & bit_src and not n.mask[ci] & bit_dst]

    def split_breaks(self, absent: bytes) -> list[int]:
        """Page offsets inside a new suffix at which insert must start a new node so that
        each node's slot can be stored: present, absent, or (`partial_tail`) absent then
        present. `absent` has one byte per page of the suffix, 1 where the given id is -1
        (a page already freed, e.g. SWA out of window); called only when some byte is 1."""
        return [i for i in range(1, len(absent)) if absent[i] != absent[i - 1]]

    # Eviction ----------------------------------------------------------------------

    @abstractmethod
    def candidate_test(self, tier: int, backed_up: bool = False) -> Callable[[Node], bool]:
        """The test "could this component's slot at a node leave `tier`, locks aside?"
        (resident and structurally allowed; the queue checks locks when it pops). Built
        once per eviction queue and run on every offer: a closure with no further calls.
        `backed_up`: an eviction from `tier` first copies the slot to the other paged tier
        (write-back)."""

    def retained_pages(self, node: Node, tier: int) -> int:
        """Pages at the tail of `node` that must stay when its slot is evicted alone from
        `tier` (the rest may go); 0 for components whose slots go whole."""
        return 0

    def valid_prefix(self, path: Sequence[Node], tiers: int, start: int = 0) -> int:
        """How many leading nodes of `path` are valid, for components whose validity is
        prefix-closed (FULL), given that the first `start` are; others answer through
        `valid_at`."""
        raise NotImplementedError(f"{type(self).__name__} is not prefix-closed")

    def rank_key(self, lfu: bool) -> Callable[[Node], int]:
        """Eviction order key, smallest first, as one int (cheap to build and compare in
        the heap): unreferenced before referenced, then the base policy, LRU (last access)
        or LFU (hits, then last access). FULL refines this with the reference count.
        Ticks and hits stay below 2**48, so the fields never overlap."""
        ci = self.index
        if lfu:
            return lambda n: ((1 << 96) if n.sref[ci] else 0) | (n.hits << 48) | n.last_access
        return lambda n: ((1 << 96) if n.sref[ci] else 0) | n.last_access
