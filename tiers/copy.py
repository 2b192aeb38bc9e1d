"""Copy engine L1 <-> L2 for whole families, one layer at a time (CPU implementation).

A copy moves rows ``src[src_ids[i]] -> dst[dst_ids[i]]`` of every layer of every family
member. Pools never move once created, so the engine views each member of both sides once
(`hicache.tiers.rows.MemberRows`: per layer the rows widened for numpy and torch and as opaque
items, plus all layers as one grid) and reuses the views: a copy costs its byte moves plus a few
microseconds per op.

Small copies (at most `SMALL_COPY_PAGES` pairs, e.g. the write-through of one insert) run
in the calling thread, one numpy fancy-index op per (member, layer) on opaque row items:
the rows go through a cache-resident temporary, cheaper than planning for so few bytes.
Only large copies use torch: pools too small for most (a family's smaller pool of at most
`SMALL_COPY_PAGES` pages) never import it, so such a daemon starts ~1.5 s sooner here; their
rare large copies (an L1 -> L2 copy that repeats sources) take numpy's forms.

Larger copies are planned once per call (`plan_rows`) by how contiguous the ids are:

- ``RUNS``: both sides advance together in long runs -> slice copies;
- ``GATHER``: the destination is in long runs -> ``np.take(out=dst_run)``, or torch
  ``index_select(out=dst_run)`` (the only one-pass gather into strided page_first slots);
- ``SCATTER``: the source is in long runs -> ``dst[ids] = src_run``;
- ``STAGED``: both sides scattered -> ``dst[ids] = src[ids]`` (numpy gathers each chunk
  into a temporary, then scatters it).

Every form is one pass over the bytes except ``STAGED``. Two executors (`_torch_form`):

- torch, in the calling thread on torch's intra-op threads: RUNS and GATHER when nobody
  waits for layers, as one call per run and member over all layers (`MemberRows.stacked`),
  i.e. one parallel region like a plain tensor copy; and GATHER into strided rows;
- numpy jobs otherwise: rows viewed as the widest integer dtype their width, strides and
  address allow (NOTE: numpy keeps the GIL for copies of fewer than 500 items, so 16 KiB
  rows as opaque items would serialise the threads), cut into chunks of about
  `CHUNK_BYTES` that the calling thread and ``threads - 1`` helpers take in layer order,
  first come first served, so a descheduled thread delays the copy by at most one chunk.
  The caller reports each layer as soon as all of its chunks are done, while the next
  layers are still being copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hicache.errors import InvalidArgument
from hicache.tiers.base import (
    CopyEngine,
    CopyResult,
    DevicePools,
    HostPools,
    LayerCallback,
    MemberPools,
    PageIds,
)
from hicache.tiers.rows import (
    SMALL_COPY_PAGES,
    LayerRows,
    MemberRows,
    PlanKind,
    RowPlan,
    plan_rows,
    validate_copy,
    validate_slot_copy,
)
from hicache.types import ComponentKind

if TYPE_CHECKING:  # imported by the copies that use it (large ones): small ones are numpy
    import torch

# Target size of one chunk of a large numpy copy. NOTE: measured on 16 KiB rows, chunks of
# 1 MiB were ~0.6-0.8x a contiguous copy (per-chunk dispatch and GIL hand-offs), 4-8 MiB
# ~0.9-1.0x; the tail a late thread leaves is at most one chunk.
CHUNK_BYTES = 4 << 20


# One unit of a large copy: (layer, work); the work moves one chunk of one member's layer.
_Job = tuple[int, Callable[[], None]]
_MemberPair = tuple[MemberRows, MemberRows]


class CpuCopyEngine(CopyEngine):
    """Copies between CPU-resident L1 (shared memory) and L2 pools.

    Holds views of the pools (`MemberRows`) from the first copy of a family until `close()`:
    close the engine before the pools (a pool closed first stays mapped until then).
    """

    def __init__(self, device: DevicePools, host: HostPools, threads: int = 2) -> None:
        if device.is_cuda:
            raise InvalidArgument("CpuCopyEngine needs CPU device pools; use CudaCopyEngine")
        # Large copies use torch: imported now, at start (before the daemon freezes its
        # heap), not by the first of them, which would wait 1.5-3 s for it. Pools too small
        # for them never import it: their rare copies past SMALL_COPY_PAGES (an L1 -> L2
        # copy may repeat its sources) take numpy's forms.
        self._torch = copies_can_be_large(device, host)
        if self._torch:
            import torch  # noqa: F401
        self._device = device
        self._host = host
        self._threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._rows: dict[tuple[bool, str], MemberRows] = {}
        self._families: dict[tuple[bool, ComponentKind], tuple[int, list[_MemberPair], int]] = {}

    def device_to_host(
        self,
        family: ComponentKind,
        device_ids: PageIds,
        host_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        s, d = validate_copy(family, self._device, device_ids, self._host, host_ids, ("L1", "L2"))
        return self._copy(family, self._device, s, self._host, d, on_layer)

    def host_to_device(
        self,
        family: ComponentKind,
        host_ids: PageIds,
        device_ids: PageIds,
        on_layer: LayerCallback | None = None,
    ) -> CopyResult:
        s, d = validate_copy(family, self._host, host_ids, self._device, device_ids, ("L2", "L1"))
        return self._copy(family, self._host, s, self._device, d, on_layer)

    def copy_within_device(self, family: ComponentKind, src: int, dst: int) -> None:
        validate_slot_copy(family, self._device, src, dst)
        for spec in self._device.family(family):
            for layer in range(spec.layers):
                rows = self._device.layer_array(spec.name, layer)
                rows[dst] = rows[src]

    def close(self) -> None:
        self._rows.clear()
        self._families.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _member_rows(self, pools: MemberPools, member: str, layers: int) -> MemberRows:
        key = (pools is self._device, member)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = MemberRows.of(pools, member, layers)
        return rows

    def _copy(
        self,
        family: ComponentKind,
        src: MemberPools,
        src_ids: npt.NDArray[np.int64],
        dst: MemberPools,
        dst_ids: npt.NDArray[np.int64],
        on_layer: LayerCallback | None,
    ) -> CopyResult:
        n = int(src_ids.size)
        layers, pairs, page_bytes = self._family_rows(family, src, dst)
        if n <= SMALL_COPY_PAGES:
            _copy_inline(pairs, src_ids, dst_ids, layers, on_layer)
        else:
            plan = plan_rows(src_ids, dst_ids)
            if self._torch and _torch_form(plan, pairs, on_layer):
                _torch_copy(plan, pairs, layers, on_layer)
            else:
                self._run_jobs(_jobs(plan, pairs, layers), layers, on_layer)
        return CopyResult(pages=n, bytes=n * page_bytes, layers=layers)

    def _family_rows(
        self, family: ComponentKind, src: MemberPools, dst: MemberPools
    ) -> tuple[int, list[_MemberPair], int]:
        """(layers, the members' (src, dst) views, bytes per page of the family) for a
        copy `src` -> `dst` of `family`: worked out at its first copy and kept (pools and
        families never change; every write-through pays this otherwise)."""
        key = (src is self._device, family)
        known = self._families.get(key)
        if known is None:
            members = src.family(family)
            pairs = [
                (self._member_rows(src, m.name, m.layers), self._member_rows(dst, m.name, m.layers))
                for m in members
            ]
            known = self._families[key] = (
                max(m.layers for m in members), pairs, sum(m.bytes_per_page for m in members)
            )
        return known

    def _run_jobs(
        self, jobs: Sequence[_Job], layers: int, on_layer: LayerCallback | None
    ) -> None:
        """Run `jobs` (in layer order) on this thread and the helpers; call `on_layer(l)`
        here, in order, once every job of layers ``<= l`` is done. A failing job stops
        the reports; its exception is raised once every job has stopped."""
        left = [0] * layers
        for layer, _ in jobs:
            left[layer] += 1
        queue = iter(jobs)
        errors: list[BaseException] = []
        cond = threading.Condition()

        def take() -> _Job | None:
            with cond:
                return next(queue, None)

        def work(job: _Job) -> None:
            try:
                if not errors:
                    job[1]()
            except BaseException as e:  # re-raised by the caller
                errors.append(e)
            finally:
                with cond:
                    left[job[0]] -= 1
                    if left[job[0]] == 0 or errors:
                        cond.notify_all()

        def drain() -> None:
            while (job := take()) is not None:
                work(job)

        helpers: list[Future[None]] = []
        if len(jobs) > 1 and self._threads > 1:
            pool = self._executor()
            helpers = [pool.submit(drain) for _ in range(min(self._threads - 1, len(jobs) - 1))]
        reported = 0
        try:
            while (job := take()) is not None:
                work(job)
                reported = _report(left, reported, on_layer, errors)
            while reported < layers and not errors:
                with cond:
                    while left[reported] and not errors:
                        cond.wait()
                reported = _report(left, reported, on_layer, errors)
        finally:
            for helper in helpers:
                helper.result()
        if errors:
            raise errors[0]

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:  # first copies may start on several threads at once
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max(1, self._threads - 1), thread_name_prefix="hicache-copy"
                )
            return self._pool


def copies_can_be_large(device: MemberPools, host: MemberPools) -> bool:
    """Whether a copy between these pools can move more than `SMALL_COPY_PAGES` pages (a
    family's smaller pool holds more): only those use torch."""
    families = {spec.component for spec in device.members}
    return any(min(device.num_pages(k), host.num_pages(k)) > SMALL_COPY_PAGES for k in families)


def _report(
    left: list[int], reported: int, on_layer: LayerCallback | None, errors: list[BaseException]
) -> int:
    """Report the finished layers from `reported` on, in order; return the next to report."""
    while reported < len(left) and left[reported] == 0 and not errors:
        if on_layer is not None:
            on_layer(reported)
        reported += 1
    return reported


def _copy_inline(
    pairs: Sequence[_MemberPair],
    s: npt.NDArray[np.int64],
    d: npt.NDArray[np.int64],
    layers: int,
    on_layer: LayerCallback | None,
) -> None:
    """A small copy: one fancy-index op per (member, layer), in this thread."""
    for layer in range(layers):
        if s.size:
            for src, dst in pairs:
                if layer < len(src):
                    dst.layers[layer].items[d] = src.layers[layer].items[s]
        if on_layer is not None:
            on_layer(layer)


def _torch_form(
    plan: RowPlan, pairs: Sequence[_MemberPair], on_layer: LayerCallback | None
) -> bool:
    """Whether torch (one call over all layers, or a GATHER into strided rows) does this
    plan; else numpy jobs do (the threads report each layer as it lands)."""
    if plan.kind is PlanKind.GATHER and not _contiguous_rows(pairs):
        return True
    stacked = all(src.grid is not None and dst.grid is not None for src, dst in pairs)
    return plan.kind in (PlanKind.RUNS, PlanKind.GATHER) and on_layer is None and stacked


def _contiguous_rows(pairs: Sequence[_MemberPair]) -> bool:
    """Whether every destination layer is C-contiguous (what `np.take(out=...)` needs)."""
    return all(rows.array.flags.c_contiguous for _, dst in pairs for rows in dst.layers)


def _torch_copy(
    plan: RowPlan, pairs: Sequence[_MemberPair], layers: int, on_layer: LayerCallback | None
) -> None:
    """RUNS or GATHER in this thread with torch: a slice ``copy_`` or an `index_select` per
    run and member, over all layers at once (`MemberRows.stacked`) when nobody waits for
    layers, so the whole copy is one parallel region like a plain tensor copy.

    NOTE: measured on a busy 2-core machine, one torch call per layer was 0.2-0.9x a
    contiguous copy (each call waits for its slowest intra-op thread, and the waits add
    up), one call over all layers 0.8-1.1x. For strided destination rows (page_first slots)
    torch is the only one-pass gather: numpy gathers into strided rows go through a
    temporary (0.5-0.9x with cache-sized chunks), and `np.take` into strided rows copies the
    whole destination to a temporary and back (0.2x).
    """
    import torch

    runs = plan.runs
    index = torch.from_numpy(plan.src_ids)
    s, d = plan.src_ids, plan.dst_ids
    gather = plan.kind is PlanKind.GATHER

    def move(src_rows: torch.Tensor, dst_rows: torch.Tensor, dim: int) -> None:
        src_rows, dst_rows = _same_width(src_rows, dst_rows)
        for a, b in runs:
            out = dst_rows.narrow(dim, int(d[a]), b - a)
            if gather:
                torch.index_select(src_rows, dim, index[a:b], out=out)
            else:
                out.copy_(src_rows.narrow(dim, int(s[a]), b - a))

    per_layer = []
    for src, dst in pairs:
        if on_layer is None and src.grid is not None and dst.grid is not None:
            assert src.stacked is not None and dst.stacked is not None
            move(src.stacked, dst.stacked, 1)
        else:
            per_layer.append((src, dst))
    for layer in range(layers):
        for src, dst in per_layer:
            if layer < len(src):
                move(src.layers[layer].tensor, dst.layers[layer].tensor, 0)
        if on_layer is not None:
            on_layer(layer)


def _same_width(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both widened rows in one dtype (bytes when their widest dtypes differ)."""
    if src.dtype == dst.dtype:
        return src, dst
    import torch

    return src.view(torch.uint8), dst.view(torch.uint8)


def _jobs(plan: RowPlan, pairs: Sequence[_MemberPair], layers: int) -> list[_Job]:
    """The numpy jobs of `plan`, in layer order, each about `CHUNK_BYTES` and never crossing
    a run boundary that its form needs."""
    s, d = plan.src_ids, plan.dst_ids
    runs = plan.runs
    kind = plan.kind
    if kind is PlanKind.GATHER and not _contiguous_rows(pairs):
        kind = PlanKind.STAGED  # (`np.take(out=)` needs contiguous rows; torch not loaded)
    jobs: list[_Job] = []
    for layer in range(layers):
        for src, dst in pairs:
            if layer >= len(src):
                continue
            src_rows, dst_rows = _same_array(src.layers[layer], dst.layers[layer])
            step = max(1, CHUNK_BYTES // (src_rows.shape[1] * src_rows.itemsize))
            for a0, b0 in runs:
                for a in range(a0, b0, step):
                    b = min(a + step, b0)
                    jobs.append((layer, _job(kind, src_rows, s, dst_rows, d, a, b)))
    return jobs


def _same_array(
    src: LayerRows, dst: LayerRows
) -> tuple[npt.NDArray[np.integer], npt.NDArray[np.integer]]:
    if src.array.dtype == dst.array.dtype:
        return src.array, dst.array
    return src.array.view(np.uint8), dst.array.view(np.uint8)


def _job(
    kind: PlanKind,
    src: npt.NDArray[np.integer],
    s: npt.NDArray[np.int64],
    dst: npt.NDArray[np.integer],
    d: npt.NDArray[np.int64],
    a: int,
    b: int,
) -> Callable[[], None]:
    """Move pairs ``a:b`` of one member's layer (`s`, `d`: the plan's ids), as wide rows:
    numpy releases the GIL for the whole move."""
    s0, d0, k = int(s[a]), int(d[a]), b - a
    if kind is PlanKind.RUNS:
        return lambda: np.copyto(dst[d0 : d0 + k], src[s0 : s0 + k])
    if kind is PlanKind.GATHER:  # contiguous destination rows (checked by the caller)

        def gather() -> None:
            np.take(src, s[a:b], axis=0, out=dst[d0 : d0 + k], mode="clip")

        return gather
    if kind is PlanKind.SCATTER:

        def scatter() -> None:
            dst[d[a:b]] = src[s0 : s0 + k]

        return scatter

    def staged() -> None:
        dst[d[a:b]] = src[s[a:b]]

    return staged


def copy_rows(
    plan: RowPlan, src_rows: torch.Tensor, dst_rows: torch.Tensor, pool: ThreadPoolExecutor
) -> None:
    """Execute `plan` for one layer of one member (CPU tensors of equal row width), the
    numpy forms split over `pool` (the CUDA engine's host-side rows)."""
    if not plan.runs:
        return
    src = MemberRows((LayerRows.of(src_rows.numpy()),), None)
    dst = MemberRows((LayerRows.of(dst_rows.numpy()),), None)
    if plan.kind is PlanKind.GATHER and not _contiguous_rows([(src, dst)]):
        _torch_copy(plan, [(src, dst)], 1, None)
        return
    futures = [pool.submit(work) for _, work in _jobs(plan, [(src, dst)], 1)]
    for future in futures:
        future.result()


def build_copy_engine(device: DevicePools, host: HostPools, threads: int = 2) -> CopyEngine:
    """The copy engine matching where the device pools live."""
    if device.is_cuda:
        from hicache.tiers.cuda import CudaCopyEngine

        return CudaCopyEngine(device, host)
    return CpuCopyEngine(device, host, threads)
