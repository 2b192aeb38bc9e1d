"""Review: write policies under memory pressure at controller level (commit 0d1ffa4: L1
is always a backed-up tier; nodes an L1 eviction keeps are copied to L2 as they leave,
`Transfers._copy_stranded`). Small L1/L2 pools, locks held, splits by matches, hybrid
models, slow and failing L2 copies, every L1->L2 x L2->L3 policy pair with a file L3."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from engine_sim import Engine, evict_all, fully_in, seq, tree_path

from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
POLICIES = ("write_through", "write_through_selective", "write_back")
MATRIX = list(itertools.product(POLICIES, POLICIES))
IDS = [f"{a}-{b}" for a, b in MATRIX]


_path, _in = tree_path, fully_in  # (engine_sim's)


def _l2_full_of_locked(ctl, eng, n: int = 8) -> list[int]:
    """L2 (32 FULL pages) full of pages held by locks (L1 emptied); the lock ids."""
    held = [seq(4, 1000 * (k + 1)) for k in range(n)]
    for tokens in held:
        eng.request(tokens)
        for _ in range(2):  # (selective: due)
            ctl.match("e1", MatchRequest("", tokens))
        assert ctl.transfers.drain(10)
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 4 * n
    evict_all(ctl, Tier.DEVICE)
    return [ctl.match("e1", MatchRequest("", t, lock=True)).lock_id for t in held]


def _counters(ctl) -> Counter[str]:
    """The controller's counters (one never touched reads 0)."""
    return Counter(ctl.stats().counters)


# ---------------------------------------------------------------- _uncopied forgotten


@pytest.mark.parametrize("checkpoint_left", [False, True], ids=["control", "checkpoint-left"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_a_checkpoint_leaving_l1_does_not_forget_the_full_copy_still_owed(make, policy,
                                                                          checkpoint_left) -> None:
    """Hybrid: `hot`'s write-through copy found L2 full (locked): remembered in
    `_uncopied`. Its MAMBA checkpoint then leaves L1 alone (its copy finds no room
    either). Once the locks go, L2 has room: `hot`'s FULL pages leaving L1 must be copied
    (README: "a copy that found no room ... is made when the slot leaves L1, if L2 has
    room by then")."""
    ctl = make(hybrid=True, l1_tokens=64, write__l1_to_l2=policy, write__l2_to_l3="write_through",
               storage__backend="none")
    eng = Engine(ctl)
    locks = _l2_full_of_locked(ctl, eng)
    hot = seq(4, 90_000)
    eng.request(hot)
    for _ in range(2):
        ctl.match("e1", MatchRequest("", hot))
    assert ctl.transfers.drain(10)
    assert not _in(ctl, hot, Tier.HOST)
    assert ctl.transfers._uncopied
    if checkpoint_left:
        with ctl._mu:  # the checkpoint alone leaves L1 (a request short of slots makes it)
            ctl.transfers._evict(Tier.DEVICE, MAMBA, 1)  # (more would take FULL leaves too)
        assert not ctl.tree.is_resident(_path(ctl, hot)[-1], MAMBA, Tier.DEVICE)
    for lock_id in locks:
        ctl.release("e1", lock_id, None)
    dropped = _counters(ctl)["backups_dropped"]
    evict_all(ctl, Tier.DEVICE)
    lost = not _in(ctl, hot, Tier.HOST)
    assert not lost, (f"hot left every tier with L2 free; backups_dropped "
                      f"{dropped} -> {_counters(ctl)['backups_dropped']}")


def _hog_l2(ctl, kind=FULL, leave: int = 0):
    """Take every free L2 page of `kind` but `leave` (nothing to evict: L2 is empty);
    returns the pages (free them with `ctl.host.allocator(kind).free`)."""
    host = ctl.host.allocator(kind)
    return host.allocate(host.free_count - leave)


def test_a_split_head_whose_tail_was_dropped_is_still_copied_when_it_leaves_l1(make) -> None:
    """`long`'s copy found no room (remembered); a match split it (head H, tail T: the
    remembered object). T left L1 while L2 still had no room: dropped, counted (2 pages).
    H is now a leaf whose copy is still owed: once L2 has room, H leaving L1 must be
    copied there (or at the very least counted in `backups_dropped`)."""
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               storage__backend="none")
    eng = Engine(ctl)
    hog = _hog_l2(ctl)
    long = seq(4, 90_000)
    eng.request(long)
    assert ctl.transfers.drain(10)
    assert ctl.transfers._uncopied
    ctl.match("e1", MatchRequest("", long[:32]))  # splits it: H (2 pages) + T (2 pages)
    with ctl._mu:
        ctl.transfers._evict(Tier.DEVICE, FULL, 2)  # T, the only leaf, goes (no room)
    assert _counters(ctl)["backups_dropped"] == 2
    assert _in(ctl, long[:32], Tier.DEVICE)
    ctl.host.allocator(FULL).free(hog)  # L2 has room now
    evict_all(ctl, Tier.DEVICE)
    c = _counters(ctl)
    assert _in(ctl, long[:32], Tier.HOST) or c["backups_dropped"] == 4, (
        f"H left every tier with L2 empty, uncounted (backups_dropped {c['backups_dropped']})")


def _fail_l2_copies(ctl, n: int = 1) -> list[int]:
    """The next `n` L1->L2 copies raise (the copy engine's error); returns the count left."""
    copier = ctl.transfers.copier
    inner = copier.device_to_host
    left = [n]

    def flaky(kind, device_ids, host_ids, on_layer=None):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected L1->L2 copy failure")
        return inner(kind, device_ids, host_ids, on_layer)

    copier.device_to_host = flaky
    return left


@pytest.mark.parametrize("l2_to_l3", ["write_through", "write_back"])
def test_a_write_through_copy_that_failed_is_made_or_counted_when_the_slot_leaves_l1(make, l2_to_l3) -> None:
    """A write-through flush failed (the copy engine raised once): the prompt is in L1
    only. When it leaves L1 with L2 empty, its copy is made then (as for one that found
    no room), or its loss is counted in `backups_dropped`."""
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through", write__l2_to_l3=l2_to_l3,
               storage__backend="file")
    eng = Engine(ctl)
    _fail_l2_copies(ctl)
    tokens = seq(4, 7000)
    eng.request(tokens)
    assert ctl.transfers.drain(10)
    assert ctl.transfers.copy_worker.failures == 1
    assert not _in(ctl, tokens, Tier.HOST)
    evict_all(ctl, Tier.DEVICE)
    c = _counters(ctl)
    m = ctl.match("e1", MatchRequest("", tokens))
    kept = m.device_tokens + m.host_tokens + m.storage_tokens == 16
    assert kept or c["backups_dropped"] == 4, (m, c["backups_dropped"], c["backups_l2_failed"])


