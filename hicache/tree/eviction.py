"""Per (tier, component) eviction queues: lazy min-heaps of candidate slots.

Why lazy: every match touches each node on its path, and re-keying a heap entry per touch
would cost O(path log n) per request. Instead an entry keeps the rank it was pushed with;
at pop time a stale rank (the slot was used since) is re-pushed with its current rank, and
a slot that is no longer a candidate is dropped. Ranks only grow between pushes, except
when a session's references drop, which re-queues eagerly. Each pop is O(log n).

`Node.qmask` has bit (tier * ncomp + ci) set while the slot has an entry queued (or
parked), so a slot is never queued twice by the same event.

Offers are lazier still: an offer only marks the slot and appends it to a pending list;
candidacy and rank are evaluated, and the heap pushed, when an eviction next needs the
queue. Inserts offer several slots per new node (and their parents), most of which stop
being candidates (a leaf gets a child) before any eviction runs; those cost one append.

Locks are checked at pop time, not tracked by the queue: a locked candidate popped during
an eviction leaves the queue (its bit moves from `Node.qmask` to `Node.lparked`) and the
tree offers it again when its lock count drops to 0. So unlocking, which happens on every
node of every request's path, costs the queues one test of a node whose count drops to 0;
and an eviction does not pop again every candidate that held locks keep (kept in the heap,
each eviction popped them all: O(held locks) each, under the controller's mutex).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from hicache.tree.node import Node

# Pending offers drained without an eviction when this many gather.
_DRAIN_AT = 4096

RankFn = Callable[[Node], int]
CandidateFn = Callable[[Node], bool]


class EvictionQueue:
    def __init__(self, bit: int, rank: RankFn, is_candidate: CandidateFn, is_locked: CandidateFn) -> None:
        self._heap: list[tuple[int, int, Node]] = []
        self._pending: list[Node] = []
        self._parked: list[Node] = []
        self._seq = itertools.count()
        self._bit = bit
        self.bit = bit  # the slot's mark in Node.qmask (read-only)
        self._rank = rank
        self._is_candidate = is_candidate
        self._is_locked = is_locked

    def __len__(self) -> int:
        return len(self._heap) + len(self._pending) + len(self._parked)

    def rank_of(self, node: Node) -> int | None:
        """`node`'s slot's rank now if it is a candidate (locks aside), else None."""
        return self._rank(node) if self._is_candidate(node) else None

    def unpark(self) -> None:
        """Put the candidates an eviction kept for later (`park`) back in the heap, with
        the slots offered since."""
        parked, self._parked = self._parked, []
        self._pending.extend(parked)
        self._drain()

    def park(self, node: Node) -> None:
        """Keep a popped candidate that could not go now queued: back in at the next
        eviction (as a locked one is)."""
        node.qmask |= self._bit
        self._parked.append(node)

    def offer(self, node: Node, force: bool = False) -> None:
        """Mark `node` for the queue unless it is marked already (`force`: a second entry
        anyway, for a rank that went down); whether it is a candidate is decided when an
        eviction drains the pending slots."""
        bit = self._bit
        if node.qmask & bit and not force:
            return
        node.qmask |= bit
        pending = self._pending
        pending.append(node)
        if len(pending) >= _DRAIN_AT:
            self._drain()  # bounded memory where evictions are rare (nodes deleted meanwhile)

    def _drain(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        bit, rank, is_candidate, seq = self._bit, self._rank, self._is_candidate, self._seq
        entries = []
        for node in pending:
            if not node.qmask & bit:
                continue  # deleted, or found no candidate by an earlier entry of this drain
            if is_candidate(node):
                entries.append((rank(node), next(seq), node))
            else:
                node.qmask &= ~bit
        heap = self._heap
        if len(entries) > len(heap):
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            for entry in entries:
                heapq.heappush(heap, entry)

    def pop(self) -> Node | None:
        """The lowest-ranked current candidate, removed from the queue; None if none."""
        self._drain()
        heap = self._heap
        while heap:
            rank, _, node = heapq.heappop(heap)
            if not node.qmask & self._bit:
                continue  # a duplicate entry of a slot already taken out
            if not self._is_candidate(node):
                node.qmask &= ~self._bit
                continue
            if self._is_locked(node):  # out until its unlock offers it again
                node.qmask &= ~self._bit
                node.lparked |= self._bit
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
