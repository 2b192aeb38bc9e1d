"""Mutation review (session 31, second round) of the tree's core paths: lock prefixes,
splits that carry hits and session references, the eviction callback's KEEP_THE_REST,
stale ranks in the eviction queue, checkpoints placed in a tier, empty namespaces, and
the session table's cap, recency and reopen clock."""

from __future__ import annotations

import pytest

from hicache.errors import InvalidArgument
from hicache.tree import KEEP_THE_REST
from hicache.types import EvictionPolicy, Tier

from .helpers import FULL, MAMBA, ids, make_tree, seq


def _unlock(tree, m) -> None:  # type: ignore[no-untyped-def]
    """Release a match's lock (the request ends without an insert)."""
    assert m.lock is not None
    tree.unlock(m.lock)


def _only_in_l2(tree, tokens: bytes, l1: list[int], l2: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Commit `tokens` in L1, back its one node up to L2, then drop it from L1."""
    tree.insert("", tokens, {FULL: ids(*l1)})
    (node,) = tree.match("", tokens).path
    tree.set_resident(node, FULL, Tier.HOST, ids(*l2))
    assert tree.evict(Tier.DEVICE, FULL, len(l1)).evicted_pages == len(l1)


def test_an_insert_under_a_lock_must_repeat_the_host_part_it_was_matched_on() -> None:
    """A lock covers the path down to its host boundary: an insert under it whose tokens
    differ inside the L2 part (not only the L1 part) is refused, since after a Load the
    insert continues from the lock's end and would file the new pages under tokens they
    were not computed for."""
    # Mutant: match's TreeLock `prefix=tokens[: d0 * pb]` (the device part only).
    tree = make_tree(4)
    tokens = seq(0, 16)
    _only_in_l2(tree, tokens, [1, 2, 3, 4], [21, 22, 23, 24])
    m = tree.match("", tokens, lock=True)
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    assert m.lock is not None and m.lock.prefix == tokens
    other = seq(0, 8) + seq(500, 8)  # agrees on the (empty) L1 part, not on the L2 part
    with pytest.raises(InvalidArgument, match="prefix the lock was matched on"):
        tree.insert("", other, {FULL: ids(31, 32, 33, 34)}, lock=m.lock)
    assert m.lock.active  # refused: nothing consumed
    tree.unlock(m.lock)
    assert tree.match("", other).matched_tokens == 8  # nothing of it was committed
    tree.check_integrity()


def test_a_split_keeps_the_hit_count_on_both_halves() -> None:
    """Splitting a node (a branch inserted off its middle) leaves the prefix as popular as
    it was: both halves keep the node's hit count (what LFU eviction and the selective
    write policy's `hits >= threshold` read)."""
    # Mutant: _split without `head.hits = node.hits`.
    tree = make_tree(4, policy=EvictionPolicy.LFU)
    tokens = seq(0, 16)
    tree.insert("", tokens, {FULL: ids(1, 2, 3, 4)})
    for _ in range(5):
        tree.match("", tokens)
    r = tree.insert("", seq(0, 8) + seq(500, 8), {FULL: ids(5, 6, 7, 8)})  # splits it at 2 pages
    assert list(r.released[FULL]) == [5, 6]  # the shared half: the tree keeps its own
    path = tree.match("", tokens).path
    assert len(path) == 2
    assert [tree.hits(n) for n in path] == [6, 6]
    tree.check_integrity()


def test_a_split_session_path_keeps_its_reference_when_the_session_end_moves_up() -> None:
    """A session's path stays referenced after a node on it is split and its end evicted:
    the session's end moves up to the split's head, which must still rank after an
    unreferenced leaf (older or not) and be released once by the close."""
    # Mutant: _split without `head.sref[ci] = node.sref[ci]`.
    tree = make_tree(4)
    tokens = seq(0, 16)
    m = tree.match("", tokens, lock=True, session_id="s")
    tree.insert("", tokens, {FULL: ids(1, 2, 3, 4)}, lock=m.lock)
    tree.insert("", seq(0, 8) + seq(500, 8), {FULL: ids(1, 2, 7, 8)})  # splits the session's node
    tree.check_integrity()
    r = tree.evict(Tier.DEVICE, FULL, 2)  # the unreferenced branch goes first
    assert sorted(r.freed[FULL].tolist()) == [7, 8]
    r = tree.evict(Tier.DEVICE, FULL, 2)  # then the session's tail: its end moves up
    assert sorted(r.freed[FULL].tolist()) == [3, 4]
    tree.insert("", seq(2000, 8), {FULL: ids(11, 12)})  # unreferenced, newer than the head
    r = tree.evict(Tier.DEVICE, FULL, 2)
    assert sorted(r.freed[FULL].tolist()) == [11, 12]  # the session's head stays
    assert tree.match("", tokens).device_tokens == 8
    assert tree.close_session("s") == 2  # the path it still referenced
    tree.check_integrity()


def test_keep_the_rest_ends_the_eviction_at_that_victim() -> None:
    """`before_drop` answering KEEP_THE_REST keeps that victim and every later one: the
    eviction stops there (the controller answers so when later victims rank after a node
    whose copy is still queued), nothing else leaves."""
    # Mutant: evict without `if kept is KEEP_THE_REST: break`.
    tree = make_tree(4)
    for i, base in enumerate((0, 100, 200)):
        tree.insert("", seq(base, 4), {FULL: ids(i + 1)})
    asked: list[list[int]] = []

    def before_drop(victim):  # type: ignore[no-untyped-def]
        asked.append(victim.pages[FULL].tolist())
        return KEEP_THE_REST if len(asked) == 1 else False

    r = tree.evict(Tier.DEVICE, FULL, 3, before_drop)
    assert r.evicted_pages == 0 and asked == [[1]]
    for base in (0, 100, 200):
        assert tree.match("", seq(base, 4)).device_tokens == 4
    assert tree.evict(Tier.DEVICE, FULL, 1).freed[FULL].tolist() == [1]  # kept, not lost
    tree.check_integrity()


def test_a_leaf_used_after_it_was_queued_is_not_evicted_by_its_old_rank() -> None:
    """LRU with queued ranks: a leaf matched after an eviction queued it is the most
    recently used one, so the next eviction takes the least recently used leaf instead
    (the queue re-ranks the stale entry)."""
    # Mutant: EvictionQueue.pop without the stale-rank re-push (`if now != rank`).
    tree = make_tree(4)
    for i, base in enumerate((0, 100, 200)):
        tree.insert("", seq(base, 4), {FULL: ids(i + 1)})
    assert tree.evict(Tier.DEVICE, FULL, 0).evicted_pages == 0  # queues every leaf, ranked now
    tree.match("", seq(0, 4))  # the oldest leaf is used again
    r = tree.evict(Tier.DEVICE, FULL, 1)
    assert r.freed[FULL].tolist() == [2]
    assert tree.match("", seq(0, 4)).device_tokens == 4
    tree.check_integrity()


def test_a_deleted_session_end_hands_its_reference_to_the_checkpoint_above() -> None:
    """When the node a session ended at is evicted, the session ends at its parent: the
    parent's MAMBA checkpoint is then the session's, and ranks after an unreferenced
    checkpoint even a newer one (the session's next turn resumes from it)."""
    # Mutant: _delete without `up.sref[point] += 1` for the session moving up.
    tree = make_tree(4, mamba=True)
    prefix = seq(0, 8)
    tree.insert("", prefix, {FULL: ids(1, 2)}, mamba_slot=1)
    tokens = prefix + seq(100, 4)
    m = tree.match("", tokens, lock=True, session_id="s")
    assert m.device_tokens == 8
    tree.insert("", tokens, {FULL: ids(3)}, lock=m.lock, mamba_slot=2)
    r = tree.evict(Tier.DEVICE, FULL, 1)  # the session's end (the only leaf) goes
    assert r.freed[FULL].tolist() == [3] and r.freed[MAMBA].tolist() == [2]
    tree.insert("", seq(1000, 8), {FULL: ids(4, 5)}, mamba_slot=3)  # unreferenced, newer
    r = tree.evict(Tier.DEVICE, MAMBA, 1)
    assert r.freed[MAMBA].tolist() == [3]
    assert tree.close_session("s") == 2
    tree.check_integrity()


def test_closing_a_session_returns_the_depth_of_its_whole_path() -> None:
    """CloseSession answers how many pages deep the referenced path was: the whole path
    from the root, not the last node's share of it."""
    # Mutant: close_session's drop returns `session.end.npages`.
    tree = make_tree(4)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)})
    tokens = seq(0, 8) + seq(100, 4)
    m = tree.match("", tokens, lock=True, session_id="s")
    tree.insert("", tokens, {FULL: ids(3)}, lock=m.lock)
    assert tree.close_session("s") == 3
    assert tree.close_session("s") == 3  # recently closed: the same answer