# ---------------------------------------------------------------- stranded nodes copied


@pytest.mark.parametrize("model", ["full", "swa", "hybrid"])
def test_a_split_head_stranded_in_l1_is_copied_bit_exact_and_comes_back(make, model) -> None:
    """`long`'s copy found no room; a match split it; L2 then had room. Emptying L1 copies
    the tail (remembered) and then the head (stranded: L1's last copy of a node with a
    child): nothing stays in L1, nothing is lost, and a request loads every page back
    byte for byte (the engine checks)."""
    kw = {"hybrid": model == "hybrid", "swa_only": model == "swa"}
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               storage__backend="none", **kw)
    eng = Engine(ctl)
    hog = _hog_l2(ctl)
    long = seq(4, 90_000)
    eng.request(long)
    assert ctl.transfers.drain(10)
    ctl.match("e1", MatchRequest("", long[:32]))  # H (2 pages) + T (2 pages)
    ctl.host.allocator(FULL).free(hog)
    before = _counters(ctl)
    evict_all(ctl, Tier.DEVICE)
    c = _counters(ctl)
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 0, "a node stuck in L1"
    assert _in(ctl, long, Tier.HOST)
    assert c["backups_l2"] - before["backups_l2"] == 4
    assert c["evictions_device"] - before["evictions_device"] == 4
    assert c["backups_dropped"] == 0
    m = eng.request(long)  # loads from L2, verified byte for byte
    assert m.host_tokens == 16
    assert eng.checked > 0


