"""Per (tier, component) eviction queues: lazy min-heaps of candidate slots.

Why lazy: every match touches each node on its path, and re-keying a heap entry per touch
would cost O(path log n) per request. Instead an entry keeps the rank it was pushed with;
at pop time a stale rank (the slot was used since) is re-pushed with its current rank, and
a slot that is no longer a candidate is dropped. Ranks only grow between pushes, except
when a session's references drop, which re-queues eagerly. Each pop is O(log n).

`Node.qmask` has bit (tier * ncomp + ci) set while the slot has an entry queued (or
parked), so a slot is never queued twice by the same event.

Locks are checked at pop time, not tracked by the queue: a locked candidate popped during
an eviction is parked and goes back into the heap at the next eviction. So unlocking,
which happens on every node of every request's path, costs the queues nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from hicache.tree.node import Node

RankFn = Callable[[Node], int]
CandidateFn = Callable[[Node], bool]


class EvictionQueue:
    def __init__(self, bit: int, rank: RankFn, is_candidate: CandidateFn, is_locked: CandidateFn) -> None:
        self._heap: list[tuple[int, int, Node]] = []
        self._parked: list[Node] = []
        self._seq = itertools.count()
        self._bit = bit
        self._rank = rank
        self._is_candidate = is_candidate
        self._is_locked = is_locked

    def __len__(self) -> int:
        return len(self._heap) + len(self._parked)

    def unpark(self) -> None:
        """Put the candidates that were locked at the last eviction back in the heap."""
        parked, self._parked = self._parked, []
        for node in parked:
            heapq.heappush(self._heap, (self._rank(node), next(self._seq), node))

    def offer(self, node: Node, force: bool = False) -> None:
        """Queue `node` if it is a candidate and not queued yet (`force`: queue a second
        entry anyway, for a rank that went down)."""
        if (node.qmask & self._bit and not force) or not self._is_candidate(node):
            return
        node.qmask |= self._bit
        heapq.heappush(self._heap, (self._rank(node), next(self._seq), node))

    def pop(self) -> Node | None:
        """The lowest-ranked current candidate, removed from the queue; None if none."""
        heap = self._heap
        while heap:
            rank, _, node = heapq.heappop(heap)
            if not node.qmask & self._bit:
                continue  # a duplicate entry of a slot already taken out
            if not self._is_candidate(node):
                node.qmask &= ~self._bit
                continue
            if self._is_locked(node):
                self._parked.append(node)  # still queued: back in at the next eviction
                continue
            now = self._rank(node)
            if now != rank:
                heapq.heappush(heap, (now, next(self._seq), node))
                continue
            node.qmask &= ~self._bit
            return node
        return None

    def compact(self) -> None:
        """Drop entries of slots that are no longer candidates (bounded memory)."""
        self.unpark()
        live: list[tuple[int, int, Node]] = []
        seen: set[int] = set()
        for entry in self._heap:
            node = entry[2]
            if node.qmask & self._bit and id(node) not in seen and self._is_candidate(node):
                seen.add(id(node))
                live.append((self._rank(node), entry[1], node))
            elif id(node) not in seen:
                node.qmask &= ~self._bit
        heapq.heapify(live)
        self._heap = live
