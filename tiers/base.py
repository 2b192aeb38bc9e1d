"""Contracts of the L1/L2 tiers: page allocator, device pools, host pools, copy engine.

Vocabulary
- *member*: one pool of a family (a component such as ``full`` or one of its sidecars),
  described by `hicache.config.MemberSpec`; a *family* is a component plus its sidecars.
- *page id*: a row index into every pool of a family; a sidecar page has its anchor's id,
  so one `PageAllocator` per component serves the whole family (MAMBA: one id per slot).
- *page ids* cross every boundary here as 1-D numpy integer arrays (`PageIds`).

Ownership: each pools object owns its allocators (one per component) and its memory; only
the allocator touches its free list; only the copy engine writes pool bytes on the daemon
side (the engine writes L1 through its own mapping). None of these objects is thread-safe
unless its docstring says so: the controller serialises calls per pools object.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hicache.config import MemberSpec
from hicache.tiers.storage.integrity import HEADER_BYTES as HEADER_BYTES
from hicache.types import ComponentKind, HostLayout

if TYPE_CHECKING:  # annotations only: clients of these contracts (the probe CLI) skip torch
    import torch

PageIds = npt.NDArray[np.integer]
"""A batch of page ids: a 1-D numpy array of any integer dtype (int32 or int64 in practice)."""

LayerCallback = Callable[[int], None]
"""Called with a layer index once that layer of every family member has been copied."""

# `HEADER_BYTES` (imported above) is reserved in front of every `page_first` L2 page slot:
# the L3 object header is written there in place, so the two can never differ.


class Allocator(abc.ABC):
    """Free list of the page ids of one component's pools (and of its sidecars' pools).

    Invariant (checked by `check_integrity`): free + allocated == total, no id twice.
    """

    @property
    @abc.abstractmethod
    def total(self) -> int:
        """Number of pages (ids are ``0 .. total-1``)."""

    @property
    @abc.abstractmethod
    def free_count(self) -> int:
        """Pages free right now; kept incrementally, O(1)."""

    @abc.abstractmethod
    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now. Mutates nothing; ``n <= 0`` is True."""

    @abc.abstractmethod
    def allocate(self, n: int) -> npt.NDArray[np.int64]:
        """Take `n` free pages and return their ids (int64, a fresh array).

        O(n). A fresh allocator hands out ascending ids; freed pages come back last-freed
        first, in the order they were freed. ``n == 0`` returns an empty array.
        Raises `ResourceExhausted` (naming n and the free count) when fewer than `n` are
        free, and `InvalidArgument` for ``n < 0``; nothing is taken on failure.
        """

    @abc.abstractmethod
    def free(self, ids: PageIds) -> None:
        """Return pages to the free list. O(len(ids)); an empty batch is a no-op.

        Raises `InvalidArgument`, naming the offending ids, for ids out of range, ids
        repeated within the batch, or ids that are not allocated (double free); the batch
        is validated completely before anything is freed, so a failed call changes nothing.
        """

    @abc.abstractmethod
    def is_allocated(self, ids: PageIds) -> npt.NDArray[np.bool_]:
        """Per id, whether it is allocated now (ids may repeat). Raises `InvalidArgument`
        for ids out of range."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise `AssertionError` with the figures when the free list is inconsistent."""


class PoolKind(enum.Enum):
    """How an L1 pool is shared with the engine."""

    SHM = "shm"  # POSIX shared memory segment (CPU-only node)
    CUDA_IPC = "cuda_ipc"  # CUDA IPC memory handle (GPU node)


@dataclass(frozen=True)
class PoolDescriptor:
    """What an engine needs to map one L1 member pool (returned by the Attach RPC).

    The pool is ``layers`` regions of ``[num_pages, page_stride_bytes]``; region `l` starts
    at ``offset_bytes + l * layer_stride_bytes`` of the mapped allocation, and page `p` of
    it at ``p * page_stride_bytes`` within the region.

    `handle`: the shm segment name (ASCII) or the 64-byte CUDA IPC memory handle.
    `device`: CUDA device ordinal in the daemon; -1 for shared memory. `device_uuid`: the
    GPU's UUID (CUDA), by which an engine finds its own ordinal of that GPU.
    The ``ref_counter_*``/``event_*`` fields carry torch's CUDA IPC bookkeeping (the
    reference-counter file and the producer's event); they are empty for SHM.
    """

    member: str
    kind: PoolKind
    handle: bytes
    device: int
    num_pages: int
    layer_stride_bytes: int
    page_stride_bytes: int
    layers: int
    offset_bytes: int = 0
    size_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    device_uuid: str = ""

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_stride_bytes


class MemberPools(abc.ABC):
    """What L1 and L2 pools share: members, geometry, allocators, lifetime."""

    @property
    @abc.abstractmethod
    def members(self) -> tuple[MemberSpec, ...]:
        """Every member pool held, in config order (component, then its sidecars)."""

    @abc.abstractmethod
    def member(self, name: str) -> MemberSpec:
        """The spec of member `name`; raises `InvalidArgument` for an unknown name."""

    @abc.abstractmethod
    def family(self, kind: ComponentKind) -> tuple[MemberSpec, ...]:
        """The members of a component's family; `InvalidArgument` if it has no pools here."""

    @abc.abstractmethod
    def num_pages(self, kind: ComponentKind) -> int:
        """Pages (MAMBA: slots) in every pool of the family of `kind`."""

    @abc.abstractmethod
    def allocator(self, kind: ComponentKind) -> Allocator:
        """The one allocator shared by every pool of the family of `kind`."""

    @abc.abstractmethod
    def layer(self, member: str, layer: int) -> torch.Tensor:
        """Rows of one layer: a uint8 tensor ``[num_pages, bytes_per_page_per_layer]``.

        Row strides may exceed the row width (L2 `page_first`). The tensor aliases the pool
        memory (CPU tensor for shm/host pools, CUDA tensor for CUDA pools); it must not be
        used after `close()`. Raises `InvalidArgument` for an unknown member or layer.
        """

    @abc.abstractmethod
    def layer_array(self, member: str, layer: int) -> npt.NDArray[np.uint8]:
        """The rows of `layer` as a numpy view, for pools in host memory (shared-memory
        L1, L2): what the CPU copy engine works on, no torch needed. CUDA pools raise
        `FailedPrecondition`."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Run every allocator's integrity check."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory (unmap, unlink, unregister). Idempotent. Views handed out
        before must be dropped first; using them afterwards is undefined."""


