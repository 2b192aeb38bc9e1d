"""Review: eviction policies (LRU / LFU) through the controller with real pools, the two L2
layouts (layer_first / page_first) under a content oracle, and capacity edges (L1 exactly
full, L2 barely larger than L1, the prefetch budget, sized pools)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from engine_sim import Engine, evict_all, seq, wait_prefetch

from hicache.config import GiB, l2_slot_bytes
from hicache.controller.base import InsertRequest, MatchRequest, PrefetchState
from hicache.errors import ResourceExhausted
from hicache.types import ComponentKind, HostLayout, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
NO_L3 = {"storage__backend": "none"}
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}


def _in_tier(ctl, tokens: bytes, tier: Tier) -> int:
    """FULL pages of `tokens` the tier holds (the tree's own view: a controller match
    would add hits)."""
    with ctl._mu:
        path = ctl.tree._walk(ctl.tree._roots.get(""), tokens, len(tokens))
        return sum(n.npages for n in path if n.mask[0] & (1 << tier))


def _in_l1(ctl, tokens: bytes) -> int:
    return _in_tier(ctl, tokens, Tier.DEVICE)


def _load_and_verify(eng: Engine, tokens: bytes) -> None:
    """Match `tokens` locked, load what L2 holds, verify every page, release."""
    ctl = eng.ctl
    m = ctl.match(eng.id, MatchRequest("", tokens, lock=True))
    pages, n = m.device_pages, m.device_tokens
    if m.host_tokens:
        *_, last = list(ctl.load(eng.id, m.lock_id))
        pages, n = last.device_pages, last.device_tokens
    assert n == len(tokens) // 4
    eng.verify(pages, tokens, n // ctl.cfg.model.page_size)
    ctl.release(eng.id, m.lock_id, None)


def _free(ctl, tier: Tier, kind: ComponentKind = FULL) -> int:
    pools = ctl.device if tier is Tier.DEVICE else ctl.host
    return pools.allocator(kind).free_count


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_victim_order_follows_the_policy_through_the_controller(make, policy: str) -> None:
    """L1 of 8 pages holds four 2-page prompts. A is hit often but long ago, B once and
    last, C and D never after their insert. A request needing 2 pages takes A under LRU
    (least recent), C under LFU (fewest hits, older of the ties)."""
    ctl = make(l1_tokens=32, eviction__policy=policy, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    a, b, c, d = (seq(2, base) for base in (0, 1000, 2000, 3000))
    eng.request(a)
    eng.request(b)
    for _ in range(5):
        ctl.match("e1", MatchRequest("", a))
    eng.request(c)
    eng.request(d)
    ctl.match("e1", MatchRequest("", b))
    assert ctl.transfers.drain(10)
    assert _free(ctl, Tier.DEVICE) == 0
    eng.request(seq(2, 9000))
    gone = {name for name, t in zip("abcd", (a, b, c, d), strict=True) if _in_l1(ctl, t) == 0}
    assert gone == ({"a"} if policy == "lru" else {"c"})
    for t in (a, b, c, d):  # every prompt still comes back bit-exact (from L2 if need be)
        eng.request(t)
    assert eng.checked > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_l2_takes_its_victim_in_policy_order_too(make, policy: str) -> None:
    """L2 of 16 pages holds eight 2-page prompts (A hit often long ago, B once and last);
    the ninth prompt's write-through copy needs room: A's L2 copy goes under LRU, C's under
    LFU."""
    ctl = make(l1_tokens=32, eviction__policy=policy, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    prompts = {name: seq(2, 1000 * i) for i, name in enumerate("abcdefghi")}
    eng.request(prompts["a"])
    eng.request(prompts["b"])
    for _ in range(5):
        ctl.match("e1", MatchRequest("", prompts["a"]))
    for name in "cdefgh":
        eng.request(prompts[name])
    ctl.match("e1", MatchRequest("", prompts["b"]))
    assert ctl.transfers.drain(10)
    assert _free(ctl, Tier.HOST) == 0
    eng.request(prompts["i"])
    assert ctl.transfers.drain(10)
    gone = {name for name, t in prompts.items() if _in_tier(ctl, t, Tier.HOST) == 0}
    assert gone == ({"a"} if policy == "lru" else {"c"})
    ctl.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_locked_victim_is_passed_over_and_taken_once_unlocked(make, policy: str) -> None:
    ctl = make(l1_tokens=32, eviction__policy=policy, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    prompts = [seq(2, base) for base in (0, 1000, 2000, 3000)]
    for t in prompts:
        eng.request(t)
    assert ctl.transfers.drain(10)
    # The first prompt is the coldest by both policies; lock it (a match holding it).
    held = ctl.match("e1", MatchRequest("", prompts[0], lock=True))
    eng.request(seq(2, 9000))
    assert _in_l1(ctl, prompts[0]) == 2
    assert _in_l1(ctl, prompts[1]) == 0  # the next coldest went instead
    ctl.release("e1", held.lock_id, None)
    for _ in range(2):  # everything else in L1 becomes hotter and more recent than it
        for t in (prompts[2], prompts[3], seq(2, 9000)):
            ctl.match("e1", MatchRequest("", t))
    eng.request(seq(2, 9500))
    assert _in_l1(ctl, prompts[0]) == 0  # unlocked, it is the coldest again
    assert all(_in_l1(ctl, t) == 2 for t in (prompts[2], prompts[3], seq(2, 9000)))
    ctl.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_hot_parent_outlives_its_cold_children_and_goes_leaf_first(make, policy: str) -> None:
    """A shared 2-page prefix P with three 1-page continuations: evicting L1 empties the
    children before P (P only once it is a leaf), whatever P's rank."""
    ctl = make(l1_tokens=20, tiers__l2__ratio=4, eviction__policy=policy, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    p = seq(2)
    kids = [p + seq(1, base) for base in (1000, 2000, 3000)]
    for t in kids:
        eng.request(t)
    assert ctl.transfers.drain(10)
    assert _free(ctl, Tier.DEVICE) == 0
    eng.request(seq(3, 9000))  # 3 pages: exactly the three leaves
    assert _in_l1(ctl, p) == 2
    assert [_in_l1(ctl, t) for t in kids] == [2, 2, 2]
    eng.request(seq(5, 19000))  # 5 pages: the other leaves, then P too
    assert _in_l1(ctl, p) == 0
    for t in kids:
        _load_and_verify(eng, t)  # all back bit-exact from L2
    ctl.check_integrity()


def _checkpoint_tiers(ctl, tokens: bytes) -> int:
    """Tier bits (1: L1, 2: L2) of the MAMBA checkpoint at the end of `tokens`' node."""
    with ctl._mu:
        end = ctl.tree._walk(ctl.tree._roots.get(""), tokens, len(tokens))[-1]
        return end.mask[ctl.tree._by_kind[MAMBA].index] & 3


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_checkpoint_leaves_l1_alone_in_policy_order(make, policy: str) -> None:
    """Four MAMBA slots hold four checkpoints; A is hit often but long ago, B once and
    last. A fifth request's slot takes A's checkpoint under LRU, C's under LFU; the FULL
    pages stay, the checkpoint stays in L2."""
    ctl = make(hybrid=True, eviction__policy=policy, tiers__l1__mamba_slots=4, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    a, b, c, d, e = (seq(2, base) for base in (0, 1000, 2000, 3000, 4000))
    eng.request(a)
    eng.request(b)
    for _ in range(5):
        ctl.match("e1", MatchRequest("", a))
    eng.request(c)
    ctl.match("e1", MatchRequest("", b))
    eng.request(d)
    assert ctl.transfers.drain(10)
    assert _free(ctl, Tier.DEVICE, MAMBA) == 0
    eng.request(e)
    assert ctl.transfers.drain(10)
    gone = "a" if policy == "lru" else "c"
    for name, t in zip("abcde", (a, b, c, d, e), strict=True):
        assert _checkpoint_tiers(ctl, t) == (2 if name == gone else 3), name
        assert _in_l1(ctl, t) == 2
    _load_and_verify(eng, a if gone == "a" else c)  # the checkpoint comes back from L2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_session_referenced_prompt_goes_after_hot_unreferenced_ones(make, policy: str) -> None:
    """A is cold by both policies but its session still references it: the unreferenced
    B goes first, however hot; once the session closes A goes first."""
    ctl = make(l1_tokens=16, tiers__l2__ratio=4, eviction__policy=policy, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    a, b = seq(2), seq(2, 1000)
    m = ctl.match("e1", MatchRequest("", a, session_id="s", lock=True, allocate_tokens=8))
    eng.write(m.pages, a, 0)
    ctl.insert(
        "e1", InsertRequest("", a, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="s")
    )
    eng.request(b)
    for _ in range(4):
        ctl.match("e1", MatchRequest("", b))
    assert ctl.transfers.drain(10) and _free(ctl, Tier.DEVICE) == 0
    eng.request(seq(2, 5000))
    assert (_in_l1(ctl, a), _in_l1(ctl, b)) == (2, 0)
    ctl.close_session("s")
    eng.request(b)  # back into L1 from L2 (hotter and more recent than A)
    assert ctl.transfers.drain(10)
    eng.request(seq(2, 6000))
    assert _in_l1(ctl, a) == 0 and _in_l1(ctl, b) == 2


# ----------------------------------------------------------------------------- layouts

LAYOUTS = [
    pytest.param("layer_first", NO_L3, id="layer_first"),
    pytest.param("page_first", NO_L3, id="page_first-no-l3"),
    pytest.param("page_first", {}, id="page_first-file"),
]


@pytest.mark.parametrize("model", ["full", "sidecar", "swa", "hybrid"])
@pytest.mark.parametrize(("layout", "l3"), LAYOUTS)
def test_l1_to_l2_and_back_is_bit_exact_in_each_layout(
    make, layout: str, l3: dict, model: str
) -> None:
    ctl = make(
        tiers__l2__layout=layout,
        sidecar=model == "sidecar",
        swa_only=model == "swa",
        hybrid=model == "hybrid",
        **l3,
        **THROUGH,
    )
    assert ctl.host.layout is HostLayout(layout)
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request(tokens)
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert (m.device_tokens, m.host_tokens) == (0, 24)
    progress = list(ctl.load("e1", m.lock_id))
    last = progress[-1]
    layers = max(mb.layers for mb in ctl.cfg.model.family(FULL))
    ready = [p.layers_ready for p in progress]  # (a fast copy may skip a message)
    assert ready == sorted(set(ready)) and ready[-1] == layers
    assert all(p.device_pages is None for p in progress[:-1])
    assert all(p.layers_total == layers for p in progress)
    assert last.device_tokens == 24 and last.device_pages is not None
    eng.verify(last.device_pages, tokens, 6)
    ctl.release("e1", m.lock_id, None)
    eng.request(tokens + seq(2, 500))  # reuses the loaded pages, verifies them again
    assert eng.checked > 0


@pytest.mark.parametrize("model", ["full", "sidecar", "hybrid"])
def test_l2_to_l3_and_back_through_page_first_is_bit_exact(make, model: str) -> None:
    ctl = make(
        tiers__l2__layout="page_first",
        sidecar=model == "sidecar",
        hybrid=model == "hybrid",
        **THROUGH,
    )
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request_then_only_in_l3(tokens)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id and m.storage_tokens == 24
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)
    eng.request(tokens)  # loads what is in L2 (or already in L1) and verifies it
    assert eng.checked >= 6


# ----------------------------------------------------------------------------- capacity


def test_an_allocation_of_exactly_l1_fits_and_one_page_more_is_refused_at_once(make) -> None:
    ctl = make(l1_tokens=32, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(3))
    assert ctl.transfers.drain(10)
    total = ctl.device.allocator(FULL).total
    with pytest.raises(ResourceExhausted):
        ctl.match("e1", MatchRequest("", seq(1, 700), lock=True, allocate_tokens=4 * (total + 1)))
    assert _in_l1(ctl, seq(3)) == 3  # nothing evicted trying
    m = ctl.match("e1", MatchRequest("", seq(total, 700), lock=True, allocate_tokens=4 * total))
    assert len(m.pages["full"]) == total and _free(ctl, Tier.DEVICE) == 0
    eng.write(m.pages, seq(total, 700), 0)
    ctl.insert(
        "e1", InsertRequest("", seq(total, 700), lock_id=m.lock_id, allocation_id=m.allocation_id)
    )
    eng.request(seq(total, 700))
    eng.request(seq(3))  # back from L2
    ctl.check_integrity()


@pytest.mark.parametrize(("layout", "l3"), LAYOUTS)
def test_an_l2_barely_larger_than_l1_keeps_serving_bit_exact(make, layout: str, l3: dict) -> None:
    """ratio 1.05: L2 has 17 pages for L1's 16. Many prompts cycle through both tiers;
    every hit, from either, is verified."""
    ctl = make(
        l1_tokens=64, tiers__l2__ratio=1.05, tiers__l2__layout=layout, hybrid=True, **l3, **THROUGH
    )
    assert ctl.host.allocator(FULL).total == 17
    eng = Engine(ctl)
    prompts = [seq(3, 1000 * i) for i in range(10)]
    for _ in range(3):
        for t in prompts:
            eng.request(t)
    # (An LRU cycle of 10 prompts through 5-prompt tiers hits in L2 only where a copy's
    # timing lets it: the newest prompt, still in L1, is a hit in every run.)
    eng.request(prompts[-1])
    assert eng.checked > 0
    ctl.check_integrity()


def test_prefetches_never_reserve_more_than_the_prefetch_fraction(make, monkeypatch) -> None:
    """prefetch_fraction 0.25 of 128 L2 pages: 32 pages. Three prefetches of 12 pages each
    while the first read is held: the first two fit (24), the third is cut to what is left
    (8), a fourth gets nothing."""
    from engine_sim import hold_nth_read

    ctl = make(l1_tokens=256, tiers__l2__prefetch_fraction=0.25, **THROUGH)
    assert ctl.host.allocator(FULL).total == 128
    eng = Engine(ctl)
    prompts = [seq(12, 10_000 * (i + 1)) for i in range(4)]
    for t in prompts:
        eng.request(t)
    assert ctl.flush(10) >= 0
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    gate, reached = hold_nth_read(ctl, monkeypatch, 1)
    try:
        ids = []
        for t in prompts:
            m = ctl.match("e1", MatchRequest("", t, prefetch=True))
            ids.append(m.prefetch_id)
            if len(ids) == 1:
                assert reached.wait(5)
        with ctl._mu:
            reserved = ctl.prefetcher._reserved_pages
            held = sum(len(a) for a in ctl.prefetcher.reserved(FULL))
        assert reserved <= 32 and held <= 32
        assert [bool(i) for i in ids] == [True, True, True, False]
        assert ctl.prefetch_status(ids[2]).tokens_total == 8 * 4
    finally:
        gate.set()
    for i in ids[:3]:
        assert wait_prefetch(ctl, i) is PrefetchState.DONE
    with ctl._mu:
        assert ctl.prefetcher._reserved_pages == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_l2_size_gb_bounds_the_host_pools(make, layout: str) -> None:
    """An absolute L2 size: the pages of every member fit in it, with page_first's header
    and padding and each member's region starting on an OS page counted: as many pages as
    fit, not one more. L2 still holds L1 and more."""
    size_gb = 0.0002
    ctl = make(
        l1_tokens=64, tiers__l2__size_gb=size_gb, tiers__l2__layout=layout, hybrid=True, **NO_L3
    )
    pages = ctl.host.allocator(FULL).total
    slots = [l2_slot_bytes(m, HostLayout(layout)) for m in ctl.cfg.model.members]

    def buffer(n: int) -> int:
        return sum(-(-n * b // mmap.PAGESIZE) * mmap.PAGESIZE for b in slots)

    assert buffer(pages) == ctl.host.buffer_size <= int(size_gb * GiB) < buffer(pages + 1)
    payload = sum(ctl.host.region_bytes(m) for m in ctl.cfg.model.members)
    assert payload <= size_gb * GiB
    assert pages > ctl.device.allocator(FULL).total
    eng = Engine(ctl)
    for i in range(8):
        eng.request(seq(3, 1000 * i))
    evict_all(ctl, Tier.DEVICE)
    for i in range(8):
        eng.request(seq(3, 1000 * i))
    assert eng.checked > 0


def test_l1_size_gb_splits_into_mamba_slots_then_pages(make) -> None:
    ctl = make(tiers__l1__size_gb=0.0001, hybrid=True, **NO_L3)
    cfg = ctl.cfg
    token_bytes = sum(m.bytes_per_page for m in cfg.model.members if m.component is not MAMBA)
    mamba_bytes = sum(m.bytes_per_page for m in cfg.model.members if m.component is MAMBA) * 16
    want = (int(0.0001 * GiB) - mamba_bytes) // token_bytes
    assert ctl.device.allocator(FULL).total == want == ctl.device.allocator(SWA).total
    assert ctl.device.allocator(MAMBA).total == 16
    eng = Engine(ctl)
    eng.request(seq(want))  # exactly L1's pages in one request
    eng.request(seq(want))
    assert eng.checked > 0


def test_an_allocation_failure_on_a_full_locked_l1_holds_nothing(make) -> None:
    ctl = make(l1_tokens=32, hybrid=True, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(4))
    hog = ctl.match("e1", MatchRequest("", seq(4), lock=True, allocate_tokens=4 * 8))
    assert hog.device_tokens == 16 and len(hog.pages["full"]) == 4
    before = {k: _free(ctl, Tier.DEVICE, k) for k in (FULL, SWA, MAMBA)}
    locks = ctl.heartbeat("e1").locks
    for _ in range(3):
        with pytest.raises(ResourceExhausted):
            ctl.match("e1", MatchRequest("", seq(2, 900), lock=True, allocate_tokens=8))
    assert {k: _free(ctl, Tier.DEVICE, k) for k in (FULL, SWA, MAMBA)} == before
    assert ctl.heartbeat("e1").locks == locks
    ctl.check_integrity()
    ctl.release("e1", hog.lock_id, hog.allocation_id)
    eng.request(seq(2, 900))
    eng.request(seq(4))
    ctl.check_integrity()
    assert np.all(ctl.device.allocator(FULL).free_count >= 0)


def test_a_doomed_allocation_fails_without_emptying_l1(make) -> None:
    """L1 of 16 pages: 8 cached pages, 6 held by another request's allocation. A request
    for 12 more pages cannot fit whatever is evicted (16 - 6 = 10). It fails, as it must,
    but it should leave the cache as it was, as one larger than the whole pool does."""
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through_selective", **NO_L3)
    eng = Engine(ctl)
    prompts = [seq(2, 1000 * i) for i in range(4)]
    for t in prompts:
        eng.request(t)
    assert ctl.transfers.drain(10)
    hog = ctl.match("e1", MatchRequest("", seq(1, 9000), lock=True, allocate_tokens=4 * 6))
    assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 8
    with pytest.raises(ResourceExhausted):
        ctl.match("e1", MatchRequest("", seq(12, 50_000), lock=True, allocate_tokens=4 * 12))
    try:
        assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 8, "the failed request emptied L1"
        assert [ctl.match("e1", MatchRequest("", t)).device_tokens for t in prompts] == [8] * 4
    finally:
        ctl.release("e1", hog.lock_id, hog.allocation_id)


def test_one_mamba_slot_is_refused_and_two_serve_a_conversation(make) -> None:
    """A request over a prefix whose checkpoint is in L1 copies it into its own slot while
    its match keeps the checkpoint locked: one slot failed every such request
    (RESOURCE_EXHAUSTED, forever), so the configuration refuses it; two serve."""
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\.l1\.mamba_slots: 1 .*at least 2"):
        make(hybrid=True, tiers__l1__mamba_slots=1, **NO_L3, **THROUGH)
    ctl = make(hybrid=True, tiers__l1__mamba_slots=2, **NO_L3, **THROUGH)
    eng = Engine(ctl)
    prompt = seq(3)
    eng.request(prompt)
    eng.request(prompt + seq(2, 77))  # a later turn of the same conversation
    eng.request(prompt)
    assert eng.checked > 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_each_load_progress_message_promises_only_layers_that_landed(make, layout: str) -> None:
    """A 300-page load from a fragmented L2 (numpy jobs on the copy threads): whenever a
    progress message says `layers_ready = k`, layers below k of every member of the FULL
    family already hold the right bytes in L1 (checked on a snapshot taken then)."""
    ctl = make(
        l1_tokens=4 * 400,
        tiers__l2__layout=layout,
        model__components={"full": {"layers": 6, "bytes_per_token_per_layer": 4096}},
        model__sidecars={
            "indexer": {"anchor": "full", "layers": 3, "bytes_per_token_per_layer": 256}
        },
        **NO_L3,
        **THROUGH,
    )
    eng = Engine(ctl)
    for i in range(30):  # fragments L2
        eng.request(seq(2, 100_000 + 1000 * i))
    evict_all(ctl, Tier.DEVICE)
    big = seq(300)
    eng.request(big)
    hashes = eng.hashes(big)
    members = ctl.cfg.model.family(FULL)
    for _ in range(5):  # (a fast copy may send no message before the last: nothing to check)
        evict_all(ctl, Tier.DEVICE)
        m = ctl.match("e1", MatchRequest("", big, lock=True))
        snaps = []
        for p in ctl.load("e1", m.lock_id):
            assert p.layers_total == 6
            if p.device_pages is None:
                snaps.append(
                    (
                        p.layers_ready,
                        {
                            mb.name: [
                                ctl.device.layer(mb.name, k).numpy().copy()
                                for k in range(min(p.layers_ready, mb.layers))
                            ]
                            for mb in members
                        },
                    )
                )
            last = p
        assert last.layers_ready == 6 and last.device_tokens == 1200
        for ready, snap in snaps:
            assert 0 < ready < 6
            for name, rows_by_layer in snap.items():
                for layer, rows in enumerate(rows_by_layer):
                    for i, pid in enumerate(last.device_pages[name]):
                        want = eng.pattern(hashes[i], name, layer, rows.shape[1])
                        assert np.array_equal(rows[int(pid)], want), (name, layer, ready, i)
        eng.verify(last.device_pages, big, 300)
        ctl.release("e1", m.lock_id, None)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_l2_size_gb_is_the_whole_host_buffer(make, layout: str) -> None:
    size_gb = 0.001
    ctl = make(
        l1_tokens=64, tiers__l2__size_gb=size_gb, tiers__l2__layout=layout, hybrid=True, **NO_L3
    )
    assert ctl.host.buffer_size <= size_gb * GiB, (ctl.host.buffer_size, int(size_gb * GiB))


def test_a_load_larger_than_l1_fails_at_once_without_emptying_it(make) -> None:
    """A daemon with a 32-page L1 stored a 20-page prompt in the shared L3. This one (L1 of
    16 pages, 4 prompts cached there) holds its first 10 pages in L2 and prefetches the
    other 10: a locked match reports 20 host pages, more than L1 holds. The Load must fail
    (it can never fit) and, as an allocation larger than the pool does, leave L1 alone."""
    big = make(l1_tokens=128, **THROUGH)
    Engine(big, engine_id="other").request(seq(20))
    assert big.flush(10) >= 0
    ctl = make(l1_tokens=64, tiers__l2__ratio=4, tiers__l2__prefetch_fraction=1.0, **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(10))
    evict_all(ctl, Tier.DEVICE)
    cached = [seq(2, 1000 * (i + 1)) for i in range(4)]
    for t in cached:
        eng.request(t)
    assert ctl.transfers.drain(10)
    m = ctl.match("e1", MatchRequest("", seq(20), lock=True, prefetch=True))
    assert (m.host_tokens, m.storage_tokens) == (40, 40)
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)
    m = ctl.match("e1", MatchRequest("", seq(20), lock=True))
    assert (m.device_tokens, m.host_tokens) == (0, 80)
    try:
        with pytest.raises(ResourceExhausted):
            list(ctl.load("e1", m.lock_id))
        assert [_in_l1(ctl, t) for t in cached] == [2] * 4, "the doomed load emptied L1"
    finally:
        ctl.release("e1", m.lock_id, None)
