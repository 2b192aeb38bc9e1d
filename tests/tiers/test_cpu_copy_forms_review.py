"""Review of the CPU copy forms after the numpy-views refactor (tiers/rows.py, tiers/copy.py):
every form (inline items, numpy RUNS/GATHER/SCATTER/STAGED jobs, torch slice copies and
`index_select` gathers, `copy_within_device`, `copy_rows`) moves exactly the bytes a plain
per-page numpy copy moves, for both L2 layouts, every family (FULL + sidecar, SWA, MAMBA),
rows that widen to int64/int32/int16/uint8, tensor-parallel rows, 64/65 pairs; the numpy
views and their lazy torch tensors alias one memory; small copies (and the numpy-only large
forms) run in a process where torch cannot be imported; `cuda_available()` without device
nodes never imports torch."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache.tiers.copy as copy_mod
from hicache.config import HicacheConfig, build_config
from hicache.tiers.base import MemberPools
from hicache.tiers.copy import CpuCopyEngine
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools, build_host_pools
from hicache.tiers.rows import (
    SMALL_COPY_PAGES,
    LayerRows,
    MemberRows,
    PlanKind,
    _grid,
    plan_rows,
    widen_array,
)
from hicache.types import ComponentKind

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
FAMILIES = (FULL, SWA, MAMBA)
TESTS = Path(__file__).parent
REPO = TESTS.parent.parent

# (page_size, full, idx sidecar, swa bytes per token per layer, mamba state bytes, tp): rows of
# full/idx/swa/mamba in bytes per page-layer (x tp) and the dtype they widen to.
GEOMETRIES = {
    # 2 (int16), 1 (uint8), 3 (uint8), 5 (uint8)
    "odd": (1, 2, 1, 3, 5, 1),
    # 6, 10, 10 (int16), 34 (int16)
    "int16": (2, 3, 5, 5, 34, 1),
    # tp 2: 4 (int32), 2 (int16), 6 (int16), 68 (int32)
    "tp2": (1, 2, 1, 3, 34, 2),
    # 32, 8 (int64), 12 (int32), 24 (int64)
    "int64": (4, 8, 2, 3, 24, 1),
}
WIDE = {np.dtype(t) for t in (np.int64, np.int32, np.int16, np.uint8)}


def geometry_config(
    geometry: str, layout: str, l1_pages: int = 100, mamba_slots: int = 70, ratio: float = 2.0
) -> HicacheConfig:
    ps, full, side, swa, mamba, tp = GEOMETRIES[geometry]
    raw = {
        "model": {
            "page_size": ps,
            "tp_size": tp,
            "components": {
                "full": {"layers": 3, "bytes_per_token_per_layer": full},
                "swa": {"layers": 2, "bytes_per_token_per_layer": swa, "window_tokens": 4 * ps},
                "mamba": {"layers": 2, "state_bytes_per_layer": mamba},
            },
            "sidecars": {"idx": {"anchor": "full", "layers": 4, "bytes_per_token_per_layer": side}},
        },
        "tiers": {
            "l1": {"tokens": l1_pages * ps, "mamba_slots": mamba_slots},
            "l2": {"ratio": ratio, "reserve_gb": 0, "layout": layout},
        },
    }
    return build_config(raw)


Snapshot = dict[str, list[np.ndarray]]


def randomize(pools: MemberPools, rng: np.random.Generator) -> None:
    for spec in pools.members:
        for layer in range(spec.layers):
            rows = pools.layer_array(spec.name, layer)
            rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)


def snapshot(pools: MemberPools, family: ComponentKind) -> Snapshot:
    return {
        spec.name: [pools.layer_array(spec.name, layer).copy() for layer in range(spec.layers)]
        for spec in pools.family(family)
    }


def reference(src: Snapshot, s: np.ndarray, dst: Snapshot, d: np.ndarray) -> Snapshot:
    """The plain reference: one page at a time, row d[i] of every member/layer becomes row s[i]."""
    out = {name: [rows.copy() for rows in layers] for name, layers in dst.items()}
    for name, layers in out.items():
        for layer, rows in enumerate(layers):
            for si, di in zip(s.tolist(), d.tolist(), strict=True):
                rows[di, :] = src[name][layer][si, :]
    return out


def assert_same(actual: Snapshot, expected: Snapshot, where: object = "") -> None:
    for name, layers in expected.items():
        for layer, rows in enumerate(layers):
            if not np.array_equal(actual[name][layer], rows):
                bad = np.flatnonzero((actual[name][layer] != rows).any(axis=1))
                raise AssertionError(f"{where}: {name} layer {layer} differs at pages {bad[:8]}")


def id_pattern(
    kind: PlanKind, n: int, n_dev: int, n_host: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(L1 ids, L2 ids) that make `plan_rows(L1, L2)` choose `kind` (n >= 2)."""
    if kind is PlanKind.RUNS:
        # two long runs that break together: RUNS but not one run
        h = n // 2
        return (np.r_[np.arange(0, h), np.arange(n_dev - (n - h), n_dev)],
                np.r_[np.arange(n_host - h, n_host), np.arange(1, 1 + n - h)])
    if kind is PlanKind.GATHER:
        return rng.permutation(n_dev)[:n], np.arange(n_host - n - 3, n_host - 3)
    if kind is PlanKind.SCATTER:
        return np.arange(n_dev - n, n_dev), rng.permutation(n_host)[:n]
    return rng.permutation(n_dev)[:n], rng.permutation(n_host)[:n]


