"""The CUDA copy engine's logic on a CPU: `hicache.tiers.cuda` with a recording fake of
`torch.cuda` (streams, events, the current stream; pinned allocations are plain CPU
memory). It checks what a CPU can: which pairs land where, in both L2 layouts; when each
layer is reported; what happens on an error; which device the streams are made on; and
the pool-side rules (UUID mapping, one rank per GPU, copy-on-write completion). What only
a GPU can tell (asynchrony, DMA into pinned memory) is `gpu`-marked in test_copy.py."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tierkit import tiny_config

import hicache.tiers.cuda as cuda_mod
from hicache.errors import FailedPrecondition
from hicache.tiers.base import PoolDescriptor, PoolKind
from hicache.tiers.cuda import CudaCopyEngine, CudaDevicePools, _in_one_range, local_ordinal
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools
from hicache.types import ComponentKind

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA


class FakeCuda:
    """What the engine calls of `torch.cuda`, logging the order of events."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.streams: list[Any] = []
        self.events: list[Any] = []
        self.uuids = ["GPU-aaaa", "GPU-bbbb"]
        fake = self

        class Stream:
            def __init__(self, device: Any = None, **_kw: Any) -> None:
                self.made_on = device
                self.device = torch.device("cpu")
                fake.streams.append(self)

            def wait_stream(self, other: Any) -> None:  # (streams by index: 0 is the current)
                fake.log.append(("wait_stream", fake.streams.index(self), fake.streams.index(other)))

            def synchronize(self) -> None:
                fake.log.append(("stream.synchronize", fake.streams.index(self)))

        class Event:
            def __init__(self, blocking: bool = False, **_kw: Any) -> None:
                self.blocking = blocking
                self.layer = len(fake.events)
                fake.events.append(self)

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", self.layer))

            def query(self) -> bool:
                return True  # (the fake's copies are done when enqueued)

            def synchronize(self) -> None:
                fake.log.append(("event.synchronize", self.layer))

        self._main = Stream()
        self._current = self._main
        self.Stream, self.Event = Stream, Event

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return len(self.uuids)

    def get_device_properties(self, ordinal: int) -> Any:
        return types.SimpleNamespace(uuid=self.uuids[ordinal])

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:  # (like torch: `s` is current inside)
        before, self._current = self._current, s
        try:
            yield
        finally:
            self._current = before

    def current_stream(self, device: Any = None) -> Any:
        return self._current


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """`hicache.tiers.cuda` sees a torch whose `cuda` is a `FakeCuda`, whose `device` is
    the CPU, and whose pinned allocations are plain ones (logged)."""
    cuda = FakeCuda()
    proxy = types.ModuleType("torch_with_fake_cuda")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]

    def empty(*args: Any, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
        if pin_memory:
            cuda.log.append(("pinned",))
        return torch.empty(*args, **kw)

    proxy.cuda = cuda  # type: ignore[attr-defined]
    proxy.empty = empty  # type: ignore[attr-defined]
    proxy.device = lambda *a, **k: a  # type: ignore[attr-defined]  # (what the stream was made on)
    monkeypatch.setattr(cuda_mod, "torch", proxy)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: cuda.log.append(("record_stream", stream)))
    real_copy_rows = cuda_mod.copy_rows

    def logged_copy_rows(*args: Any) -> None:
        cuda.log.append(("cpu_rows",))
        real_copy_rows(*args)

    monkeypatch.setattr(cuda_mod, "copy_rows", logged_copy_rows)
    yield cuda


def _pools(make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools],
           layout: str) -> tuple[ShmDevicePools, HostBufferPools]:
    cfg = tiny_config(layout)
    return make_device(cfg), make_host(cfg)


