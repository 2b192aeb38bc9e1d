"""Narrated scenarios with exact boundaries, pages and eviction order."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import InvalidArgument, NotFound
from hicache.keys import chain_hashes
from hicache.types import EvictionPolicy, Tier

from .helpers import FULL, MAMBA, SWA, ids, make_tree, seq, toks


def four_node_path(swa: bool, mamba: bool):
    """Four nodes of 4 tokens (one page each) along one path, built turn by turn.
    Node 3's SWA slot is a tombstone; node 4 has no MAMBA checkpoint."""
    tree = make_tree(4, swa_window=4 if swa else None, mamba=mamba)
    swa_pages = [0, 1, -1, 3]
    for n in range(1, 5):
        pages = {FULL: ids(*range(n))}
        if swa:
            pages[SWA] = ids(*swa_pages[:n])
        slot = 100 + n if (mamba and n < 4) else None
        tree.insert("", seq(0, 4 * n), pages, mamba_slot=slot)
        tree.check_integrity()
    return tree


@pytest.mark.parametrize(
    ("swa", "mamba", "boundary"),
    [
        (True, True, 8),  # node 4: no checkpoint; node 3: SWA tombstone; node 2 passes all
        (True, False, 16),  # node 3 fails SWA but the walk goes on: node 4's window is whole
        (False, False, 16),  # FULL alone: the whole path
    ],
)
def test_four_node_path_deepest_safe_boundary(swa: bool, mamba: bool, boundary: int) -> None:
    tree = four_node_path(swa, mamba)
    m = tree.match("", seq(0, 18))  # two tokens past the last page: never reused
    assert m.device_tokens == boundary
    assert m.host_tokens == m.storage_tokens == 0
    assert m.matched_tokens == 16
    assert list(m.device_pages[FULL]) == list(range(boundary // 4))
    if swa:  # the window (one page) before the boundary; -1 before it, held or not
        assert list(m.device_pages[SWA]) == {16: [-1, -1, -1, 3], 8: [-1, 1]}[boundary]
    if mamba:
        assert list(m.device_pages[MAMBA]) == [102]
    tree.check_integrity()


@pytest.mark.parametrize(("window_pages", "want"), [(2, [-1, -1, -1, 14, 15]), (3, [-1, -1, 13, 14, 15])])
def test_a_match_hands_out_the_swa_ids_of_the_window_only(window_pages: int, want: list[int]) -> None:
    """The engine reads SWA data only inside the window before the boundary: the ids
    before it read -1 although the tree holds them (they are neither copied nor sent),
    and a window that starts inside a node takes that node's last pages."""
    tree = make_tree(4, swa_window=4 * window_pages)
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3), SWA: ids(11, 12, 13)})
    tree.insert("", seq(0, 20), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    m = tree.match("", seq(0, 20))
    assert m.device_tokens == 20 and list(m.device_pages[FULL]) == [1, 2, 3, 4, 5]
    assert list(m.device_pages[SWA]) == want
    assert list(tree.match("", seq(0, 8)).device_pages[SWA]) == [11, 12]  # within one window: all
    assert tree.resident_pages(Tier.DEVICE, SWA) == 5  # still held, only not handed out
    tree.check_integrity()


def test_partial_last_page_is_never_reused_and_match_splits_without_copying() -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 12), {FULL: ids(7, 8, 9)})
    m = tree.match("", seq(0, 7))  # 1 whole page + 3 tokens
    assert m.device_tokens == 4 and list(m.device_pages[FULL]) == [7]
    m = tree.match("", seq(0, 8) + toks(99, 99, 99, 99))  # diverges inside the node: split
    assert m.device_tokens == 8 and list(m.device_pages[FULL]) == [7, 8]
    head, tail = m.path[0], next(iter(m.path[0].children.values()))  # type: ignore[attr-defined]
    assert head.res[0].base is not None and head.res[0].base is tail.res[0].base, "split must divide, not copy"
    tree.check_integrity()


def test_insert_adds_only_the_unmatched_suffix_and_returns_duplicates() -> None:
    tree = make_tree(4)
    r = tree.insert("", seq(0, 8), {FULL: ids(1, 2)})
    assert (r.inserted_tokens, r.reused_tokens) == (8, 0)
    # A second engine computed the same first page again (page 5) and one more page.
    r = tree.insert("", seq(0, 12), {FULL: ids(5, 2, 6)})
    assert (r.inserted_tokens, r.reused_tokens) == (4, 8)
    assert list(r.released[FULL]) == [5]  # the tree keeps its own page 1
    assert list(tree.match("", seq(0, 12)).device_pages[FULL]) == [1, 2, 6]
    tree.check_integrity()