_SWAPPED = {PlanKind.GATHER: PlanKind.SCATTER, PlanKind.SCATTER: PlanKind.GATHER}


class Spy:
    """Counts which executor each copy took (inline, torch, numpy jobs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name, tag in (("_copy_inline", "inline"), ("_torch_copy", "torch"), ("_jobs", "jobs")):
            real = getattr(copy_mod, name)

            def wrapped(*a: Any, _real: Any = real, _tag: str = tag, **k: Any) -> Any:
                self.calls.append(_tag)
                return _real(*a, **k)

            monkeypatch.setattr(copy_mod, name, wrapped)

    def take(self) -> list[str]:
        out, self.calls = self.calls, []
        return out


@pytest.fixture
def pools_for(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> Iterator[Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]]]:
    engines: list[CpuCopyEngine] = []

    def make(cfg: HicacheConfig, threads: int = 2) -> tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]:
        dev, host = make_device(cfg), make_host(cfg)
        rng = np.random.default_rng(20261202)
        randomize(dev, rng)
        randomize(host, rng)
        engine = CpuCopyEngine(dev, host, threads=threads)
        engines.append(engine)
        return dev, host, engine

    yield make
    for engine in engines:
        engine.close()


# ------------------------------------------------------------------ the whole matrix


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_every_copy_form_matches_a_per_page_reference(
    pools_for: Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]],
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    geometry: str,
) -> None:
    """Every family, 64 and 65 pairs (inline / planned), every plan kind, both directions,
    with and without per-layer reports: bytes equal the per-page reference, reports are
    0..layers-1 in order, and the executor is the one `_torch_form` promises."""
    dev, host, engine = pools_for(geometry_config(geometry, layout))
    spy = Spy(monkeypatch)
    rng = np.random.default_rng(zlib.crc32(f"{layout}/{geometry}".encode()))
    dtypes: set[np.dtype] = set()
    kinds_seen: set[PlanKind] = set()
    for family in FAMILIES:
        n_dev, n_host = dev.num_pages(family), host.num_pages(family)
        layers = max(spec.layers for spec in dev.family(family))
        for spec in dev.family(family):
            dtypes.add(MemberRows.of(dev, spec.name, spec.layers).layers[0].array.dtype)
        for n, kind, to_host, report in itertools.product(
            (SMALL_COPY_PAGES - 1, SMALL_COPY_PAGES, SMALL_COPY_PAGES + 1, SMALL_COPY_PAGES + 2),
            PlanKind, (True, False), (False, True),
        ):
            dev_ids, host_ids = id_pattern(kind, n, n_dev, n_host, rng)
            src, s, dst, d = (dev, dev_ids, host, host_ids) if to_host else (host, host_ids, dev, dev_ids)
            want_kind = kind if to_host else _SWAPPED.get(kind, kind)
            assert plan_rows(s, d).kind is want_kind
            want = reference(snapshot(src, family), s, snapshot(dst, family), d)
            seen: list[int] = []
            copy = engine.device_to_host if to_host else engine.host_to_device
            result = copy(family, s, d, on_layer=seen.append if report else None)
            where = (family, n, kind, to_host, report)
            assert_same(snapshot(dst, family), want, where)
            assert seen == (list(range(layers)) if report else []), where
            page_bytes = sum(m.bytes_per_page for m in dev.family(family))
            assert (result.pages, result.bytes, result.layers) == (n, n * page_bytes, layers)
            calls = spy.take()
            if n <= SMALL_COPY_PAGES:
                assert calls == ["inline"], where
                continue
            kinds_seen.add(want_kind)
            # (only torch gathers into strided rows: page_first L2 slots)
            strided_gather = want_kind is PlanKind.GATHER and to_host and layout == "page_first"
            torch_form = strided_gather or (
                want_kind in (PlanKind.RUNS, PlanKind.GATHER) and not report)
            assert calls == (["torch"] if torch_form else ["jobs"]), where
            randomize(dst, rng)  # fresh bytes so that a stale row cannot pass by chance
    assert kinds_seen == set(PlanKind)
    assert dtypes <= WIDE


def test_small_chunks_on_many_threads_match_the_reference(
    pools_for: Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The numpy jobs cut to a few rows each and taken by 4 threads (GATHER/SCATTER/STAGED
    runs cut at chunk boundaries) still move exactly the reference's bytes, page_first
    with int16 rows."""
    dev, host, engine = pools_for(geometry_config("int16", "page_first"), threads=4)
    monkeypatch.setattr(copy_mod, "CHUNK_BYTES", 40)
    rng = np.random.default_rng(5)
    for family in FAMILIES:
        n_dev, n_host = dev.num_pages(family), host.num_pages(family)
        for kind, to_host in itertools.product(PlanKind, (True, False)):
            dev_ids, host_ids = id_pattern(kind, 66, n_dev, n_host, rng)
            src, s, dst, d = (dev, dev_ids, host, host_ids) if to_host else (host, host_ids, dev, dev_ids)
            want = reference(snapshot(src, family), s, snapshot(dst, family), d)
            seen: list[int] = []
            (engine.device_to_host if to_host else engine.host_to_device)(family, s, d, seen.append)
            assert_same(snapshot(dst, family), want, (family, kind, to_host))
            assert seen == list(range(max(m.layers for m in dev.family(family))))