def test_a_checkpoint_for_a_tier_that_lacks_the_nodes_full_slot_is_handed_back() -> None:
    """A prefetch commit (insert into L2) whose tokens end at a node held in L1 only keeps
    no MAMBA checkpoint there (a checkpoint in a tier needs FULL there): the slot comes
    back in `released` for the caller to free, and the tree stays consistent."""
    # Mutant: _place_checkpoint without `node.mask[FULL] & (1 << tier)`.
    tree = make_tree(4, mamba=True)
    tokens = seq(0, 8)
    tree.insert("", tokens, {FULL: ids(1, 2)}, mamba_slot=1)
    m = tree.match("", tokens, lock=True)
    assert m.device_tokens == 8
    r = tree.insert("", tokens, {}, lock=m.lock, mamba_slot=7, tier=Tier.HOST)
    assert r.released[MAMBA].tolist() == [7]
    assert tree.resident_pages(Tier.HOST, MAMBA) == 0
    tree.check_integrity()


def test_inserts_that_commit_nothing_keep_no_namespace_roots() -> None:
    """An Insert of less than a page into a new namespace commits nothing and keeps no
    root for it (namespaces carry tenants' salts: one kept per empty insert would grow
    without bound)."""
    # Mutant: insert without its final `del self._roots[namespace]`.
    tree = make_tree(4)
    for i in range(50):
        r = tree.insert(f"ns{i}", seq(0, 3), {})
        assert r.inserted_tokens == 0 and r.end is None
    assert tree._roots == {}
    tree.check_integrity()