def test_namespaces_never_share_pages() -> None:
    tree = make_tree(4)
    tree.insert("tenant-a", seq(0, 8), {FULL: ids(1, 2)})
    assert tree.match("tenant-b", seq(0, 8)).device_tokens == 0
    assert tree.match("", seq(0, 8)).device_tokens == 0
    assert tree.match("tenant-a", seq(0, 8)).device_tokens == 8
    # Hashes are seeded by the namespace: the same tokens chain differently per tenant,
    # and the tree's hashes are the chain the controller computes for pages past the tree.
    hashes = tree.page_hashes(tree.match("tenant-a", seq(0, 8)).path[0])
    seeded = chain_hashes(tree.chain_prev("tenant-a", None), seq(0, 8), 16)
    assert hashes == seeded != chain_hashes(tree.chain_prev("tenant-b", None), seq(0, 8), 16)


def test_chained_hashes_depend_on_the_whole_prefix_and_survive_splits() -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3)})
    whole = tree.page_hashes(tree.match("", seq(0, 12)).path[-1])
    tree.match("", seq(0, 4) + toks(9, 9, 9, 9))  # split after page 1
    m = tree.match("", seq(0, 12))
    assert b"".join(tree.page_hashes(n) for n in m.path) == whole
    other = make_tree(4, model_id="model")
    other.insert("", toks(5, 5, 5, 5) + seq(4, 8), {FULL: ids(1, 2, 3)})
    m2 = other.match("", toks(5, 5, 5, 5) + seq(4, 8))
    assert tree.page_hashes(m.path[-1])[-16:] != other.page_hashes(m2.path[-1])[-16:]
    # The model id seeds the chain too: the same tokens under another model never share keys.
    renamed = make_tree(4, model_id="other-model")
    renamed.insert("", seq(0, 12), {FULL: ids(1, 2, 3)})
    assert renamed.page_hashes(renamed.match("", seq(0, 12)).path[-1]) != whole


def test_a_long_session_moves_only_the_branch_it_grows() -> None:
    """Each turn of a session continues the last: only the new branch gains a reference,
    the shared prefix is not touched, and the eviction queues do not grow per turn."""
    tree = make_tree(4, swa_window=8, mamba=True)
    tokens, next_id = b"", iter(range(10**6))
    for turn in range(60):
        tokens += seq(turn * 8, 8)
        m = tree.match("", tokens, lock=True, session_id="s")
        n = len(tokens) // 16 - m.device_tokens // 4
        pages = {kind: np.array([next(next_id) for _ in range(n)]) for kind in (FULL, SWA)}
        tree.insert("", tokens, pages, lock=m.lock, mamba_slot=next(next_id))
        tree.check_integrity()  # references equal the sessions' paths
    queued = sum(len(q) for row in tree._queues for q in row)
    # At most one entry per new node in each of the 6 queues (2 tiers x 3 components);
    # was ~60 * 60 / 2 when every turn re-queued the path.
    assert queued <= 6 * 60, queued


def test_lru_eviction_order_leaf_first_and_locks_hold() -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)})  # A=[1] -> B=[2] after the next insert
    tree.insert("", seq(0, 4) + seq(100, 4), {FULL: ids(1, 3)})  # sibling C=[3]
    tree.match("", seq(0, 8))  # B used after C
    lock = tree.match("", seq(0, 4) + seq(100, 4), lock=True).lock  # C locked
    assert tree.locked_pages(Tier.DEVICE, FULL) == 2
    r = tree.evict(Tier.DEVICE, FULL, 1)
    assert list(r.freed[FULL]) == [2]  # B: the only unlocked leaf
    r = tree.evict(Tier.DEVICE, FULL, 5)
    assert r.evicted_pages == 0  # A has a child, C is locked
    assert lock is not None
    tree.unlock(lock)
    r = tree.evict(Tier.DEVICE, FULL, 5)
    assert list(r.freed[FULL]) == [3, 1]  # C, then A once it became a leaf
    assert tree.resident_pages(Tier.DEVICE, FULL) == 0
    tree.check_integrity()
    with pytest.raises(NotFound):
        tree.unlock(lock)


def test_lfu_prefers_cold_leaves() -> None:
    tree = make_tree(4, policy=EvictionPolicy.LFU)
    tree.insert("", seq(0, 4), {FULL: ids(1)})
    tree.insert("", seq(50, 4), {FULL: ids(2)})
    for _ in range(3):
        tree.match("", seq(0, 4))
    tree.match("", seq(50, 4))  # most recent, but used once
    assert list(tree.evict(Tier.DEVICE, FULL, 1).freed[FULL]) == [2]


