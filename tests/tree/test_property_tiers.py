"""Property test across tiers: random insert (into L1 or L2, with arbitrary SWA gap masks,
so SWA slots may be tails), match, evict (with write-back), unlock, close-session, copies
between L1 and L2 (`set_resident`) and L3 recording, against a page-level oracle of which
page id holds each prefix in each tier. Checks the boundaries per tier, that the storage
boundary is never unsafe, that released and dropped ids are exactly the caller's to free,
that nothing locked is evicted, `check_integrity()` and the per-tier counters after every
step. (`test_property.py` covers L1 alone, with sessions, at twice the examples.)"""
from __future__ import annotations

import itertools

import numpy as np
from fuzzing import fuzz_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.tree import HiRadixTree
from hicache.types import Tier

from .test_property import (
    DEV,
    FULL,
    HOST,
    MAMBA,
    SWA,
    WINDOW,
    Oracle,
    P,
    apply_shared_op,
    check_match,
    check_step,
    token_bytes,
)

pages_st = st.lists(st.sampled_from([(0, 0), (0, 0), (0, 0), (1, 0), (0, 1)]), min_size=1, max_size=7)
op_st = st.one_of(
    st.tuples(st.just("insert"), pages_st, st.lists(st.booleans(), max_size=7), st.booleans(),
              st.booleans(), st.sampled_from([DEV, DEV, HOST])),
    st.tuples(st.just("match"), pages_st, st.booleans(), st.sampled_from([None, "s1", "s2"])),
    st.tuples(st.just("evict"), st.sampled_from([DEV, HOST]), st.sampled_from([FULL, SWA, MAMBA]),
              st.integers(1, 4), st.booleans()),
    st.tuples(st.just("unlock"), st.integers(0, 5)),
    st.tuples(st.just("close"), st.sampled_from(["s1", "s2"])),
    st.tuples(st.just("copy"), st.integers(0, 20), st.sampled_from([DEV, HOST])),
    st.tuples(st.just("l3"), st.integers(0, 20)),
)


def run_sequence(kinds, ops):
    tree = HiRadixTree(P, {k: (WINDOW * P if k is SWA else 0) for k in kinds})
    oracle = Oracle(kinds)
    ids = itertools.count(1)
    locks: list = []

    def node_prefixes(node):
        for t in (DEV, HOST):
            full = tree.pages_of(node, FULL, t)
            if full is not None:
                return [oracle.owner[(FULL, t, int(p))] for p in full]
        raise AssertionError("node without FULL")

    def nodes():
        return sorted(tree.iter_nodes(), key=lambda n: (tree.depth_tokens(n), n.key))

    for op in ops:
        if op[0] == "insert":
            _, spec, gaps, checkpoint, with_lock, tier = op
            pages = tuple(spec)
            lock = None
            start = 0
            if with_lock:
                m = tree.match("", token_bytes(pages), lock=True)
                lock = m.lock
                if tier is DEV:
                    start = m.device_tokens // P
                else:
                    start = (m.device_tokens + m.host_tokens) // P
            n = len(pages) - start
            given = {FULL: np.array([next(ids) for _ in range(n)], dtype=np.int64)}
            if SWA in kinds:
                swa = np.array([next(ids) for _ in range(n)], dtype=np.int64)
                for i, g in enumerate(gaps[:n]):
                    if g:
                        swa[i] = -1
                given[SWA] = swa
            slot = next(ids) if (checkpoint and MAMBA in kinds) else None
            before = oracle.stored(pages)
            r = tree.insert("", token_bytes(pages), given, lock=lock, mamba_slot=slot, tier=tier)
            assert r.reused_tokens == max(before, start) * P
            for kind, arr in given.items():
                rel = r.released[kind].tolist()
                assert len(set(rel)) == len(rel), ("released twice", rel)
                assert all(x >= 0 for x in rel), ("released -1", rel)
                released = set(rel)
                assert released <= set(arr.tolist()), ("released foreign ids", released, arr)
                for i, pid in enumerate(arr.tolist()):
                    if pid >= 0 and pid not in released:
                        oracle.set(pages[: start + i + 1], kind, tier, pid)
            if slot is not None and slot not in set(r.released[MAMBA].tolist()):
                oracle.set(pages, MAMBA, tier, slot)
            for kind, arr in r.dropped.items():
                other = HOST if tier == DEV else DEV
                for pid in arr.tolist():
                    oracle.free(kind, other, pid)
            if lock is not None:
                oracle.locked = [lk for lk in oracle.locked if lk[3] is not lock]
        elif op[0] == "match":
            _, spec, lock, session = op
            pages = tuple(spec)
            m = tree.match("", token_bytes(pages), lock=lock, session_id=session)
            b0, b1 = check_match(m, oracle, pages)
            b2 = oracle.boundary(pages, (DEV, HOST), l3=True)
            got2 = (m.device_tokens + m.host_tokens + m.storage_tokens) // P
            assert got2 <= b2, ("storage boundary unsafe", got2, b2)
            if m.lock is not None:
                locks.append(m.lock)
                oracle.locked.append((b0, b1, pages, m.lock))
        elif op[0] == "copy":
            # Like the controller: copy a node's family slots that dst lacks from src.
            all_nodes = nodes()
            if all_nodes:
                node = all_nodes[op[1] % len(all_nodes)]
                dst = op[2]
                src = HOST if dst is DEV else DEV
                parent = tree.parent_of(node)
                ok_parent = dst is HOST or parent is None or tree.is_resident(parent, FULL, DEV)
                if ok_parent:
                    for k in kinds:
                        arr = tree.pages_of(node, k, src)
                        if arr is None or tree.is_resident(node, k, dst):
                            continue
                        if k is not FULL and not tree.is_resident(node, FULL, dst):
                            continue
                        new = np.array([next(ids) for _ in arr], dtype=np.int64)
                        tree.set_resident(node, k, dst, new)
                        for a, b in zip(arr.tolist(), new.tolist(), strict=True):
                            oracle.set(oracle.owner[(k, src, a)], k, dst, b)
        elif op[0] == "l3":
            all_nodes = nodes()
            if all_nodes:
                node = all_nodes[op[1] % len(all_nodes)]
                node_prefixes(node)  # (raises unless the oracle knows every FULL page id)
                for k in kinds:
                    arr = tree.pages_of(node, k, HOST)
                    if arr is None:
                        continue
                    for pid in arr.tolist():
                        oracle.l3.add((oracle.owner[(k, HOST, pid)], k))
                    if not tree.is_resident(node, k, Tier.STORAGE):
                        tree.set_resident(node, k, Tier.STORAGE)
        else:
            apply_shared_op(tree, oracle, ids, locks, op)
        check_step(tree, oracle)


SETTINGS = settings(fuzz_settings(400), print_blob=True)


@SETTINGS
@given(st.lists(op_st, min_size=1, max_size=40))
def test_full_swa_mamba_across_tiers(ops: list) -> None:
    run_sequence((FULL, SWA, MAMBA), ops)


@SETTINGS
@given(st.lists(op_st, min_size=1, max_size=40))
def test_full_swa_across_tiers(ops: list) -> None:
    run_sequence((FULL, SWA), ops)
