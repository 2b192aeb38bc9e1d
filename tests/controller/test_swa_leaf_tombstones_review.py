"""Review of today's SWA change (ebf95c8): a leaf longer than the SWA window is an SWA
eviction candidate (`SwaComponent.candidate_test`), offered at insert (`_leaf_windows`),
so its SWA pages before the trailing window can be tombstoned alone (the leaf is split at
the retention boundary). Tree level (edge cases of the window, PARTIAL tails, both paged
tiers, locks, sessions, a seeded mixed-op fuzz with an ownership oracle and
`check_integrity` after every op) and controller level (Engine-verified bytes, pool
accounting, L2 copies under write-through and write-back, L3 round trips)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from engine_sim import Engine, evict_all, seq, wait_prefetch
from tree_kit import freed, ids, toks, tree_of

from hicache.controller.base import MatchRequest, PrefetchState
from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
DEV, HOST = Tier.DEVICE, Tier.HOST


def copy_to_host(tree: HiRadixTree, node, base: int) -> None:
    """Every slot of `node` that L1 holds goes to L2 (FULL first), ids `base + L1 id`."""
    for kind in tree.kinds:
        pages = tree.pages_of(node, kind, DEV)
        if pages is not None and kind is not MAMBA and not tree.is_resident(node, kind, HOST):
            tree.set_resident(node, kind, HOST, pages + base)


# ----------------------------------------------------------------------------- tree: edges


def test_a_leaf_of_exactly_the_window_is_no_swa_candidate() -> None:
    tree = tree_of(4, swa_window=8)  # 2 pages
    tree.insert("", toks(0, 8), {FULL: ids(1, 2), SWA: ids(11, 12)})
    assert freed(tree, DEV, SWA, 10) == []
    m = tree.match("", toks(0, 8))
    assert m.device_tokens == 8 and m.device_pages[SWA].tolist() == [11, 12]


def test_a_leaf_of_window_plus_one_drops_exactly_its_first_page() -> None:
    tree = tree_of(4, swa_window=8)
    tree.insert("", toks(0, 12), {FULL: ids(1, 2, 3), SWA: ids(11, 12, 13)})
    assert freed(tree, DEV, SWA, 10) == [11]
    m = tree.match("", toks(0, 12))
    assert m.device_tokens == 12
    assert m.device_pages[FULL].tolist() == [1, 2, 3]
    assert m.device_pages[SWA].tolist() == [-1, 12, 13]
    assert tree.resident_pages(DEV, SWA) == 2 and tree.resident_pages(DEV, FULL) == 3
    # a boundary inside the tombstoned head is no longer valid from L1 ...
    assert tree.match("", toks(0, 4)).device_tokens == 0
    # ... but the head's FULL pages are: a prefix ending there is recomputed and re-adopted
    r = tree.insert("", toks(0, 4) + toks(900, 4), {FULL: ids(91, 21), SWA: ids(31, 32)})
    tree.check_integrity()
    assert r.released[FULL].tolist() == [91] and r.released[SWA].tolist() == []
    m = tree.match("", toks(0, 4) + toks(900, 4))
    assert m.device_tokens == 8 and m.device_pages[FULL].tolist() == [1, 21]
    assert m.device_pages[SWA].tolist() == [31, 32]


def test_a_window_not_a_page_multiple_rounds_up_at_tree_level() -> None:
    """window 6 tokens, pages of 4: 2 pages are kept (the config refuses such a window;
    the tree rounds up, never down)."""
    tree = tree_of(4, swa_window=6)
    tree.insert("", toks(0, 20), {FULL: ids(1, 2, 3, 4, 5), SWA: ids(11, 12, 13, 14, 15)})
    assert freed(tree, DEV, SWA, 10) == [11, 12, 13]
    assert tree.match("", toks(0, 20)).device_tokens == 20


def test_a_partial_tail_longer_than_the_window_keeps_only_the_window() -> None:
    tree = tree_of(4, swa_window=8)
    tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(-1, -1, 13, 14, 15, 16)})
    assert freed(tree, DEV, SWA, 10) == [13, 14]
    m = tree.match("", toks(0, 24))
    assert m.device_tokens == 24
    assert m.device_pages[SWA].tolist() == [-1, -1, -1, -1, 15, 16]


def test_a_partial_tail_of_the_window_or_less_is_never_cut() -> None:
    tree = tree_of(4, swa_window=8)
    tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(-1, -1, -1, -1, 15, 16)})
    tree.insert("", toks(100, 24), {FULL: ids(*range(21, 27)), SWA: ids(-1, -1, -1, -1, -1, 36)})
    assert freed(tree, DEV, SWA, 10) == []
    assert tree.match("", toks(0, 24)).device_tokens == 24
    assert tree.match("", toks(100, 24)).device_tokens == 0  # 1 page < window: never valid


def test_l2_tombstones_a_long_leaf_on_its_own_and_l1_keeps_its_copy() -> None:
    tree = tree_of(4, swa_window=8)
    r = tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))})
    copy_to_host(tree, r.end, 100)
    tree.check_integrity()
    assert freed(tree, HOST, SWA, 10) == [111, 112, 113, 114]
    assert tree.resident_pages(DEV, SWA) == 6  # L1's copy is a separate slot
    assert freed(tree, DEV, SWA, 10) == [11, 12, 13, 14]
    assert freed(tree, DEV, FULL, 10) == list(range(1, 7))
    m = tree.match("", toks(0, 24))
    assert (m.device_tokens, m.host_tokens) == (0, 24)


def test_l2_partial_tail_copy_is_cut_like_l1() -> None:
    """A PARTIAL slot (3 pages of 6) copied to L2 with the same length: each tier cuts it
    to the window on its own."""
    tree = tree_of(4, swa_window=8)
    r = tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(-1, -1, -1, 14, 15, 16)})
    copy_to_host(tree, r.end, 100)
    tree.check_integrity()
    assert freed(tree, HOST, SWA, 10) == [114]
    assert freed(tree, DEV, SWA, 10) == [14]
    assert freed(tree, DEV, FULL, 10) == list(range(1, 7))
    m = tree.match("", toks(0, 24))
    assert (m.device_tokens, m.host_tokens) == (0, 24)


@pytest.mark.parametrize("mamba", [False, True])
def test_a_locked_long_leaf_is_never_tombstoned(mamba: bool) -> None:
    tree = tree_of(4, swa_window=8, mamba=mamba)
    kw = {"mamba_slot": 40} if mamba else {}
    tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))}, **kw)
    held = tree.match("", toks(0, 24) + toks(500, 4), lock=True).lock
    assert held is not None and held.end is not None
    assert freed(tree, DEV, SWA, 10) == []
    assert tree.locked_pages(DEV, SWA) == 6
    # the request extends the leaf: the lock moves below, the leaf gets a child
    tree.insert("", toks(0, 24) + toks(500, 4), {FULL: ids(7), SWA: ids(17)}, lock=held,
                **({"mamba_slot": 41} if mamba else {}))
    tree.check_integrity()
    assert freed(tree, DEV, SWA, 10) == [11, 12, 13, 14, 15]  # only the new leaf's window stays
    m = tree.match("", toks(0, 24) + toks(500, 4))
    assert m.device_tokens == 28
    assert m.device_pages[SWA].tolist() == [-1] * 5 + [16, 17]


def test_a_lock_on_a_prefix_of_a_long_leaf_keeps_that_prefix_window() -> None:
    """A match ending inside the long leaf splits it; its lock covers the head (whose SWA
    window is then needed) but not the tail: the tail's pages before its window may go."""
    tree = tree_of(4, swa_window=8)
    tree.insert("", toks(0, 32), {FULL: ids(*range(1, 9)), SWA: ids(*range(11, 19))})
    held = tree.match("", toks(0, 12) + toks(700, 4), lock=True).lock  # boundary: 3 pages
    assert freed(tree, DEV, SWA, 10) == [14, 15, 16]  # tail's pages before its window
    assert tree.match("", toks(0, 12)).device_tokens == 12  # locked head window intact
    tree.unlock(held)
    tree.check_integrity()
    assert freed(tree, DEV, SWA, 10) == [11, 12, 13]  # head: a child 5 pages long continues it
    assert tree.match("", toks(0, 32)).device_tokens == 32
    assert tree.match("", toks(0, 12)).device_tokens == 0


