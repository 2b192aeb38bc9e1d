"""Copy engine paths: the inline path for small copies and the planned, threaded path for
large ones move exactly the same bytes as a plain numpy oracle (random ids, both host
layouts, a sidecar with more layers, both directions, every plan form); layer reports come
in order and only once a layer has landed; a failing chunk stops the reports and surfaces."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from tierkit import tiny_config

import hicache.tiers.copy as copy_mod
import hicache.tiers.pool as pool_mod
from hicache.errors import InvalidArgument
from hicache.tiers.base import HEADER_BYTES, MemberPools
from hicache.tiers.copy import CpuCopyEngine
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools
from hicache.tiers.rows import MemberRows, PlanKind, plan_rows
from hicache.types import ComponentKind

FULL = ComponentKind.FULL
Snapshot = dict[str, list[np.ndarray]]


def randomize(pools: MemberPools, rng: np.random.Generator) -> None:
    for spec in pools.family(FULL):
        for layer in range(spec.layers):
            rows = pools.layer(spec.name, layer)
            rows.copy_(torch.from_numpy(rng.integers(0, 256, tuple(rows.shape), dtype=np.uint8)))


def snapshot(pools: MemberPools) -> Snapshot:
    return {
        spec.name: [pools.layer(spec.name, layer).numpy().copy() for layer in range(spec.layers)]
        for spec in pools.family(FULL)
    }


def expected_after(src: Snapshot, s: np.ndarray, dst: Snapshot, d: np.ndarray) -> Snapshot:
    """The oracle: destination rows d[i] of every member/layer become source rows s[i]."""
    out = {name: [layer.copy() for layer in layers] for name, layers in dst.items()}
    for name, layers in out.items():
        for layer, rows in enumerate(layers):
            rows[d] = src[name][layer][s]
    return out


def assert_same(actual: Snapshot, expected: Snapshot) -> None:
    for name, layers in expected.items():
        for layer, rows in enumerate(layers):
            assert np.array_equal(actual[name][layer], rows), (name, layer)


@pytest.fixture(params=["layer_first", "page_first"])
def pools(
    request: pytest.FixtureRequest,
    make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> Iterator[tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine]]:
    cfg = tiny_config(request.param)
    dev, host = make_device(cfg), make_host(cfg)
    rng = np.random.default_rng(7)
    randomize(dev, rng)
    randomize(host, rng)
    engine = CpuCopyEngine(dev, host)
    yield dev, host, engine
    engine.close()


def id_cases(rng: np.random.Generator, n: int) -> dict[PlanKind, tuple[np.ndarray, np.ndarray]]:
    """L1 ids (16 pages) and L2 ids (32 pages) that make `plan_rows` pick each form
    (named for L1 -> L2; the other direction swaps GATHER and SCATTER)."""
    return {
        PlanKind.RUNS: (np.arange(3, 3 + n), np.arange(20 - n, 20)),
        PlanKind.GATHER: (rng.permutation(16)[:n], np.arange(7, 7 + n)),
        PlanKind.SCATTER: (np.arange(16 - n, 16), rng.permutation(32)[:n]),
        PlanKind.STAGED: (rng.permutation(16)[:n], rng.permutation(32)[:n]),
    }


@pytest.mark.parametrize("path", ["inline", "planned"])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
@pytest.mark.parametrize("with_callback", [False, True])
def test_every_path_matches_the_oracle(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    direction: str,
    with_callback: bool,
) -> None:
    dev, host, engine = pools
    if path == "planned":
        # Force the threaded path and cut every run into several chunks (16 B each).
        monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", 0)
        monkeypatch.setattr(copy_mod, "CHUNK_BYTES", 16)
    rng = np.random.default_rng(11)
    kinds = set()
    for dev_ids, host_ids in id_cases(rng, 12).values():
        if direction == "to_host":
            src, s, dst, d = dev, dev_ids, host, host_ids
        else:
            src, s, dst, d = host, host_ids, dev, dev_ids
        kinds.add(plan_rows(s, d).kind)
        want = expected_after(snapshot(src), s, snapshot(dst), d)
        layers: list[int] = []
        on_layer = layers.append if with_callback else None
        if direction == "to_host":
            result = engine.device_to_host(FULL, s.astype(np.int32), d, on_layer=on_layer)
        else:
            result = engine.host_to_device(FULL, s, d.astype(np.int32), on_layer=on_layer)
        assert_same(snapshot(dst), want)
        assert (result.pages, result.bytes, result.layers) == (12, 12 * (2 * 32 + 3 * 8), 3)
        assert layers == ([0, 1, 2] if with_callback else [])
    assert kinds == set(PlanKind)


@pytest.mark.parametrize("path", ["inline", "planned"])
def test_a_layer_is_reported_only_once_it_has_landed(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    dev, host, engine = pools
    if path == "planned":
        monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", 0)
        monkeypatch.setattr(copy_mod, "CHUNK_BYTES", 8)
    h, d = np.arange(10, 26), np.random.default_rng(3).permutation(16)
    want = expected_after(snapshot(host), h, snapshot(dev), d)
    seen: list[int] = []

    def on_layer(layer: int) -> None:
        # Every member that has this layer holds its final bytes already.
        for spec in dev.family(FULL):
            if layer < spec.layers:
                rows = dev.layer(spec.name, layer).numpy()
                assert np.array_equal(rows, want[spec.name][layer]), (spec.name, layer)
        seen.append(layer)

    engine.host_to_device(FULL, h, d, on_layer=on_layer)
    assert seen == [0, 1, 2]


def test_a_failing_chunk_stops_the_reports_and_is_raised(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
) -> None:
    _, _, engine = pools
    done: list[int] = []

    def boom() -> None:
        raise RuntimeError("chunk failed")

    jobs = [(0, lambda: done.append(0)), (1, boom), (2, lambda: done.append(2))]
    layers: list[int] = []
    with pytest.raises(RuntimeError, match="chunk failed"):
        engine._run_jobs(jobs, 3, layers.append)
    assert 1 not in layers and 2 not in layers
    assert layers in ([], [0])


def test_zero_pages_report_every_layer_on_both_paths(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, engine = pools
    empty = np.array([], dtype=np.int64)
    for small in (64, 0):
        monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", small)
        layers: list[int] = []
        assert engine.device_to_host(FULL, empty, empty, on_layer=layers.append).pages == 0
        assert layers == [0, 1, 2]


def test_repeated_destination_ids_are_refused_on_every_check_path(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, host, engine = pools
    before = snapshot(host)
    # Small batch (set check), large unsorted batch (np.unique) -- and a large ascending one
    # passes without a sort.
    monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", 2)
    monkeypatch.setattr(pool_mod, "_SMALL", 2)  # the id checks' list-or-array threshold
    with pytest.raises(InvalidArgument, match=r"L2 ids \[4\] appear twice"):
        engine.device_to_host(FULL, np.array([0, 1]), np.array([4, 4]))
    with pytest.raises(InvalidArgument, match=r"L2 ids \[9\] appear twice"):
        engine.device_to_host(FULL, np.arange(4), np.array([9, 3, 9, 1]))
    with pytest.raises(InvalidArgument, match=r"L2 ids \[2\] appear twice"):
        engine.device_to_host(FULL, np.arange(4), np.array([1, 2, 2, 3]))
    with pytest.raises(InvalidArgument, match="L1 ids must be a 1-D integer array"):
        engine.device_to_host(FULL, np.array([0.0]), np.array([1]))
    assert_same(snapshot(host), before)
    engine.device_to_host(FULL, np.arange(4), np.array([1, 2, 5, 30]))


def test_stacked_views_are_every_layer_of_the_member(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
) -> None:
    dev, host, _ = pools
    for side in (dev, host):
        for spec in side.family(FULL):
            rows = MemberRows.of(side, spec.name, spec.layers)
            assert rows.stacked is not None
            assert tuple(rows.stacked.shape[:2]) == (spec.layers, side.num_pages(FULL))
            for layer in range(spec.layers):
                as_bytes = rows.stacked[layer].view(torch.uint8)
                assert torch.equal(as_bytes, side.layer(spec.name, layer))
                assert as_bytes.data_ptr() == side.layer(spec.name, layer).data_ptr()


def test_page_first_header_and_padding_are_never_written(
    make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = tiny_config("page_first")
    dev, host = make_device(cfg), make_host(cfg)
    randomize(dev, np.random.default_rng(5))
    buf = host.buffer_view()
    buf[:] = 0xAB
    engine = CpuCopyEngine(dev, host)
    rng = np.random.default_rng(9)
    for small in (64, 0):
        monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", small)
        for dev_ids, host_ids in id_cases(rng, 10).values():
            engine.device_to_host(FULL, dev_ids, host_ids)
    for page in range(host.num_pages(FULL)):
        for spec in host.family(FULL):
            start = host.object_address(spec.name, page) - host.buffer_address
            slot = buf[start : start + host.slot_bytes(spec)]
            payload_end = HEADER_BYTES + spec.bytes_per_page
            assert (slot[:HEADER_BYTES] == 0xAB).all(), (spec.name, page)
            assert (slot[payload_end:] == 0xAB).all(), (spec.name, page)
    engine.close()


@pytest.mark.parametrize("to_host", [True, False])
def test_copy_rows_moves_one_layer_exactly(
    pools: tuple[ShmDevicePools, HostBufferPools, CpuCopyEngine],
    monkeypatch: pytest.MonkeyPatch,
    to_host: bool,
) -> None:
    # What the CUDA engine does on the host side: staging rows <-> one layer of L2.
    from concurrent.futures import ThreadPoolExecutor

    _, host, _ = pools
    monkeypatch.setattr(copy_mod, "CHUNK_BYTES", 32)
    rng = np.random.default_rng(4)
    host_rows = host.layer("full", 1)
    with ThreadPoolExecutor(2) as pool:
        for _, host_ids in id_cases(rng, 12).values():
            staging = torch.from_numpy(rng.integers(0, 256, (12, 32), dtype=np.uint8))
            staged = np.arange(12)
            before_host, before_staging = host_rows.numpy().copy(), staging.numpy().copy()
            if to_host:
                copy_mod.copy_rows(plan_rows(staged, host_ids), staging, host_rows, pool)
                before_host[host_ids] = before_staging
                assert np.array_equal(host_rows.numpy(), before_host)
            else:
                copy_mod.copy_rows(plan_rows(host_ids, staged), host_rows, staging, pool)
                assert np.array_equal(staging.numpy(), before_host[host_ids])