def test_write_back_eviction_moves_a_family_to_host_and_match_reports_host_tokens() -> None:
    tree = make_tree(4, swa_window=4, mamba=True)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2), SWA: ids(11, 12)}, mamba_slot=21)
    host = iter(range(500, 600))

    def back_up(victim) -> None:
        for kind, pages in victim.pages.items():
            tree.set_resident(victim.node, kind, Tier.HOST, np.array([next(host) for _ in pages]))

    r = tree.evict(Tier.DEVICE, FULL, 2, before_drop=back_up)
    assert list(r.freed[FULL]) == [1, 2] and list(r.freed[MAMBA]) == [21]
    m = tree.match("", seq(0, 8), lock=True)
    assert (m.device_tokens, m.host_tokens) == (0, 8)
    assert m.lock is not None and m.lock.end is not None
    assert tree.locked_pages(Tier.HOST, FULL) == 2
    tree.check_integrity()
    tree.unlock(m.lock)
    assert tree.evict(Tier.HOST, FULL, 10).evicted_pages == 2
    assert tree.match("", seq(0, 8)).matched_tokens == 0
    tree.check_integrity()


def test_swa_eviction_splits_at_the_retention_boundary_and_leaves_tombstones() -> None:
    tree = make_tree(4, swa_window=8)  # window: 2 pages
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(11, 12, 13, 14)})
    tree.insert("", seq(0, 16) + seq(200, 4), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    # Path: X=[p1..p4] -> Y=[p5] (leaf). Y's window needs p4 and p5: only p1..p3 may go.
    r = tree.evict(Tier.DEVICE, SWA, 10)
    assert list(r.freed[SWA]) == [11, 12, 13]
    assert r.freed[FULL].size == 0
    m = tree.match("", seq(0, 16) + seq(200, 4))
    assert m.device_tokens == 20  # still reusable at the end
    assert list(m.device_pages[SWA]) == [-1, -1, -1, 14, 15]
    assert tree.match("", seq(0, 12)).device_tokens == 0  # inside the tombstone: no window
    tree.check_integrity()


def test_session_references_reorder_eviction_and_close_drops_them() -> None:
    tree = make_tree(4)
    m = tree.match("", seq(0, 4), lock=True, session_id="s1")
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=m.lock)
    tree.insert("", seq(40, 4), {FULL: ids(2)})  # sessionless, newer
    assert list(tree.evict(Tier.DEVICE, FULL, 1).freed[FULL]) == [2]  # referenced goes last
    tree.insert("", seq(40, 4), {FULL: ids(2)})
    assert tree.close_session("s1") == 1
    assert tree.close_session("s1") == 1  # recently closed: the same answer, nothing changed
    with pytest.raises(NotFound):
        tree.close_session("never-opened")
    assert list(tree.evict(Tier.DEVICE, FULL, 1).freed[FULL]) == [1]  # plain LRU again
    tree.check_integrity()


def test_late_request_cannot_restore_references_after_close_and_reopen() -> None:
    tree = make_tree(4)
    late = tree.match("", seq(0, 4), lock=True, session_id="s")
    tree.close_session("s")
    fresh = tree.match("", seq(80, 4), lock=True, session_id="s")  # reopened
    tree.insert("", seq(0, 4), {FULL: ids(1)}, lock=late.lock)
    tree.insert("", seq(80, 4), {FULL: ids(2)}, lock=fresh.lock)
    tree.check_integrity()
    # Only the new generation's boundary is referenced: page 1 (late) goes first.
    assert list(tree.evict(Tier.DEVICE, FULL, 1).freed[FULL]) == [1]

def test_a_request_naming_its_session_only_at_insert_is_late_if_it_began_before_a_close() -> None:
    """An insert without the match's lock says when the request began (`session_since`):
    the session closed after that stays closed, and once reopened by a newer request the
    late one references nothing in it either; one that began after the close opens it."""
    tree = make_tree(4)
    tree.match("", seq(0, 4), lock=True, session_id="s")  # opens s
    began = tree.session_clock
    assert tree.close_session("s") == 0
    tree.insert("", seq(0, 4), {FULL: ids(1)}, session_id="s", session_since=began)
    assert tree.close_session("s") == 0  # still the closed session: the same answer
    fresh = tree.match("", seq(80, 4), lock=True, session_id="s")  # a new request reopens it
    tree.insert("", seq(40, 4), {FULL: ids(2)}, session_id="s", session_since=began)
    tree.insert("", seq(80, 4), {FULL: ids(3)}, lock=fresh.lock)
    assert tree.close_session("s") == 1  # the new request's page only
    after = tree.session_clock
    tree.insert("", seq(120, 4), {FULL: ids(4)}, session_id="s", session_since=after)
    assert tree.close_session("s") == 1  # began after the close: a new generation of s
    tree.check_integrity()