def test_a_session_on_a_long_leaf_references_its_window_not_what_lies_before() -> None:
    """DESIGN §1: a session references SWA's trailing window only. The pages of its long
    leaf before the window are no use to it: they go by LRU like anyone's (here first,
    being the colder), and its window stays."""
    tree = tree_of(4, swa_window=8)
    m = tree.match("", toks(0, 24), lock=True, session_id="s")
    tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))}, lock=m.lock)
    tree.insert("", toks(100, 24), {FULL: ids(*range(21, 27)), SWA: ids(*range(31, 37))})
    tree.match("", toks(100, 24))  # unreferenced one hotter
    assert freed(tree, DEV, SWA, 1) == [11, 12, 13, 14]  # colder, and out of the window
    assert freed(tree, DEV, SWA, 1) == [31, 32, 33, 34]
    assert tree.match("", toks(0, 24)).device_tokens == 24
    tree.close_session("s")
    tree.check_integrity()


def test_a_tombstoned_long_leaf_extended_by_a_longer_prompt() -> None:
    tree = tree_of(4, swa_window=8, mamba=True)
    tree.insert("", toks(0, 24), {FULL: ids(*range(1, 7)), SWA: ids(*range(11, 17))}, mamba_slot=40)
    assert freed(tree, DEV, SWA, 10) == [11, 12, 13, 14]
    m = tree.match("", toks(0, 24) + toks(500, 8), lock=True)
    assert m.device_tokens == 24 and m.device_pages[MAMBA].tolist() == [40]
    tree.insert("", toks(0, 24) + toks(500, 8), {FULL: ids(7, 8), SWA: ids(17, 18)},
                lock=m.lock, mamba_slot=41)
    tree.check_integrity()
    # the old window (15, 16) is now covered by the new leaf's own window
    assert freed(tree, DEV, SWA, 10) == [15, 16]
    m = tree.match("", toks(0, 24) + toks(500, 8))
    assert m.device_tokens == 32 and m.device_pages[SWA].tolist() == [-1] * 6 + [17, 18]
    assert tree.match("", toks(0, 24)).device_tokens == 0  # its window went (checkpoint alone)