@pytest.fixture(scope="module")
def shared_pools() -> Iterator[tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]]:
    """Module-wide pools for the property test (page_first, odd widths: uint8 and int16 rows)."""
    cfg = geometry_config("odd", "page_first", l1_pages=90, mamba_slots=8)
    dev = ShmDevicePools.create(cfg, f"t{os.getpid()}_rv_{uuid.uuid4().hex[:8]}")
    host = build_host_pools(cfg, pin=False)
    engine = CpuCopyEngine(dev, host)
    randomize(dev, np.random.default_rng(1))
    randomize(host, np.random.default_rng(2))
    yield dev, host, engine
    engine.close()
    host.close()
    dev.close()


@st.composite
def id_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, bool]:
    """(source ids, destination ids, L1 -> L2?) made of a few runs of random starts and
    lengths; destinations distinct, sources may repeat (L1 -> L2: several L2 copies of a
    page). The pools: 90 L1 pages, 180 L2 pages."""
    n = draw(st.integers(0, 90))
    to_host = draw(st.booleans())

    def side(pages: int, distinct: bool) -> np.ndarray:
        ids: list[int] = []
        while len(ids) < n:
            start, length = draw(st.integers(0, pages - 1)), draw(st.integers(1, 40))
            ids += [(start + k) % pages for k in range(length)]
        if distinct:
            ids = list(dict.fromkeys(ids))
            taken = set(ids)
            ids += [p for p in range(pages) if p not in taken]
        return np.array(ids[:n], dtype=np.int64)

    s = side(90 if to_host else 180, distinct=not (to_host and draw(st.booleans())))
    d = side(180 if to_host else 90, distinct=True)
    return s, d, to_host


@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=id_batches(), report=st.booleans())
def test_random_run_mixes_match_the_reference(
    shared_pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
    batch: tuple[np.ndarray, np.ndarray, bool],
    report: bool,
) -> None:
    dev, host, engine = shared_pools
    s, d, to_host = batch
    assert (dev.num_pages(FULL), host.num_pages(FULL)) == (90, 180)
    src, dst = (dev, host) if to_host else (host, dev)
    want = reference(snapshot(src, FULL), s, snapshot(dst, FULL), d)
    seen: list[int] = []
    (engine.device_to_host if to_host else engine.host_to_device)(
        FULL, s, d, seen.append if report else None)
    assert_same(snapshot(dst, FULL), want, plan_rows(s, d).kind if s.size else "empty")
    assert seen == ([0, 1, 2, 3] if report else [])