def test_sessions_up_to_the_cap_all_stay_open() -> None:
    """`max_open_sessions` sessions may be open at once: reaching the cap closes none,
    only going past it does."""
    # Mutant: SessionTable.over_cap `len(table) < max_open` (closes one at the cap).
    tree = make_tree(4, max_open_sessions=2)
    for sid in ("a", "b"):
        m = tree.match("", seq(0, 4), lock=True, session_id=sid)
        _unlock(tree, m)
    assert tree.sessions_closed_for_room == 0
    m = tree.match("", seq(0, 4), lock=True, session_id="c")
    _unlock(tree, m)
    assert tree.sessions_closed_for_room == 1


def test_the_session_closed_for_room_is_the_least_recently_used_not_the_oldest() -> None:
    """Past the cap the least recently used session closes: one opened first but named
    by a request since stays open (a late insert of its request still references what
    it commits), the other one closes."""
    # Mutant: SessionTable.open without `table.move_to_end(session_id)`.
    tree = make_tree(4, max_open_sessions=2)
    for sid in ("a", "b", "a"):  # a, b opened; a used again
        m = tree.match("", seq(0, 4), lock=True, session_id=sid)
        _unlock(tree, m)
    began = tree.session_clock
    m = tree.match("", seq(0, 4), lock=True, session_id="c")  # past the cap: b closes
    _unlock(tree, m)
    assert tree.sessions_closed_for_room == 1
    tree.insert("", seq(300, 8), {FULL: ids(1, 2)}, session_id="a", session_since=began)
    assert tree.close_session("a") == 2  # still open: it references the insert
    tree.insert("", seq(400, 8), {FULL: ids(3, 4)}, session_id="b", session_since=began)
    assert tree.close_session("b") == 0  # closed since the request began: nothing
    tree.check_integrity()


