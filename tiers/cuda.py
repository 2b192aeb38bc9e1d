"""CUDA side of the tiers: L1 pools in GPU memory exported over CUDA IPC, pinned host
registration, and the stream/event copy engine. Importable without CUDA; every entry
point raises `FailedPrecondition` when CUDA is absent.

IPC uses torch's own protocol (`torch.multiprocessing.reductions`): the daemon keeps each
pool tensor alive for its lifetime; `PoolDescriptor` carries the IPC memory handle, the
offset of the pool inside the exported allocation, torch's reference-counter and event
handles, and the GPU's UUID, so any process with torch can open it (`open_ipc_pool`) on
the same physical GPU whatever its own device numbering.

Ordering with the engine: CUDA streams and events order work within one process only.
The engine's writes to L1 pages must be complete before it calls Insert or Release on
them (`hicache.client.Client` synchronizes the device first unless told the engine did);
the daemon's copies into L1 are complete before Load reports a layer (host-side event
wait), and its own copies within L1 (MAMBA copy-on-write) before the RPC returns.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch
from torch.multiprocessing import reductions

from hicache.config import HicacheConfig, MemberSpec
from hicache.errors import FailedPrecondition
from hicache.tiers.base import (
    CopyEngine,
    CopyResult,
    DevicePools,
    HostPools,
    LayerCallback,
    PageIds,
    PoolDescriptor,
    PoolKind,
)
from hicache.tiers.copy import copy_rows
from hicache.tiers.members import MemberTable
from hicache.tiers.rows import RowPlan, plan_rows, validate_copy, validate_slot_copy
from hicache.types import ComponentKind

# cudaHostRegister calls cover at most this much: recent drivers refuse single calls near
# 512 GiB. A copy must not span two registrations (the driver answers "invalid argument"
# or falls back to a synchronous copy), so fewer, larger ones are better: the copy engine
# stages a run that would span two (`_in_one_range`).
REGISTER_CHUNK = 256 << 30


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise FailedPrecondition("CUDA is not available on this machine")


def register_host_memory(
    address: int, size: int, chunk: int = REGISTER_CHUNK
) -> list[tuple[int, int]]:
    """Page-lock ``[address, address + size)`` in chunks; return the chunks registered.

    On failure, the chunks registered so far are unregistered and `FailedPrecondition`
    (with the CUDA error code) is raised.
    """
    _require_cuda()
    cudart = torch.cuda.cudart()
    done: list[tuple[int, int]] = []
    for start in range(address, address + size, chunk):
        length = min(chunk, address + size - start)
        err = cudart.cudaHostRegister(start, length, 0)
        if int(err) != 0:
            unregister_host_memory(done)
            raise FailedPrecondition(
                f"cudaHostRegister({length} bytes at {start:#x}) failed with CUDA error {int(err)}"
            )
        done.append((start, length))
    return done


def unregister_host_memory(chunks: Sequence[tuple[int, int]]) -> None:
    """Undo `register_host_memory`; errors are ignored (the memory is being released)."""
    cudart = torch.cuda.cudart()
    for start, _ in chunks:
        cudart.cudaHostUnregister(start)


class CudaDevicePools(MemberTable, DevicePools):
    """L1 pools as one CUDA tensor per member ``layers x num_pages x page`` bytes."""

    def __init__(
        self,
        members: Sequence[MemberSpec],
        pages: Mapping[ComponentKind, int],
        device: int | None = None,
    ) -> None:
        _require_cuda()
        MemberTable.__init__(self, members, pages, "l1")
        self._device = torch.cuda.current_device() if device is None else device
        self._uuid = device_uuid(self._device)
        self._tensors: dict[str, torch.Tensor] = {}
        for spec in self.members:
            n = self.num_pages(spec.component)
            # Zeroed, as shared-memory pools are (a fresh slot reads the same on both).
            self._tensors[spec.name] = torch.zeros(
                (spec.layers, n, spec.bytes_per_page_per_layer),
                dtype=torch.uint8,
                device=f"cuda:{self._device}",
            )
        self._descriptors = self._export()

    @classmethod
    def create(cls, cfg: HicacheConfig, device: int | None = None) -> CudaDevicePools:
        if cfg.model.tp_size > 1:
            # One pool set on one GPU would be shared by every rank, each overwriting the
            # others' head shards; per-rank pools on each rank's GPU are not built yet.
            raise FailedPrecondition(
                f"model.tp_size={cfg.model.tp_size}: CUDA L1 pools serve one rank on one "
                "GPU; run one daemon (instance) per tensor-parallel rank, each with tp_size 1, "
                "CUDA_VISIBLE_DEVICES set to that rank's GPU, and a model.id naming the rank "
                "(e.g. '<model>@tp1of8': ranks hold different shards, which must not share "
                "L3 keys)"
            )
        members = cfg.model.members
        return cls(members, {m.component: cfg.pages_for(m.component) for m in members}, device)

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> int:
        return self._device

    def layer(self, member: str, layer: int) -> torch.Tensor:
        self.checked_layer(member, layer)
        self._require_open()
        return self._tensors[member][layer]

    def layer_array(self, member: str, layer: int) -> npt.NDArray[np.uint8]:
        self.checked_layer(member, layer)
        raise FailedPrecondition(f"{member}: L1 pools on cuda:{self._device} have no host view")

    def _require_open(self) -> None:
        if not self._tensors:
            raise FailedPrecondition(f"L1 pools on cuda:{self._device} are closed")

    def descriptors(self, tp_rank: int = 0) -> tuple[PoolDescriptor, ...]:
        """Rank 0's (`create` refuses tp_size > 1). Exported once, when the pools were
        made: each export makes torch a new sharing record (reference counter slot, event)
        that only a consumer of that very export frees, so exporting per Attach (or twice
        in a race) would pile them up."""
        self._require_open()
        return self._descriptors

    def _export(self) -> tuple[PoolDescriptor, ...]:
        out = []
        for spec in self.members:
            tensor = self._tensors[spec.name]
            _, args = reductions.reduce_tensor(tensor)
            # args: cls, size, stride, offset, storage cls, dtype, device, handle, storage
            # bytes, storage offset bytes, requires_grad, refcounter handle/offset, event.
            n = self.num_pages(spec.component)
            out.append(
                PoolDescriptor(
                    member=spec.name,
                    kind=PoolKind.CUDA_IPC,
                    handle=bytes(args[7]),
                    device=int(args[6]),
                    num_pages=n,
                    layer_stride_bytes=n * spec.bytes_per_page_per_layer,
                    page_stride_bytes=spec.bytes_per_page_per_layer,
                    layers=spec.layers,
                    offset_bytes=int(args[9]) + int(args[3]),
                    size_bytes=int(args[8]),
                    ref_counter_handle=bytes(args[11]),
                    ref_counter_offset=int(args[12]),
                    event_handle=bytes(args[13]) if args[13] is not None else b"",
                    event_sync_required=bool(args[14]),
                    device_uuid=self._uuid,
                )
            )
        return tuple(out)

    def close(self) -> None:
        self._descriptors = ()
        self._tensors.clear()


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def local_ordinal(desc: PoolDescriptor) -> int:
    """This process's ordinal of the GPU `desc` lives on: found by UUID (an engine may see
    the daemon's GPU 3 as its cuda:0), else the daemon's ordinal (no UUID sent). Raises
    `FailedPrecondition` when this process cannot see that GPU."""
    if not desc.device_uuid:
        return desc.device
    for ordinal in range(torch.cuda.device_count()):
        if device_uuid(ordinal) == desc.device_uuid:
            return ordinal
    raise FailedPrecondition(
        f"pool {desc.member!r} lives on GPU {desc.device_uuid}, which this process does not "
        "see (CUDA_VISIBLE_DEVICES): the engine must run on the daemon's GPU"
    )


def open_ipc_pool(desc: PoolDescriptor) -> tuple[torch.Tensor, ...]:
    """Engine side: open one CUDA IPC pool; per-layer uint8 tensors ``[num_pages, page]``."""
    _require_cuda()
    device = local_ordinal(desc)
    total = desc.layers * desc.layer_stride_bytes
    flat = reductions.rebuild_cuda_tensor(
        torch.Tensor,
        (total,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        device,
        desc.handle,
        desc.size_bytes,
        desc.offset_bytes,
        False,
        desc.ref_counter_handle,
        desc.ref_counter_offset,
        desc.event_handle or None,
        desc.event_sync_required,
    )
    grid = flat.view(desc.layers, desc.num_pages, desc.page_stride_bytes)
    return tuple(grid[layer] for layer in range(desc.layers))


# Layers of a staged copy (host pages not one pinned run) in flight at once: each holds a
# pinned staging buffer until its layer lands.
STAGED_LAYERS = 2


class CudaCopyEngine(CopyEngine):
    """L1 (GPU) <-> L2 (pinned host) on dedicated streams (one for backups, one for loads),
    one event per layer.

    Layers are enqueued in order; after each, the layers whose copies already finished are
    reported (a host->device copy that stages on the CPU gathers layer `l+1` while layer
    `l` is in flight, and reports `l` as soon as it landed); then the calling thread waits
    on the rest in order. The GPU side gathers/scatters with index ops into contiguous
    staging rows; the host side moves straight between staging and the pool when the host
    ids form one contiguous run of a contiguous layer view inside one pinned registration,
    and through a pinned staging buffer plus a CPU row copy otherwise.
    """

    def __init__(self, device: DevicePools, host: HostPools) -> None:
        _require_cuda()
        self._device = device
        self._host = host
        # On the pools' GPU (not whichever is current): the streams and events must be
        # the ones of the device the rows live on.
        ordinal = device.device if isinstance(device, CudaDevicePools) else torch.cuda.current_device()
        # Backups (L1 -> L2) and loads (L2 -> L1) on streams of their own (DESIGN §3): a
        # load, on a request's time to first token, never queues behind a flush. They need
        # no order between them: each call waits for its own copies before it returns,
        # and no page is both a backup's source and a load's target at once (the tree
        # pins the one, the other is freshly allocated).
        self._stream = torch.cuda.Stream(device=torch.device("cuda", ordinal))
        self._load_stream = torch.cuda.Stream(device=torch.device("cuda", ordinal))
        self._cow_stream = torch.cuda.Stream(device=torch.device("cuda", ordinal))
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="hicache-cuda-copy")

    def device_to_host(
        self,
        family: ComponentKind,
        device_ids: PageIds,
        host_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        d, h = validate_copy(family, self._device, device_ids, self._host, host_ids, ("L1", "L2"))
        return self._run(family, d, h, to_host=True, on_layer=on_layer)

    def host_to_device(
        self,
        family: ComponentKind,
        host_ids: PageIds,
        device_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        h, d = validate_copy(family, self._host, host_ids, self._device, device_ids, ("L2", "L1"))
        return self._run(family, d, h, to_host=False, on_layer=on_layer)

    def copy_within_device(self, family: ComponentKind, src: int, dst: int) -> None:
        """Copy L1 slot `src` of every member of `family` to slot `dst` (MAMBA
        copy-on-write), complete when this returns: the engine uses `dst` right after the
        RPC, and nothing in its process waits on this daemon's streams.

        On a stream of its own: the caller holds the controller's mutex, and waiting for
        the copy stream would wait for every load and flush queued there. Nothing queued
        there touches `src` (a checkpoint in the tree: its copy completed before it landed)
        or `dst` (just allocated)."""
        validate_slot_copy(family, self._device, src, dst)
        main = torch.cuda.current_stream(self._cow_stream.device)
        self._cow_stream.wait_stream(main)
        with torch.cuda.stream(self._cow_stream):
            for spec in self._device.family(family):
                for layer in range(spec.layers):
                    rows = self._device.layer(spec.name, layer)
                    rows[dst].copy_(rows[src], non_blocking=True)
        self._cow_stream.synchronize()

    def close(self) -> None:
        self._stream.synchronize()
        self._load_stream.synchronize()
        self._pool.shutdown(wait=True)

    def _run(
        self,
        family: ComponentKind,
        dev_ids: npt.NDArray[np.int64],
        host_ids: npt.NDArray[np.int64],
        to_host: bool,
        on_layer: LayerCallback | None,
    ) -> CopyResult:
        members = self._device.family(family)
        n = int(dev_ids.size)
        layers = max(m.layers for m in members)
        staged = np.arange(n, dtype=np.int64)
        # Rows i of a staging buffer belong to pair i; host side: staging <-> host ids.
        host_plan = (
            plan_rows(staged, host_ids) if to_host else plan_rows(host_ids, staged)
        )
        # One contiguous run of host pages: DMA straight between staging and the pool.
        direct = n > 0 and bool(np.all(np.diff(host_ids) == 1))
        ranges = self._host.pinned_ranges()
        events: list[torch.cuda.Event] = []
        finish: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        reported = 0
        moved = 0
        # Orders this copy after L1 work this thread queued on its current stream: NOT
        # after the engine's kernels, which run in another process (the engine
        # synchronizes before Insert/Release). Nothing waits the other way round: when
        # this returns, every copy it queued has completed (its events were waited for).
        stream = self._stream if to_host else self._load_stream
        main = torch.cuda.current_stream(stream.device)
        # Uploaded on the current stream (a blocking upload on the copy stream would wait
        # for every copy other threads queued there), kept from reuse until the copy
        # stream is done with it.
        gpu_ids = torch.from_numpy(dev_ids).to(stream.device, non_blocking=False)
        gpu_ids.record_stream(stream)
        stream.wait_stream(main)
        try:
            with torch.cuda.stream(stream):
                for layer in range(layers):
                    if not direct and layer >= STAGED_LAYERS:
                        # Staged: at most STAGED_LAYERS layers' pinned buffers at once
                        # (queuing takes microseconds, the copies milliseconds: every
                        # layer's buffer would be alive, and kept by torch's pinned cache).
                        reported = self._report(events, finish, host_plan, reported, on_layer,
                                                wait=True, until=layer - STAGED_LAYERS + 1)
                    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
                    for spec in members:
                        if layer >= spec.layers or n == 0:
                            continue
                        moved += n * spec.bytes_per_page_per_layer
                        dev_rows = self._device.layer(spec.name, layer)
                        host_rows = self._host.layer(spec.name, layer)
                        h0 = int(host_ids[0])
                        host_slice = host_rows[h0 : h0 + n]
                        use_direct = (direct and host_slice.is_contiguous()
                                      and _in_one_range(ranges, host_slice.data_ptr(),
                                                        host_slice.numel()))
                        if to_host:
                            rows = dev_rows.index_select(0, gpu_ids)
                            if use_direct:
                                host_slice.copy_(rows, non_blocking=True)
                            else:
                                pinned = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                                pinned.copy_(rows, non_blocking=True)
                                pending.append((pinned, host_rows))
                        else:
                            if use_direct:
                                src = host_slice
                            else:
                                src = torch.empty(
                                    (n, host_rows.shape[1]), dtype=torch.uint8, pin_memory=True
                                )
                                copy_rows(host_plan, host_rows, src, self._pool)
                            rows = src.to(stream.device, non_blocking=True)
                            dev_rows.index_copy_(0, gpu_ids, rows)
                    # Blocking: a waiting thread sleeps instead of spinning on a core.
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                    events.append(event)
                    finish.append(pending)
                    reported = self._report(events, finish, host_plan, reported, on_layer, wait=False)
            self._report(events, finish, host_plan, reported, on_layer, wait=True)
        except BaseException:
            # Copies already queued may still write into pages the caller frees now.
            stream.synchronize()
            raise
        # (No `main.wait_stream(self._stream)`: it would make later work on this thread's
        # stream, a copy-on-write or the next upload, wait for other threads' copies.)
        return CopyResult(pages=n, bytes=moved, layers=layers)

    def _report(
        self,
        events: list[torch.cuda.Event],
        finish: list[list[tuple[torch.Tensor, torch.Tensor]]],
        host_plan: RowPlan,
        reported: int,
        on_layer: LayerCallback | None,
        wait: bool,
        until: int | None = None,
    ) -> int:
        """Land and report layers from `reported` on, in order: those already copied, or
        (`wait`) all of them (those before `until`). Returns the next layer to report."""
        end = len(events) if until is None else min(until, len(events))
        while reported < end:
            event = events[reported]
            if wait:
                event.synchronize()
            elif not event.query():
                break
            for pinned, host_rows in finish[reported]:
                copy_rows(host_plan, pinned, host_rows, self._pool)
            finish[reported] = []
            if on_layer is not None:
                on_layer(reported)
            reported += 1
        return reported


def _in_one_range(ranges: Sequence[tuple[int, int]], address: int, size: int) -> bool:
    """Whether ``[address, address + size)`` lies inside one of `ranges` (sorted
    (start, length) registrations); True when there are none (pageable memory: torch
    copies it synchronously, but correctly)."""
    if not ranges:
        return True
    i = bisect.bisect_right(ranges, (address, 1 << 62)) - 1
    if i < 0:
        return False
    start, length = ranges[i]
    return start <= address and address + size <= start + length