# ------------------------------------------------------------------ copy_within_device


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_copy_within_device_moves_one_slot_of_every_member(
    pools_for: Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]],
    geometry: str,
) -> None:
    dev, host, engine = pools_for(geometry_config(geometry, "page_first", l1_pages=20, mamba_slots=6))
    host_before = {k: snapshot(host, k) for k in FAMILIES}
    for family, (src, dst) in itertools.product(FAMILIES, ((0, 5), (5, 0), (3, 4), (4, 3))):
        others = {k: snapshot(dev, k) for k in FAMILIES if k is not family}
        want = reference(snapshot(dev, family), np.array([src]), snapshot(dev, family), np.array([dst]))
        engine.copy_within_device(family, src, dst)
        assert_same(snapshot(dev, family), want, (family, src, dst))
        for k, snap in others.items():
            assert_same(snapshot(dev, k), snap, ("untouched", k))
    for k in FAMILIES:
        assert_same(snapshot(host, k), host_before[k], ("host untouched", k))


# ------------------------------------------------------------------ views and aliasing


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_numpy_views_and_lazy_tensors_alias_the_pools(
    make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
    layout: str,
    geometry: str,
) -> None:
    """`LayerRows.array`/`items`/`tensor` and `MemberRows.grid`/`stacked` are one memory:
    a write through any of them is seen by the others and by the pool's own views."""
    import torch

    cfg = geometry_config(geometry, layout, l1_pages=12, mamba_slots=4)
    rng = np.random.default_rng(9)
    for pools in (make_device(cfg), make_host(cfg)):
        for spec in pools.members:
            rows = MemberRows.of(pools, spec.name, spec.layers)
            assert rows.grid is not None and rows.stacked is not None
            assert rows.grid.dtype == rows.layers[0].array.dtype == np.dtype(
                str(rows.stacked.dtype).replace("torch.", ""))
            for layer, lr in enumerate(rows.layers):
                raw = pools.layer_array(spec.name, layer)
                width = spec.bytes_per_page_per_layer
                assert lr.array.view(np.uint8).shape == raw.shape == (pools.num_pages(spec.component), width)
                assert lr.tensor.data_ptr() == raw.ctypes.data == rows.stacked[layer].data_ptr()
                assert np.shares_memory(lr.array, raw) and np.shares_memory(rows.grid[layer], raw)
                page = int(rng.integers(pools.num_pages(spec.component)))
                # numpy -> tensor
                new = rng.integers(0, 256, width, dtype=np.uint8)
                raw[page] = new
                assert np.array_equal(lr.tensor[page].view(torch.uint8).numpy(), new)
                assert np.array_equal(rows.stacked[layer, page].view(torch.uint8).numpy(), new)
                assert lr.items[page].tobytes() == new.tobytes()
                # tensor -> numpy
                new = rng.integers(0, 256, width, dtype=np.uint8)
                lr.tensor[page].view(torch.uint8).copy_(torch.from_numpy(new))
                assert np.array_equal(raw[page], new)
                assert np.array_equal(rows.grid[layer, page].view(np.uint8), new)
                # stacked -> items
                new = rng.integers(0, 256, width, dtype=np.uint8)
                rows.stacked[layer, page].view(torch.uint8).copy_(torch.from_numpy(new))
                assert lr.items[page].tobytes() == new.tobytes()
                assert np.array_equal(pools.layer(spec.name, layer)[page].numpy(), new)
            assert rows.stacked is rows.stacked and rows.layers[0].tensor is rows.layers[0].tensor


def _expected_width(row: int, stride: int, offset: int) -> np.dtype:
    for size, dtype in ((8, np.int64), (4, np.int32), (2, np.int16)):
        if row % size == 0 and stride % size == 0 and offset % size == 0:
            return np.dtype(dtype)
    return np.dtype(np.uint8)


_BUFFER = np.zeros(1 << 14, dtype=np.uint8)
_BASE = (-_BUFFER.ctypes.data) % 64


@settings(max_examples=200, derandomize=True, deadline=None)
@given(offset=st.integers(0, 63), row=st.integers(1, 40), extra=st.integers(0, 24),
       pages=st.integers(1, 20), layers=st.integers(2, 4), gap=st.integers(0, 17))