def test_mamba_checkpoint_copy_on_write_keeps_the_original() -> None:
    tree = make_tree(4, mamba=True)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)}, mamba_slot=30)
    m = tree.match("", seq(0, 12), lock=True)
    assert list(m.device_pages[MAMBA]) == [30]  # the engine copies it into its own slot
    r = tree.insert("", seq(0, 12), {FULL: ids(3)}, lock=m.lock, mamba_slot=31)
    assert r.released[MAMBA].size == 0
    assert list(tree.match("", seq(0, 8)).device_pages[MAMBA]) == [30]
    assert list(tree.match("", seq(0, 12)).device_pages[MAMBA]) == [31]
    r = tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3)}, mamba_slot=32)
    assert list(r.released[MAMBA]) == [32]  # a checkpoint is there already
    tree.check_integrity()


def test_keep_lock_moves_the_lock_to_the_new_end() -> None:
    tree = make_tree(4)
    m = tree.match("", seq(0, 8), lock=True)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)}, lock=m.lock, keep_lock=True)
    assert tree.locked_pages(Tier.DEVICE, FULL) == 2
    assert tree.evict(Tier.DEVICE, FULL, 9).evicted_pages == 0
    assert m.lock is not None
    tree.insert("", seq(0, 12), {FULL: ids(3)}, lock=m.lock)
    assert tree.active_locks == 0 and tree.locked_pages(Tier.DEVICE, FULL) == 0
    tree.check_integrity()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.match("", b"\x01\x02\x03"), "not a multiple of 4"),
        (lambda t: t.insert("", seq(0, 8), {FULL: ids(1)}), "1 page ids for 2 new pages"),
        (lambda t: t.insert("", seq(0, 4), {FULL: ids(-1)}), "page ids must be >= 0"),
        # (a negative id after the first: found by its sign byte, and past 512 pages by a
        # reduction)
        (lambda t: t.insert("", seq(0, 12), {FULL: ids(1, 2, -3)}), "page ids must be >= 0"),
        (lambda t: t.insert("", seq(0, 4 * 600), {FULL: np.append(np.arange(1, 600), -1)}),
         "page ids must be >= 0"),
        (lambda t: t.insert("", seq(0, 4), {SWA: ids(1)}), "which this model does not have"),
        (lambda t: t.evict(Tier.STORAGE, FULL, 1), "manages its own eviction"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(call, message: str) -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 4), {FULL: ids(9)})
    with pytest.raises(InvalidArgument, match=message):
        call(tree)
    assert list(tree.match("", seq(0, 4)).device_pages[FULL]) == [9]
    tree.check_integrity()


def test_insert_with_a_lock_on_other_tokens_is_refused() -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 4), {FULL: ids(9)})
    m = tree.match("", seq(0, 4), lock=True)
    with pytest.raises(InvalidArgument, match="do not start with the prefix"):
        tree.insert("", seq(1, 8), {FULL: ids(1)}, lock=m.lock)
    with pytest.raises(InvalidArgument, match="does not match the lock's namespace"):
        tree.insert("other", seq(0, 8), {FULL: ids(1)}, lock=m.lock)
    tree.check_integrity()


def test_nodes_lacking_a_tier_root_first() -> None:
    tree = make_tree(4)
    tree.insert("", seq(0, 8), {FULL: ids(0, 1)})
    end = tree.insert("", seq(0, 16), {FULL: ids(0, 1, 2, 3)}).end
    head = tree.parent_of(end)
    assert tree.nodes_lacking(end, FULL, Tier.HOST) == [head, end]
    tree.set_resident(head, FULL, Tier.HOST, ids(7, 8))
    assert tree.nodes_lacking(end, FULL, Tier.HOST) == [end]
    assert tree.nodes_lacking(end, FULL, Tier.DEVICE) == []
    tree.check_integrity()


def test_swa_data_pushed_out_of_the_window_by_a_deeper_insert_becomes_evictable() -> None:
    """An SWA slot popped while its window kept it whole loses its queue mark; when the
    path below grows, it must be offered again (found by a review: it was never queued)."""
    tree = make_tree(2, swa_window=4)
    tree.insert("", seq(0, 2), {FULL: ids(0), SWA: ids(0)})
    tree.insert("", seq(0, 4), {FULL: ids(0, 1), SWA: ids(0, 1)})
    assert tree.evict(Tier.DEVICE, SWA, 1).evicted_pages == 0  # both pages in the window
    tree.insert("", seq(0, 6), {FULL: ids(0, 1, 2), SWA: ids(0, 1, 2)})
    tree.check_integrity()  # raised "evictable swa/0 not queued"
    assert tree.evict(Tier.DEVICE, SWA, 1).evicted_pages == 1  # page 0 left the window
    tree.check_integrity()


