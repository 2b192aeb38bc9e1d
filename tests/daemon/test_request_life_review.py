"""A request's life beyond the simple round, checked against API.md word by word: an
Insert mid-request with keep_lock, decode growth of the allocation, a final Insert; partial
pages, divergent or foreign handles, duplicates from two requests at once, lapsed leases,
sessions on Insert vs MatchPrefix, MAMBA copy-on-write. Every committed page is checked
byte for byte (`engine_sim.Engine` / `KvOracle`), and after each scenario every L1 page is
free, in the tree, or in a live allocation (`check_integrity`)."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import Engine, built_controllers, seq, toks

from hicache.bench.oracle import KvOracle
from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest
from hicache.errors import InvalidArgument, NotFound
from hicache.types import ComponentKind, Tier

from .daemonkit import FULL_SWA_MAMBA, Daemon

FULL = ComponentKind.FULL
MAMBA = ComponentKind.MAMBA
PS = 4  # the tiny config's page size
PB = PS * 4
_instances = itertools.count()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., object]]:
    with built_controllers(tmp_path, "rl") as factory:
        yield factory


def t(lo: int, hi: int) -> bytes:
    return toks(range(lo, hi))


def allocated(ctl, ids, kind=FULL) -> np.ndarray:
    return ctl.device.allocator(kind).is_allocated(np.asarray(ids, dtype=np.int64))


def used(ctl, kind=FULL) -> int:
    a = ctl.device.allocator(kind)
    return a.total - a.free_count


def tree_pages(ctl, tokens: bytes) -> np.ndarray:
    return ctl.match("probe", MatchRequest("", tokens)).device_pages["full"]


def attach_probe(ctl) -> None:
    ctl.attach("probe", 0, 1)


# ------------------------------------------------------------------ the whole life


def test_prefill_keep_lock_insert_growth_and_final_insert_commit_each_page_in_place(make) -> None:
    """A 10-token prefill (2.5 pages): the keep_lock Insert commits 2 pages and leaves the
    partial third with the allocation; decode grows it twice with a second keep_lock Insert
    between; the final Insert commits the rest. Every page lands at its position, the
    bytes the engine wrote come back, and the accounting adds up at each step."""
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    attach_probe(ctl)
    total = ctl.device.allocator(FULL).total
    prompt = t(1000, 1010)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=10))
    p = m.pages["full"].copy()
    assert len(p) == 3 and m.device_tokens == 0
    eng.write(m.pages, prompt, 0)
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id,
                                         allocation_id=m.allocation_id, keep_lock=True))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 0)
    assert np.array_equal(tree_pages(ctl, prompt), p[:2])
    assert allocated(ctl, p).all()  # the partial page stays with the allocation
    hb = ctl.heartbeat("e1")
    assert (hb.locks, hb.allocations) == (1, 1)
    ctl.check_integrity()

    # Decode to 14 tokens: one more page; the response lists what the allocation holds.
    g1 = ctl.allocate("e1", AllocateRequest("", 4, allocation_id=m.allocation_id))
    assert g1.allocation_id == m.allocation_id
    assert len(g1.pages["full"]) == 2 and g1.pages["full"][0] == p[2]
    mid = t(1000, 1014)
    eng.write(g1.pages, mid, 2)  # page 2 (now whole) and nothing of page 3 yet
    out = ctl.insert("e1", InsertRequest("", mid, lock_id=m.lock_id,
                                         allocation_id=m.allocation_id, keep_lock=True))
    assert (out.inserted_tokens, out.reused_tokens) == (4, 8)
    assert np.array_equal(tree_pages(ctl, mid), p)
    ctl.check_integrity()

    # Decode to 22 tokens: two more pages, then the final Insert.
    g2 = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    assert len(g2.pages["full"]) == 3 and g2.pages["full"][0] == g1.pages["full"][1]
    full = t(1000, 1022)
    eng.write(g2.pages, full, 3)
    out = ctl.insert("e1", InsertRequest("", full, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 12)
    hb = ctl.heartbeat("e1")
    assert (hb.locks, hb.allocations) == (0, 0)
    want = np.concatenate([p, g2.pages["full"][:2]])
    again = ctl.match("e1", MatchRequest("", full, lock=True))
    assert again.device_tokens == 20
    assert np.array_equal(again.device_pages["full"], want)
    eng.verify(again.device_pages, full, 5)
    ctl.release("e1", again.lock_id, None)
    # The partial last page left with the final Insert; the committed five stay.
    assert not allocated(ctl, g2.pages["full"][2:]).any()
    assert used(ctl) == 5 and ctl.device.allocator(FULL).free_count == total - 5
    ctl.check_integrity()


def test_a_prefix_extended_by_a_partial_page_commits_nothing_new(make) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    eng.request(t(2000, 2008))
    before = used(ctl)
    prompt = t(2000, 2010)  # the cached 2 pages and half a page
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=10))
    assert m.device_tokens == 8 and len(m.pages["full"]) == 1
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (0, 8)
    assert used(ctl) == before  # the partial page went back
    assert ctl.heartbeat("e1").locks == 0 and ctl.heartbeat("e1").allocations == 0
    # Lock only (no allocation): the partial page needs none either.
    m = ctl.match("e1", MatchRequest("", prompt, lock=True))
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id))
    assert (out.inserted_tokens, out.reused_tokens) == (0, 8)
    assert ctl.heartbeat("e1").locks == 0
    ctl.check_integrity()


# ------------------------------------------------------------------ malformed inserts


@pytest.mark.parametrize("after_keep_lock", [False, True])
def test_an_insert_diverging_from_the_locks_path_is_invalid_and_changes_nothing(
        make, after_keep_lock: bool) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    attach_probe(ctl)
    eng.request(t(3000, 3008))
    prompt = t(3000, 3016)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=20))
    assert m.device_tokens == 8
    eng.write(m.pages, prompt, 2)
    if after_keep_lock:
        ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                       keep_lock=True))
    pools = ctl.stats().pools
    # Same length, another token inside the locked part; and a sequence shorter than it.
    bad = bytearray(prompt)
    bad[4:8] = toks([99_999])
    for tokens in (bytes(bad), prompt[:PB]):
        with pytest.raises(InvalidArgument, match="do not start with the prefix"):
            ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id,
                                           allocation_id=m.allocation_id))
    assert ctl.stats().pools == pools
    assert ctl.heartbeat("e1").locks == 1 and ctl.heartbeat("e1").allocations == 1
    assert ctl.match("probe", MatchRequest("", bytes(bad))).device_tokens == 0
    out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert out.inserted_tokens + out.reused_tokens == 16
    again = ctl.match("e1", MatchRequest("", prompt, lock=True))
    eng.verify(again.device_pages, prompt, 4)
    ctl.release("e1", again.lock_id, None)
    ctl.check_integrity()


def test_an_insert_past_its_allocation_or_without_one_is_invalid_and_changes_nothing(make) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    prompt = t(4000, 4012)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    eng.write(m.pages, prompt, 0)
    pools = ctl.stats().pools
    longer = prompt + t(4100, 4104)
    with pytest.raises(InvalidArgument, match=r"covers token pages \[0, 3\); insert needs \[0, 4\)"):
        ctl.insert("e1", InsertRequest("", longer, lock_id=m.lock_id, allocation_id=m.allocation_id))
    with pytest.raises(InvalidArgument, match="3 new pages of tokens but no allocation_id"):
        ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id))
    assert ctl.stats().pools == pools
    assert ctl.heartbeat("e1").locks == 1 and ctl.heartbeat("e1").allocations == 1
    # An allocation without the lock: it is inserted from the root (the match was empty).
    out = ctl.insert("e1", InsertRequest("", prompt, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (12, 0)
    assert ctl.heartbeat("e1").allocations == 0 and ctl.heartbeat("e1").locks == 1
    ctl.release("e1", m.lock_id, None)
    again = ctl.match("e1", MatchRequest("", prompt, lock=True))
    eng.verify(again.device_pages, prompt, 3)
    ctl.release("e1", again.lock_id, None)
    ctl.check_integrity()


def test_an_allocation_without_its_lock_cannot_skip_the_matched_prefix(make) -> None:
    """An allocation that starts after a matched prefix, inserted without the lock, would
    commit its pages at the front of the sequence: refused."""
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    eng.request(t(4500, 4508))
    prompt = t(4500, 4516)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=16))
    assert m.device_tokens == 8
    pools = ctl.stats().pools
    with pytest.raises(InvalidArgument, match=r"covers token pages \[2, 4\); insert needs \[0, 4\)"):
        ctl.insert("e1", InsertRequest("", prompt, allocation_id=m.allocation_id))
    assert ctl.stats().pools == pools
    ctl.release("e1", m.lock_id, m.allocation_id)
    ctl.check_integrity()


def test_an_insert_in_another_namespace_than_the_match_is_refused(make) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    prompt = t(5000, 5008)
    m = ctl.match("e1", MatchRequest("tenant-a", prompt, lock=True, allocate_tokens=8))
    eng.write(m.pages, prompt, 0)
    with pytest.raises(InvalidArgument, match="namespace 'tenant-b' does not match lock"):
        ctl.insert("e1", InsertRequest("tenant-b", prompt, lock_id=m.lock_id,
                                       allocation_id=m.allocation_id))
    with pytest.raises(InvalidArgument, match="namespace 'tenant-b' does not match allocation"):
        ctl.insert("e1", InsertRequest("tenant-b", prompt, allocation_id=m.allocation_id))
    for ns in ("tenant-b", ""):
        assert ctl.match("e1", MatchRequest(ns, prompt)).device_tokens == 0
    ctl.insert("e1", InsertRequest("tenant-a", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert ctl.match("e1", MatchRequest("tenant-a", prompt)).device_tokens == 8
    assert ctl.match("e1", MatchRequest("tenant-b", prompt)).device_tokens == 0
    ctl.check_integrity()


# ------------------------------------------------------------------ two requests, one suffix


@pytest.mark.parametrize("keep_lock", [False, True])
def test_two_requests_inserting_one_new_suffix_at_once_leave_one_copy(make, keep_lock: bool) -> None:
    """Both matched the same 2 cached pages and computed the same 3 new ones; their Inserts
    race. The tree holds the winner's pages; the loser's duplicates are freed (at once, or
    with keep_lock when its request ends); both engines' next match hits, byte exact."""
    ctl = make(storage__backend="none")
    a, b = Engine(ctl, "a"), Engine(ctl, "b")
    a.request(t(6000, 6008))
    prompt = t(6000, 6020)
    ms = {e.id: ctl.match(e.id, MatchRequest("", prompt, lock=True, allocate_tokens=24)) for e in (a, b)}
    for e in (a, b):
        assert ms[e.id].device_tokens == 8 and len(ms[e.id].pages["full"]) == 4
        e.write(ms[e.id].pages, prompt, 2)
    before = used(ctl)
    outs: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(e: Engine) -> None:
        barrier.wait(5)
        outs[e.id] = ctl.insert(e.id, InsertRequest("", prompt, lock_id=ms[e.id].lock_id,
                                                    allocation_id=ms[e.id].allocation_id,
                                                    keep_lock=keep_lock))

    threads = [threading.Thread(target=run, args=(e,)) for e in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sorted((o.inserted_tokens, o.reused_tokens) for o in outs.values()) == [(0, 20), (12, 8)]
    winner = next(k for k, o in outs.items() if o.inserted_tokens)
    loser = "b" if winner == "a" else "a"
    held = ctl.match("a", MatchRequest("", prompt)).device_pages["full"]
    assert np.array_equal(held[2:], ms[winner].pages["full"][:3])
    lost = ms[loser].pages["full"][:3]
    # keep_lock: the loser's request still reads its own 3 pages.
    if keep_lock:
        assert allocated(ctl, lost).all()
        assert used(ctl) == before  # the partial 4th pages too, with their allocations
    else:  # both allocations consumed: the loser's 4 pages and the winner's partial one freed
        assert not allocated(ctl, lost).any()
        assert used(ctl) == before - 5 == 5
    ctl.check_integrity()
    if keep_lock:  # each ends with its own decode
        for i, e in enumerate((a, b)):
            full = prompt + t(7000 + 100 * i, 7004 + 100 * i)
            g = ctl.allocate(e.id, AllocateRequest("", 4, allocation_id=ms[e.id].allocation_id))
            assert len(g.pages["full"]) == 2  # the partial 4th page of the match, and one more
            e.write(g.pages, full, 5)
            out = ctl.insert(e.id, InsertRequest("", full, lock_id=ms[e.id].lock_id,
                                                 allocation_id=ms[e.id].allocation_id))
            assert (out.inserted_tokens, out.reused_tokens) == (4, 20)
        assert not allocated(ctl, lost).any()
    for e in (a, b):
        assert ctl.heartbeat(e.id).locks == 0 and ctl.heartbeat(e.id).allocations == 0
        hit = ctl.match(e.id, MatchRequest("", prompt, lock=True))
        assert hit.device_tokens == 20
        e.verify(hit.device_pages, prompt, 5)
        ctl.release(e.id, hit.lock_id, None)
    assert used(ctl) == 5 + (2 if keep_lock else 0)
    ctl.check_integrity()


# ------------------------------------------------------------------ handles mid-request


def test_a_lapsed_lease_mid_request_keeps_what_was_committed_and_frees_the_rest(make) -> None:
    ctl = make(storage__backend="none", server__lease_ms=200)
    eng = Engine(ctl)
    prompt = t(8000, 8010)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    eng.write(m.pages, prompt, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   keep_lock=True))
    ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    assert used(ctl) == 5
    deadline = time.monotonic() + 5
    while not ctl.expire_leases():
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.02)
    with pytest.raises(NotFound, match="lease expired"):
        ctl.insert("e1", InsertRequest("", t(8000, 8016), lock_id=m.lock_id,
                                       allocation_id=m.allocation_id))
    assert ctl.tree.active_locks == 0
    assert used(ctl) == 2  # the two committed pages, in the tree
    ctl.check_integrity()
    other = Engine(ctl, "e2")
    hit = ctl.match("e2", MatchRequest("", prompt, lock=True))
    assert hit.device_tokens == 8
    other.verify(hit.device_pages, prompt, 2)
    ctl.release("e2", hit.lock_id, None)