def test_a_request_that_began_right_after_a_close_belongs_to_the_reopened_session() -> None:
    """A request that began right after a session closed (at the close's clock) and names
    it only at insert is the new generation's: once another request reopened the session,
    the insert's path is the session's reference (its close reports that depth)."""
    # Mutant: SessionTable.open `session.reopened_at >= since`.
    tree = make_tree(4)
    m = tree.match("", seq(0, 4), lock=True, session_id="s")
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=m.lock)
    assert tree.close_session("s") == 1
    began = tree.session_clock  # the request begins now, after the close
    m = tree.match("", seq(100, 4), lock=True, session_id="s")  # another request reopens s
    tree.insert("", seq(100, 4), {FULL: ids(2)}, lock=m.lock)
    tree.insert("", seq(200, 8), {FULL: ids(3, 4)}, session_id="s", session_since=began)
    assert tree.close_session("s") == 2
    tree.check_integrity()


def test_a_request_older_than_a_reopen_cannot_move_the_new_sessions_end() -> None:
    """A request that began before the session closed is late even after a new request
    reopened the session: its insert references nothing, so the reopened session's
    references stay where the new request left them."""
    # Mutant: SessionTable.open records `reopened_at=0` for a reopened session.
    tree = make_tree(4)
    m = tree.match("", seq(0, 4), lock=True, session_id="s")
    _unlock(tree, m)
    began = tree.session_clock  # a request of the first generation begins
    tree.close_session("s")
    m = tree.match("", seq(100, 4), lock=True, session_id="s")  # reopened by a new request
    tree.insert("", seq(100, 4), {FULL: ids(2)}, lock=m.lock)
    tree.insert("", seq(200, 8), {FULL: ids(3, 4)}, session_id="s", session_since=began)
    assert tree.close_session("s") == 1  # the new request's one page, not the late one's two
    tree.check_integrity()


def test_recording_a_slot_twice_in_a_tier_is_refused() -> None:
    """`set_resident` of a slot already in that tier (a backup recorded twice) is the
    caller's error: InvalidArgument, and the tier's page count is not counted twice."""
    # Mutant: set_resident without its "already resident" check.
    tree = make_tree(4)
    tokens = seq(0, 8)
    tree.insert("", tokens, {FULL: ids(1, 2)})
    (node,) = tree.match("", tokens).path
    tree.set_resident(node, FULL, Tier.HOST, ids(21, 22))
    with pytest.raises(InvalidArgument, match="already resident in HOST"):
        tree.set_resident(node, FULL, Tier.HOST, ids(23, 24))
    assert tree.resident_pages(Tier.HOST, FULL) == 2
    held = tree.pages_of(node, FULL, Tier.HOST)
    assert held is not None and held.tolist() == [21, 22]
    tree.check_integrity()


def test_served_tokens_counts_what_l2_holds_too() -> None:
    """`served_tokens` (a prefetch asking whether another brought its pages) answers the
    host boundary: pages only L2 holds count, as a match would serve them after a Load."""
    # Mutant: served_tokens answering the L1 boundary (`i1 = i0`).
    tree = make_tree(4)
    tokens = seq(0, 16)
    _only_in_l2(tree, tokens, [1, 2, 3, 4], [21, 22, 23, 24])
    assert tree.served_tokens("", tokens + seq(900, 4)) == 16
    m = tree.match("", tokens)
    assert (m.device_tokens, m.host_tokens) == (0, 16)


def test_a_checkpoint_only_l3_holds_is_reported_as_the_trees_storage_part() -> None:
    """A MAMBA model's node whose FULL pages are in L1 but whose checkpoint only L3 holds
    is reusable from L3: a match reports its tokens as `storage_tokens` (the controller
    prefetches that part), not as a miss."""
    # Mutant: match `i2 = i1` (the storage boundary never past the host one).
    tree = make_tree(4, mamba=True)
    tokens = seq(0, 8)
    tree.insert("", tokens, {FULL: ids(1, 2)}, mamba_slot=1)
    (node,) = tree.match("", tokens).path
    tree.set_resident(node, FULL, Tier.STORAGE)
    tree.set_resident(node, MAMBA, Tier.STORAGE)
    assert tree.evict(Tier.DEVICE, MAMBA, 1).freed[MAMBA].tolist() == [1]
    m = tree.match("", tokens)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 8)
    assert m.matched_tokens == 8
    tree.check_integrity()