class DevicePools(MemberPools):
    """L1: what the engine computes with; layer-major per member (see `PoolDescriptor`)."""

    @property
    @abc.abstractmethod
    def is_cuda(self) -> bool:
        """True when the pools live in GPU memory."""

    @abc.abstractmethod
    def descriptors(self, tp_rank: int = 0) -> tuple[PoolDescriptor, ...]:
        """One descriptor per member, for the engine's rank `tp_rank` to map its shard of
        the pools (`ModelConfig.members`: a row holds every rank's shard). Mutates
        nothing."""


class HostPools(MemberPools):
    """L2: one page-aligned (pinned when CUDA is present) buffer holding every member pool.

    Layout `layer_first` is like L1; `page_first` stores each page of a member as one
    contiguous slot ``[HEADER_BYTES header | layers x bytes_per_page_per_layer payload]``,
    which is one L3 object, so storage I/O goes straight from/to the slot.
    """

    @property
    @abc.abstractmethod
    def layout(self) -> HostLayout:
        """`LAYER_FIRST` or `PAGE_FIRST` (never `AUTO`)."""

    @property
    @abc.abstractmethod
    def pinned(self) -> bool:
        """Whether the buffer is page-locked (registered with CUDA)."""

    def pinned_ranges(self) -> tuple[tuple[int, int], ...]:
        """The (address, length) registrations of a pinned buffer, sorted; () if none. A
        single DMA must stay inside one of them."""
        return ()

    @property
    @abc.abstractmethod
    def buffer_address(self) -> int:
        """Address of the whole buffer (for e.g. Mooncake `register_buffer`)."""

    @property
    @abc.abstractmethod
    def buffer_size(self) -> int:
        """Size in bytes of the whole buffer (a multiple of the OS page size)."""

    @abc.abstractmethod
    def object_view(self, member: str, page_id: int) -> npt.NDArray[np.uint8]:
        """`page_first` only: the header + payload bytes of one page slot, contiguous.

        Raises `FailedPrecondition` for `layer_first` pools and `InvalidArgument` for an
        unknown member or a page id out of range.
        """

    @abc.abstractmethod
    def object_views(self, member: str, page_ids: npt.NDArray[np.int64]) -> list[npt.NDArray[np.uint8]]:
        """`object_view` of each of `page_ids`, in order (one batch check, no copies: what
        an L3 batch hands its backend). Same errors as `object_view`."""

    @abc.abstractmethod
    def payload_view(self, member: str, page_id: int) -> npt.NDArray[np.uint8]:
        """`page_first` only: the payload (``layers x bytes_per_page_per_layer``) of a slot."""

    @abc.abstractmethod
    def object_address(self, member: str, page_id: int) -> int:
        """`page_first` only: address of `object_view(member, page_id)` (zero-copy L3 I/O)."""

    @property
    @abc.abstractmethod
    def object_bytes(self) -> dict[str, int]:
        """`page_first` only: size of one page object (header + payload) per member."""

    @abc.abstractmethod
    def close(self, keep_memory: bool = False) -> None:
        """Release the memory (unmap, unregister) after stopping helper threads;
        `keep_memory`: stop the threads only and leave the memory mapped (and pinned)
        until the process ends, for a writer that may still land in it (an L3 call given
        up on). Idempotent."""


@dataclass(frozen=True)
class CopyResult:
    """What one family copy moved."""

    pages: int
    bytes: int
    layers: int


class CopyEngine(abc.ABC):
    """Moves whole families between L1 and L2, one layer at a time.

    A copy validates everything (family present on both sides, equal id counts, ids in
    range, no destination id twice) before it touches memory, raising `InvalidArgument`.
    Layer `l` is copied for every member that has it, then ``on_layer(l)`` is called; when
    it is called, that layer's bytes are in place (on CUDA: the layer's event completed).
    Copying zero pages is valid: it calls ``on_layer`` for every layer and moves nothing.
    The engine neither allocates nor frees pages: the caller owns both id batches.
    Calls may come from several threads at once (loads, the copy worker, RPC threads);
    each returns once its own copy is complete.
    """

    @abc.abstractmethod
    def device_to_host(
        self,
        family: ComponentKind,
        device_ids: PageIds,
        host_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        """Copy L1 pages `device_ids[i]` to L2 pages `host_ids[i]` of every family member."""

    @abc.abstractmethod
    def host_to_device(
        self,
        family: ComponentKind,
        host_ids: PageIds,
        device_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        """Copy L2 pages `host_ids[i]` to L1 pages `device_ids[i]` of every family member."""

    @abc.abstractmethod
    def copy_within_device(self, family: ComponentKind, src: int, dst: int) -> None:
        """Copy L1 page (slot) `src` to `dst` for every member of `family` (MAMBA
        copy-on-write); complete when it returns."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop helper threads/streams. Idempotent."""