def test_releasing_the_allocation_mid_request_keeps_the_lock_and_the_committed_pages(make) -> None:
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    prompt = t(9000, 9010)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=16))
    eng.write(m.pages, prompt, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   keep_lock=True))
    ctl.release("e1", None, m.allocation_id)
    assert not allocated(ctl, m.pages["full"][2:]).any() and allocated(ctl, m.pages["full"][:2]).all()
    assert ctl.tree.locked_pages(Tier.DEVICE, FULL) == 2
    ctl.check_integrity()
    with pytest.raises(NotFound, match=f"allocation {m.allocation_id}"):
        ctl.release("e1", None, m.allocation_id)
    with pytest.raises(NotFound, match=f"allocation {m.allocation_id}"):
        ctl.insert("e1", InsertRequest("", t(9000, 9012), lock_id=m.lock_id,
                                       allocation_id=m.allocation_id))
    with pytest.raises(InvalidArgument, match="no allocation_id"):
        ctl.insert("e1", InsertRequest("", t(9000, 9012), lock_id=m.lock_id))
    # A new allocation extending the kept lock starts at its (moved) end.
    a2 = ctl.allocate("e1", AllocateRequest("", 4, lock_id=m.lock_id))
    full = t(9000, 9012)
    eng.write(a2.pages, full, 2)
    out = ctl.insert("e1", InsertRequest("", full, lock_id=m.lock_id, allocation_id=a2.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (4, 8)
    assert ctl.heartbeat("e1").locks == 0 and ctl.heartbeat("e1").allocations == 0
    hit = ctl.match("e1", MatchRequest("", full, lock=True))
    eng.verify(hit.device_pages, full, 3)
    ctl.release("e1", hit.lock_id, None)
    ctl.check_integrity()


def test_allocating_against_another_engines_lock_is_not_found(make) -> None:
    ctl = make(storage__backend="none")
    Engine(ctl, "a")
    Engine(ctl, "b")
    m = ctl.match("b", MatchRequest("", seq(2, 9500), lock=True))
    pools = ctl.stats().pools
    with pytest.raises(NotFound, match=f"lock {m.lock_id}"):
        ctl.allocate("a", AllocateRequest("", 4, lock_id=m.lock_id))
    with pytest.raises(NotFound, match=f"lock {m.lock_id}"):
        ctl.insert("a", InsertRequest("", seq(2, 9500), lock_id=m.lock_id))
    assert ctl.stats().pools == pools
    ctl.release("b", m.lock_id, None)


@pytest.mark.parametrize("whose", ["unknown", "other-engine", "other-namespace"])
def test_growth_naming_a_lock_that_is_not_the_callers_is_refused(make, whose: str) -> None:
    ctl = make(storage__backend="none")
    Engine(ctl, "a")
    Engine(ctl, "b")
    m = ctl.match("a", MatchRequest("", seq(2, 9600), lock=True, allocate_tokens=8))
    lock = {
        "unknown": 987_654_321,
        "other-engine": ctl.match("b", MatchRequest("", seq(1, 9700), lock=True)).lock_id,
        "other-namespace": ctl.match("a", MatchRequest("x", seq(1, 9700), lock=True)).lock_id,
    }[whose]
    pools = ctl.stats().pools
    try:
        with pytest.raises((NotFound, InvalidArgument), match=f"lock {lock}"):
            ctl.allocate("a", AllocateRequest("", 4, lock_id=lock, allocation_id=m.allocation_id))
        assert ctl.stats().pools == pools
    finally:
        for engine in ("a", "b"):
            for lock_id in list(ctl._engines.engine(engine).locks):
                ctl.release(engine, lock_id, None)
        ctl.release("a", None, m.allocation_id)


# ------------------------------------------------------------------ sessions


@pytest.mark.parametrize("final_session", ["", "other"])
def test_the_final_inserts_session_references_the_path_a_keep_lock_insert_none(
        make, final_session: str) -> None:
    """The match names session "s"; a keep_lock Insert references nothing (the request
    goes on); the final Insert references its end under its own session_id, or the
    match's when it names none."""
    ctl = make(storage__backend="none")
    eng = Engine(ctl)
    prompt, full = seq(2, 10_000), seq(3, 10_000)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12, session_id="s"))
    eng.write(m.pages, full, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   keep_lock=True, session_id="mid"))
    with pytest.raises(NotFound, match="'mid' is not open"):
        ctl.close_session("mid")
    ctl.insert("e1", InsertRequest("", full, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   session_id=final_session))
    if final_session:
        assert ctl.close_session(final_session) == 3
        assert ctl.close_session("s") == 0  # opened by the match, never referenced
    else:
        assert ctl.close_session("s") == 3
    ctl.check_integrity()