def test_window_walks_owed_by_inserts_run_when_an_eviction_needs_them() -> None:
    """Inserts only note the parents whose children changed; the SWA window walks run at
    the next eviction (no integrity check in between: it would run them itself)."""
    tree = make_tree(2, swa_window=4)
    tree.insert("", seq(0, 4), {FULL: ids(0, 1), SWA: ids(0, 1)})
    assert tree.evict(Tier.DEVICE, SWA, 1).evicted_pages == 0  # both pages in the window
    tree.insert("", seq(0, 6), {FULL: ids(0, 1, 2), SWA: ids(0, 1, 2)})
    assert tree.evict(Tier.DEVICE, SWA, 1).evicted_pages == 1  # page 0 left the window
    tree.check_integrity()


def test_window_walks_owed_stay_bounded_without_evictions() -> None:
    from hicache.tree import core

    tree = make_tree(2, swa_window=4)
    tree.insert("", seq(0, 2), {FULL: ids(0), SWA: ids(0)})
    for i in range(core._WINDOW_WALKS_AT + 10):  # children of one parent, never evicted
        tree.insert("", seq(0, 2) + toks(10_000 + i, 10_000 + i), {FULL: ids(0, i + 1), SWA: ids(0, i + 1)})
    assert 0 < len(tree._moved[Tier.DEVICE]) < core._WINDOW_WALKS_AT
    tree.check_integrity()
    assert not tree._moved[Tier.DEVICE]


def test_a_long_prefill_keeps_its_swa_window_as_the_tail_of_one_node() -> None:
    """An engine frees SWA pages outside the window during a long prefill: the tree keeps
    the window as the tail of ONE node (not a tombstone node plus a window node), counts
    only the pages it holds, reuses the end, and not a boundary inside the freed part."""
    tree = make_tree(4, swa_window=8, mamba=True)  # window: 2 pages
    r = tree.insert("", seq(0, 24), {FULL: ids(1, 2, 3, 4, 5, 6), SWA: ids(-1, -1, -1, -1, 15, 16)},
                    mamba_slot=30)
    assert len(tree.iter_nodes()) == 1
    assert tree.resident_pages(Tier.DEVICE, SWA) == 2 and r.released[SWA].size == 0
    m = tree.match("", seq(0, 24), lock=True)
    assert m.device_tokens == 24
    assert list(m.device_pages[SWA]) == [-1, -1, -1, -1, 15, 16]
    assert tree.locked_pages(Tier.DEVICE, SWA) == 2 and tree.locked_pages(Tier.DEVICE, FULL) == 6
    tree.check_integrity()
    tree.unlock(m.lock)
    assert tree.match("", seq(0, 16)).device_tokens == 0  # (no MAMBA state there either)
    tree.check_integrity()


@pytest.mark.parametrize(
    ("at", "head_swa", "tail_swa"),
    [(5, [14, 15], [16]), (4, [14], [15, 16]), (3, [], [14, 15, 16]), (2, [], [14, 15, 16])],
)
def test_a_split_gives_each_part_its_share_of_a_tail(at: int, head_swa: list[int],
                                                    tail_swa: list[int]) -> None:
    """A match ending inside a node with an SWA tail (pages 3-5 of 6) splits it after page
    `at`: each part keeps the tail's pages it covers (the head only what reaches up to it:
    a tail itself, or a tombstone); the pages, counters and the reuse at the end stay."""
    tree = make_tree(4, swa_window=12)  # window: 3 pages
    tree.insert("", seq(0, 24), {FULL: ids(1, 2, 3, 4, 5, 6), SWA: ids(-1, -1, -1, 14, 15, 16)})
    tree.match("", seq(0, 4 * at))  # splits the node after page `at`
    head, tail = sorted(tree.iter_nodes(), key=tree.depth_tokens)
    held = tree.pages_of(head, SWA, Tier.DEVICE)
    assert (list(held) if held is not None else []) == head_swa
    assert list(tree.pages_of(tail, SWA, Tier.DEVICE)) == tail_swa
    assert tree.resident_pages(Tier.DEVICE, SWA) == 3
    m = tree.match("", seq(0, 24))
    assert m.device_tokens == 24 and list(m.device_pages[SWA]) == [-1, -1, -1, 14, 15, 16]
    tree.check_integrity()


