"""Copy engine: bit-exact family round trips L1 -> L2 -> L1 in both host layouts under the
content oracle, per-layer progress, plan choice, and validation before any byte moves."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tierkit import oracle, tiny_config

import hicache.tiers.copy as copy_mod
from hicache.errors import InvalidArgument
from hicache.tiers.base import MemberPools
from hicache.tiers.copy import CpuCopyEngine
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools
from hicache.tiers.rows import PlanKind, plan_rows, widen
from hicache.types import ComponentKind

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA


def i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def fill(pools: MemberPools, kind: ComponentKind, pages: np.ndarray, salt: int = 0) -> None:
    for spec in pools.family(kind):
        for layer in range(spec.layers):
            rows = pools.layer(spec.name, layer)
            for p in pages.tolist():
                rows[p] = torch.from_numpy(oracle(spec.name, p, layer, rows.shape[1], salt))


def assert_holds(pools: MemberPools, kind: ComponentKind, at: np.ndarray, origin: np.ndarray) -> None:
    """Page at[i] of every member/layer holds the oracle bytes of page origin[i]."""
    for spec in pools.family(kind):
        for layer in range(spec.layers):
            rows = pools.layer(spec.name, layer)
            for p, o in zip(at.tolist(), origin.tolist(), strict=True):
                expected = oracle(spec.name, o, layer, rows.shape[1])
                assert np.array_equal(rows[p].cpu().numpy(), expected), (spec.name, layer, p, o)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_family_round_trip_is_bit_exact(
    layout: str, make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    cfg = tiny_config(layout)
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    try:
        # The engine computed pages 0..5 of the full family (full + its 3-layer sidecar).
        dev_ids = dev.allocator(FULL).allocate(6)
        assert dev_ids.tolist() == [0, 1, 2, 3, 4, 5]
        fill(dev, FULL, dev_ids)
        # Back up pages [5, 1, 3] into fresh L2 pages [0, 1, 2]; report layers as they land.
        host_ids = host.allocator(FULL).allocate(3)
        layers: list[int] = []
        result = engine.device_to_host(FULL, i64(5, 1, 3), host_ids, on_layer=layers.append)
        assert layers == [0, 1, 2]  # the sidecar has a third layer
        assert (result.pages, result.bytes, result.layers) == (3, 3 * (2 * 32 + 3 * 8), 3)
        assert_holds(host, FULL, host_ids, i64(5, 1, 3))

        # L1 forgets them; reload into other L1 pages, in another order.
        dev.allocator(FULL).free(i64(5, 1, 3))
        reload = dev.allocator(FULL).allocate(3)
        assert reload.tolist() == [5, 1, 3]
        fill(dev, FULL, reload, salt=9)  # garbage that the load must overwrite
        engine.host_to_device(FULL, i64(2, 0, 1), i64(1, 3, 5))
        assert_holds(dev, FULL, i64(1, 3, 5), i64(3, 5, 1))
        assert_holds(dev, FULL, i64(0, 2, 4), i64(0, 2, 4))  # untouched neighbours
        host.allocator(FULL).free(host_ids)
        dev.allocator(FULL).free(np.concatenate([i64(0, 2, 4), reload]))
    finally:
        engine.close()


def test_mamba_slots_move_like_pages(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    cfg = tiny_config("page_first")
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    fill(dev, MAMBA, i64(0, 1, 2, 3))
    engine.device_to_host(MAMBA, i64(3, 0), i64(7, 6))
    assert_holds(host, MAMBA, i64(7, 6), i64(3, 0))
    engine.host_to_device(MAMBA, i64(7), i64(1))
    assert_holds(dev, MAMBA, i64(1), i64(3))
    # A page_first MAMBA slot is one L3 object: header, then both layers' states.
    assert np.array_equal(host.payload_view("mamba", 7)[:24], oracle("mamba", 3, 0, 24))
    engine.close()


def test_large_batches_take_every_plan_and_stay_exact(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copy_mod, "SMALL_COPY_PAGES", 0)  # 16 pages: take the planned paths
    cfg = tiny_config("page_first")
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    fill(dev, FULL, np.arange(16))
    rng = np.random.default_rng(1)
    cases = {
        PlanKind.RUNS: (np.arange(16), np.arange(10, 26)),
        PlanKind.GATHER: (rng.permutation(16), np.arange(16, 32)),
        PlanKind.SCATTER: (np.arange(16), rng.permutation(16) + 16),
        PlanKind.STAGED: (rng.permutation(16), rng.permutation(32)[:16]),
    }
    for kind, (d, h) in cases.items():
        assert plan_rows(d, h).kind is kind
        host.layer("full", 0).zero_()
        engine.device_to_host(FULL, d, h)
        assert_holds(host, FULL, h, d)
        engine.host_to_device(FULL, h, d)
        assert_holds(dev, FULL, d, d)
    engine.close()


def test_plan_runs_are_the_whole_runs_of_the_form() -> None:
    plan = plan_rows(np.arange(40), np.concatenate([np.arange(100, 120), np.arange(0, 20)]))
    assert plan.kind is PlanKind.RUNS
    assert plan.runs == ((0, 20), (20, 40))
    assert plan_rows(np.arange(10), np.arange(50, 60)).runs == ((0, 10),)
    staged = plan_rows(np.random.default_rng(0).permutation(40), np.random.default_rng(1).permutation(40))
    assert staged.kind is PlanKind.STAGED and staged.runs == ((0, 40),)
    assert plan_rows(i64(), i64()).runs == ()


def test_rows_are_widened_to_the_widest_dtype() -> None:
    buf = torch.zeros(4, 24, dtype=torch.uint8)
    assert widen(buf).dtype is torch.int64
    assert widen(buf[:, 8:20]).dtype is torch.int32
    assert widen(buf[:, 2:8]).dtype is torch.int16
    assert widen(buf[:, 1:4]).dtype is torch.uint8


def test_bad_copies_are_refused_before_any_byte_moves(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    cfg = tiny_config()
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    fill(dev, FULL, np.arange(16))
    before = host.layer("full", 0).clone()
    with pytest.raises(InvalidArgument, match=r"full L2 ids \[32\] out of range \[0, 32\)"):
        engine.device_to_host(FULL, i64(0, 1), i64(3, 32))
    with pytest.raises(InvalidArgument, match=r"full L1 ids \[-1\] out of range"):
        engine.device_to_host(FULL, i64(-1), i64(0))
    with pytest.raises(InvalidArgument, match="2 L1 ids but 1 L2 ids"):
        engine.device_to_host(FULL, i64(0, 1), i64(0))
    with pytest.raises(InvalidArgument, match=r"L2 ids \[4\] appear twice"):
        engine.device_to_host(FULL, i64(0, 1), i64(4, 4))
    with pytest.raises(InvalidArgument, match="no pools for component 'swa'"):
        engine.device_to_host(ComponentKind.SWA, i64(0), i64(0))
    assert torch.equal(host.layer("full", 0), before)
    layers: list[int] = []
    assert engine.host_to_device(FULL, i64(), i64(), on_layer=layers.append).pages == 0
    assert layers == [0, 1, 2]
    engine.close()


def test_a_slot_copy_outside_the_pool_or_onto_itself_is_refused(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    """MAMBA copy-on-write within L1: a slot of -1 used to copy the last slot (numpy and
    torch index from the end), silently."""
    cfg = tiny_config()
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    slots = dev.num_pages(MAMBA)
    fill(dev, MAMBA, np.arange(slots))
    for src, dst, fragment in ((-1, 0, "source slot -1"), (0, slots, f"destination slot {slots}"),
                               (2, 2, "slot 2 onto itself")):
        with pytest.raises(InvalidArgument, match=fragment):
            engine.copy_within_device(MAMBA, src, dst)
    assert_holds(dev, MAMBA, np.arange(slots), np.arange(slots))  # nothing moved
    engine.copy_within_device(MAMBA, 1, 0)
    assert_holds(dev, MAMBA, i64(0), i64(1))
    engine.close()


def test_the_helper_pool_is_made_once_when_first_copies_start_together(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads' first large copies used to make a helper pool each (one leaked)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    made: list[object] = []

    class SlowPool(ThreadPoolExecutor):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            time.sleep(0.05)  # widens the window between the check and the assignment
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(copy_mod, "ThreadPoolExecutor", SlowPool)
    cfg = tiny_config()
    engine = CpuCopyEngine(make_device(cfg), make_host(cfg))
    start = threading.Barrier(4)
    threads = [threading.Thread(target=lambda: (start.wait(), engine._executor())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_family_round_trip(layout: str, pin: bool) -> None:
    """Pinned L2 too: only there are the copies asynchronous, so only there would a
    missing event or stream wait show."""
    from hicache.tiers.cuda import CudaCopyEngine, CudaDevicePools
    from hicache.tiers.host import build_host_pools

    cfg = tiny_config(layout)
    dev = CudaDevicePools.create(cfg)
    host = build_host_pools(cfg, pin=pin)
    engine = CudaCopyEngine(dev, host)
    try:
        fill(dev, FULL, np.arange(16))
        layers: list[int] = []
        engine.device_to_host(FULL, i64(5, 1, 3), i64(0, 1, 2), on_layer=layers.append)
        assert layers == [0, 1, 2]
        assert_holds(host, FULL, i64(0, 1, 2), i64(5, 1, 3))
        engine.device_to_host(FULL, i64(7, 8), i64(20, 9))
        engine.host_to_device(FULL, i64(2, 0, 9), i64(10, 11, 12))
        assert_holds(dev, FULL, i64(10, 11, 12), i64(3, 5, 8))
        engine.copy_within_device(FULL, 10, 13)  # (copy-on-write: complete on return)
        assert_holds(dev, FULL, i64(13), i64(3))
    finally:
        engine.close()
        dev.close()
        host.close()


_ENGINE_IMPORTS_TORCH = """
import json, sys
from hicache.config import build_config
from hicache.tiers.copy import CpuCopyEngine, copies_can_be_large
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import build_host_pools
sys.path.insert(0, {tests!r})
from tierkit import TINY
raw = {{**TINY, "tiers": {{**TINY["tiers"], "l1": {{"tokens": {tokens}, "mamba_slots": 4}}}}}}
cfg = build_config(raw)
dev = ShmDevicePools.create(cfg, {instance!r})
host = build_host_pools(cfg, pin=False)
engine = CpuCopyEngine(dev, host)
large = copies_can_be_large(dev, host)
engine.close(); host.close(); dev.close()
print(json.dumps([large, "torch" in sys.modules]))
"""


@pytest.mark.parametrize(("l1_tokens", "large"), [(64 * 4, False), (65 * 4, True)])
def test_the_engine_imports_torch_at_start_only_where_a_copy_can_be_large(
    l1_tokens: int, large: bool, instance: str
) -> None:
    """Only copies of more than `SMALL_COPY_PAGES` pages use torch: pools that small make
    none and never import it (a start ~1.5 s sooner); larger ones import it with the
    engine, so that no copy waits for the import."""
    code = _ENGINE_IMPORTS_TORCH.format(tests=str(Path(__file__).parent), tokens=l1_tokens,
                                        instance=instance)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout) == [large, large]
