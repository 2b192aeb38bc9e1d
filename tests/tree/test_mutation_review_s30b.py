"""Mutation review, second round (tree): behaviour of `HiRadixTree` and `SessionTable`
that no other test pinned; each test names the mutant of the product code it kills."""

from __future__ import annotations

import pytest

from hicache.errors import InvalidArgument, NotFound
from hicache.types import Tier

from .helpers import FULL, SWA, ids, make_tree, seq


def test_a_partial_swa_slot_is_not_offered_to_l3_again_once_full_is_recorded_there() -> None:
    """A node of three pages whose SWA slot holds only its tail (the page inside the
    window: a partial slot, in L1 and L2). Before L3 has it, a flush would write FULL and
    the SWA tail; once FULL is recorded in STORAGE (the SWA tail's L3 copy is never
    recorded: only whole slots are), `slots_for_storage` offers nothing: offering the
    partial slot again would rewrite it on every flush.
    Mutant killed: `slots_for_storage` without `skip |= PARTIAL` (answers [SWA])."""
    tree = make_tree(4, swa_window=4)
    tree.insert("", seq(0, 12), {FULL: ids(1, 2, 3), SWA: ids(-1, -1, 13)})
    node = tree.match("", seq(0, 12)).path[-1]
    assert tree.pages_of(node, SWA, Tier.DEVICE).tolist() == [13]
    tree.set_resident(node, FULL, Tier.HOST, ids(101, 102, 103))
    tree.set_resident(node, SWA, Tier.HOST, ids(113))
    assert tree.slots_for_storage(node) == [FULL, SWA]
    tree.set_resident(node, FULL, Tier.STORAGE)
    tree.set_resident(node, SWA, Tier.STORAGE)  # (a partial slot: not recorded)
    assert not tree.is_resident(node, SWA, Tier.STORAGE)
    assert tree.slots_for_storage(node) == []
    tree.check_integrity()


def test_mark_loaded_refuses_a_lock_whose_path_is_not_in_l1() -> None:
    """A two-page prefix only L2 holds, matched with a lock (device 0 tokens, host 8):
    `mark_loaded` before any load brought it into L1 must raise InvalidArgument (an engine
    told the prefix is in L1 would compute with KV that is not there), and leave the lock
    as it was (its device end still None).
    Mutant killed: `mark_loaded` without its "not in L1 yet" check."""
    tree = make_tree(4)
    tree.insert("", seq(0, 8), {FULL: ids(1, 2)}, tier=Tier.HOST)
    match = tree.match("", seq(0, 8), lock=True)
    assert (match.device_tokens, match.host_tokens) == (0, 8)
    with pytest.raises(InvalidArgument, match="not in L1 yet"):
        tree.mark_loaded(match.lock)
    assert match.lock.device_end is None
    tree.unlock(match.lock)
    tree.check_integrity()


def test_a_request_that_began_right_after_a_close_reopens_the_session() -> None:
    """Session "s" references one page, then closes (the close ticks the sessions'
    clock). A request that read the clock right after that close (`session_since` equal to
    the close's tick, nothing in between) began after it: it is the session's next turn,
    not a late request of the closed one, so its insert reopens "s", and closing "s" again
    releases the new path's two pages (not the old record's one).
    Mutant killed: `SessionTable.open` with `closed[1] >= since` (the request taken as
    late: "s" stays closed, and the close answers the old record, 1)."""
    tree = make_tree(4)
    tree.insert("", seq(0, 4), {FULL: ids(1)}, session_id="s")
    assert tree.close_session("s") == 1
    since = tree.session_clock
    tree.insert("", seq(100, 8), {FULL: ids(5, 6)}, session_id="s", session_since=since)
    assert tree.close_session("s") == 2
    tree.check_integrity()


def test_closed_session_records_are_kept_up_to_the_configured_number() -> None:
    """`closed_session_tombstones=2`: after three sessions close, the oldest record is
    gone (closing it again is NotFound) while the two newest still answer their depth.
    Mutant killed: `SessionTable.close` trimming to `max_closed + 1` records."""
    tree = make_tree(4, closed_session_tombstones=2)
    for i, name in enumerate(("a", "b", "c")):
        tree.insert("", seq(100 * i, 4 * (i + 1)), {FULL: ids(*range(10 * i, 10 * i + i + 1))},
                    session_id=name)
        assert tree.close_session(name) == i + 1
    with pytest.raises(NotFound):
        tree.close_session("a")
    assert tree.close_session("b") == 2
    assert tree.close_session("c") == 3
    tree.check_integrity()