def test_a_tail_slot_has_one_length_in_every_tier() -> None:
    """L2 takes a tail only of the length L1 holds (and the reverse); an L3 copy of a
    tail is not recorded (only whole slots are), so a later match never counts on it."""
    tree = make_tree(4, swa_window=8)
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, 13, 14)})
    (node,) = tree.iter_nodes()
    tree.set_resident(node, FULL, Tier.HOST, ids(51, 52, 53, 54))
    with pytest.raises(InvalidArgument, match="2 pages given 4"):
        tree.set_resident(node, SWA, Tier.HOST, ids(61, 62, 63, 64))
    tree.set_resident(node, SWA, Tier.HOST, ids(63, 64))
    tree.set_resident(node, FULL, Tier.STORAGE)
    tree.set_resident(node, SWA, Tier.STORAGE)  # a tail: not recorded
    assert not tree.is_resident(node, SWA, Tier.STORAGE)
    tree.check_integrity()
    r = tree.evict(Tier.DEVICE, FULL, 4)
    assert list(r.freed[SWA]) == [13, 14]
    m = tree.match("", seq(0, 16))
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    tree.check_integrity()


@pytest.mark.parametrize("locked", [False, True])
def test_an_insert_over_a_node_gone_from_l1_adopts_a_tail_of_one_length(locked: bool) -> None:
    """The node left L1 and L2 holds its SWA slot as a 2-page tail. A later insert into
    L1 brings all 4 SWA pages: they are adopted whole and the shorter L2 copy goes
    (`dropped`); while the node is locked (a load may be reading L2) only a 2-page tail
    is adopted, one length in both tiers, and the rest goes back."""
    tree = make_tree(4, swa_window=8)
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, 13, 14)})
    (node,) = tree.iter_nodes()
    tree.set_resident(node, FULL, Tier.HOST, ids(51, 52, 53, 54))
    tree.set_resident(node, SWA, Tier.HOST, ids(63, 64))
    tree.evict(Tier.DEVICE, FULL, 4)  # L1 copy gone (L2 keeps the family)
    lock = tree.pin(node) if locked else None
    r = tree.insert("", seq(0, 16), {FULL: ids(5, 6, 7, 8), SWA: ids(21, 22, 23, 24)})
    if locked:
        assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [23, 24]
        assert sorted(r.released[SWA].tolist()) == [21, 22] and r.dropped == {}
        tree.unlock(lock)
    else:
        assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [21, 22, 23, 24]
        assert r.released[SWA].size == 0 and list(r.dropped[SWA]) == [63, 64]
    tree.check_integrity()


def test_a_tail_a_split_left_short_grows_with_the_next_insert() -> None:
    """A node holding SWA for its last 2 pages (the window) is split by a request that
    shares 5 of its 6 pages and diverges: the 5-page head keeps 1 SWA page, less than a
    window, so its end is not reusable. That diverging insert brought whole SWA pages
    for the head: they extend its tail in front (found by a review: the tree kept its
    short tail and handed them back, and the boundary never became reusable)."""
    tree = make_tree(4, swa_window=8)  # window: 2 pages
    tree.insert("", seq(0, 24), {FULL: ids(1, 2, 3, 4, 5, 6), SWA: ids(-1, -1, -1, -1, 15, 16)})
    r = tree.insert("", seq(0, 20) + seq(900, 4), {FULL: ids(21, 22, 23, 24, 25, 26),
                                                    SWA: ids(31, 32, 33, 34, 35, 36)})
    head = min(tree.iter_nodes(), key=tree.depth_tokens)
    assert list(tree.pages_of(head, SWA, Tier.DEVICE)) == [31, 32, 33, 34, 15]
    assert sorted(r.released[SWA].tolist()) == [35] and r.dropped == {}
    assert tree.match("", seq(0, 20)).device_tokens == 20
    assert tree.resident_pages(Tier.DEVICE, SWA) == 5 + 1 + 1
    tree.check_integrity()


@pytest.mark.parametrize("locked", [False, True])
def test_a_longer_tail_replaces_the_other_tiers_shorter_copy_unless_locked(locked: bool) -> None:
    """L1 and L2 hold the same 2-page tail (one length per node). An insert into L1 that
    brings the whole window grows the L1 tail and lets the L2 copy go (reported in
    `dropped`, for the caller to free in L2), but not while the node is locked: a load
    may be reading the L2 copy then."""
    tree = make_tree(4, swa_window=16)  # window: 4 pages
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, 13, 14)})
    (node,) = tree.iter_nodes()
    tree.set_resident(node, FULL, Tier.HOST, ids(51, 52, 53, 54))
    tree.set_resident(node, SWA, Tier.HOST, ids(63, 64))
    lock = tree.pin(node) if locked else None
    r = tree.insert("", seq(0, 16), {FULL: ids(5, 6, 7, 8), SWA: ids(21, 22, 23, 24)})
    if locked:
        assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [13, 14]
        assert sorted(r.released[SWA].tolist()) == [21, 22, 23, 24] and r.dropped == {}
        assert tree.match("", seq(0, 16)).device_tokens == 0
        tree.unlock(lock)
    else:
        assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [21, 22, 13, 14]
        assert sorted(r.released[SWA].tolist()) == [23, 24]
        assert list(r.dropped[SWA]) == [63, 64] and not tree.is_resident(node, SWA, Tier.HOST)
        assert tree.match("", seq(0, 16)).device_tokens == 16
    assert sorted(r.released[FULL].tolist()) == [5, 6, 7, 8]
    tree.check_integrity()