# ----------------------------------------------------------------------------- tree: fuzz


class Owners:
    """Which prefix (token bytes) each page id of (kind, tier) holds: learned only from
    what the tree reports (kept at insert, freed by evict, copied by set_resident)."""

    def __init__(self) -> None:
        self.of: dict[tuple[ComponentKind, Tier, int], bytes] = {}

    def add(self, kind: ComponentKind, tier: Tier, pid: int, prefix: bytes) -> None:
        key = (kind, tier, pid)
        assert key not in self.of, f"{key} owned twice"
        self.of[key] = prefix

    def free(self, kind: ComponentKind, tier: Tier, pid: int) -> bytes:
        key = (kind, tier, pid)
        assert key in self.of, f"{key} freed but not owned"
        return self.of.pop(key)

    def count(self, kind: ComponentKind, tier: Tier) -> int:
        return sum(1 for k in self.of if k[0] is kind and k[1] is tier)


def _fuzz(seed: int, window_tokens: int, mamba: bool, steps: int = 400) -> None:
    ps = 2
    rnd = random.Random(seed)
    tree = HiRadixTree(ps, {FULL: 0, SWA: window_tokens, **({MAMBA: 0} if mamba else {})})
    window = -(-window_tokens // ps)
    pb = ps * 4
    owners = Owners()
    counter = iter(range(1, 10**9))
    locks: list = []  # (lock, {(kind, pid)} it protects)
    alphabet = [toks(0, ps), toks(0, ps), toks(0, ps), toks(10, ps), toks(20, ps)]

    def prompt() -> bytes:
        return b"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 10)))

    def check_match(tokens: bytes, m) -> None:
        n = m.device_tokens // ps
        full = m.device_pages[FULL].tolist()
        assert len(full) == n
        for i, pid in enumerate(full):
            assert owners.of.get((FULL, DEV, pid)) == tokens[: (i + 1) * pb], ("full", i)
        swa = m.device_pages[SWA].tolist()
        assert len(swa) == n
        for i, pid in enumerate(swa):
            if i >= n - window:  # the whole window before the boundary, exact
                assert pid >= 0, ("swa window hole", i, swa)
                assert owners.of.get((SWA, DEV, pid)) == tokens[: (i + 1) * pb], ("swa", i)
            else:
                assert pid == -1
        if mamba and n:
            (slot,) = m.device_pages[MAMBA].tolist()
            assert owners.of.get((MAMBA, DEV, slot)) == tokens[: n * pb]

    def protected(m) -> set:
        out: set = set()
        for kind in (FULL, SWA):
            out |= {(kind, int(p)) for p in m.device_pages[kind].tolist() if p >= 0}
        return out

    for _ in range(steps):
        op = rnd.random()
        if op < 0.35:  # insert (maybe after a locked match, maybe with SWA gaps, L1 or L2)
            tokens = prompt()
            tier = HOST if rnd.random() < 0.15 else DEV
            lock, start = None, 0
            if rnd.random() < 0.5:
                m = tree.match("", tokens, lock=True)
                check_match(tokens, m)
                lock = m.lock
                start = (m.device_tokens if tier is DEV else m.device_tokens + m.host_tokens) // ps
            n = len(tokens) // pb - start
            full = np.array([next(counter) for _ in range(n)], dtype=np.int64)
            swa = np.array([next(counter) for _ in range(n)], dtype=np.int64)
            gap = rnd.choice([0, 0, 0, rnd.randint(0, n)])
            swa[:gap] = -1
            slot = next(counter) if mamba and rnd.random() < 0.7 else None
            r = tree.insert("", tokens, {FULL: full, SWA: swa}, lock=lock, mamba_slot=slot, tier=tier)
            for kind, arr in ((FULL, full), (SWA, swa)):
                released = set(r.released[kind].tolist())
                for i, pid in enumerate(arr.tolist()):
                    if pid >= 0 and pid not in released:
                        owners.add(kind, tier, pid, tokens[: (start + i + 1) * pb])
            if slot is not None and slot not in set(r.released[MAMBA].tolist()):
                owners.add(MAMBA, tier, slot, tokens)
            other = HOST if tier is DEV else DEV
            for kind, arr in r.dropped.items():
                for pid in arr.tolist():
                    owners.free(kind, other, pid)
            if lock is not None:
                locks[:] = [x for x in locks if x[0] is not lock]
        elif op < 0.55:  # match (maybe locked, maybe with a session)
            tokens = prompt()
            m = tree.match("", tokens, lock=rnd.random() < 0.4,
                           session_id=rnd.choice([None, None, "s1", "s2"]))
            check_match(tokens, m)
            if m.lock is not None:
                locks.append((m.lock, protected(m)))
        elif op < 0.8:  # evict
            tier = rnd.choice([DEV, DEV, HOST])
            kind = rnd.choice([SWA, SWA, FULL] + ([MAMBA] if mamba else []))
            r = tree.evict(tier, kind, rnd.randint(1, 6))
            for k, arr in r.freed.items():
                for pid in arr.tolist():
                    owners.free(k, tier, pid)
                    if tier is DEV and k is not MAMBA:
                        for _, prot in locks:
                            assert (k, pid) not in prot, ("locked page evicted", k, pid)
        elif op < 0.9:  # copy a node's slots L1 -> L2 (write-through) or L2 -> L1 (a load)
            nodes = sorted(tree.iter_nodes(), key=lambda x: (tree.depth_tokens(x), x.key))
            if nodes:
                node = rnd.choice(nodes)
                dst = rnd.choice([DEV, HOST])
                src = HOST if dst is DEV else DEV
                parent = tree.parent_of(node)
                if dst is HOST or parent is None or tree.is_resident(parent, FULL, DEV):
                    for kind in tree.kinds:
                        arr = tree.pages_of(node, kind, src)
                        if arr is None or tree.is_resident(node, kind, dst):
                            continue
                        if kind is not FULL and not tree.is_resident(node, FULL, dst):
                            continue
                        new = np.array([next(counter) for _ in arr], dtype=np.int64)
                        tree.set_resident(node, kind, dst, new)
                        for a, b in zip(arr.tolist(), new.tolist(), strict=True):
                            owners.add(kind, dst, b, owners.of[(kind, src, a)])
        elif op < 0.96:
            if locks:
                lock, _ = locks.pop(rnd.randrange(len(locks)))
                if lock.active:
                    tree.unlock(lock)
        else:
            try:
                tree.close_session(rnd.choice(["s1", "s2"]))
            except Exception as e:
                assert type(e).__name__ == "NotFound"
        tree.check_integrity()
        for tier in (DEV, HOST):
            for kind in tree.kinds:
                assert tree.resident_pages(tier, kind) == owners.count(kind, tier), (tier, kind)
    for lock, _ in locks:
        if lock.active:
            tree.unlock(lock)
    tree.check_integrity()
    # with nothing locked, each tier's SWA keeps at most a window per node
    for tier in (DEV, HOST):
        tree.evict(tier, SWA, 10**6)
        tree.check_integrity()
        for node in tree.iter_nodes():
            held = tree.pages_of(node, SWA, tier)
            if held is not None:
                assert len(held) <= window, (tier, len(held), window)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("window_tokens", "mamba"), [(4, False), (6, True), (5, False), (2, True)])
