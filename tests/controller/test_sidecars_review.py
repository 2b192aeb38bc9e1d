"""Sidecar pools review (`model.sidecars`): pools that share an anchor component's page ids
(FULL, SWA or MAMBA) and never vote on reuse. Their bytes, written by the test engine
(`engine_sim.Engine`: a function of page hash, member and layer), must survive every path
their anchor takes: L1 -> L2 (write-through, write-back; `layer_first` and `page_first`),
L2 -> L3 and back (prefetch, load), eviction and re-hit, SWA tails, MAMBA copy-on-write;
a second controller sharing the store reads them right, and a sidecar of another geometry
seeds other L3 keys. Config validation, stats and attach descriptors list them truthfully.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_sim import Engine, evict_all, prefetch_back, seq

from hicache.config import ConfigError, build_config
from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
NO_L3 = {"storage__backend": "none"}
THROUGH = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}
BACK = {"write__l1_to_l2": "write_back", "write__l2_to_l3": "write_back"}

# Sidecars with more layers than their anchor (the copy engine's layer loop must cover
# them) and of other widths; one anchored on each component.
IDX3 = {"anchor": "full", "layers": 3, "bytes_per_token_per_layer": 2}
SWA_IDX = {"anchor": "swa", "layers": 3, "bytes_per_token_per_layer": 4}
CONV = {"anchor": "mamba", "layers": 3, "state_bytes_per_layer": 24}
MODELS = {
    "full+idx": dict(model__sidecars={"idx": IDX3}),
    "full+2sidecars": dict(model__sidecars={"idx": IDX3, "a-scale_0": {"layers": 1, "bytes_per_token_per_layer": 1}}),
    "swa+swa_idx": dict(swa_only=True, model__sidecars={"swa_idx": SWA_IDX, "idx": IDX3}),
    "hybrid+all": dict(hybrid=True, model__sidecars={"idx": IDX3, "swa_idx": SWA_IDX, "conv": CONV}),
}


def _model(name: str) -> dict:
    return dict(MODELS[name])


# ----------------------------------------------------------------------------- L1 <-> L2


@pytest.mark.parametrize("policy", ["through", "back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("model", list(MODELS))
def test_sidecar_bytes_survive_l1_eviction_and_a_load_back(make, model: str, layout: str, policy: str) -> None:
    ctl = make(tiers__l2__layout=layout, **NO_L3, **(THROUGH if policy == "through" else BACK), **_model(model))
    eng = Engine(ctl)
    tokens = seq(6)
    eng.request(tokens)
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert (m.device_tokens, m.host_tokens) == (0, 24)
    before = eng.checked
    eng.request(tokens)  # loads from L2, verifies every member byte for byte
    assert eng.checked > before
    # Every member was checked: a second turn reuses all of it in L1.
    eng.request(tokens + seq(2, 900))
    ctl.check_integrity()


# ----------------------------------------------------------------------------- L2 <-> L3


def _only_in_l3(ctl, eng: Engine, tokens: bytes, policy: str) -> None:  # type: ignore[no-untyped-def]
    eng.request(tokens)
    evict_all(ctl, Tier.DEVICE)
    if policy == "back":
        ctl.flush(10)
    assert ctl.transfers.drain(10)
    ctl.flush(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)


@pytest.mark.parametrize("policy", ["through", "back"])
@pytest.mark.parametrize("model", list(MODELS))
def test_sidecar_bytes_survive_l3_and_a_prefetch_back(make, model: str, policy: str) -> None:
    ctl = make(**(THROUGH if policy == "through" else BACK), **_model(model))
    eng = Engine(ctl)
    tokens = seq(6)
    _only_in_l3(ctl, eng, tokens, policy)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 24)
    prefetch_back(ctl, tokens)
    before = eng.checked
    eng.request(tokens)
    assert eng.checked > before
    assert ctl.match("e1", MatchRequest("", tokens)).device_tokens == 24


@pytest.mark.parametrize("model", list(MODELS))
def test_a_second_controller_sharing_the_store_reads_the_sidecars_right(make, model: str) -> None:
    a = make(**THROUGH, **_model(model))
    tokens = seq(6)
    ea = Engine(a, "ea")
    ea.request(tokens)
    a.flush(10)
    b = make(**THROUGH, **_model(model))
    eb = Engine(b, "eb")
    assert b.match("eb", MatchRequest("", tokens)).storage_tokens == 24
    prefetch_back(b, tokens, engine_id="eb")
    eb.request(tokens)
    assert eb.checked > 0
    assert b.match("eb", MatchRequest("", tokens)).device_tokens == 24


GEOMETRY_VARIANTS = {
    "sidecar bytes": {"idx": {**IDX3, "bytes_per_token_per_layer": 4}},
    "sidecar layers": {"idx": {**IDX3, "layers": 2}},
    "sidecar name": {"idx2": IDX3},
    "sidecar dropped": {},
    "sidecar added": {"idx": IDX3, "extra": {"layers": 1, "bytes_per_token_per_layer": 1}},
    "sidecar anchor": {"idx": {**IDX3, "anchor": "swa"}},
}


@pytest.mark.parametrize("variant", list(GEOMETRY_VARIANTS))
def test_a_sidecar_of_another_geometry_changes_the_l3_keys(make, variant: str) -> None:
    """README: every sidecar's layers and bytes seed every L3 key: a daemon whose sidecar
    differs never reads the other's objects (not even the FULL ones)."""
    a = make(swa_only=True, model__sidecars={"idx": IDX3}, **THROUGH)
    tokens = seq(6)
    Engine(a, "ea").request(tokens)
    a.flush(10)
    b = make(swa_only=True, model__sidecars=GEOMETRY_VARIANTS[variant], **THROUGH)
    assert a.cfg.model.chain_seed("") != b.cfg.model.chain_seed("")
    Engine(b, "eb")
    m = b.match("eb", MatchRequest("", tokens))
    assert m.storage_tokens == 0