def test_a_locked_tail_never_grows_even_when_no_other_tier_holds_it() -> None:
    """A pinned node (its L1->L2 copy queued, a load or a prefetch reading it) keeps its
    SWA slot exactly as it is: an insert bringing a longer tail gets its pages back
    (found by a review: only a copy in the other tier was protected)."""
    tree = make_tree(4, swa_window=16)
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4), SWA: ids(-1, -1, 13, 14)})
    (node,) = tree.iter_nodes()
    pin = tree.pin(node)
    r = tree.insert("", seq(0, 16), {FULL: ids(5, 6, 7, 8), SWA: ids(21, 22, 23, 24)})
    assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [13, 14]
    assert sorted(r.released[SWA].tolist()) == [21, 22, 23, 24] and r.dropped == {}
    tree.unlock(pin)
    r = tree.insert("", seq(0, 16), {FULL: ids(5, 6, 7, 8), SWA: ids(31, 32, 33, 34)})
    assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [31, 32, 13, 14]
    tree.check_integrity()


def test_the_tree_keeps_its_own_copy_of_the_page_ids_it_is_given() -> None:
    """Writing into the arrays a caller passed, after the insert, changes nothing in the
    tree: the ids of new nodes (an SWA tail out of a mostly -1 array included) and the
    ids adopted into a slot an existing node lacked are the tree's own copies."""
    tree = make_tree(4, swa_window=8, mamba=True)
    full, swa = ids(1, 2, 3, 4), ids(-1, -1, 13, 14)
    tree.insert("", seq(0, 16), {FULL: full, SWA: swa}, mamba_slot=7)
    full[:], swa[:] = 999, 999
    (node,) = tree.iter_nodes()
    assert list(tree.pages_of(node, FULL, Tier.DEVICE)) == [1, 2, 3, 4]
    assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [13, 14]
    assert list(tree.pages_of(node, MAMBA, Tier.DEVICE)) == [7]
    tree.set_resident(node, FULL, Tier.HOST, ids(51, 52, 53, 54))
    tree.evict(Tier.DEVICE, FULL, 4)  # L1 copy gone: the next insert adopts its ids
    full, swa = ids(5, 6, 7, 8), ids(21, 22, 23, 24)
    tree.insert("", seq(0, 16), {FULL: full, SWA: swa})
    full[:], swa[:] = 999, 999
    assert list(tree.pages_of(node, FULL, Tier.DEVICE)) == [5, 6, 7, 8]
    assert list(tree.pages_of(node, SWA, Tier.DEVICE)) == [21, 22, 23, 24]
    tree.check_integrity()


@pytest.mark.parametrize("slot", [7, 5000, (1 << 20) + 5])
def test_a_checkpoint_slot_reads_back_whatever_its_number(slot: int) -> None:
    """A checkpoint's one-id array is a read-only view of a shared range (grown on demand
    up to 2**20 slots) or, past that, an array of its own: either way it reads back the
    slot given, and nobody can write into the shared range through it."""
    tree = make_tree(4, mamba=True)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)}, mamba_slot=slot)
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3)}, mamba_slot=slot + 1)
    nodes = sorted(tree.iter_nodes(), key=tree.depth_tokens)
    assert [list(tree.pages_of(n, MAMBA, Tier.DEVICE)) for n in nodes] == [[slot], [slot + 1]]
    point = tree.pages_of(nodes[0], MAMBA, Tier.DEVICE)
    if slot < 1 << 20:
        with pytest.raises(ValueError):
            point[0] = 0
    tree.check_integrity()


def test_a_window_far_down_a_long_prefix_is_minus_one_before_it() -> None:
    """Past 1,024 pages before the window, the shared run of -1s the SWA result is cut
    from grows; two matches of different depths each get their own, whole result."""
    tree = make_tree(1, swa_window=2)
    n = 3000
    tree.insert("", seq(0, n), {FULL: np.arange(n, dtype=np.int64), SWA: np.arange(n, dtype=np.int64) + 10_000})
    short = tree.match("", seq(0, 700)).device_pages[SWA]
    deep = tree.match("", seq(0, n)).device_pages[SWA]
    assert deep.tolist() == [-1] * (n - 2) + [10_000 + n - 2, 10_000 + n - 1]
    assert short.tolist() == [-1] * 698 + [10_698, 10_699]
    tree.check_integrity()