def _family(pools: Any, kind: ComponentKind) -> dict[str, list[np.ndarray]]:
    return {m.name: [pools.layer(m.name, layer).numpy().copy() for layer in range(m.layers)]
            for m in pools.family(kind)}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_random_family_copies_land_where_a_plain_model_says(
    fake: FakeCuda, layout: str, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """Both directions, contiguous host runs (the direct path) and scattered ones (staged),
    members with different layer counts (the sidecar has 3, `full` 2)."""
    dev, host = _pools(make_device, make_host, layout)
    rng = np.random.default_rng(1)
    for pools in (dev, host):
        for m in pools.members:
            for layer in range(m.layers):
                rows = pools.layer(m.name, layer).numpy()
                rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    engine = CudaCopyEngine(dev, host)
    nd, nh = dev.num_pages(FULL), host.num_pages(FULL)
    try:
        for trial in range(120):
            n = int(rng.integers(0, min(nd, nh) + 1))
            d = rng.permutation(nd)[:n].astype(np.int64)
            if trial % 3 == 0:
                h = np.arange(n, dtype=np.int64) + int(rng.integers(0, nh - n + 1))
            else:
                h = rng.permutation(nh)[:n].astype(np.int64)
            to_host = bool(trial % 2)
            src, dst = (dev, host) if to_host else (host, dev)
            src_ids, dst_ids = (d, h) if to_host else (h, d)
            before, source = _family(dst, FULL), _family(src, FULL)
            if to_host:
                engine.device_to_host(FULL, d, h)
            else:
                engine.host_to_device(FULL, h, d)
            for name, layers in _family(dst, FULL).items():
                for layer, rows in enumerate(layers):
                    expected = before[name][layer].copy()
                    expected[dst_ids] = source[name][layer][src_ids]
                    assert np.array_equal(rows, expected), (trial, name, layer)
    finally:
        engine.close()


def test_a_staged_load_reports_each_layer_once_landed_not_after_staging_them_all(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """Scattered host ids stage every layer on the CPU before its copy. Layer 0 used to be
    reported only after the CPU had staged all layers: Load's per-layer progress was lost."""
    dev, host = _pools(make_device, make_host, "page_first")
    engine = CudaCopyEngine(dev, host)
    reported: list[int] = []

    def on_layer(layer: int) -> None:
        fake.log.append(("on_layer", layer))
        reported.append(layer)

    try:
        engine.host_to_device(FULL, np.array([5, 1, 3], dtype=np.int64),
                              np.array([0, 1, 2], dtype=np.int64), on_layer=on_layer)
    finally:
        engine.close()
    assert reported == [0, 1, 2]  # the sidecar's third layer too
    steps = [e for e in fake.log if e[0] in ("cpu_rows", "on_layer")]
    assert steps.index(("on_layer", 0)) < len(steps) - 1 - steps[::-1].index(("cpu_rows",))
    assert all(e.blocking for e in fake.events)  # waiting threads sleep, never spin


def test_an_error_mid_copy_waits_for_what_was_queued_before_raising(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """The caller frees the destination pages when a copy fails: copies already queued on
    the stream must have finished writing them first."""
    dev, host = _pools(make_device, make_host, "layer_first")
    engine = CudaCopyEngine(dev, host)

    def on_layer(layer: int) -> None:
        raise RuntimeError("the engine's stream went away")

    try:
        with pytest.raises(RuntimeError, match="went away"):
            engine.host_to_device(FULL, np.array([0, 1], dtype=np.int64),
                                  np.array([2, 3], dtype=np.int64), on_layer=on_layer)
        assert fake.log[-1] == ("stream.synchronize", 2)  # the load stream
    finally:
        engine.close()


def test_a_finished_copy_leaves_nothing_on_the_current_stream_waiting_for_other_copies(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """A copy returns complete. Making the thread's stream wait for the copy stream would
    make its next work (a copy-on-write under the controller's mutex, the next page-id
    upload) wait for copies other threads queued there meanwhile."""
    dev, host = _pools(make_device, make_host, "layer_first")
    engine = CudaCopyEngine(dev, host)
    try:
        engine.host_to_device(FULL, np.array([0, 1], dtype=np.int64), np.array([2, 3], dtype=np.int64))
        engine.device_to_host(FULL, np.array([2, 3], dtype=np.int64), np.array([5, 6], dtype=np.int64))
    finally:
        engine.close()
    waits = [e for e in fake.log if e[0] == "wait_stream"]
    # The load's stream (2), then the backup's (1), after this thread's, only: a load
    # never queues behind a flush (DESIGN 3).
    assert waits == [("wait_stream", 2, 0), ("wait_stream", 1, 0)]
    for stream in (2, 1):  # page ids kept for the copy stream that reads them
        assert ("record_stream", fake.streams[stream]) in fake.log


def test_copy_on_write_is_complete_when_it_returns(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    dev, host = _pools(make_device, make_host, "layer_first")
    engine = CudaCopyEngine(dev, host)
    try:
        for m in dev.family(MAMBA):
            for layer in range(m.layers):
                dev.layer(m.name, layer)[1] = 7 + layer
        fake.log.clear()
        engine.copy_within_device(MAMBA, 1, 3)
        # On its own stream (3), after this thread's (0), never waiting for the copy
        # streams (1, 2), where flushes and loads queue.
        assert fake.log == [("wait_stream", 3, 0), ("stream.synchronize", 3)]
        for m in dev.family(MAMBA):
            for layer in range(m.layers):
                assert (dev.layer(m.name, layer)[3] == 7 + layer).all()
    finally:
        engine.close()


def test_a_direct_copy_must_stay_inside_one_pinned_registration() -> None:
    ranges = ((1000, 100), (1100, 50), (5000, 10))
    assert _in_one_range(ranges, 1000, 100) and _in_one_range(ranges, 1120, 30)
    assert not _in_one_range(ranges, 1090, 20)  # spans two registrations
    assert not _in_one_range(ranges, 900, 10) and not _in_one_range(ranges, 5005, 10)
    assert _in_one_range((), 123, 456)  # pageable memory: any copy (synchronous) is fine


def test_the_engine_maps_the_daemons_gpu_by_uuid_whatever_its_numbering(fake: FakeCuda) -> None:
    desc = PoolDescriptor(member="full", kind=PoolKind.CUDA_IPC, handle=b"h", device=0,
                          num_pages=1, layer_stride_bytes=1, page_stride_bytes=1, layers=1,
                          device_uuid="GPU-bbbb")
    assert local_ordinal(desc) == 1  # the daemon's cuda:0 is this process's cuda:1
    with pytest.raises(FailedPrecondition, match=r"GPU-cccc.*CUDA_VISIBLE_DEVICES"):
        local_ordinal(PoolDescriptor(**{**desc.__dict__, "device_uuid": "GPU-cccc"}))
    assert local_ordinal(PoolDescriptor(**{**desc.__dict__, "device_uuid": "", "device": 0})) == 0


def test_cuda_pools_refuse_more_than_one_tensor_parallel_rank(fake: FakeCuda) -> None:
    """One pool set on one GPU would be mapped by every rank, each overwriting the others'
    head shards."""
    from tierkit import TINY

    from hicache.config import build_config

    cfg = build_config({**TINY, "model": {**TINY["model"], "tp_size": 2}})
    with pytest.raises(FailedPrecondition, match="tp_size=2"):
        CudaDevicePools.create(cfg)


def test_the_copy_streams_are_made_on_the_pools_gpu_not_the_current_one(
    fake: FakeCuda, make_host: Callable[..., HostBufferPools],
) -> None:
    pools = CudaDevicePools.__new__(CudaDevicePools)  # (no GPU memory here: only its ordinal)
    pools._device = 1
    engine = CudaCopyEngine(pools, make_host(tiny_config()))
    try:
        assert [stream.made_on for stream in fake.streams[1:]] == [("cuda", 1)] * 3
    finally:
        engine.close()


def test_a_run_that_would_span_two_pinned_registrations_is_staged(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A contiguous host run normally moves straight between the pool and the GPU; across
    a registration boundary the driver refuses it, so it goes through a staging buffer."""
    dev, host = _pools(make_device, make_host, "layer_first")
    engine = CudaCopyEngine(dev, host)
    rows = host.layer("full", 0)
    split = rows[2].data_ptr()  # a registration ends inside the run [0, 4)
    monkeypatch.setattr(host, "pinned_ranges", lambda: ((rows.data_ptr(), split - rows.data_ptr()),
                                                        (split, 1 << 40)))
    try:
        for m in dev.family(FULL):
            for layer in range(m.layers):
                dev.layer(m.name, layer)[:4] = torch.arange(4, dtype=torch.uint8)[:, None] + 1
        engine.device_to_host(FULL, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64))
        assert ("pinned",) in fake.log  # staged, not a direct copy
        assert (host.layer("full", 0)[:4, 0] == torch.tensor([1, 2, 3, 4], dtype=torch.uint8)).all()
        fake.log.clear()
        engine.device_to_host(FULL, np.arange(4, dtype=np.int64), np.arange(4, 8, dtype=np.int64))
        assert ("pinned",) not in fake.log  # inside one registration: direct
    finally:
        engine.close()


def test_a_staged_backup_lands_each_layer_before_reporting_it(
    fake: FakeCuda, make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    dev, host = _pools(make_device, make_host, "page_first")
    engine = CudaCopyEngine(dev, host)
    try:
        engine.device_to_host(FULL, np.array([5, 1, 3], dtype=np.int64),
                              np.array([7, 0, 4], dtype=np.int64),
                              on_layer=lambda layer: fake.log.append(("on_layer", layer)))
    finally:
        engine.close()
    steps = [e[0] for e in fake.log if e[0] in ("cpu_rows", "on_layer")]
    # Layers 0 and 1: both members' rows land, then the layer is reported; layer 2 is the
    # sidecar's alone.
    assert steps == ["cpu_rows", "cpu_rows", "on_layer"] * 2 + ["cpu_rows", "on_layer"]


def test_an_engine_opens_the_pool_on_its_own_ordinal_of_the_daemons_gpu(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[object] = []

    def rebuild(*args: object) -> torch.Tensor:
        opened.append(args[6])  # torch's rebuild_cuda_tensor: the device argument
        return torch.zeros(8, dtype=torch.uint8)

    monkeypatch.setattr(cuda_mod.reductions, "rebuild_cuda_tensor", rebuild)
    desc = PoolDescriptor(member="full", kind=PoolKind.CUDA_IPC, handle=b"h", device=0,
                          num_pages=2, layer_stride_bytes=4, page_stride_bytes=2, layers=2,
                          device_uuid="GPU-bbbb")
    layers = cuda_mod.open_ipc_pool(desc)
    assert opened == [1] and [tuple(t.shape) for t in layers] == [(2, 2), (2, 2)]
