"""`PageAllocator`: the free list of one component's pages (shared by its sidecars' pools)."""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import numpy.typing as npt

from hicache.arrays import all_of, max_of, min_of
from hicache.errors import InvalidArgument, ResourceExhausted
from hicache.tiers.base import Allocator, PageIds

_SHOWN_IDS = 8  # ids quoted in an error message before "..."
# Batches up to this size are checked and marked as Python lists: numpy's per-call overhead
# is more than the work for the few pages a request allocates or frees. Fancy indexing and
# ufuncs cost most, and more in the daemon than warm: there each request meets cold caches
# (a ufunc reduction of one id took ~10 us).
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
        self._flags = self._allocated.data.cast("B")  # the same bytes, set one by one

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
        top = self._top
        ids = self._stack[top - n : top][::-1].copy()
        self._top = top - n
        if n <= _SMALL:
            flags = self._flags
            for i in ids.tolist():
                flags[i] = 1
        else:
            self._allocated[ids] = True
        return ids

    def free(self, ids: PageIds) -> None:
        batch = self._validated(ids)
        n = batch.size
        if n == 0:
            return
        if n <= _SMALL:
            flags = self._flags
            listed = batch.tolist()
            for i in listed:
                if not flags[i]:
                    self._double_free(batch)
            for i in listed:
                flags[i] = 0
        else:
            if not all_of(self._allocated[batch]):
                self._double_free(batch)
            self._allocated[batch] = False
        self._stack[self._top : self._top + n] = batch[::-1]
        self._top += n

    def _double_free(self, batch: npt.NDArray[np.int64]) -> NoReturn:
        held = self._allocated[batch]
        raise InvalidArgument(
            f"{self._name}: double free: pages {_show(batch[~held])} are not allocated"
        )

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
        batch = checked_ids(ids, self._total, f"{self._name}: page ids")
        if not allow_repeats:
            twice = repeated_ids(batch)
            if twice.size:
                raise InvalidArgument(f"{self._name}: page ids {_show(twice)} repeated in one batch")
        return batch


def checked_ids(ids: PageIds, pages: int, what: str) -> npt.NDArray[np.int64]:
    """`ids` as int64, or `InvalidArgument` (naming `what` and the bad ids) if they are not
    1-D integers within ``[0, pages)``."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(
            f"{what} must be a 1-D integer array (got shape {arr.shape}, dtype {arr.dtype})"
        )
    out = arr.astype(np.int64, copy=False)
    if not out.flags.c_contiguous:  # (a reversed or strided view: torch takes none)
        out = np.ascontiguousarray(out)
    n = out.size
    if n == 0:
        return out
    if n <= 8:  # (a list's min and max cost less for a few ids)
        listed = out.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = min_of(out), max_of(out)
    if lo < 0 or hi >= pages:
        bad = out[(out < 0) | (out >= pages)]
        raise InvalidArgument(f"{what} {_show(bad)} out of range [0, {pages})")
    return out


def repeated_ids(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The ids that appear more than once in `ids` (sorted; empty when all differ)."""
    n = int(ids.size)
    if n <= _SMALL:
        if len(set(ids.tolist())) == n:
            return ids[:0]
    elif all_of(np.diff(ids) > 0):  # ascending (allocator order): distinct, no sort
        return ids[:0]
    uniq, counts = np.unique(ids, return_counts=True)
    return uniq[counts > 1]


def _show(ids: npt.NDArray[np.int64]) -> str:
    head = ", ".join(str(int(i)) for i in ids[:_SHOWN_IDS])
    more = f", ... ({ids.size} in all)" if ids.size > _SHOWN_IDS else ""
    return f"[{head}{more}]"
