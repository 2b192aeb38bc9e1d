"""The lazy eviction queue on its own: offers are marks, candidacy and rank are decided
when an eviction drains them."""

from __future__ import annotations

from hicache.tree import eviction
from hicache.tree.eviction import EvictionQueue
from hicache.tree.node import Node


def _nodes(n: int) -> list[Node]:
    root = Node(b"", 0, None, 1)
    return [Node(i.to_bytes(4, "little"), 1, root, 1) for i in range(n)]


def _queue(candidates: set[int]) -> EvictionQueue:
    return EvictionQueue(
        1,
        lambda node: node.last_access,
        lambda node: id(node) in candidates,
        lambda node: node.lock[0] > 0,
    )


def test_pop_order_follows_the_rank_at_pop_time_not_at_offer_time() -> None:
    nodes = _nodes(4)
    for tick, node in zip((5, 1, 7, 3), nodes, strict=True):
        node.last_access = tick
    q = _queue({id(n) for n in nodes})
    for node in nodes:
        q.offer(node)
    nodes[1].last_access = 9  # used after it was offered: goes last
    order = []
    while (node := q.pop()) is not None:
        order.append(node.last_access)
    assert order == [3, 5, 7, 9]
    assert all(not n.qmask for n in nodes)


def test_a_slot_that_is_no_candidate_when_drained_is_unmarked_and_can_come_back() -> None:
    a, b = _nodes(2)
    candidates = {id(b)}
    q = _queue(candidates)
    q.offer(a)
    q.offer(a)  # marked already: one entry
    q.offer(b)
    assert len(q) == 2
    assert q.pop() is b
    assert q.pop() is None and not a.qmask
    candidates.add(id(a))  # became a candidate: the event that made it one offers it
    q.offer(a)
    assert q.pop() is a


def test_a_locked_candidate_leaves_the_queue_until_its_unlock_offers_it_again() -> None:
    """Kept queued, every eviction popped every locked candidate again (O(held locks)
    each): it leaves the queue instead, marked in `lparked` for the tree's unlock."""
    a, b = _nodes(2)
    a.last_access, b.last_access = 1, 2
    q = _queue({id(a), id(b)})
    q.offer(a)
    q.offer(b)
    a.lock[0] = 1
    assert q.pop() is b
    assert (a.qmask & q.bit, a.lparked & q.bit) == (0, q.bit)
    q.unpark()  # (the next eviction)
    assert q.pop() is None and len(q) == 0
    a.lock[0] = 0
    q.offer(a)  # what the tree's unlock does for a node with `lparked` bits
    assert q.pop() is a


def test_pending_offers_are_drained_without_an_eviction_so_memory_stays_bounded() -> None:
    nodes = _nodes(eviction._DRAIN_AT + 10)
    q = _queue(set())  # nothing is a candidate, no eviction ever runs
    for node in nodes:
        q.offer(node)
    assert len(q) < eviction._DRAIN_AT
    assert sum(1 for n in nodes if n.qmask) == len(q)