# ------------------------------------------------------------------ MAMBA


def test_two_requests_checkpointing_one_boundary_with_keep_lock_keep_their_own_slots(make) -> None:
    """Both keep_lock-insert the same prompt with mamba_checkpoint: the tree keeps one
    copy (the first's), the second's copy is freed, and both go on writing their own slots
    without touching the stored checkpoint; the final Inserts hand their slots over."""
    ctl = make(hybrid=True, storage__backend="none")
    a, b = Engine(ctl, "a"), Engine(ctl, "b")
    prompt = seq(3, 11_000)
    ms = {e.id: ctl.match(e.id, MatchRequest("", prompt, lock=True, allocate_tokens=16)) for e in (a, b)}
    slots = {e.id: int(ms[e.id].pages["mamba"][0]) for e in (a, b)}
    assert used(ctl, MAMBA) == 2
    for e in (a, b):
        e.write(ms[e.id].pages, prompt, 0)
    for e in (a, b):
        ctl.insert(e.id, InsertRequest("", prompt, lock_id=ms[e.id].lock_id,
                                       allocation_id=ms[e.id].allocation_id, keep_lock=True,
                                       mamba_checkpoint=True))
    assert used(ctl, MAMBA) == 3  # the two requests' slots and the tree's copy
    stored = ctl.match("a", MatchRequest("", prompt)).device_pages["mamba"]
    assert int(stored[0]) not in slots.values()
    ctl.check_integrity()
    fulls = {}
    for i, e in enumerate((a, b)):
        full = prompt + seq(1, 12_000 + 100 * i)
        g = ctl.allocate(e.id, AllocateRequest("", 4, allocation_id=ms[e.id].allocation_id))
        assert int(g.pages["mamba"][0]) == slots[e.id]
        e.write(g.pages, full, 3)  # the decoded page and the state after it, in its slot
        fulls[e.id] = full
    hit = ctl.match("a", MatchRequest("", prompt, lock=True))  # the checkpoint is intact
    assert hit.device_tokens == 12
    a.verify(hit.device_pages, prompt, 3)
    ctl.release("a", hit.lock_id, None)
    for e in (a, b):
        out = ctl.insert(e.id, InsertRequest("", fulls[e.id], lock_id=ms[e.id].lock_id,
                                             allocation_id=ms[e.id].allocation_id,
                                             mamba_checkpoint=True))
        assert (out.inserted_tokens, out.reused_tokens) == (4, 12)
    assert used(ctl, MAMBA) == 3  # three boundaries, one checkpoint each
    for e in (a, b):
        for tokens, n in ((fulls[e.id], 4), (prompt, 3)):
            hit = ctl.match(e.id, MatchRequest("", tokens, lock=True))
            assert hit.device_tokens == n * PS
            e.verify(hit.device_pages, tokens, n)
            ctl.release(e.id, hit.lock_id, None)
    ctl.check_integrity()


