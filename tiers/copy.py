"""Copy engine L1 <-> L2 for whole families, one layer at a time (CPU implementation).

A copy moves rows ``src[src_ids[i]] -> dst[dst_ids[i]]`` of every layer of every family
member. The id pairs are planned once per call (`plan_rows`), by how contiguous they are:

- ``RUNS``: both sides advance together in long runs -> one slice ``copy_`` per run;
- ``GATHER``: the destination is in long runs -> ``index_select(out=dst_run)``;
- ``SCATTER``: the source is in long runs -> ``dst[ids] = src_run`` (numpy, rows as items);
- ``STAGED``: both sides scattered -> ``dst[ids] = src[ids]`` (numpy gathers each chunk
  into a temporary, then scatters it).

Every form is one pass over the bytes except ``STAGED``. Torch forms view rows as the
widest integer dtype their width and stride allow (NOTE: a uint8 scatter is ~10x slower
than the same bytes as int64) and run in the calling thread on torch's intra-op threads;
numpy forms view each row as one opaque item (`row_items`: one memmove per row) and are
split over a small thread pool (numpy releases the GIL).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

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
from hicache.types import ComponentKind

MIN_RUN = 16  # average run length (pages) from which run-wise copies beat index ops
# Pool copies are cut into this many chunks per thread: threads that finish early take more
# (on a busy machine one thread is often descheduled; equal halves would wait for it).
CHUNKS_PER_THREAD = 4


class PlanKind(enum.Enum):
    RUNS = "runs"
    GATHER = "gather"
    SCATTER = "scatter"
    STAGED = "staged"


@dataclass(frozen=True)
class RowPlan:
    """How to move rows `src_ids[i] -> dst_ids[i]`; `chunks` are ``(start, stop)`` ranges of
    the pair index, each inside one run of the side(s) that `kind` needs contiguous."""

    kind: PlanKind
    src_ids: npt.NDArray[np.int64]
    dst_ids: npt.NDArray[np.int64]
    chunks: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return int(self.src_ids.size)


def plan_rows(
    src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64], parts: int = 2
) -> RowPlan:
    """Choose the copy form for these pairs and cut it into chunks.

    Chunks never cross a run boundary of the side the form needs contiguous, and no
    chunk is longer than ``ceil(n / parts)``, so `parts` workers get similar shares.
    """
    n = int(src_ids.size)
    if n == 0:
        return RowPlan(PlanKind.RUNS, src_ids, dst_ids, ())
    src_breaks = np.diff(src_ids) != 1
    dst_breaks = np.diff(dst_ids) != 1
    limit = max(1, n // MIN_RUN)
    candidates = (
        (PlanKind.RUNS, src_breaks | dst_breaks),
        (PlanKind.GATHER, dst_breaks),
        (PlanKind.SCATTER, src_breaks),
    )
    kind, breaks = PlanKind.STAGED, np.zeros(n - 1, dtype=np.bool_)
    for candidate, candidate_breaks in candidates:
        if int(candidate_breaks.sum()) + 1 <= limit:
            kind, breaks = candidate, candidate_breaks
            break
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1, [n]))
    longest = -(-n // max(1, parts))
    chunks: list[tuple[int, int]] = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        chunks.extend((lo, min(lo + longest, b)) for lo in range(a, b, longest))
    return RowPlan(kind, src_ids, dst_ids, tuple(chunks))


def widen(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (uint8, 2-D) viewed as the widest integer dtype that divides it evenly."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (
            rows.shape[1] % size == 0
            and rows.stride(0) % size == 0
            and rows.storage_offset() % size == 0
        ):
            return rows.view(dtype)
    return rows


def row_items(rows: torch.Tensor) -> npt.NDArray[np.void]:
    """`rows` (uint8, 2-D, each row contiguous) as a 1-D numpy array with one opaque item
    per row. NOTE: numpy moves a fancy-indexed item of this kind with one `memmove`, with
    the GIL released: a row scatter this way measured ~1.0x a contiguous copy of the same
    bytes, vs ~0.7-0.8x for the same scatter on an int64 view (a strided inner loop per
    row) and ~0.1x on uint8."""
    arr = rows.numpy()
    return arr.view(np.dtype((np.void, arr.shape[1])))[:, 0]


def checked_ids(ids: PageIds, pages: int, what: str) -> npt.NDArray[np.int64]:
    """`ids` as int64, or `InvalidArgument` if not 1-D integers within ``[0, pages)``."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgument(f"{what}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
    out = arr.astype(np.int64, copy=False)
    bad = out[(out < 0) | (out >= pages)]
    if bad.size:
        raise InvalidArgument(f"{what} {bad[:8].tolist()} out of range [0, {pages})")
    return out