def test_a_keep_lock_insert_leaves_the_session_at_its_last_finished_request() -> None:
    """A session references the boundary its last *finished* request reached: an insert
    that keeps its lock (the request goes on decoding) does not move the session's
    references; the request's final insert does."""
    # Mutant: insert referencing the session also when `keep_lock` (`if sid:`).
    tree = make_tree(4)
    m = tree.match("", seq(0, 4), lock=True, session_id="s")
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=m.lock)  # request 1 finished: depth 1
    tokens = seq(0, 4) + seq(100, 8)
    m = tree.match("", tokens, lock=True, session_id="s")
    tree.insert("", tokens, {FULL: ids(2, 3)}, lock=m.lock, keep_lock=True)  # still running
    assert tree.close_session("s") == 1
    _unlock(tree, m)
    tree.check_integrity()


def test_a_session_that_moved_on_is_not_moved_by_its_old_end_leaving() -> None:
    """A session's next request ending on another branch moves the session there: when
    the node its earlier request ended at is evicted later, the session keeps its new
    end (its close reports that path, whose references it releases)."""
    # Mutant: SessionTable.set_end not removing the session from its old end's index.
    tree = make_tree(4)
    m = tree.match("", seq(0, 4), lock=True, session_id="s")
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=m.lock)  # request 1 ends at A
    m = tree.match("", seq(100, 8), lock=True, session_id="s")
    tree.insert("", seq(100, 8), {FULL: ids(2, 3)}, lock=m.lock)  # request 2 ends at B
    r = tree.evict(Tier.DEVICE, FULL, 1)  # A: unreferenced now, the oldest leaf
    assert r.freed[FULL].tolist() == [1]
    assert tree.close_session("s") == 2
    tree.check_integrity()
    assert sorted(tree.evict(Tier.DEVICE, FULL, 2).freed[FULL].tolist()) == [2, 3]


def test_a_closed_sessions_old_end_leaving_references_nothing_above_it() -> None:
    """Closing a session releases its references for good: when the node it ended at is
    evicted later, the checkpoint above it does not become the (closed) session's, and
    it is evicted in plain LRU order."""
    # Mutant: SessionTable.close without `set_end(session_id, session, None)`.
    tree = make_tree(4, mamba=True)
    prefix = seq(0, 8)
    tree.insert("", prefix, {FULL: ids(1, 2)}, mamba_slot=1)
    tokens = prefix + seq(100, 4)
    m = tree.match("", tokens, lock=True, session_id="s")
    tree.insert("", tokens, {FULL: ids(3)}, lock=m.lock, mamba_slot=2)
    assert tree.close_session("s") == 3
    r = tree.evict(Tier.DEVICE, FULL, 1)  # the old end (the only leaf) goes
    assert r.freed[FULL].tolist() == [3]
    tree.insert("", seq(1000, 8), {FULL: ids(4, 5)}, mamba_slot=3)  # newer checkpoint
    r = tree.evict(Tier.DEVICE, MAMBA, 1)
    assert r.freed[MAMBA].tolist() == [1]  # the older, unreferenced one
    tree.check_integrity()


def test_a_node_queued_before_it_got_a_child_is_evicted_once_the_child_left() -> None:
    """A leaf queued for eviction that then gets a child stops being a candidate; a
    queue compaction (many sessions closing) drops its stale entry. Once its child is
    evicted it is a leaf again and must be evictable (else its L1 pages are stuck)."""
    # Mutant: EvictionQueue.compact not clearing the mark of an entry it drops.
    tree = make_tree(4)
    leaf = seq(0, 4)
    tree.insert("", leaf, {FULL: ids(1)})
    assert tree.evict(Tier.DEVICE, FULL, 0).evicted_pages == 0  # queues the leaf
    tree.insert("", leaf + seq(50, 4), {FULL: ids(1, 2)})  # it gets a child
    other = seq(500, 8)
    tree.insert("", other, {FULL: ids(3, 4)})
    for i in range(400):  # each close re-queues the session's path: a compaction follows
        m = tree.match("", other, lock=True, session_id=f"s{i}")
        tree.insert("", other, {}, lock=m.lock)
        tree.close_session(f"s{i}")
    assert len(tree._queues[Tier.DEVICE][0]) < 400  # (the premise: a compaction ran)
    r = tree.evict(Tier.DEVICE, FULL, 4)
    assert sorted(r.freed[FULL].tolist()) == [1, 2, 3, 4]
    assert tree.resident_pages(Tier.DEVICE, FULL) == 0
    tree.check_integrity()