def test_widen_array_picks_the_widest_exact_view(
    offset: int, row: int, extra: int, pages: int, layers: int, gap: int
) -> None:
    """Misaligned addresses and strides: the widest dtype dividing row, strides and
    address; the view covers exactly the same bytes (same address, same rows)."""
    stride = row + extra
    buf = _BUFFER[_BASE + offset:]
    rows = np.lib.stride_tricks.as_strided(buf, (pages, row), (stride, 1))
    wide = widen_array(rows)
    assert wide.dtype == _expected_width(row, stride, offset)
    assert wide.ctypes.data == rows.ctypes.data and wide.strides[0] == stride
    assert np.array_equal(wide.view(np.uint8), rows)
    # a 3-D grid with a layer step
    step = pages * stride + gap
    grid = np.lib.stride_tricks.as_strided(buf, (layers, pages, row), (step, stride, 1))
    wide = widen_array(grid)
    assert wide.dtype == _expected_width(row, np.gcd(stride, step), offset)
    assert wide.ctypes.data == grid.ctypes.data
    assert wide.strides[:2] == (step, stride)
    assert wide.view(np.uint8).shape == grid.shape


def _rows_at(raw: np.ndarray, offset: int, n: int, row: int, layers: int, stride: int) -> list[np.ndarray]:
    base = (-raw.ctypes.data) % 64 + offset
    return [np.lib.stride_tricks.as_strided(raw[base + layer * n * stride:], (n, row), (stride, 1))
            for layer in range(layers)]


@pytest.mark.parametrize(("src_at", "dst_at"), [((0, 16), (1, 16)), ((0, 16), (2, 18)),
                                                ((4, 20), (0, 24)), ((3, 16), (0, 16))])
def test_executors_fall_back_to_bytes_when_the_sides_widen_differently(
    src_at: tuple[int, int], dst_at: tuple[int, int]
) -> None:
    """`_same_width` / `_same_array`: rows of one width that widen to different dtypes on
    the two sides (misaligned address or stride) are moved as bytes by both executors."""
    rng = np.random.default_rng(17)
    n, row, layers = 200, 16, 3
    src_raw = np.zeros(layers * n * 24 + 128, np.uint8)
    dst_raw = np.zeros(layers * n * 24 + 128, np.uint8)
    srows = _rows_at(src_raw, src_at[0], n, row, layers, src_at[1])
    drows = _rows_at(dst_raw, dst_at[0], n, row, layers, dst_at[1])
    for r in srows:
        r[...] = rng.integers(0, 256, r.shape, dtype=np.uint8)
    src = MemberRows(tuple(LayerRows.of(r) for r in srows), _grid(srows))
    dst = MemberRows(tuple(LayerRows.of(r) for r in drows), _grid(drows))
    assert src.grid is not None and dst.grid is not None
    assert src.layers[0].array.dtype != dst.layers[0].array.dtype
    cases = [(np.arange(10, 110), np.arange(50, 150)),
             (rng.permutation(n)[:100], np.arange(3, 103)),
             (np.arange(0, 100), rng.permutation(n)[:100]),
             (rng.permutation(n)[:100], rng.permutation(n)[:100])]
    for (s, d), executor, report in itertools.product(cases, ("torch", "jobs"), (False, True)):
        plan = plan_rows(s, d)
        if executor == "torch" and plan.kind not in (PlanKind.RUNS, PlanKind.GATHER):
            continue
        if (executor == "jobs" and plan.kind is PlanKind.GATHER
                and not copy_mod._contiguous_rows([(src, dst)])):
            continue  # (np.take wants contiguous destination rows: torch does that one)
        for r in drows:
            r[...] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        want = [r.copy() for r in drows]
        for layer in range(layers):
            for si, di in zip(s.tolist(), d.tolist(), strict=True):
                want[layer][di] = srows[layer][si]
        seen: list[int] = []
        if executor == "torch":
            copy_mod._torch_copy(plan, [(src, dst)], layers, seen.append if report else None)
        else:
            for _, job in copy_mod._jobs(plan, [(src, dst)], layers):
                job()
        for layer in range(layers):
            assert np.array_equal(drows[layer], want[layer]), (plan.kind, executor, report, layer)


