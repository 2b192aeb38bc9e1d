"""Background population of pool memory: every page becomes resident, contents are never
changed (it may run while the pool is in use), and stop() ends it before unmapping."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
import pytest

from hicache.tiers import prefault
from hicache.tiers.prefault import Prefaulter, populate

SIZE = 16 << 20


def resident_pages(m: mmap.mmap) -> int:
    """Pages of `m` resident in this process (its mapping's Rss in /proc/self/smaps)."""
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    inside, rss = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss // mmap.PAGESIZE


@pytest.fixture
def region():
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    yield m
    m.close()


def test_populate_makes_every_page_resident_without_changing_it(region) -> None:
    arr = np.frombuffer(region, dtype=np.uint8)
    arr[5 * 4096 + 7] = 42  # a page already written keeps its bytes
    assert resident_pages(region) <= 2
    done = populate(arr.ctypes.data, SIZE)
    if done == 0:
        pytest.skip("kernel without MADV_POPULATE_WRITE")
    assert done == SIZE
    assert resident_pages(region) == SIZE // mmap.PAGESIZE
    assert arr[5 * 4096 + 7] == 42 and int(arr.sum()) == 42
    del arr


def test_prefaulter_stops_between_chunks(region, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "CHUNK_BYTES", 1 << 20)
    arr = np.frombuffer(region, dtype=np.uint8)
    stop = threading.Event()
    stop.set()
    assert populate(arr.ctypes.data, SIZE, stop) == 0  # stopped before the first chunk
    p = Prefaulter(arr.ctypes.data, SIZE, "test")
    assert p.wait(10)
    p.stop()  # idempotent after it finished
    assert p.done_bytes in (0, SIZE)
    del arr
