"""Random operation sequences against a brute-force oracle.

The oracle is a plain map from each stored prefix (a tuple of pages) to its residency per
component and tier (page ids). It learns only what the tree reports to the engine
(pages taken or handed back by insert, pages freed or backed up by eviction) and computes
every boundary itself, page by page, from the component rules. After every step the test
compares match results and counters with the oracle and runs `check_integrity()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
from fuzzing import fuzz_examples, fuzz_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
P = 2  # tokens per page
WINDOW = 2  # SWA window in pages
DEV, HOST = Tier.DEVICE, Tier.HOST

# A small page alphabet, weighted to one page, so sequences share prefixes and diverge often.
pages_st = st.lists(st.sampled_from([(0, 0), (0, 0), (0, 0), (1, 0), (0, 1)]), min_size=1, max_size=6)
op_st = st.one_of(
    st.tuples(st.just("insert"), pages_st, st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("match"), pages_st, st.booleans(), st.sampled_from([None, "s1", "s2"])),
    st.tuples(st.just("evict"), st.sampled_from([DEV, HOST]), st.sampled_from([FULL, SWA, MAMBA]),
              st.integers(1, 4), st.booleans()),
    st.tuples(st.just("unlock"), st.integers(0, 5)),
    st.tuples(st.just("close"), st.sampled_from(["s1", "s2"])),
)


class Oracle:
    def __init__(self, kinds: tuple[ComponentKind, ...]) -> None:
        self.kinds = kinds
        # prefix -> {(kind, tier): page id}
        self.res: dict[tuple, dict[tuple[ComponentKind, Tier], int]] = {}
        self.owner: dict[tuple[ComponentKind, Tier, int], tuple] = {}
        self.locked: list[tuple] = []  # (device boundary, host boundary, pages, lock)
        self.l3: set[tuple] = set()  # (prefix, kind) written to L3 (test_property_tiers)

    def set(self, prefix: tuple, kind: ComponentKind, tier: Tier, pid: int) -> None:
        self.res.setdefault(prefix, {})[(kind, tier)] = pid
        self.owner[(kind, tier, pid)] = prefix

    def free(self, kind: ComponentKind, tier: Tier, pid: int) -> tuple:
        prefix = self.owner.pop((kind, tier, pid))
        del self.res[prefix][(kind, tier)]
        return prefix

    def drop_dead(self) -> None:
        for prefix in [p for p, r in self.res.items() if (FULL, DEV) not in r and (FULL, HOST) not in r]:
            for (kind, tier), pid in self.res.pop(prefix).items():
                del self.owner[(kind, tier, pid)]

    def boundary(self, pages: tuple, tiers: tuple[Tier, ...], l3: bool = False) -> int:
        """Deepest page boundary every component accepts, using data in `tiers` (and L3)."""
        def has(i: int, kind: ComponentKind) -> bool:
            r = self.res.get(pages[:i], {})
            return any((kind, t) in r for t in tiers) or (l3 and (pages[:i], kind) in self.l3)

        best = 0
        for b in range(1, len(pages) + 1):
            if not has(b, FULL):
                break
            ok = True
            if SWA in self.kinds:
                ok = all(has(i, SWA) for i in range(max(1, b - WINDOW + 1), b + 1))
            if MAMBA in self.kinds:
                ok = ok and has(b, MAMBA)
            if ok:
                best = b
        return best

    def stored(self, pages: tuple) -> int:
        n = 0
        while n < len(pages) and pages[: n + 1] in self.res:
            n += 1
        return n


def token_bytes(pages: tuple) -> bytes:
    return np.array([t for page in pages for t in page], dtype="<u4").tobytes()


def check_match(m, oracle: Oracle, pages: tuple) -> tuple[int, int]:
    """A match's device and host boundaries and device pages against the oracle's;
    returns the boundaries (pages)."""
    b0 = oracle.boundary(pages, (DEV,))
    b1 = oracle.boundary(pages, (DEV, HOST))
    assert m.device_tokens == b0 * P, (m, b0)
    assert m.host_tokens == (b1 - b0) * P, (m, b1)
    assert m.matched_tokens == oracle.stored(pages) * P
    want = [oracle.res[pages[: i + 1]][(FULL, DEV)] for i in range(b0)]
    assert m.device_pages[FULL].tolist() == want
    if SWA in oracle.kinds:
        # Reuse reads only the window before the boundary: the ids before it read -1.
        want_swa = [oracle.res[pages[: i + 1]].get((SWA, DEV), -1) if i >= b0 - WINDOW else -1
                    for i in range(b0)]
        assert m.device_pages[SWA].tolist() == want_swa
    if MAMBA in oracle.kinds and b0:
        assert m.device_pages[MAMBA].tolist() == [oracle.res[pages[:b0]][(MAMBA, DEV)]]
    return b0, b1


def record_evicted(freed, oracle: Oracle, tier: Tier) -> None:
    """Pages an eviction freed leave the oracle; none of them may be one a live lock
    covers: FULL/SWA up to the host boundary, MAMBA at the device and host boundaries."""
    for k, arr in freed.items():
        for pid in arr.tolist():
            prefix = oracle.free(k, tier, pid)
            for b0, b1, pages, _ in oracle.locked:
                if k is MAMBA:
                    assert prefix not in (pages[:b0], pages[:b1]) or not prefix, "locked checkpoint evicted"
                else:
                    assert not (len(prefix) <= b1 and pages[: len(prefix)] == prefix), "locked page evicted"
    oracle.drop_dead()


def back_up_to_host(tree: HiRadixTree, oracle: Oracle, ids: Iterator[int], victim) -> None:
    """Write-back of an L1 victim: its slots L2 lacks go there (FULL first) before it
    leaves, with fresh host page ids."""
    for k, arr in victim.pages.items():
        first = oracle.owner[(k, DEV, int(arr[0]))]
        if (k, HOST) in oracle.res[first]:
            continue  # already backed up: only missing pages are written
        if k is not FULL and (FULL, HOST) not in oracle.res[first]:
            continue  # a slot goes to host only where FULL is there too
        host_ids = np.array([next(ids) for _ in arr], dtype=np.int64)
        tree.set_resident(victim.node, k, HOST, host_ids)
        for dev_pid, host_pid in zip(arr.tolist(), host_ids.tolist(), strict=True):
            oracle.set(oracle.owner[(k, DEV, dev_pid)], k, HOST, host_pid)


def unlock_one(tree: HiRadixTree, oracle: Oracle, locks: list, pick: int) -> None:
    if locks:
        lock = locks.pop(pick % len(locks))
        if lock.active:
            tree.unlock(lock)
        oracle.locked = [lk for lk in oracle.locked if lk[3] is not lock]


def close_one(tree: HiRadixTree, session: str) -> None:
    try:
        tree.close_session(session)
    except Exception as e:  # unknown session: must be NotFound
        assert type(e).__name__ == "NotFound"


def apply_shared_op(tree: HiRadixTree, oracle: Oracle, ids: Iterator[int], locks: list,
                    op: tuple) -> None:
    """The ops both property tests run alike: evict (optionally writing L1 victims back to
    L2 first), unlock, close-session."""
    if op[0] == "evict":
        _, tier, kind, n, write_back = op
        if kind not in oracle.kinds:
            return

        def back_up(victim) -> None:
            if tier is DEV and write_back:
                back_up_to_host(tree, oracle, ids, victim)

        record_evicted(tree.evict(tier, kind, n, before_drop=back_up).freed, oracle, tier)
    elif op[0] == "unlock":
        unlock_one(tree, oracle, locks, op[1])
    elif op[0] == "close":
        close_one(tree, op[1])
    else:
        raise AssertionError(f"unknown op {op[0]!r}")


def check_step(tree: HiRadixTree, oracle: Oracle) -> None:
    tree.check_integrity()
    for tier in (DEV, HOST):
        for kind in oracle.kinds:
            held = sum(1 for r in oracle.res.values() if (kind, tier) in r)
            assert tree.resident_pages(tier, kind) == held, (tier, kind, tree.resident_pages(tier, kind), held)


def run_sequence(kinds: tuple[ComponentKind, ...], ops: list, backed_up: bool = False) -> None:
    """`backed_up`: L1 is a write-back tier (`backed_up_tiers`): interior L1-only nodes
    are eviction candidates, kept when the op's eviction makes no L2 copy."""
    tree = HiRadixTree(P, {k: (WINDOW * P if k is SWA else 0) for k in kinds},
                       backed_up_tiers=(DEV,) if backed_up else ())
    oracle = Oracle(kinds)
    ids = itertools.count(1)
    locks: list = []

    def as_pages(spec) -> tuple:
        return tuple((a, b) for a, b in spec)

    for op in ops:
        if op[0] == "insert":
            _, spec, swa_gap, checkpoint, with_lock = op
            pages = as_pages(spec)
            lock = None
            start = 0
            if with_lock:
                m = tree.match("", token_bytes(pages), lock=True)
                lock = m.lock
                start = m.device_tokens // P
                assert lock is not None
            n = len(pages) - start
            given_ids = {FULL: np.array([next(ids) for _ in range(n)], dtype=np.int64)}
            if SWA in kinds:
                swa = np.array([next(ids) for _ in range(n)], dtype=np.int64)
                swa[: min(swa_gap, n)] = -1  # engine freed pages outside its window
                given_ids[SWA] = swa
            slot = next(ids) if (checkpoint and MAMBA in kinds) else None
            before = oracle.stored(pages)
            r = tree.insert("", token_bytes(pages), given_ids, lock=lock, mamba_slot=slot)
            assert r.reused_tokens == max(before, start) * P
            assert r.inserted_tokens == (len(pages) - max(before, start)) * P
            for kind, arr in given_ids.items():
                released = set(r.released[kind].tolist())
                for i, pid in enumerate(arr.tolist()):
                    if pid >= 0 and pid not in released:
                        oracle.set(pages[: start + i + 1], kind, DEV, pid)
            if slot is not None and slot not in set(r.released[MAMBA].tolist()):
                oracle.set(pages, MAMBA, DEV, slot)
            for kind, arr in r.dropped.items():  # a shorter L2 copy of an SWA tail it grew
                for pid in arr.tolist():
                    oracle.free(kind, HOST, pid)
            if lock is not None:
                oracle.locked = [lk for lk in oracle.locked if lk[3] is not lock]
        elif op[0] == "match":
            _, spec, lock, session = op
            pages = as_pages(spec)
            m = tree.match("", token_bytes(pages), lock=lock, session_id=session)
            b0, b1 = check_match(m, oracle, pages)
            if m.lock is not None:
                locks.append(m.lock)
                oracle.locked.append((b0, b1, pages, m.lock))
        else:
            apply_shared_op(tree, oracle, ids, locks, op)
        check_step(tree, oracle)


SETTINGS = fuzz_settings(1000)


@SETTINGS
@given(st.lists(op_st, min_size=1, max_size=30))
def test_full_only_against_oracle(ops: list) -> None:
    run_sequence((FULL,), ops)


@SETTINGS
@given(st.lists(op_st, min_size=1, max_size=30))
def test_full_swa_mamba_against_oracle(ops: list) -> None:
    run_sequence((FULL, SWA, MAMBA), ops)


@settings(SETTINGS, max_examples=fuzz_examples(400))
@given(st.lists(op_st, min_size=1, max_size=30))
def test_full_only_with_write_back_l1_against_oracle(ops: list) -> None:
    run_sequence((FULL,), ops, backed_up=True)


@settings(SETTINGS, max_examples=fuzz_examples(400))
@given(st.lists(op_st, min_size=1, max_size=30))
def test_full_swa_mamba_with_write_back_l1_against_oracle(ops: list) -> None:
    run_sequence((FULL, SWA, MAMBA), ops, backed_up=True)
