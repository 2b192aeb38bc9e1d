"""Review: write policies under memory pressure at controller level (commit 0d1ffa4: L1
is always a backed-up tier; nodes an L1 eviction keeps are copied to L2 as they leave,
`Transfers._copy_stranded`). Small L1/L2 pools, locks held, splits by matches, hybrid
models, slow and failing L2 copies, every L1->L2 x L2->L3 policy pair with a file L3."""

from __future__ import annotations

import itertools

import pytest
from engine_sim import Engine, evict_all, seq

from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
POLICIES = ("write_through", "write_through_selective", "write_back")
MATRIX = list(itertools.product(POLICIES, POLICIES))
IDS = [f"{a}-{b}" for a, b in MATRIX]


def _path(ctl, tokens: bytes):
    tree = ctl.tree
    return tree._walk(tree._roots.get(""), tokens, len(tokens))


def _in(ctl, tokens: bytes, tier: Tier) -> bool:
    """Every page of `tokens` is in the tree, FULL resident in `tier` (no hit counted)."""
    with ctl._mu:
        path = _path(ctl, tokens)
        return (sum(n.npages for n in path) == len(tokens) // 16
                and all(ctl.tree.is_resident(n, FULL, tier) for n in path))


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


def _counters(ctl) -> dict[str, int]:
    return dict(ctl.stats().counters)


# ---------------------------------------------------------------- _uncopied forgotten


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_a_checkpoint_leaving_l1_does_not_forget_the_full_copy_still_owed(make, policy) -> None:
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
    with ctl._mu:  # the checkpoint alone leaves L1 (as a request short of slots would make it)
        ctl.transfers._evict(Tier.DEVICE, MAMBA, 16)
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
