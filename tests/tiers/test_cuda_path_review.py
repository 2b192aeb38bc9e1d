"""Review of the CUDA path (never run on a GPU): `hicache.tiers.cuda` (IPC-exported L1
pools, the stream/event copy engine, pinned staging) and the client's device sync before
Release, read against torch's CUDA semantics.

On a CPU the CUDA calls are replaced by small recording fakes whose events complete only
when waited for (as on a GPU, where enqueuing a copy takes microseconds and the copy
milliseconds); what only a GPU can show is `gpu`-marked (skipped here)."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tierkit import tiny_config

import hicache.tiers.cuda as cuda_mod
from hicache.client import Client
from hicache.config import build_config
from hicache.errors import FailedPrecondition
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.tiers.base import PoolKind
from hicache.tiers.cuda import CudaCopyEngine, CudaDevicePools
from hicache.tiers.device import ShmDevicePools, attach_device_pools
from hicache.tiers.host import HostBufferPools
from hicache.types import ComponentKind

FULL = ComponentKind.FULL

# A deep FULL family (8 layers of 32-byte rows, no sidecar): staging per layer is small
# next to the whole copy, so "staging bounded by a few layers" and "staging = the whole
# copy" tell apart.
DEEP: dict[str, Any] = {
    "model": {"page_size": 4,
              "components": {"full": {"layers": 8, "bytes_per_token_per_layer": 8}}},
    "tiers": {"l1": {"tokens": 64}, "l2": {"ratio": 2.0, "reserve_gb": 0, "layout": "page_first"}},
}


class LateCuda:
    """`torch.cuda` as the copy engine sees it, where queued work completes only when
    waited for (`Event.synchronize` / `Stream.synchronize`); `query()` says not yet."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.events: list[Any] = []
        self.pinned_live = 0
        self.pinned_peak = 0
        self.uuids = ["GPU-aaaa"]
        fake = self

        class Stream:
            def __init__(self, device: Any = None, **_kw: Any) -> None:
                self.device = torch.device("cpu")

            def wait_stream(self, other: Any) -> None:
                pass

            def synchronize(self) -> None:
                for e in fake.events:
                    e.done = True

        class Event:
            def __init__(self, blocking: bool = False, **_kw: Any) -> None:
                self.layer = len(fake.events)
                self.done = False
                fake.events.append(self)

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", self.layer))

            def query(self) -> bool:
                return self.done

            def synchronize(self) -> None:
                self.done = True
                fake.log.append(("event.synchronize", self.layer))

        self.Stream, self.Event = Stream, Event
        self._main = Stream()

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return len(self.uuids)

    def get_device_properties(self, ordinal: int) -> Any:
        return types.SimpleNamespace(uuid=self.uuids[ordinal])

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        yield

    def current_stream(self, device: Any = None) -> Any:
        return self._main

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t` as live pinned staging until it is collected."""
        size = t.numel() * t.element_size()
        self.pinned_live += size
        self.pinned_peak = max(self.pinned_peak, self.pinned_live)

        def gone() -> None:
            self.pinned_live -= size

        weakref.finalize(t, gone)
        return t


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> Iterator[LateCuda]:
    """`hicache.tiers.cuda` sees a torch whose `cuda` is a `LateCuda`, whose CUDA tensors
    are CPU ones, and whose pinned allocations are plain ones (counted while alive)."""
    cuda = LateCuda()
    proxy = types.ModuleType("torch_with_late_cuda")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]

    def empty(*args: Any, pin_memory: bool = False, device: Any = None, **kw: Any) -> torch.Tensor:
        t = torch.empty(*args, **kw)
        return cuda.pinned(t) if pin_memory else t

    def zeros(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
        return torch.zeros(*args, **kw)

    proxy.cuda = cuda  # type: ignore[attr-defined]
    proxy.empty = empty  # type: ignore[attr-defined]
    proxy.zeros = zeros  # type: ignore[attr-defined]
    proxy.device = lambda *a, **k: a  # type: ignore[attr-defined]
    monkeypatch.setattr(cuda_mod, "torch", proxy)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    yield cuda


def _fake_reductions(monkeypatch: pytest.MonkeyPatch, storage_offset: int = 512) -> list[Any]:
    """torch's CUDA IPC export/import on CPU tensors: `reduce_tensor` answers the 15
    arguments of `rebuild_cuda_tensor` (storage `storage_offset` bytes into its
    allocation); `rebuild_cuda_tensor` returns a flat CPU tensor of the asked size."""
    rebuilt: list[Any] = []

    def reduce_tensor(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        nbytes = t.untyped_storage().nbytes()
        return (None, (torch.Tensor, t.size(), t.stride(), t.storage_offset(), torch.UntypedStorage,
                       t.dtype, 0, b"\x07" * 64, nbytes, storage_offset, False, b"/rc", 3,
                       b"\x09" * 64, True))

    def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
        rebuilt.append(args)
        (size,) = args[1]
        return torch.arange(size, dtype=torch.int64).to(torch.uint8)  # byte i holds i % 256

    monkeypatch.setattr(cuda_mod, "reductions", types.SimpleNamespace(
        reduce_tensor=reduce_tensor, rebuild_cuda_tensor=rebuild_cuda_tensor))
    return rebuilt


# --------------------------------------------------------------------------- copy engine


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_no_layer_is_reported_before_its_event_completed_and_bytes_land_exactly(
    late: LateCuda, layout: str, to_host: bool, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """Load's per-layer progress (`layers_ready > N` lets the engine compute layer N) must
    come after that layer's copies finished on the stream, staged or direct, whichever
    direction; and a staged backup lands its rows in L2 before reporting them."""
    cfg = tiny_config(layout)
    dev, host = make_device(cfg), make_host(cfg)
    engine = CudaCopyEngine(dev, host)
    rng = np.random.default_rng(7)
    src, dst = (dev, host) if to_host else (host, dev)
    for m in src.members:
        for layer in range(m.layers):
            rows = src.layer(m.name, layer).numpy()
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    cases = [(np.array([5, 1, 3, 9], dtype=np.int64), np.array([7, 0, 4, 2], dtype=np.int64)),
             (np.array([2, 3, 4], dtype=np.int64), np.array([10, 11, 12], dtype=np.int64))]
    try:
        for d, h in cases:
            late.events.clear()
            seen: list[int] = []

            def on_layer(layer: int, d: np.ndarray = d, h: np.ndarray = h,
                         seen: list[int] = seen) -> None:
                assert late.events[layer].done, f"layer {layer} reported before its copy completed"
                if to_host:  # staged rows already in L2 when the layer is reported
                    for m in host.family(FULL):
                        if layer < m.layers:
                            got = host.layer(m.name, layer).numpy()[h]
                            assert np.array_equal(got, dev.layer(m.name, layer).numpy()[d])
                seen.append(layer)

            if to_host:
                engine.device_to_host(FULL, d, h, on_layer=on_layer)
            else:
                engine.host_to_device(FULL, h, d, on_layer=on_layer)
            assert seen == [0, 1, 2]
            s_ids, d_ids = (d, h) if to_host else (h, d)
            for m in dst.family(FULL):
                for layer in range(m.layers):
                    assert np.array_equal(dst.layer(m.name, layer).numpy()[d_ids],
                                          src.layer(m.name, layer).numpy()[s_ids])
    finally:
        engine.close()


def test_a_staged_backup_keeps_pinned_staging_bounded_while_the_gpu_copies(
    late: LateCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    cfg = build_config(DEEP)
    dev, host = make_device(cfg), make_host(cfg)
    engine = CudaCopyEngine(dev, host)
    n = 16
    layer_bytes = n * dev.member("full").bytes_per_page_per_layer
    try:
        engine.device_to_host(FULL, np.arange(n, dtype=np.int64),
                              np.arange(n, 2 * n, dtype=np.int64)[::-1].copy())
    finally:
        engine.close()
    total = layer_bytes * dev.member("full").layers
    assert late.pinned_peak > 0  # (it did stage: page_first rows are strided)
    # Double buffering (two layers in flight) is enough to keep the DMA engine busy.
    assert late.pinned_peak <= 2 * layer_bytes, (
        f"{late.pinned_peak} bytes of pinned staging live at once for a {total}-byte copy")


# --------------------------------------------------------------------------- CUDA pools


def test_cuda_pool_descriptors_map_the_same_geometry_as_shared_memory_ones(
    late: LateCuda, monkeypatch: pytest.MonkeyPatch, make_device: Callable[..., ShmDevicePools],
) -> None:
    """Byte arithmetic of the export and of the engine's view: where each layer's page
    starts, how large the rows are, and what torch's `rebuild_cuda_tensor` gets (the
    storage's offset in its allocation, not the tensor's in elements)."""
    rebuilt = _fake_reductions(monkeypatch, storage_offset=512)
    cfg = tiny_config()
    pools = CudaDevicePools.create(cfg)
    shm = make_device(cfg)
    try:
        descs = pools.descriptors()
        for cd, sd in zip(descs, shm.descriptors(), strict=True):
            assert cd.kind is PoolKind.CUDA_IPC and cd.member == sd.member
            assert (cd.num_pages, cd.layers, cd.layer_stride_bytes, cd.page_stride_bytes) == (
                sd.num_pages, sd.layers, sd.layer_stride_bytes, sd.page_stride_bytes)
            assert cd.size_bytes == sd.size_bytes  # the pool's storage, in bytes
            assert cd.offset_bytes == 512 and cd.device_uuid == "GPU-aaaa"
            assert cd.event_sync_required and cd.ref_counter_offset == 3
        assert pools.descriptors() is descs  # exported once, not per Attach
        views = attach_device_pools(descs, cfg.model.rank_members)
        for d in descs:
            args = rebuilt.pop(0)
            assert args[1] == (d.layers * d.layer_stride_bytes,) and args[3] == 0
            assert args[8] == d.size_bytes and args[9] == 512 and args[13] == b"\x09" * 64
            for layer, rows in enumerate(views[d.member]):
                assert tuple(rows.shape) == (d.num_pages, d.page_stride_bytes)
                for p in (0, d.num_pages - 1):
                    start = layer * d.layer_stride_bytes + p * d.page_stride_bytes
                    assert int(rows[p, 0]) == start % 256 and int(rows[p, 1]) == (start + 1) % 256
    finally:
        pools.close()


def test_closed_cuda_pools_refuse_like_shared_memory_pools(
    late: LateCuda, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_reductions(monkeypatch)
    pools = CudaDevicePools.create(tiny_config())
    pools.close()
    pools.close()  # idempotent
    with pytest.raises(FailedPrecondition, match="closed"):
        pools.descriptors()
    with pytest.raises(FailedPrecondition, match="closed"):
        pools.layer("full", 0)


# --------------------------------------------------------------------------- client sync


class _Recorder:
    """A Client's `_attempts` answering locally: a MatchPrefix with a lock and an
    allocation, empty results otherwise; every request is kept."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def __call__(self, fn: object, request: Any, **_kw: object) -> tuple[object, bool]:
        self.sent.append(request)
        if isinstance(request, pb.MatchPrefixRequest):
            return pb.MatchPrefixResponse(lock_id=7, allocation_id=9), False
        if isinstance(request, pb.BatchRequest):
            return pb.BatchResponse(results=[pb.BatchResult(**{op.WhichOneof("op"): {}})
                                             for op in request.ops]), False
        return pb.ReleaseResponse(), False

    def released(self) -> set[tuple[str, int]]:
        """The handles the Release ops sent name: ("lock" | "allocation", id)."""
        out = set()
        for r in self.sent:
            if isinstance(r, pb.BatchRequest):
                for op in r.ops:
                    if op.WhichOneof("op") == "release":
                        which = op.release.WhichOneof("target")
                        kind = "lock" if which == "lock_id" else "allocation"
                        out.add((kind, getattr(op.release, which)))
        return out


def _cuda_fault(_device: object = None) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def gpu_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Client, _Recorder]]:
    """A Client whose pools live on cuda:0 and whose device sync hits a sticky CUDA fault
    (the engine's kernels fail asynchronously: the error surfaces at the next sync)."""
    monkeypatch.setattr(torch.cuda, "synchronize", _cuda_fault)
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e")
    rec = _Recorder()
    monkeypatch.setattr(client, "_attempts", rec)
    client._cuda_devices = (torch.device("cuda", 0),)
    try:
        yield client, rec
    finally:
        client.close()


def test_a_cuda_fault_in_the_body_still_releases_the_matched_handles(
    gpu_client: tuple[Client, _Recorder],
) -> None:
    """The block's own error is raised; the release goes without the (failing) sync."""
    client, rec = gpu_client
    with pytest.raises(ValueError, match="engine failed"), \
            client.matched(np.arange(1, 9, dtype=np.uint32), allocate_tokens=8):
        raise ValueError("engine failed")
    assert rec.released() == {("lock", 7), ("allocation", 9)}


def test_a_cuda_fault_surfacing_at_the_release_sync_still_releases_the_matched_handles(
    gpu_client: tuple[Client, _Recorder],
) -> None:
    client, rec = gpu_client
    with contextlib.suppress(RuntimeError), \
            client.matched(np.arange(1, 9, dtype=np.uint32), allocate_tokens=8):
        pass  # the engine's kernels were queued here; their fault shows at the sync
    settled = rec.released() | {(k, h) for lock, alloc in client._owed
                                for k, h in (("lock", lock), ("allocation", alloc)) if h}
    assert settled == {("lock", 7), ("allocation", 9)}


# --------------------------------------------------------------------------- on a GPU


def _gpu_pools(raw: dict[str, Any]) -> tuple[Any, Any, Any]:
    from hicache.tiers.host import build_host_pools

    cfg = build_config(raw)
    dev = CudaDevicePools.create(cfg)
    host = build_host_pools(cfg, pin=True)
    return dev, host, CudaCopyEngine(dev, host)


GPU_DEEP: dict[str, Any] = {
    "model": {"page_size": 16,
              "components": {"full": {"layers": 16, "bytes_per_token_per_layer": 1024}}},
    "tiers": {"l1": {"tokens": 16 * 512}, "l2": {"ratio": 2.0, "reserve_gb": 0,
                                                   "layout": "page_first"}},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_page_first_backup_keeps_pinned_staging_bounded() -> None:
    dev, host, engine = _gpu_pools(GPU_DEEP)
    n = 256  # 256 pages x 16 KiB per layer = 4 MiB a layer, 64 MiB the copy
    layer_bytes = n * dev.member("full").bytes_per_page_per_layer
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_host_memory_stats()
        engine.device_to_host(FULL, np.random.default_rng(0).permutation(n).astype(np.int64),
                              np.arange(n, dtype=np.int64)[::-1].copy())
        peak = torch.cuda.host_memory_stats()["active_bytes.peak"]
        assert peak <= 4 * layer_bytes, f"{peak} bytes of pinned staging for a {16 * layer_bytes}-byte copy"
    finally:
        engine.close()
        host.close()
        dev.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_gpu_each_reported_layer_is_readable_from_another_stream(layout: str) -> None:
    """What Load's progress promises the engine: once layer N is reported, work on any
    other stream (the engine's, here this thread's current one) reads the loaded bytes."""
    raw = {**GPU_DEEP, "tiers": {**GPU_DEEP["tiers"], "l2": {**GPU_DEEP["tiers"]["l2"],
                                                            "layout": layout}}}
    dev, host, engine = _gpu_pools(raw)
    n = 256
    rng = np.random.default_rng(3)
    host_ids = rng.permutation(host.num_pages(FULL))[:n].astype(np.int64)
    dev_ids = np.arange(n, dtype=np.int64)
    try:
        for layer in range(16):
            rows = host.layer("full", layer).numpy()
            rows[host_ids] = rng.integers(0, 256, (n, rows.shape[1]), dtype=np.uint8)
            dev.layer("full", layer).zero_()
        torch.cuda.synchronize()
        index = torch.from_numpy(dev_ids).cuda()
        bad: list[int] = []

        def on_layer(layer: int) -> None:
            got = dev.layer("full", layer).index_select(0, index).cpu().numpy()
            if not np.array_equal(got, host.layer("full", layer).numpy()[host_ids]):
                bad.append(layer)

        engine.host_to_device(FULL, host_ids, dev_ids, on_layer=on_layer)
        assert bad == []
    finally:
        engine.close()
        host.close()
        dev.close()