@pytest.mark.parametrize("l1_to_l2", ["write_through_selective", "write_back"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_an_l1_parent_of_a_child_prefetched_into_l2_leaves_l1_copied(make, l1_to_l2, hybrid) -> None:
    """A second daemon wrote `long` (8 pages) to the shared L3. Here its first 4 pages
    are in L1 only (a cold prompt: selective copies it not; write-back not yet); a
    prefetch brings the other 4 from L3 into L2, under it. Emptying L1 copies the parent
    down (it is L1's last copy of a node with a child): nothing stays in L1 and the
    whole prompt loads back byte for byte."""
    writer = make(hybrid=hybrid, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    long = seq(8, 50_000)
    Engine(writer).request(long)
    writer.flush(10)
    ctl = make(hybrid=hybrid, write__l1_to_l2=l1_to_l2, write__l2_to_l3="write_through_selective")
    eng = Engine(ctl)
    eng.request(long[:64])
    assert ctl.transfers.drain(10)
    assert _in(ctl, long[:64], Tier.DEVICE) and not _in(ctl, long[:64], Tier.HOST)
    m = ctl.match("e1", MatchRequest("", long, lock=True, prefetch=True))
    assert m.prefetch_id and m.device_tokens == 16
    from engine_sim import wait_prefetch

    from hicache.controller.base import PrefetchState
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)
    assert ctl.transfers.drain(10)
    with ctl._mu:
        path = _path(ctl, long)
        assert [ctl.tree.is_resident(n, FULL, Tier.HOST) for n in path] == [False, True]
    evict_all(ctl, Tier.DEVICE)
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 0, "a node stuck in L1"
    assert _in(ctl, long, Tier.HOST)
    assert _counters(ctl)["backups_dropped"] == 0
    again = eng.request(long)  # loads all 8 pages from L2, verified byte for byte
    assert again.host_tokens == 32


# ---------------------------------------------------------------- L2 short of held pages


def _l1_parent_over_a_full_l2(ctl, eng, with_child: bool) -> bytes:
    """write_back L1 -> L2: `long`'s first 4 pages P in L1 alone; with `with_child` its
    last 4 (C) in L2 under P (recently used); L2 (32 pages) full of unlocked prompts.
    Returns `long` (or P's tokens alone)."""
    long = seq(8, 50_000)
    eng.request(long[:64])
    if with_child:
        eng.request(long)
        with ctl._mu:
            ctl.transfers._evict(Tier.DEVICE, FULL, 4)  # C, the leaf: written back
    lock = ctl.match("e1", MatchRequest("", long[:64], lock=True)).lock_id  # P stays meanwhile
    for k in range(7 if with_child else 8):
        eng.request(seq(4, 1000 * (k + 1)))
        with ctl._mu:
            ctl.transfers._evict(Tier.DEVICE, FULL, 4)  # written back to L2
    assert ctl.transfers.drain(10)
    if with_child:
        ctl.match("e1", MatchRequest("", long))  # C is L2's most recently used
    ctl.release("e1", lock, None)
    assert (ctl.tree.resident_pages(Tier.DEVICE, FULL), ctl.tree.resident_pages(Tier.HOST, FULL)) == (4, 32)
    return long if with_child else long[:64]


@pytest.mark.parametrize("with_child", [False, True], ids=["leaf", "parent"])
def test_a_write_back_victim_short_of_parked_l2_room_waits_for_it_then_goes(make, with_child) -> None:
    """write_back / write_back with a healthy file L3. A request needs the whole of L1;
    its one cached node P must go to L2, which is full: the L2 victims that make room are
    written to L3 first and their pages stay held until that lands (ms). P is kept a
    moment (README: "stays in L1 while other victims can go ...; an allocation that needs
    it gone waits at most 0.1 s for that room"), then copied: the allocation succeeds
    and nothing is lost, whether P is a leaf or the parent of a node in L2."""
    from hicache.controller.base import AllocateRequest

    ctl = make(l1_tokens=64, write__l1_to_l2="write_back", write__l2_to_l3="write_back")
    eng = Engine(ctl)
    tokens = _l1_parent_over_a_full_l2(ctl, eng, with_child)
    a = ctl.allocate("e1", AllocateRequest("", 64))
    ctl.release("e1", None, a.allocation_id)
    assert ctl.transfers.drain(10)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert m.device_tokens + m.host_tokens + m.storage_tokens == len(tokens) // 4
    assert _counters(ctl)["backups_dropped"] == 0


# ---------------------------------------------------------------- the matrix under pressure


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), MATRIX, ids=IDS)
def test_a_seeded_mix_under_pressure_keeps_pages_owned_once_and_bytes_exact(
        make, l1_to_l2, l2_to_l3, hybrid) -> None:
    """Every policy pair, a file L3, L1 of 16 pages and L2 of 32: requests sharing
    prefixes (matches split nodes), hits, locks held across evictions, tiers emptied.
    After each step every L1/L2 page is owned exactly once and the tree is whole; at the
    end the last prompts are requested again and every page served is checked byte for
    byte. No step spins or raises (nothing is held long enough to exhaust a pool)."""
    import random

    from engine_sim import toks

    rng = random.Random(f"{l1_to_l2}/{l2_to_l3}/{hybrid}")
    ctl = make(hybrid=hybrid, l1_tokens=64, write__l1_to_l2=l1_to_l2, write__l2_to_l3=l2_to_l3)
    eng = Engine(ctl)
    bases = [rng.randrange(1000) * 100 for _ in range(6)]
    inserted: list[bytes] = []
    locks: list[int] = []
    for _ in range(70):
        ids = list(range(b := rng.choice(bases), b + 4 * rng.randint(1, 5)))
        if rng.random() < 0.4:
            ids += [rng.randrange(10**6) for _ in range(4 * rng.randint(1, 2))]
        tokens = toks(ids)
        op = rng.random()
        if op < 0.55:
            eng.request(tokens)
            inserted.append(tokens)
        elif op < 0.7:
            ctl.match("e1", MatchRequest("", tokens[: 16 * rng.randint(1, len(tokens) // 16)]))
        elif op < 0.78 and len(locks) < 2:
            locks.append(ctl.match("e1", MatchRequest("", tokens, lock=True)).lock_id)
        elif op < 0.86 and locks:
            ctl.release("e1", locks.pop(rng.randrange(len(locks))), None)
        else:
            for lock_id in locks:
                ctl.release("e1", lock_id, None)
            locks.clear()
            evict_all(ctl, rng.choice([Tier.DEVICE, Tier.HOST]))
        ctl.check_integrity()
    for lock_id in locks:
        ctl.release("e1", lock_id, None)
    assert ctl.transfers.drain(10)
    for tokens in inserted[-6:]:
        eng.request(tokens)
    assert ctl.transfers.drain(10)
    assert eng.checked > 0