@pytest.mark.parametrize("width", [2, 6, 10, 34, 17, 32])
@pytest.mark.parametrize("to_host", [True, False])
def test_copy_rows_moves_one_strided_layer_exactly(width: int, to_host: bool) -> None:
    """The CUDA engine's host side (`copy_rows` on CPU tensors): staging rows <-> one
    page_first-like strided layer (64 B header, 64 B-aligned slots), every plan kind
    (GATHER into the strided rows goes to torch)."""
    import torch

    rng = np.random.default_rng(width)
    n_host, n = 160, 80
    slot = -(-(64 + 3 * width) // 64) * 64
    raw = np.zeros(n_host * slot + 64, np.uint8)
    base = (-raw.ctypes.data) % 64
    host_np = raw[base: base + n_host * slot].reshape(n_host, slot)[:, 64 + width: 64 + 2 * width]
    host_rows = torch.from_numpy(host_np)
    host_np[...] = rng.integers(0, 256, host_np.shape, dtype=np.uint8)
    kinds = set()
    cases = [(np.arange(n), np.arange(30, 30 + n)), (np.arange(n), rng.permutation(n_host)[:n]),
             (rng.permutation(n), np.arange(30, 30 + n)),
             (rng.permutation(n), rng.permutation(n_host)[:n])]
    with ThreadPoolExecutor(2) as pool:
        for staged, host_ids in cases:
            staging = torch.from_numpy(rng.integers(0, 256, (n, width), dtype=np.uint8))
            before_host, before_staging = host_np.copy(), staging.numpy().copy()
            if to_host:
                plan = plan_rows(staged, host_ids)
                copy_mod.copy_rows(plan, staging, host_rows, pool)
                for st_id, h in zip(staged.tolist(), host_ids.tolist(), strict=True):
                    before_host[h] = before_staging[st_id]
                assert np.array_equal(host_np, before_host), plan.kind
            else:
                plan = plan_rows(host_ids, staged)
                copy_mod.copy_rows(plan, host_rows, staging, pool)
                for st_id, h in zip(staged.tolist(), host_ids.tolist(), strict=True):
                    before_staging[st_id] = before_host[h]
                assert np.array_equal(staging.numpy(), before_staging), plan.kind
                assert np.array_equal(host_np, before_host)
            kinds.add(plan.kind)
    assert kinds == set(PlanKind)


# ------------------------------------------------------------------ without torch


def _run_python(code: str, block_torch: bool) -> Any:
    prelude = "import sys\n" + ("sys.modules['torch'] = None\n" if block_torch else "")
    prelude += f"sys.path.insert(0, {str(TESTS)!r})\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_TORCHLESS_FORMS = """
import itertools, json, os
import numpy as np
import hicache.tiers.copy as copy_mod
from hicache.tiers.accelerator import cuda_available
from hicache.tiers.copy import CpuCopyEngine, copies_can_be_large
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import build_host_pools
from hicache.tiers.rows import MemberRows, PlanKind, plan_rows
from test_cpu_copy_forms_review import (FAMILIES, geometry_config, id_pattern, randomize,
                                        reference, snapshot, assert_same)
results = []
rng = np.random.default_rng(3)
for i, (layout, geometry) in enumerate(itertools.product(("layer_first", "page_first"),
                                                         ("odd", "int16", "tp2", "int64"))):
    cfg = geometry_config(geometry, layout, l1_pages=64, mamba_slots=8)
    dev = ShmDevicePools.create(cfg, f"t{os.getpid()}_nt{i}")
    host = build_host_pools(cfg)  # pin=None asks cuda_available(): no torch for that
    assert not copies_can_be_large(dev, host)
    engine = CpuCopyEngine(dev, host)
    randomize(dev, rng); randomize(host, rng)
    for spec in dev.members:
        assert MemberRows.of(dev, spec.name, spec.layers).grid is not None
    for family, n, kind, to_host, report in itertools.product(
            FAMILIES, (1, 7, 64), PlanKind, (True, False), (False, True)):
        n = min(n, dev.num_pages(family))
        if n < 2 and kind is not PlanKind.RUNS:
            continue
        dev_ids, host_ids = id_pattern(kind, n, dev.num_pages(family), host.num_pages(family), rng)
        src, s, dst, d = (dev, dev_ids, host, host_ids) if to_host else (host, host_ids, dev, dev_ids)
        want = reference(snapshot(src, family), s, snapshot(dst, family), d)
        seen = []
        (engine.device_to_host if to_host else engine.host_to_device)(
            family, s.astype(np.int32), d, seen.append if report else None)
        assert_same(snapshot(dst, family), want, (layout, geometry, family, n, kind))
        assert seen == (list(range(max(m.layers for m in dev.family(family)))) if report else [])
        results.append("inline")
    for family in FAMILIES:
        want = reference(snapshot(dev, family), np.array([1]), snapshot(dev, family), np.array([2]))
        engine.copy_within_device(family, 1, 2)
        assert_same(snapshot(dev, family), want, ("cow", family))
        results.append("cow")
    # The large forms numpy alone does (SCATTER, STAGED; RUNS/GATHER with reports, into
    # contiguous rows): forced past the threshold, they too run without torch.
    copy_mod.SMALL_COPY_PAGES = 0
    for family, kind, to_host in itertools.product(FAMILIES, PlanKind, (True, False)):
        n = min(40, dev.num_pages(family))
        dev_ids, host_ids = id_pattern(kind, n, dev.num_pages(family), host.num_pages(family), rng)
        src, s, dst, d = (dev, dev_ids, host, host_ids) if to_host else (host, host_ids, dev, dev_ids)
        plan = plan_rows(s, d)
        if plan.kind is PlanKind.GATHER and layout == "page_first" and to_host:
            continue  # (only torch gathers into strided rows)
        want = reference(snapshot(src, family), s, snapshot(dst, family), d)
        seen = []
        (engine.device_to_host if to_host else engine.host_to_device)(family, s, d, seen.append)
        assert_same(snapshot(dst, family), want, ("large", layout, geometry, family, kind))
        results.append(plan.kind.value)
    copy_mod.SMALL_COPY_PAGES = 64
    engine.close(); host.close(); dev.close()
mods = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"blocked": sys.modules.get("torch", 1) is None, "torch_modules": mods,
                  "cuda": cuda_available(), "counts": {k: results.count(k) for k in set(results)}}))