def test_a_write_back_tier_evicts_an_interior_node_once_its_child_left() -> None:
    """L1 under write-back (`backed_up_tiers`): once a leaf went to L2, its parent, L1's
    last copy of a node with children, is a candidate too (its eviction copies it first).
    It used to be none: L1 pages stuck for good with nothing locked. Where the copy is
    not made, the node stays, queued for the next eviction."""
    tree = make_tree(4, backed_up_tiers=(Tier.DEVICE,))
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)})
    tree.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4)})  # A = pages 1, 2; its child B = 3, 4
    host = iter(range(500, 600))
    copy = [True]

    def back_up(victim) -> None:
        if copy[0]:
            for kind, pages in victim.pages.items():
                tree.set_resident(victim.node, kind, Tier.HOST, np.array([next(host) for _ in pages]))

    assert list(tree.evict(Tier.DEVICE, FULL, 2, before_drop=back_up).freed[FULL]) == [3, 4]
    copy[0] = False  # no room in L2, say: A must stay (the path would be cut)
    kept = tree.evict(Tier.DEVICE, FULL, 2, before_drop=back_up)
    assert kept.evicted_pages == 0
    assert len(kept.stranded) == 1  # the caller is told, so that it may copy A
    a = tree.match("", seq(0, 8), lock=True).lock
    assert kept.stranded == (a.end,)
    tree.unlock(a)
    tree.check_integrity()  # (A is still queued: the audit checks every candidate is)
    assert tree.match("", seq(0, 16)).device_tokens == 8
    copy[0] = True
    assert list(tree.evict(Tier.DEVICE, FULL, 2, before_drop=back_up).freed[FULL]) == [1, 2]
    m = tree.match("", seq(0, 16))
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    tree.check_integrity()
    # Without the tier backed up, A is no candidate: an eviction takes nothing.
    plain = make_tree(4)
    plain.insert("", seq(0, 8), {FULL: ids(1, 2)})
    plain.insert("", seq(0, 16), {FULL: ids(1, 2, 3, 4)})
    assert plain.evict(Tier.DEVICE, FULL, 4, before_drop=back_up).evicted_pages == 2


def test_full_pages_only_above_counts_what_a_flush_would_still_write() -> None:
    tree = make_tree(4)
    a = tree.insert("", seq(0, 8), {FULL: ids(1, 2)}).end  # 2 pages, L1 only
    b = tree.insert("", seq(40, 4), {FULL: ids(3)}).end  # 1 page, L1 only
    assert tree.full_pages_only_above(Tier.STORAGE) == 3
    tree.set_resident(a, FULL, Tier.STORAGE)
    assert tree.full_pages_only_above(Tier.STORAGE) == 1
    tree.set_resident(b, FULL, Tier.HOST, ids(9))
    assert tree.full_pages_only_above(Tier.STORAGE) == 1  # in L2 too, still not in L3
    assert tree.full_pages_only_above(Tier.HOST) == 2  # L1 only: a's two pages
    tree.check_integrity()


def test_an_l3_record_older_than_stale_before_offers_its_slots_again_and_a_split_keeps_its_age() -> None:
    """A store whose objects expire (Redis's ttl_s): `slots_for_storage(node, stale_before)`
    offers the L2 slots of a node recorded in STORAGE before `stale_before` again; a
    record renewed (`storage_renewed`) or younger is not; both halves of a split keep the
    record's age (the head's objects were written when the tail's were)."""
    tree = make_tree(4, swa_window=4)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2), SWA: ids(11, 12)})
    node = tree.match("", seq(0, 8)).path[-1]
    tree.set_resident(node, FULL, Tier.HOST, ids(101, 102))
    tree.set_resident(node, SWA, Tier.HOST, ids(111, 112))
    assert tree.slots_for_storage(node) == [FULL, SWA]
    tree.set_resident(node, FULL, Tier.STORAGE)
    tree.set_resident(node, SWA, Tier.STORAGE)
    written = node.stored_at
    assert written > 0
    assert tree.slots_for_storage(node) == []
    assert tree.slots_for_storage(node, stale_before=written) == []
    assert tree.slots_for_storage(node, stale_before=written + 1) == [FULL, SWA]
    tree.match("", seq(0, 4) + toks(7, 7, 7, 7))  # split after page 1
    head, tail = tree.match("", seq(0, 8)).path
    assert head.stored_at == tail.stored_at == written
    assert tree.slots_for_storage(head, stale_before=written + 1) == [FULL, SWA]
    tree.storage_renewed(head)
    assert head.stored_at > written
    renewed = head.stored_at
    assert tree.slots_for_storage(head, stale_before=renewed) == []
    assert tree.slots_for_storage(tail, stale_before=renewed) == [FULL, SWA]
    tree.check_integrity()
