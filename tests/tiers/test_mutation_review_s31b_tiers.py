"""Mutation review (session 31, second round) of `hicache.tiers.cuda` on a CPU, with the
fake `torch.cuda` of test_cuda_logic.py: pinned host registration in chunks, the GPU
ordinal of a descriptor without a UUID, and what a copy reports it moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_cuda_logic as cuda_logic
from tierkit import tiny_config

from hicache.errors import FailedPrecondition
from hicache.tiers.base import PoolDescriptor, PoolKind
from hicache.tiers.cuda import CudaCopyEngine, local_ordinal, register_host_memory
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools
from hicache.types import ComponentKind

FULL = ComponentKind.FULL
fake = cuda_logic.fake  # the fixture: `torch.cuda` replaced by test_cuda_logic.FakeCuda


class _Cudart:
    """The two runtime calls `register_host_memory` makes, recorded; the `fail_at`-th
    register call (0-based) answers CUDA error 1."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, start: int, length: int, flags: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 1
        self.registered.append((start, length))
        return 0

    def cudaHostUnregister(self, start: int) -> int:
        self.unregistered.append(start)
        return 0


def test_host_memory_is_registered_in_chunks_that_end_at_the_buffer(fake: Any) -> None:
    """A buffer longer than one registration is page-locked in chunks of `chunk` bytes,
    the last one only up to the buffer's end (registering past it would lock, or fail
    on, memory the pool does not own)."""
    # Mutant: register_host_memory `length = chunk` for every chunk.
    cudart = _Cudart()
    fake.cudart = lambda: cudart
    done = register_host_memory(1000, 250, chunk=100)
    assert done == [(1000, 100), (1100, 100), (1200, 50)]
    assert cudart.registered == done


def test_a_failed_registration_unregisters_the_chunks_already_registered(fake: Any) -> None:
    """When the driver refuses a chunk, the chunks registered before it are unregistered
    again before FailedPrecondition is raised (page-locked memory nobody would release
    otherwise, and a retry would find it registered already)."""
    # Mutant: register_host_memory without `unregister_host_memory(done)` on failure.
    cudart = _Cudart(fail_at=2)
    fake.cudart = lambda: cudart
    with pytest.raises(FailedPrecondition, match="CUDA error 1"):
        register_host_memory(1000, 250, chunk=100)
    assert cudart.unregistered == [1000, 1100]


def test_a_descriptor_without_a_uuid_maps_to_the_daemons_ordinal(fake: Any) -> None:
    """An older daemon's descriptor names no GPU UUID: the engine opens the pool on the
    ordinal the daemon reported, whatever it is (not always cuda:0)."""
    # Mutant: local_ordinal returning 0 (not `desc.device`) when no UUID is sent.
    desc = PoolDescriptor(member="full", kind=PoolKind.CUDA_IPC, handle=b"h", device=1,
                          num_pages=1, layer_stride_bytes=1, page_stride_bytes=1, layers=1,
                          device_uuid="")
    assert local_ordinal(desc) == 1


@pytest.mark.parametrize("host_ids", [[4, 5, 6], [6, 1, 4]], ids=["direct", "staged"])
def test_a_copy_reports_the_bytes_of_every_member_and_layer_it_moved(
    fake: Any, host_ids: list[int], make_device: Callable[..., ShmDevicePools],
    make_host: Callable[..., HostBufferPools],
) -> None:
    """`CopyResult` says what one family copy moved: its pages, and its bytes summed over
    every member of the family (a sidecar with its own layer count and page size too)."""
    # Mutant: CudaCopyEngine._run `moved += n` (pages, not bytes).
    cfg = tiny_config("page_first")
    dev, host = make_device(cfg), make_host(cfg)
    engine = CudaCopyEngine(dev, host)
    d = np.array([0, 2, 3], dtype=np.int64)
    h = np.array(host_ids, dtype=np.int64)
    want = sum(3 * m.layers * m.bytes_per_page_per_layer for m in dev.family(FULL))
    try:
        for result in (engine.device_to_host(FULL, d, h), engine.host_to_device(FULL, h, d)):
            assert result.pages == 3
            assert result.bytes == want
    finally:
        engine.close()
