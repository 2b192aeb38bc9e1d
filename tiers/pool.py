"""`PageAllocator`: the free list of one component's pages (shared by its sidecars' pools)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from hicache.errors import InvalidArgument, ResourceExhausted
from hicache.tiers.base import Allocator, PageIds

_SHOWN_IDS = 8  # ids quoted in an error message before "..."
# Batches up to this size are checked as Python lists: numpy's per-call overhead is more
# than the work for the few pages a request allocates or frees.
_SMALL = 32


class PageAllocator(Allocator):
    """A LIFO stack of free ids plus an allocated mask.

    The stack is a preallocated int64 array: allocate pops a batch off the top, free pushes
    one back, so both cost O(batch) whatever the pool size (O(1) per page). Popping returns
    the top in reverse so that a batch freed as ``[a, b, c]`` is handed out again as
    ``[a, b, c]`` and a fresh allocator yields ``0, 1, 2, ...`` (contiguous runs make the
    copy engine's job a plain slice copy).
    """

    def __init__(self, total: int, name: str = "pages") -> None:
        if total <= 0:
            raise InvalidArgument(f"{name}: a pool needs at least one page (got {total})")
        self._name = name
        self._total = total
        self._stack = np.arange(total - 1, -1, -1, dtype=np.int64)
        self._top = total  # stack[:top] are the free ids; the next one out is stack[top-1]
        self._allocated = np.zeros(total, dtype=np.bool_)

    def __repr__(self) -> str:
        return f"PageAllocator({self._name!r}, free={self._top}/{self._total})"

    @property
    def name(self) -> str:
        return self._name

    @property
    def total(self) -> int:
        return self._total

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self._total - self._top

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    def allocate(self, n: int) -> npt.NDArray[np.int64]:
        if n < 0:
            raise InvalidArgument(f"{self._name}: cannot allocate a negative count ({n})")
        if n > self._top:
            raise ResourceExhausted(
                f"{self._name}: {n} pages requested, {self._top} of {self._total} free"
            )
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._allocated[ids] = True
        return ids

    def free(self, ids: PageIds) -> None:
        batch = self._validated(ids)
        if batch.size == 0:
            return
        held = self._allocated[batch]
        if not held.all():
            raise InvalidArgument(
                f"{self._name}: double free: pages {_show(batch[~held])} are not allocated"
            )
        self._allocated[batch] = False
        self._stack[self._top : self._top + batch.size] = batch[::-1]
        self._top += batch.size

    def is_allocated(self, ids: PageIds) -> npt.NDArray[np.bool_]:
        """Per id, whether it is allocated. Raises `InvalidArgument` for bad ids."""
        batch = self._validated(ids, allow_repeats=True)
        return self._allocated[batch].copy()

    def check_integrity(self) -> None:
        free = self._stack[: self._top]
        assert np.unique(free).size == free.size, f"{self._name}: an id is free twice"
        assert not self._allocated[free].any(), f"{self._name}: a free id is marked allocated"
        allocated = int(self._allocated.sum())
        assert free.size + allocated == self._total, (
            f"{self._name}: free {free.size} + allocated {allocated} != total {self._total}"
        )

    def _validated(self, ids: PageIds, allow_repeats: bool = False) -> npt.NDArray[np.int64]:
        arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidArgument(
                f"{self._name}: page ids must be a 1-D integer array "
                f"(got shape {arr.shape}, dtype {arr.dtype})"
            )
        batch = arr.astype(np.int64, copy=False)
        n = batch.size
        if n == 0:
            return batch
        if n <= _SMALL:
            listed = batch.tolist()
            in_range = min(listed) >= 0 and max(listed) < self._total
            repeated = not allow_repeats and n > 1 and len(set(listed)) != n
        else:
            in_range = int(batch.min()) >= 0 and int(batch.max()) < self._total
            ordered = np.sort(batch) if not allow_repeats else batch
            repeated = not allow_repeats and bool((ordered[1:] == ordered[:-1]).any())
        if not in_range:
            bad = batch[(batch < 0) | (batch >= self._total)]
            raise InvalidArgument(
                f"{self._name}: page ids {_show(bad)} out of range [0, {self._total})"
            )
        if repeated:
            uniq, counts = np.unique(batch, return_counts=True)
            raise InvalidArgument(
                f"{self._name}: page ids {_show(uniq[counts > 1])} repeated in one batch"
            )
        return batch


def _show(ids: npt.NDArray[np.int64]) -> str:
    head = ", ".join(str(int(i)) for i in ids[:_SHOWN_IDS])
    more = f", ... ({ids.size} in all)" if ids.size > _SHOWN_IDS else ""
    return f"[{head}{more}]"