def validate_copy(
    family: ComponentKind,
    src: MemberPools,
    src_ids: PageIds,
    dst: MemberPools,
    dst_ids: PageIds,
    names: tuple[str, str],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Check a family copy before any byte moves; return both id batches as int64."""
    src_family, dst_family = src.family(family), dst.family(family)
    if src_family != dst_family:
        raise InvalidArgument(
            f"{family.value}: {names[0]} and {names[1]} hold different family members"
        )
    s = checked_ids(src_ids, src.num_pages(family), f"{family.value} {names[0]} ids")
    d = checked_ids(dst_ids, dst.num_pages(family), f"{family.value} {names[1]} ids")
    if s.size != d.size:
        raise InvalidArgument(
            f"{family.value}: {s.size} {names[0]} ids but {d.size} {names[1]} ids"
        )
    uniq, counts = np.unique(d, return_counts=True)
    if uniq.size != d.size:
        raise InvalidArgument(
            f"{family.value}: {names[1]} ids {uniq[counts > 1][:8].tolist()} appear twice"
        )
    return s, d


class CpuCopyEngine(CopyEngine):
    """Copies between CPU-resident L1 (shared memory) and L2 pools."""

    def __init__(self, device: DevicePools, host: HostPools, threads: int = 2) -> None:
        if device.is_cuda:
            raise InvalidArgument("CpuCopyEngine needs CPU device pools; use CudaCopyEngine")
        self._device = device
        self._host = host
        self._threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _copy(
        self,
        family: ComponentKind,
        src: MemberPools,
        src_ids: npt.NDArray[np.int64],
        dst: MemberPools,
        dst_ids: npt.NDArray[np.int64],
        on_layer: LayerCallback | None,
    ) -> CopyResult:
        members = src.family(family)
        plan = plan_rows(src_ids, dst_ids, self._threads * CHUNKS_PER_THREAD)
        layers = max(m.layers for m in members)
        moved = 0
        for layer in range(layers):
            for spec in members:
                if layer < spec.layers:
                    copy_rows(
                        plan,
                        src.layer(spec.name, layer),
                        dst.layer(spec.name, layer),
                        self._executor(),
                    )
                    moved += plan.rows * spec.bytes_per_page_per_layer
            if on_layer is not None:
                on_layer(layer)
        return CopyResult(pages=plan.rows, bytes=moved, layers=layers)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="hicache-copy")
        return self._pool


def copy_rows(
    plan: RowPlan, src_rows: torch.Tensor, dst_rows: torch.Tensor, pool: ThreadPoolExecutor
) -> None:
    """Execute `plan` for one layer of one member (CPU tensors of equal row width)."""
    if not plan.chunks:
        return
    src, dst = widen(src_rows), widen(dst_rows)
    if src.dtype != dst.dtype:
        src, dst = src_rows, dst_rows
    s, d = plan.src_ids, plan.dst_ids
    if plan.kind is PlanKind.RUNS:
        for a, b in _merged(plan):
            d0, s0 = int(d[a]), int(s[a])
            dst[d0 : d0 + b - a].copy_(src[s0 : s0 + b - a])
        return
    if plan.kind is PlanKind.GATHER:
        # One index_select per run writes the rows in place, strided (page_first slots)
        # or not. NOTE: measured alternatives were slower here: `np.take` into strided
        # rows copies the whole destination to a temporary and back (0.2x); staging
        # through a cache-sized buffer 0.5-0.6x; torch calls of <= 16 rows from the pool
        # (serial, no OpenMP) ~0.5x; `np.take` into contiguous rows (layer_first) 0.7x
        # on a quiet machine vs 0.85-0.9x for this (better only under load).
        index = torch.from_numpy(s)
        for a, b in _merged(plan):
            d0 = int(d[a])
            torch.index_select(src, 0, index[a:b], out=dst[d0 : d0 + b - a])
        return
    src_items, dst_items = row_items(src_rows), row_items(dst_rows)
    work: Callable[[int, int], None]
    if plan.kind is PlanKind.SCATTER:

        def scatter(a: int, b: int) -> None:
            s0 = int(s[a])
            dst_items[d[a:b]] = src_items[s0 : s0 + b - a]

        work = scatter
    else:

        def staged(a: int, b: int) -> None:
            dst_items[d[a:b]] = src_items[s[a:b]]

        work = staged
    futures = [pool.submit(work, a, b) for a, b in plan.chunks]
    for future in futures:
        future.result()


def _merged(plan: RowPlan) -> list[tuple[int, int]]:
    """Chunks glued back into whole runs: torch ops parallelise inside one call already."""
    out: list[tuple[int, int]] = []
    s, d = plan.src_ids, plan.dst_ids
    for a, b in plan.chunks:
        if out and out[-1][1] == a and _continues(plan.kind, s, d, a):
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _continues(
    kind: PlanKind, s: npt.NDArray[np.int64], d: npt.NDArray[np.int64], at: int
) -> bool:
    dst_ok = bool(d[at] == d[at - 1] + 1)
    if kind is PlanKind.GATHER:
        return dst_ok
    return dst_ok and bool(s[at] == s[at - 1] + 1)


def build_copy_engine(device: DevicePools, host: HostPools, threads: int = 2) -> CopyEngine:
    """The copy engine matching where the device pools live."""
    if device.is_cuda:
        from hicache.tiers.cuda import CudaCopyEngine

        return CudaCopyEngine(device, host)
    return CpuCopyEngine(device, host, threads)