"""


def test_small_copies_and_numpy_forms_run_where_torch_cannot_be_imported() -> None:
    """In a process where `import torch` fails: pool views, every inline copy form (all
    families, layouts, widths, 1..64 pairs, with reports), copy-on-write, and the large
    numpy-only forms move the reference's bytes; host pools pin=None, cuda_available()."""
    got = _run_python(_TORCHLESS_FORMS, block_torch=True)
    assert got["blocked"] and got["torch_modules"] == ["torch"]  # (only the blocking None)
    assert got["cuda"] is False
    counts = got["counts"]
    assert counts["cow"] == 8 * 3 and counts["inline"] > 8 * 3 * 3 * 4
    assert {"runs", "gather", "scatter", "staged"} <= set(counts)


_CUDA_AVAILABLE = """
import json
import hicache.tiers.accelerator as acc
import os
nodes = [p for p in acc.DEVICE_NODES if os.path.exists(p)]
first = acc.cuda_available()
imported_first = "torch" in sys.modules
acc.DEVICE_NODES = ("/proc/self",)  # a node that exists: now torch is asked
second = acc.cuda_available()
import torch
print(json.dumps([nodes, first, imported_first, second, torch.cuda.is_available(),
                  "torch" in sys.modules]))
"""


def test_cuda_available_without_device_nodes_never_imports_torch() -> None:
    nodes, first, imported_first, second, truth, imported = _run_python(_CUDA_AVAILABLE, False)
    if nodes:
        pytest.skip(f"this machine has GPU nodes: {nodes}")
    assert (first, imported_first) == (False, False)
    assert second == truth and imported


# ------------------------------------------------------------------ bugs


_REPEATED_SOURCES = """
import json, os
import numpy as np
from tierkit import TINY
from hicache.config import build_config
from hicache.tiers.copy import CpuCopyEngine, copies_can_be_large
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import build_host_pools
from hicache.types import ComponentKind
raw = {**TINY, "tiers": {**TINY["tiers"], "l2": {"ratio": 5.0, "reserve_gb": 0}}}
cfg = build_config(raw)
dev = ShmDevicePools.create(cfg, f"t{os.getpid()}_rep")
host = build_host_pools(cfg, pin=False)
engine = CpuCopyEngine(dev, host)
full = dev.layer_array("full", 0)
full[...] = np.arange(full.size, dtype=np.int64).reshape(full.shape) % 251
# 65 L1 -> L2 pairs: every L1 page (16) copied to several L2 pages (80): distinct
# destinations, as the engine's contract requires; the sources may repeat.
s, d = np.arange(65) % 16, np.arange(65)
try:
    engine.device_to_host(ComponentKind.FULL, s, d)
    ok = bool(np.array_equal(host.layer_array("full", 0)[d], full[s]))
    error = None
except Exception as e:
    ok, error = False, f"{type(e).__name__}: {e}"
print(json.dumps([dev.num_pages(ComponentKind.FULL), host.num_pages(ComponentKind.FULL),
                  copies_can_be_large(dev, host), ok, error]))
engine.close(); host.close(); dev.close()
"""


