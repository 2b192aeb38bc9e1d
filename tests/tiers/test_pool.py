"""PageAllocator: narrated batches with exact ids, and every way a free can be wrong."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import InvalidArgument, ResourceExhausted
from hicache.tiers.pool import PageAllocator


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_fresh_allocator_hands_out_ascending_ids_and_reuses_last_freed_first() -> None:
    alloc = PageAllocator(8, "l1.full")
    assert alloc.allocate(3).tolist() == [0, 1, 2]
    assert alloc.allocate(2).tolist() == [3, 4]
    assert (alloc.free_count, alloc.used_count) == (3, 5)

    # Freed as [4, 1]: the next batch gets them back in that order, then fresh 5, 6.
    alloc.free(np.array([4, 1], dtype=np.int32))
    assert alloc.free_count == 5
    assert alloc.allocate(4).tolist() == [4, 1, 5, 6]
    assert alloc.allocate(0).tolist() == []
    alloc.check_integrity()


def test_exhaustion_is_checked_before_anything_is_taken() -> None:
    alloc = PageAllocator(4, "l2.full")
    alloc.allocate(3)
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(ResourceExhausted, match=r"l2.full: 2 pages requested, 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.free_count == 1
    assert alloc.allocate(1).tolist() == [3]
    alloc.check_integrity()


def test_double_free_names_the_pages_and_changes_nothing() -> None:
    alloc = PageAllocator(6, "l1.full")
    alloc.allocate(4)
    alloc.free(ids(2))
    with pytest.raises(InvalidArgument, match=r"double free: pages \[2\] are not allocated"):
        alloc.free(ids(1, 2))
    assert alloc.free_count == 3  # page 1 was not freed by the failed call
    alloc.free(ids(1))
    alloc.check_integrity()


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (ids(1, 6, -1), r"page ids \[6, -1\] out of range \[0, 6\)"),
        (ids(0, 3, 0), r"page ids \[0\] repeated in one batch"),
        (np.zeros((2, 2), dtype=np.int64), r"1-D integer array"),
        (np.array([0.0, 1.0]), r"1-D integer array"),
    ],
)
def test_bad_batches_are_rejected_whole(batch: np.ndarray, message: str) -> None:
    alloc = PageAllocator(6, "l1.full")
    alloc.allocate(6)
    with pytest.raises(InvalidArgument, match=message):
        alloc.free(batch)
    assert alloc.free_count == 0
    alloc.check_integrity()


@pytest.mark.parametrize("size", [5, 31, 32, 200])  # as lists (to 32 ids), and as arrays
def test_bad_large_and_small_batches_name_the_offending_ids(size: int) -> None:
    alloc = PageAllocator(300, "l2.full")
    held = alloc.allocate(size)
    with pytest.raises(InvalidArgument, match=r"page ids \[300\] out of range \[0, 300\)"):
        alloc.free(np.append(held, 300))
    with pytest.raises(InvalidArgument, match=rf"page ids \[{held[1]}\] repeated in one batch"):
        alloc.free(np.append(held, held[1]))
    with pytest.raises(InvalidArgument, match=r"double free: pages \[299\] are not allocated"):
        alloc.free(np.append(held[:-1], 299))
    assert alloc.free_count == 300 - size  # nothing freed by the failed calls
    alloc.free(held)
    alloc.check_integrity()


def test_empty_free_and_bad_counts() -> None:
    alloc = PageAllocator(2)
    alloc.free(np.array([], dtype=np.int64))
    with pytest.raises(InvalidArgument, match="negative"):
        alloc.allocate(-1)
    with pytest.raises(InvalidArgument, match="at least one page"):
        PageAllocator(0)


def test_is_allocated_and_integrity_catches_corruption() -> None:
    alloc = PageAllocator(5, "l1.full")
    alloc.allocate(2)
    assert alloc.is_allocated(ids(0, 1, 2, 0)).tolist() == [True, True, False, True]
    alloc.check_integrity()
    alloc._allocated[4] = True  # simulate a bug: an id both free and allocated
    with pytest.raises(AssertionError, match="free id is marked allocated"):
        alloc.check_integrity()


def test_large_batches_cycle_without_leaks() -> None:
    alloc = PageAllocator(100_000)
    rng = np.random.default_rng(0)
    held = alloc.allocate(60_000)
    rng.shuffle(held)
    alloc.free(held[:30_000])
    again = alloc.allocate(50_000)
    assert np.array_equal(again[:30_000], held[:30_000])  # freed batch returns in order
    assert np.unique(np.concatenate([held[30_000:], again])).size == 80_000
    alloc.check_integrity()