def test_seeded_mixed_op_fuzz_keeps_integrity_and_exact_windows(seed: int, window_tokens: int,
                                                                mamba: bool) -> None:
    _fuzz(seed * 7919 + window_tokens, window_tokens, mamba)


# ----------------------------------------------------------------------------- controller


def _free(ctl, tier: Tier, kind: ComponentKind) -> int:
    pools = ctl.device if tier is Tier.DEVICE else ctl.host
    return pools.allocator(kind).free_count


def _evict_swa(ctl, tier: Tier, n: int) -> None:
    with ctl._mu:
        ctl.transfers._evict(tier, SWA, n)


def _served(eng: Engine, tokens: bytes) -> tuple[int, int]:
    """Match (locked), load what L2 holds, verify, release: (device, total) tokens."""
    ctl = eng.ctl
    m = ctl.match(eng.id, MatchRequest("", tokens, lock=True))
    eng.verify(m.device_pages, tokens, m.device_tokens // eng.ps)
    total = m.device_tokens
    if m.host_tokens:
        *_, last = list(ctl.load(eng.id, m.lock_id))
        eng.verify(last.device_pages, tokens, last.device_tokens // eng.ps)
        total = last.device_tokens
    ctl.release(eng.id, m.lock_id, None)
    return m.device_tokens, total


MODELS = [{"swa_only": True}, {"hybrid": True}, {"swa_only": True, "sidecar": True},
          {"swa_only": True, "model__sidecars": {"swa_idx": {"anchor": "swa", "layers": 1,
                                                             "bytes_per_token_per_layer": 4}}}]
MODEL_IDS = ["swa", "hybrid", "swa+full-sidecar", "swa+swa-sidecar"]


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("l1_to_l2", ["write_through", "write_back"])
def test_l1_tombstone_of_a_long_leaf_frees_exactly_and_serves_exact_bytes(make, model, l1_to_l2) -> None:
    ctl = make(**model, write__l1_to_l2=l1_to_l2, storage__backend="none")
    eng = Engine(ctl)
    t = seq(6)
    eng.request(t)
    assert ctl.transfers.drain(10)
    free0 = _free(ctl, DEV, SWA)
    res0 = ctl.tree.resident_pages(DEV, SWA)
    full0 = ctl.tree.resident_pages(DEV, FULL)
    _evict_swa(ctl, DEV, 4)
    assert _free(ctl, DEV, SWA) - free0 == 4 == res0 - ctl.tree.resident_pages(DEV, SWA)
    assert ctl.tree.resident_pages(DEV, FULL) == full0  # FULL stays
    assert ctl.stats().counters["evictions_device_swa"] == 4
    ctl.check_integrity()
    assert _served(eng, t) == (24, 24)  # the window before the end is all it needs
    eng.request(t + seq(3, 900))  # a longer prompt extends the leaf, verified
    assert _served(eng, t + seq(3, 900)) == (36, 36)
    # a prefix ending in the tombstoned head: not from L1, from L2's copy (write-through
    # made it at insert, write-back as the head's SWA left L1); a hybrid model has no
    # checkpoint there
    assert _served(eng, seq(3)) == ((0, 0) if "hybrid" in model else (0, 12))
    ctl.check_integrity()


@pytest.mark.parametrize("model", MODELS[:2], ids=MODEL_IDS[:2])
@pytest.mark.parametrize("l1_to_l2", ["write_through", "write_back"])
def test_a_tombstoned_long_leaf_round_trips_through_l2_and_l3(make, model, l1_to_l2) -> None:
    ctl = make(**model, write__l1_to_l2=l1_to_l2, write__l2_to_l3="write_through")
    eng = Engine(ctl)
    t = seq(7)
    eng.request(t)
    assert ctl.transfers.drain(10)
    _evict_swa(ctl, DEV, 5)
    ctl.check_integrity()
    evict_all(ctl, DEV)  # (write-back copies it to L2 here)
    ctl.check_integrity()
    assert _served(eng, t) == (0, 28)  # loaded from L2, verified
    evict_all(ctl, DEV)
    _evict_swa(ctl, HOST, 5)  # L2's copy is tombstoned too
    ctl.check_integrity()
    assert _served(eng, t) == (0, 28)
    ctl.flush(10)
    evict_all(ctl, DEV, HOST)
    m = ctl.match(eng.id, MatchRequest("", t, lock=True, prefetch=True))
    assert m.storage_tokens == 28 and m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release(eng.id, m.lock_id, None)
    assert _served(eng, t)[1] == 28
    eng.request(t + seq(2, 900))
    assert _served(eng, t + seq(2, 900))[1] == 36
    ctl.check_integrity()


def test_a_locked_long_leaf_keeps_its_swa_pages_in_the_controller(make) -> None:
    ctl = make(swa_only=True, storage__backend="none")
    eng = Engine(ctl)
    t = seq(6)
    eng.request(t)
    assert ctl.transfers.drain(10)
    m = ctl.match(eng.id, MatchRequest("", t + seq(1, 900), lock=True))
    assert m.device_tokens == 24
    free0 = _free(ctl, DEV, SWA)
    _evict_swa(ctl, DEV, 4)
    assert _free(ctl, DEV, SWA) == free0  # nothing else to take: the locked leaf stays
    eng.verify(m.device_pages, t + seq(1, 900), 6)
    ctl.release(eng.id, m.lock_id, None)
    _evict_swa(ctl, DEV, 4)
    assert _free(ctl, DEV, SWA) == free0 + 4
    assert _served(eng, t) == (24, 24)


@pytest.mark.parametrize("model", MODELS[:2], ids=MODEL_IDS[:2])
@pytest.mark.parametrize("l1_to_l2", ["write_through", "write_back"])
def test_requests_under_l1_pressure_with_long_leaves_serve_exact_bytes(make, model, l1_to_l2) -> None:
    """A small L1 (24 pages a pool) and prompts of 3-9 pages sharing prefixes: allocations
    evict whole leaves, and after each request SWA tombstones (long leaves' out-of-window
    pages) are taken too; every reuse verified byte for byte, pages owned exactly once
    after every step."""
    ctl = make(**model, l1_tokens=24 * 4, write__l1_to_l2=l1_to_l2, storage__backend="none")
    eng = Engine(ctl)
    rnd = random.Random(11)
    stems = [seq(rnd.randint(2, 5), 1000 * i) for i in range(3)]
    for _ in range(40):
        tokens = rnd.choice(stems) + seq(rnd.randint(1, 4), 100 * rnd.randint(1, 4))
        eng.request(tokens)
        assert ctl.transfers.drain(10)
        ctl.check_integrity()
        # (SWA pages freed by this request's own tombstones, if any: pools equal in size,
        # so FULL is short first and leaves take their SWA slot along)
        _evict_swa(ctl, DEV, 2)
        ctl.check_integrity()
    assert ctl.stats().counters["evictions_device"] > 0
    assert ctl.stats().counters.get("evictions_device_swa", 0) > 0 and eng.checked > 0
