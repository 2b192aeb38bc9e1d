"""How the copy engines see pools and plan row moves (shared by the CPU and CUDA engines).

Pools never move once created, so a member's layers are viewed once (`MemberRows`: per
layer the rows widened for numpy and torch and as opaque items, plus all layers as one
grid). The views are numpy; their torch tensors are made at their first use (only large
copies use torch: a CPU daemon whose copies are all small never imports it).
`plan_rows` chooses, per call, how to move rows ``src[src_ids[i]] -> dst[dst_ids[i]]``
by how contiguous the ids are; `validate_copy` checks the ids first.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hicache.arrays import all_of
from hicache.errors import InvalidArgument
from hicache.tiers.base import MemberPools, PageIds
from hicache.tiers.pool import checked_ids, repeated_ids
from hicache.types import ComponentKind

if TYPE_CHECKING:
    import torch

MIN_RUN = 16  # average run length (pages) from which run-wise copies beat index ops
SMALL_COPY_PAGES = 64  # copies of at most this many pairs take the inline path


class PlanKind(enum.Enum):
    RUNS = "runs"
    GATHER = "gather"
    SCATTER = "scatter"
    STAGED = "staged"


@dataclass(frozen=True)
class RowPlan:
    """How to move rows `src_ids[i] -> dst_ids[i]`; `runs` are ``(start, stop)`` ranges of
    the pair index, each a whole run of the side(s) that `kind` needs contiguous (the
    executors cut them to their own chunk sizes)."""

    kind: PlanKind
    src_ids: npt.NDArray[np.int64]
    dst_ids: npt.NDArray[np.int64]
    runs: tuple[tuple[int, int], ...]


def plan_rows(src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]) -> RowPlan:
    """Choose the copy form for these pairs: the first of RUNS, GATHER, SCATTER whose
    side(s) break into at most one run per `MIN_RUN` pairs, else STAGED (one run)."""
    n = int(src_ids.size)
    if n == 0:
        return RowPlan(PlanKind.RUNS, src_ids, dst_ids, ())
    if _is_run(src_ids) and _is_run(dst_ids):  # the common case: no per-pair work at all
        return RowPlan(PlanKind.RUNS, src_ids, dst_ids, ((0, n),))
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
    starts = [0, *(np.flatnonzero(breaks) + 1).tolist(), n]
    return RowPlan(kind, src_ids, dst_ids, tuple(itertools.pairwise(starts)))


def _is_run(ids: npt.NDArray[np.int64]) -> bool:
    """Whether `ids` (non-empty) is ``a, a+1, ..., a+n-1``."""
    n = int(ids.size)
    return int(ids[-1]) - int(ids[0]) == n - 1 and (n < 3 or all_of(np.diff(ids) == 1))


_WIDE = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.int16))


def widen_array(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.integer]:
    """`rows` (uint8, rows in the last dimension, each contiguous) viewed as the widest
    integer dtype that divides every row, every stride and the address evenly."""
    address = rows.__array_interface__["data"][0]
    for dtype in _WIDE:
        size = dtype.itemsize
        if (
            rows.shape[-1] % size == 0
            and all(stride % size == 0 for stride in rows.strides[:-1])
            and address % size == 0
        ):
            return rows.view(dtype)
    return rows


def widen(rows: torch.Tensor) -> torch.Tensor:
    """`widen_array` for a CPU tensor (the same memory, as a tensor)."""
    import torch

    return torch.from_numpy(widen_array(rows.numpy()))


def row_items(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.void]:
    """`rows` (uint8, 2-D, each row contiguous) as a 1-D numpy array with one opaque item
    per row: the cheapest form for fancy indexing a few rows (one `memmove` per row).
    NOTE: numpy keeps the GIL for a copy of fewer than 500 items, so threads only help on
    wider views (`LayerRows.array`)."""
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


@dataclass(frozen=True)
class LayerRows:
    """One layer of one member pool, viewed once: `array` the rows widened (threaded
    numpy ops), `items` rows as opaque items (small copies), `tensor` the widened rows
    for torch ops (made at its first use)."""

    array: npt.NDArray[np.integer]
    items: npt.NDArray[np.void]

    @classmethod
    def of(cls, rows: npt.NDArray[np.uint8]) -> LayerRows:
        return cls(widen_array(rows), row_items(rows))

    @functools.cached_property
    def tensor(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.array)


@dataclass(frozen=True)
class MemberRows:
    """Every layer of one member pool; `grid` is all of them as one widened array
    ``[layers, num_pages, row]`` when the layers lie at equal distances (both L1 and L2
    layouts do), else None; `stacked` is that grid as a tensor (made at its first use)."""

    layers: tuple[LayerRows, ...]
    grid: npt.NDArray[np.integer] | None

    @classmethod
    def of(cls, pools: MemberPools, member: str, layers: int) -> MemberRows:
        rows = [pools.layer_array(member, layer) for layer in range(layers)]
        return cls(tuple(LayerRows.of(r) for r in rows), _grid(rows))

    @functools.cached_property
    def stacked(self) -> torch.Tensor | None:
        if self.grid is None:
            return None
        import torch

        return torch.from_numpy(self.grid)

    def __len__(self) -> int:
        return len(self.layers)


def _grid(rows: Sequence[npt.NDArray[np.uint8]]) -> npt.NDArray[np.integer] | None:
    """`rows` (one uint8 array per layer) as one widened ``[layers, pages, row]`` view."""
    if len(rows) < 2 or any(r.shape != rows[0].shape or r.strides != rows[0].strides for r in rows):
        return None
    addresses = [r.__array_interface__["data"][0] for r in rows]
    step = addresses[1] - addresses[0]
    if step <= 0 or any(b - a != step for a, b in itertools.pairwise(addresses)):
        return None
    first = rows[0]
    grid = np.lib.stride_tricks.as_strided(
        first, (len(rows), *first.shape), (step, *first.strides)
    )
    return widen_array(grid)


def validate_slot_copy(family: ComponentKind, pools: MemberPools, src: int, dst: int) -> None:
    """Check a copy of one slot to another within `pools` (MAMBA copy-on-write): both in
    range (a -1 would index the last slot) and not the same slot."""
    n = pools.num_pages(family)
    for name, slot in (("source", src), ("destination", dst)):
        if not 0 <= slot < n:
            raise InvalidArgument(f"{family.value} {name} slot {slot} is outside [0, {n})")
    if src == dst:
        raise InvalidArgument(f"{family.value}: copy of slot {src} onto itself")


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
    twice = repeated_ids(d)
    if twice.size:
        raise InvalidArgument(f"{family.value}: {names[1]} ids {twice[:8].tolist()} appear twice")
    return s, d