def test_a_large_copy_from_a_small_l1_with_repeated_sources_needs_no_torch() -> None:
    """The contract forbids only repeated destination ids, so an L1 -> L2 copy can have
    up to L2-pages pairs even when L1 holds <= SMALL_COPY_PAGES: such a copy takes the
    planned path, and its GATHER numpy's form (the engine never imports torch there)."""
    l1, l2, large, ok, error = _run_python(_REPEATED_SOURCES, block_torch=True)
    assert (l1, l2, large) == (16, 80, False)
    assert ok, error


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_large_copies_accept_reversed_id_views(
    pools_for: Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]], layout: str
) -> None:
    """`checked_ids` accepts any 1-D integer array; a reversed view is made contiguous
    there, so the torch forms (`torch.from_numpy`) take it too."""
    dev, host, engine = pools_for(geometry_config("int64", layout))
    perm = np.random.default_rng(8).permutation(dev.num_pages(FULL))
    cases = [
        (perm[:80][::-1], np.arange(10, 90)),  # GATHER
        (np.arange(89, 9, -1)[::-1], np.arange(100, 180)),  # RUNS (ascending, stride -8)
    ]
    for s, d in cases:
        assert s.strides[0] < 0 and plan_rows(np.ascontiguousarray(s), d).kind in (
            PlanKind.GATHER, PlanKind.RUNS)
        want = reference(snapshot(dev, FULL), s, snapshot(host, FULL), d)
        engine.device_to_host(FULL, s, d)
        assert_same(snapshot(host, FULL), want, layout)


# ------------------------------------------------------------------ more pins


def test_reversed_id_views_are_fine_on_the_inline_and_numpy_paths(
    pools_for: Callable[..., tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]],
) -> None:
    """The negative-stride ids (made contiguous by `checked_ids` for torch) are moved
    exactly by the inline path and by the numpy jobs (a copy with layer reports)."""
    dev, host, engine = pools_for(geometry_config("int64", "layer_first"))
    perm = np.random.default_rng(12).permutation(dev.num_pages(FULL))
    for n, report in ((40, False), (80, True)):
        s, d = perm[:n][::-1], np.arange(100, 100 + n)
        assert s.strides[0] < 0
        want = reference(snapshot(dev, FULL), s, snapshot(host, FULL), d)
        engine.device_to_host(FULL, s, d, on_layer=[].append if report else None)
        assert_same(snapshot(host, FULL), want, n)


@pytest.mark.parametrize(("l1_pages", "mamba_slots", "large"),
                         [(64, 8, False), (65, 8, True), (16, 64, False), (16, 65, True)])
def test_copies_can_be_large_is_per_family_at_the_threshold(
    make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
    l1_pages: int,
    mamba_slots: int,
    large: bool,
) -> None:
    """A family whose L1 (the smaller pool) has more than SMALL_COPY_PAGES pages or slots
    makes the engine import torch; 64 everywhere does not (MAMBA slots count too)."""
    cfg = geometry_config("odd", "page_first", l1_pages=l1_pages, mamba_slots=mamba_slots)
    assert copy_mod.copies_can_be_large(make_device(cfg), make_host(cfg)) is large


def test_unevenly_spaced_layers_have_no_grid_and_copy_per_layer() -> None:
    """`_grid` is None (and `stacked` None) when the layers are not equally far apart; the
    torch forms then go layer by layer and still move the exact bytes."""
    rng = np.random.default_rng(21)
    raw = np.zeros(3 * 200 * 16 + 256, np.uint8)
    base = (-raw.ctypes.data) % 64
    starts = (0, 200 * 16 + 64, 2 * 200 * 16 + 192)  # 3264 apart, then 3328 apart
    rows = [raw[base + a: base + a + 200 * 16].reshape(200, 16) for a in starts]
    for r in rows:
        r[...] = rng.integers(0, 256, r.shape, dtype=np.uint8)
    src = MemberRows(tuple(LayerRows.of(r) for r in rows), _grid(rows))
    assert src.grid is None and src.stacked is None
    raw_out = np.zeros(3 * 100 * 16 + 256, np.uint8)  # (3 arrays of their own could lie evenly)
    base_out = (-raw_out.ctypes.data) % 64
    out = [raw_out[base_out + a: base_out + a + 100 * 16].reshape(100, 16)
           for a in (0, 100 * 16 + 64, 2 * 100 * 16 + 192)]
    dst = MemberRows(tuple(LayerRows.of(r) for r in out), _grid(out))
    assert dst.grid is None
    s, d = rng.permutation(200)[:100], np.arange(100)
    plan = plan_rows(s, d)
    assert plan.kind is PlanKind.GATHER
    copy_mod._torch_copy(plan, [(src, dst)], 3, None)
    for layer in range(3):
        assert np.array_equal(out[layer], rows[layer][s])