def test_an_sidecar_object_of_the_swa_tail_missing_in_l3_limits_the_prefetch(make) -> None:
    """A page needs every member's object: with the SWA sidecar's object of the last
    page gone the boundary at the end is not reusable from L3 (SWA needs its window)."""
    ctl = make(swa_only=True, model__sidecars={"swa_idx": SWA_IDX}, **THROUGH)
    eng = Engine(ctl)
    tokens = seq(6)
    _only_in_l3(ctl, eng, tokens, "through")
    assert ctl.match("e1", MatchRequest("", tokens)).storage_tokens == 24
    hs = eng.hashes(tokens)
    member = [m for m in ctl.cfg.model.members if m.name == "swa_idx"]
    key = ctl.l3.keys("", [hs[5]], member)[0]
    assert ctl.l3.backend.delete([key]) == 1
    ctl.l3.cache.forget([key])
    got = ctl.match("e1", MatchRequest("", tokens)).storage_tokens
    assert got < 24


# ----------------------------------------------------------------------------- MAMBA


def test_a_continued_checkpoint_is_copied_with_its_mamba_sidecars(make) -> None:
    """A request continuing an L1 checkpoint gets its own slot, a copy of the checkpoint:
    of MAMBA and of every MAMBA-anchored sidecar, every layer."""
    ctl = make(hybrid=True, model__sidecars={"idx": IDX3, "conv": CONV, "conv2": {**CONV, "layers": 1}},
               **NO_L3, **THROUGH)
    eng = Engine(ctl)
    prompt = seq(3)
    eng.request(prompt)
    longer = prompt + seq(2, 300)
    m = ctl.match("e1", MatchRequest("", longer, lock=True, allocate_tokens=len(longer) // 4))
    assert m.device_tokens == 12
    src = int(m.device_pages["mamba"][0])
    dst = int(m.pages["mamba"][0])
    assert src != dst
    for member in ctl.cfg.model.family(MAMBA):
        assert int(m.pages[member.name][0]) == dst and int(m.device_pages[member.name][0]) == src
        for layer in range(member.layers):
            rows = ctl.device.layer(member.name, layer).numpy()
            assert np.array_equal(rows[dst], rows[src]), (member.name, layer)
    ctl.release("e1", m.lock_id, m.allocation_id)


# ----------------------------------------------------------------------------- reports


def test_attach_lists_every_sidecar_pool_with_its_anchors_page_count(make) -> None:
    ctl = make(hybrid=True, model__sidecars={"idx": IDX3, "swa_idx": SWA_IDX, "conv": CONV}, **NO_L3)
    info = ctl.attach("e9", 0, 1)
    names = [m.name for m in info.members]
    assert names == ["full", "idx", "swa", "swa_idx", "mamba", "conv"]
    by = {m.name: m for m in info.members}
    assert by["idx"].component is FULL and by["idx"].anchor is FULL and by["idx"].layers == 3
    assert by["swa_idx"].component is SWA and by["conv"].component is MAMBA
    assert by["conv"].bytes_per_page_per_layer == 24
    assert by["swa_idx"].bytes_per_page_per_layer == 16
    pools = {p.member: p for p in info.pools}
    assert set(pools) == set(names)
    for name, spec in by.items():
        p = pools[name]
        n = ctl.cfg.pages_for(spec.component)
        assert p.num_pages == n == ctl.device.allocator(spec.component).total
        assert p.layers == spec.layers
        assert p.page_stride_bytes == spec.bytes_per_page_per_layer
        assert p.layer_stride_bytes == n * spec.bytes_per_page_per_layer
        assert p.size_bytes == spec.layers * n * spec.bytes_per_page_per_layer
        arr = ctl.device.layer(name, spec.layers - 1).numpy()
        assert arr.shape == (n, spec.bytes_per_page_per_layer)


def test_stats_report_each_sidecar_pool_as_its_anchor(make) -> None:
    ctl = make(hybrid=True, model__sidecars={"idx": IDX3, "swa_idx": SWA_IDX, "conv": CONV}, **NO_L3,
               **THROUGH)
    eng = Engine(ctl)
    eng.request(seq(5))
    assert ctl.transfers.drain(10)
    m = ctl.match("e1", MatchRequest("", seq(5), lock=True))
    pools = {(p.tier, p.member): p for p in ctl.stats().pools}
    anchors = {"idx": "full", "swa_idx": "swa", "conv": "mamba"}
    for tier in ("device", "host"):
        for side, anchor in anchors.items():
            s, a = pools[(tier, side)], pools[(tier, anchor)]
            assert (s.capacity_pages, s.used_pages, s.locked_pages) == (
                a.capacity_pages, a.used_pages, a.locked_pages), (tier, side)
    assert pools[("device", "idx")].locked_pages >= 5
    ctl.release("e1", m.lock_id, None)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(("sidecars", "components", "message"), [
    ({"swa": {"bytes_per_token_per_layer": 1}}, None, r"model\.sidecars\.swa: a sidecar may not take a component's name"),
    ({"mamba": {"bytes_per_token_per_layer": 1}}, None, r"model\.sidecars\.mamba: a sidecar may not take"),
    ({"ix": {"anchor": "mamba", "state_bytes_per_layer": 4}}, None,
     r"model\.sidecars\.ix\.anchor: 'mamba' is not a configured component; allowed: \['full'\]"),
    ({"ix": {"anchor": "full"}}, None, r"model\.sidecars\.ix\.bytes_per_token_per_layer: 0 must be > 0"),
    ({"ix": {"bytes_per_token_per_layer": 2, "layers": 0}}, None, r"model\.sidecars\.ix\.layers: 0 must be > 0"),
    ({"ix": {"anchor": "mamba"}}, "mamba", r"model\.sidecars\.ix\.state_bytes_per_layer: 0 must be > 0"),
    ({"ix": {"anchor": "mamba", "state_bytes_per_layer": 4, "bytes_per_token_per_layer": 2}}, "mamba",
     r"model\.sidecars\.ix\.bytes_per_token_per_layer: .*mamba-anchored sidecar"),
    ({"ix": {"anchor": "swa", "bytes_per_token_per_layer": 2, "state_bytes_per_layer": 2}}, "swa",
     r"model\.sidecars\.ix\.state_bytes_per_layer: .*swa-anchored sidecar"),
    ({"": {"bytes_per_token_per_layer": 2}}, None, r"model\.sidecars: name .* must be 1-32 ASCII"),
    ({"a/b": {"bytes_per_token_per_layer": 2}}, None, r"model\.sidecars: name .* must be 1-32 ASCII"),
    ({"x" * 33: {"bytes_per_token_per_layer": 2}}, None, r"model\.sidecars: name .* must be 1-32 ASCII"),
])
def test_a_bad_sidecar_entry_is_refused_naming_its_key(sidecars: dict, components: str | None, message: str) -> None:
    comps: dict = {"full": {"layers": 1, "bytes_per_token_per_layer": 2}}
    if components == "mamba":
        comps["mamba"] = {"layers": 1, "state_bytes_per_layer": 8}
    if components == "swa":
        comps["swa"] = {"layers": 1, "bytes_per_token_per_layer": 2, "window_tokens": 64}
    with pytest.raises(ConfigError, match=message):
        build_config({"model": {"components": comps, "sidecars": sidecars}})


# ----------------------------------------------------------------------------- seeded fuzz

FUZZ = {
    "swa-sidecars-wt-wb": dict(swa_only=True, model__sidecars={"idx": IDX3, "swa_idx": SWA_IDX},
                               write__l1_to_l2="write_through", write__l2_to_l3="write_back"),
    "hybrid-all-wb-wt": dict(hybrid=True, model__sidecars={"idx": IDX3, "swa_idx": SWA_IDX, "conv": CONV},
                             write__l1_to_l2="write_back", write__l2_to_l3="write_through"),
}


@pytest.mark.parametrize("seed", [7])
@pytest.mark.parametrize("config", list(FUZZ))
def test_seeded_fuzz_with_sidecars_on_every_anchor(make, config: str, seed: int) -> None:
    """The model fuzz of `test_model_fuzz_review` (every reused page of every member
    verified byte for byte, integrity audited) with sidecars on FULL, SWA and MAMBA that
    have more layers than their anchors."""
    from test_model_fuzz_review import LIMIT, Model

    kw = FUZZ[config]
    ctl = make(l1_tokens=64, server__max_tokens_per_request=LIMIT, **kw)
    lossless = all(kw.get(k) in ("write_through", "write_back") for k in ("write__l1_to_l2", "write__l2_to_l3"))
    model = Model(ctl, seed * 100 + list(FUZZ).index(config), lossless=lossless)
    try:
        model.run(60)
    except BaseException as e:
        e.add_note(f"ops: {model.log}")
        raise


# ----------------------------------------------------------------------------- L3 evictions


def test_storage_evictions_count_the_full_pages_the_store_evicted(make, tmp_path) -> None:
    """README: `hicache_evictions_total{tier="storage"}` counts the store's own evictions in
    pages, as the other tiers count FULL pages. A hybrid model with sidecars (5 members)
    and a file store of 4 KB: 12 prompts of 4 pages written through one at a time."""
    ctl = make(hybrid=True, storage__file__capacity_gb=4e-6, **THROUGH)
    eng = Engine(ctl)
    prompts = [seq(4, 1000 * (i + 1)) for i in range(12)]
    for p in prompts:
        eng.request(p)
        assert ctl.transfers.drain(10)
        ctl.flush(10)
    full = ctl.cfg.model.family(FULL)[:1]
    gone = sum(not os.path.exists(ctl.l3.backend.path_of(k))
               for p in prompts for k in ctl.l3.keys("", eng.hashes(p), full))
    assert gone > 0
    assert ctl.stats().counters["evictions_storage"] == gone