def test_a_final_insert_without_new_pages_keeps_the_checkpoint_already_stored(make) -> None:
    """The final Insert adds no whole page after a keep_lock one: the boundary has its
    checkpoint already, so the request's slot is freed, not stored over it."""
    ctl = make(hybrid=True, storage__backend="none")
    eng = Engine(ctl)
    prompt = seq(2, 13_000)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    eng.write(m.pages, prompt, 0)
    ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   keep_lock=True, mamba_checkpoint=True))
    slot = int(m.pages["mamba"][0])
    ctl.device.layer("mamba", 0).numpy()[slot] = 7  # the engine decodes on in its slot
    out = ctl.insert("e1", InsertRequest("", prompt + toks([1, 2]), lock_id=m.lock_id,
                                         allocation_id=m.allocation_id, mamba_checkpoint=True))
    assert (out.inserted_tokens, out.reused_tokens) == (0, 8)
    assert not allocated(ctl, [slot], MAMBA).any()
    assert used(ctl, MAMBA) == 1
    hit = ctl.match("e1", MatchRequest("", prompt, lock=True))
    eng.verify(hit.device_pages, prompt, 2)
    ctl.release("e1", hit.lock_id, None)
    ctl.check_integrity()


# ------------------------------------------------------------------ through the daemon


@pytest.fixture(scope="module")
def hd(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("rl"), *FULL_SWA_MAMBA, "tiers.l1.tokens=256").start()
    yield d
    d.close()


