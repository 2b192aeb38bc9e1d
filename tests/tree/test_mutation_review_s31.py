"""Mutation review (session 31) of the FULL / SWA / MAMBA components: narrated scenarios
that pin which boundary a match may reuse and which slots an eviction may take."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicache.tree import HiRadixTree
from hicache.tree.components import SwaComponent
from hicache.tree.node import PARTIAL, Node
from hicache.types import EvictionPolicy, Tier

from .helpers import FULL, MAMBA, SWA, ids, make_tree, seq


def test_an_swa_tail_does_not_borrow_its_parents_pages_to_fill_a_window() -> None:
    """A node whose SWA slot holds only its last page has a gap before that page: the
    window of its end cannot be completed from the parent's SWA data, so a match stops
    at the parent (reusing the end would hand the engine a window with holes)."""
    # Mutant: swa.valid_at without `if n < node.npages: return False`.
    tree = make_tree(4, swa_window=12)  # window: 3 pages
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    tree.insert("", seq(0, 32), {FULL: ids(1, 2, 3, 4, 5, 6, 7, 8),
                                 SWA: ids(11, 12, 13, 14, -1, -1, -1, 18)})
    assert tree.resident_pages(Tier.DEVICE, SWA) == 5  # the child holds its tail only
    m = tree.match("", seq(0, 32))
    assert m.matched_tokens == 32
    assert m.device_tokens == 16  # the parent's end: its own window is whole
    assert list(m.device_pages[SWA]) == [-1, 12, 13, 14]
    tree.check_integrity()


def test_a_short_node_cannot_reuse_its_end_with_less_than_a_window_of_swa_data() -> None:
    """The window a boundary needs is counted over the whole prefix (up to its depth),
    not over the last node: a one-page node under a node with no SWA data holds one page
    of a three-page window, so its end is not reusable (an engine would attend over a
    window with two pages missing)."""
    # Mutant: swa.valid_at `need = min(window, path[i - 1].npages)` (not `.depth`).
    tree = make_tree(4, swa_window=12)  # window: 3 pages
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, -1, -1)})
    tree.insert("", seq(0, 20), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(-1, -1, -1, -1, 15)})
    assert len(tree.iter_nodes()) == 2
    m = tree.match("", seq(0, 20))
    assert m.matched_tokens == 20 and m.device_tokens == 0
    tree.insert("", seq(0, 20), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(-1, -1, 13, 14, 15)})
    assert tree.match("", seq(0, 20)).device_tokens == 20  # a whole window now
    tree.check_integrity()


def test_swa_eviction_keeps_the_window_of_the_nearest_leaf_below() -> None:
    """SWA data of an inner node may go alone only outside the window of every boundary
    kept below it: with a long and a short leaf under it, the short leaf's window reaches
    furthest up, so only the node's first page becomes a tombstone and both leaves stay
    reusable. (The longer leaf was inserted first, so a walk that kept the last leaf it
    saw, not the nearest, would drop pages the short leaf still needs.)"""
    # Mutant: swa.retained_pages `best = min(best, dist)` -> `best = dist`.
    tree = make_tree(4, swa_window=16)  # window: 4 pages
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    long_leaf = seq(0, 16) + seq(100, 12)
    short_leaf = seq(0, 16) + seq(200, 4)
    tree.insert("", long_leaf, {FULL: ids(1, 2, 3, 4, 5, 6, 7), SWA: ids(11, 12, 13, 14, 15, 16, 17)})
    tree.insert("", short_leaf, {FULL: ids(1, 2, 3, 4, 8), SWA: ids(11, 12, 13, 14, 18)})
    r = tree.evict(Tier.DEVICE, SWA, 10)
    assert list(r.freed[SWA]) == [11]
    assert r.freed[FULL].size == 0
    m = tree.match("", short_leaf)
    assert m.device_tokens == 20 and list(m.device_pages[SWA]) == [-1, 12, 13, 14, 18]
    m = tree.match("", long_leaf)
    assert m.device_tokens == 28 and list(m.device_pages[SWA]) == [-1, -1, -1, 14, 15, 16, 17]
    tree.check_integrity()


def test_an_swa_window_that_is_not_whole_pages_needs_the_page_it_starts_in() -> None:
    """A window of 6 tokens on 4-token pages reaches into a second page before the
    boundary: a node whose SWA data holds only its last page is not reusable at its end
    (the tree rounds the window up, never down)."""
    # Mutant: SwaComponent.window_pages rounded down (`window_tokens // page_size`).
    assert SwaComponent(1, 4, 6).window_pages == 2
    assert SwaComponent(1, 4, 8).window_pages == 2
    tree = make_tree(4, swa_window=6)
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3), SWA: ids(-1, -1, 13)})
    m = tree.match("", seq(0, 12))
    assert m.matched_tokens == 12 and m.device_tokens == 0
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3), SWA: ids(-1, 12, 13)})  # the tail grows
    assert tree.match("", seq(0, 12)).device_tokens == 12
    tree.check_integrity()


def test_a_full_slot_with_an_l2_copy_leaves_l1_although_its_child_lives_in_l2_only() -> None:
    """Write-through kept both nodes of a path in L2; once the leaf left L1, its parent
    (backed up in L2, no child left in L1) may leave L1 too: L1 must not stay pinned by a
    node whose data and children are all safe in L2. The path stays reusable from L2."""
    # Mutant: full.candidate_test `(mask & other) or not node.children` -> `not node.children`.
    tree = make_tree(4)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)})
    tree.insert("", seq(0, 4) + seq(100, 4), {FULL: ids(1, 3)})  # head=[1], two leaves
    head = min(tree.iter_nodes(), key=tree.depth_tokens)
    for node in tree.iter_nodes():
        held = tree.pages_of(node, FULL, Tier.DEVICE)
        assert held is not None
        (l1,) = held.tolist()
        tree.set_resident(node, FULL, Tier.HOST, ids(50 + l1))
    assert sorted(tree.evict(Tier.DEVICE, FULL, 2).freed[FULL].tolist()) == [2, 3]
    assert tree.is_resident(head, FULL, Tier.DEVICE) and not tree.is_leaf(head)
    r = tree.evict(Tier.DEVICE, FULL, 1)
    assert list(r.freed[FULL]) == [1]
    assert tree.resident_pages(Tier.DEVICE, FULL) == 0
    m = tree.match("", seq(0, 8))
    assert (m.device_tokens, m.host_tokens) == (0, 8)
    tree.check_integrity()


def test_a_mamba_checkpoint_of_an_inner_node_can_be_evicted() -> None:
    """A MAMBA checkpoint is one slot at one boundary: it may go whether or not deeper
    nodes continue the path (else every checkpoint above a leaf would pin its slot
    forever). FULL stays."""
    # Mutant: mamba.candidate_test also requiring `not node.children`.
    tree = make_tree(4, mamba=True)
    tree.insert("", seq(0, 4), {FULL: ids(1)}, mamba_slot=101)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)}, mamba_slot=102)
    r = tree.evict(Tier.DEVICE, MAMBA, 2)
    assert sorted(r.freed[MAMBA].tolist()) == [101, 102] and r.freed[FULL].size == 0
    assert tree.resident_pages(Tier.DEVICE, MAMBA) == 0
    assert tree.resident_pages(Tier.DEVICE, FULL) == 2
    assert tree.match("", seq(0, 8)).matched_tokens == 8
    tree.check_integrity()


def test_a_mamba_checkpoint_a_session_references_goes_after_unreferenced_ones() -> None:
    """Session-aware ranking for MAMBA: after a session's request finished, its boundary's
    checkpoint is taken only after checkpoints no session references, even newer ones."""
    # Mutant: Component.rank_key (LRU) dropping the `sref` term.
    tree = make_tree(4, mamba=True)
    m = tree.match("", seq(0, 4), lock=True, session_id="s1")
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=m.lock, mamba_slot=101)
    tree.insert("", seq(50, 4), {FULL: ids(2)}, mamba_slot=102)  # sessionless, newer
    assert list(tree.evict(Tier.DEVICE, MAMBA, 1).freed[MAMBA]) == [102]
    tree.close_session("s1")
    tree.insert("", seq(50, 4), {FULL: ids(2)}, mamba_slot=102)
    assert list(tree.evict(Tier.DEVICE, MAMBA, 1).freed[MAMBA]) == [101]  # plain LRU again
    tree.check_integrity()


def test_lfu_takes_the_rarely_used_mamba_checkpoint_first() -> None:
    """Under LFU, MAMBA checkpoints go by hit count before recency: a checkpoint matched
    many times stays while a newer one matched once goes."""
    # Mutant: Component.rank_key (LFU) with hits not shifted above the access tick.
    tree = make_tree(4, mamba=True, policy=EvictionPolicy.LFU)
    tree.insert("", seq(0, 4), {FULL: ids(1)}, mamba_slot=101)
    for _ in range(3):
        tree.match("", seq(0, 4))
    tree.insert("", seq(50, 4), {FULL: ids(2)}, mamba_slot=102)
    for _ in range(3):
        tree.match("", seq(90, 4))  # (time passes: other prompts miss)
    tree.match("", seq(50, 4))  # most recent, but used once
    assert list(tree.evict(Tier.DEVICE, MAMBA, 1).freed[MAMBA]) == [102]
    tree.check_integrity()


# The integrity checker ---------------------------------------------------------------
# Most tests end with `check_integrity()`; each case below breaks one piece of the tree's
# bookkeeping by hand and requires the checker to say what broke. (Without these, a
# weakened check would let every other test pass over a corrupt tree.)

H = 1  # (index of a node's HOST page ids within a component's pair of slots)


def _two_nodes() -> tuple[HiRadixTree, Node, Node]:
    """A head node (FULL and SWA in L1 and L2) and its leaf (L1 only)."""
    tree = make_tree(4, swa_window=8)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2), SWA: ids(11, 12)})
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3), SWA: ids(11, 12, 13)})
    head, leaf = sorted(tree.iter_nodes(), key=tree.depth_tokens)
    assert isinstance(head, Node) and isinstance(leaf, Node)
    tree.set_resident(head, FULL, Tier.HOST, ids(51, 52))
    tree.set_resident(head, SWA, Tier.HOST, ids(61, 62))
    tree.check_integrity()
    return tree, head, leaf


def _tail_node() -> tuple[HiRadixTree, Node]:
    """One node whose SWA slot is its last 2 of 4 pages, in L1 and L2."""
    tree = make_tree(4, swa_window=8)
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, 13, 14)})
    (node,) = tree.iter_nodes()
    assert isinstance(node, Node)
    tree.set_resident(node, FULL, Tier.HOST, ids(51, 52, 53, 54))
    tree.set_resident(node, SWA, Tier.HOST, ids(63, 64))
    tree.check_integrity()
    return tree, node


def _drop_l1_of_head(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    for ci in (0, 1):  # (FULL, SWA: neither may stay in L1 without FULL)
        head.mask[ci] &= ~1
        head.res[2 * ci] = None
        tree._resident[Tier.DEVICE][ci] -= head.npages


def _leaf_depth(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.depth += 1


def _resident_counter(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    tree._resident[Tier.DEVICE][0] += 1


def _locked_counter(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    tree._locked[Tier.HOST][1] += 1


def _no_full_anywhere(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.mask[0] = 0
    head.nres[Tier.DEVICE] -= 1  # (the head's count of children in L1 agrees)


def _stray_lock(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.lock[0] += 1


def _stray_session_ref(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.sref[0] += 1


def _leaf_not_queued(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.qmask = 0


def _unrecorded_l2_ids(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.res[H] = ids(99)


def _swa_lengths_differ(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    head.res[2 + H] = ids(62)


def _leaf_under_another_key(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.key = seq(500, 4)


def _leaf_key_too_long(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.key += seq(500, 4)


def _short_hashes(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    leaf.hashes = bytes(15)


def _empty_root_kept(tree: HiRadixTree, head: Node, leaf: Node) -> None:
    assert head.parent is not None
    head.parent.children.clear()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_leaf_depth, "@4p: depth"),
        (_resident_counter, "resident counters"),
        (_locked_counter, "locked counters"),
        (_no_full_anywhere, "node without FULL in L1 or L2"),
        (_drop_l1_of_head, "L1 FULL under a parent without it"),
        (_stray_lock, "full lock 1 != 0"),
        (_stray_session_ref, "full sref 1 != 0"),
        (_leaf_not_queued, "evictable full/0 not queued"),
        (_unrecorded_l2_ids, "full res/mask HOST"),
        (_swa_lengths_differ, "swa lengths"),
        (_leaf_under_another_key, "@3p: child key"),
        (_leaf_key_too_long, "^''@3p$"),
        (_short_hashes, "@3p: hashes"),
        (_empty_root_kept, "'': a root with nothing under it is kept"),
    ],
)
def test_the_integrity_check_names_each_kind_of_broken_bookkeeping(
    corrupt: Callable[[HiRadixTree, Node, Node], None], message: str
) -> None:
    """`check_integrity` fails, naming the broken invariant, on a tree whose shape
    (depth, keys, hashes, an empty namespace root), counters, residency, locks, session
    references, eviction queue or per-tier slot lengths are off: what every other test
    relies on to see a corrupt tree."""
    # Mutants: each of these asserts in integrity.check_tree removed.
    tree, head, leaf = _two_nodes()
    corrupt(tree, head, leaf)
    with pytest.raises(AssertionError, match=message):
        tree.check_integrity()


def test_the_integrity_check_catches_a_tail_slot_without_its_partial_bit() -> None:
    """An SWA slot holding only its node's tail must carry PARTIAL (match relies on it
    to stop the window there), and is never recorded in L3: the checker sees either
    broken."""
    # Mutants: the PARTIAL-bit and the "partial slot recorded in L3" asserts removed.
    tree, node = _tail_node()
    node.mask[1] &= ~PARTIAL
    with pytest.raises(AssertionError, match="swa PARTIAL bit"):
        tree.check_integrity()
    tree, node = _tail_node()
    node.mask[1] |= 1 << Tier.STORAGE
    with pytest.raises(AssertionError, match="swa partial slot recorded in L3"):
        tree.check_integrity()


def test_the_integrity_check_catches_an_inactive_lock_left_registered() -> None:
    """A lock released (inactive) but still registered would keep its path pinned with
    nobody to release it: the checker says so."""
    # Mutant: the "an inactive lock is still registered" assert removed.
    tree, _head, _leaf = _two_nodes()
    lock = tree.match("", seq(0, 12), lock=True).lock
    assert lock is not None
    tree.check_integrity()
    lock.active = False
    with pytest.raises(AssertionError, match="an inactive lock is still registered"):
        tree.check_integrity()