def _l1_used(c) -> dict[str, int]:
    return {p.member: p.used_pages for p in c.stats().pools if p.tier == "device"}


def test_two_engines_living_one_request_each_through_the_daemon_stay_byte_exact(hd: Daemon) -> None:
    """Over gRPC with a hybrid model: two engines prefill one prompt at once, keep_lock
    Insert it with a checkpoint, decode (one page each, their own), and Insert at the end.
    A third engine reads every committed page and checkpoint byte for byte; nothing is left
    held and L1 holds exactly the committed pages."""
    prompt = toks(np.arange(20_000, 20_012))  # 3 pages
    with hd.client(engine_id="reader") as r:
        ra = r.attach()
        base = _l1_used(r)
        errors: list[BaseException] = []
        fulls: dict[str, bytes] = {}

        def life(name: str, i: int, barrier: threading.Barrier) -> None:
            try:
                with hd.client(engine_id=name) as c:
                    att = c.attach()
                    oracle = KvOracle(att.info, att.pools)
                    m = c.match(prompt, lock=True, allocate_tokens=14, request_id=f"{name}-1")
                    assert len(m.pages["full"]) == 4
                    oracle.write(prompt, m.pages, 0)
                    barrier.wait(10)
                    out = c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   keep_lock=True, mamba_checkpoint=True, request_id=f"{name}-1")
                    assert out.inserted_tokens + out.reused_tokens == 12
                    full = prompt + toks(np.arange(21_000 + 100 * i, 21_004 + 100 * i))
                    g = c.allocate(4, allocation_id=m.allocation_id)
                    oracle.write(full, {k: (v if k in ("mamba", "conv") else v[:1])
                                        for k, v in g.pages.items()}, 3)
                    out = c.insert(full, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                   mamba_checkpoint=True, request_id=f"{name}-1")
                    assert (out.inserted_tokens, out.reused_tokens) == (4, 12)
                    hb = c.heartbeat()
                    assert (hb.locks, hb.allocations) == (0, 0)
                    fulls[name] = full
            except BaseException as e:
                errors.append(e)

        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=life, args=(n, i, barrier)) for i, n in enumerate(("ea", "eb"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        oracle = KvOracle(ra.info, ra.pools)
        for tokens, n in ((prompt, 3), (fulls["ea"], 4), (fulls["eb"], 4)):
            with r.matched(tokens) as hit:
                assert hit.device_tokens == n * PS
                oracle.verify(tokens, hit.device_pages, n)
        assert oracle.wrong_bytes == 0 and oracle.pages_checked > 0
        grew = {k: v - base[k] for k, v in _l1_used(r).items()}
        # 3 shared pages + 1 per engine; 3 checkpoints (the prompt's, each end's).
        for member in ("full", "idx", "swa", "swaside"):
            assert grew[member] == 5, grew
        assert grew["mamba"] == grew["conv"] == 3, grew


def test_the_oracle_accepts_a_correct_reuse_of_an_swa_sidecar(hd: Daemon) -> None:
    prompt = toks(np.arange(30_000, 30_012))  # 3 pages: the first leaves the 2-page window
    with hd.client(engine_id="oracle") as c:
        att = c.attach()
        side = next(m for m in att.info.members if m.component is ComponentKind.SWA and m.name != "swa")
        oracle = KvOracle(att.info, att.pools)
        m = c.match(prompt, lock=True, allocate_tokens=12)
        oracle.write(prompt, m.pages, 0)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
        with c.matched(prompt) as hit:
            assert hit.device_tokens == 12
            assert int(hit.device_pages[side.name][0]) == -1  # out of the window, like its anchor
            oracle.verify(prompt, hit.device_pages, 3)
        assert (oracle.wrong_bytes, oracle.pages_missing) == (0, 0)
