"""Background population of pool memory: every page becomes resident, contents are never
changed (it may run while the pool is in use), and stop() ends it before unmapping."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading

import numpy as np
import pytest

from hicache.tiers import prefault
from hicache.tiers.prefault import Prefaulter, populate

SIZE = 16 << 20


def resident_pages(m: mmap.mmap) -> int:
    """Pages of `m` resident in memory, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = len(m) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(m)), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def _kernel_populates() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE, asked of libc directly: deciding by
    `populate` (the code under test) turned a broken `populate` into a skip."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        addr = np.frombuffer(page, dtype=np.uint8).ctypes.data
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE),
                            prefault.MADV_POPULATE_WRITE) == 0
    finally:
        with contextlib.suppress(BufferError):
            page.close()


needs_populate = pytest.mark.skipif(not _kernel_populates(),
                                    reason="kernel without MADV_POPULATE_WRITE")


@pytest.fixture
def region():
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    yield m
    with contextlib.suppress(BufferError):  # a failed test's traceback may hold a view
        m.close()


@needs_populate
def test_populate_makes_every_page_resident_without_changing_it(region) -> None:
    arr = np.frombuffer(region, dtype=np.uint8)
    arr[5 * 4096 + 7] = 42  # a page already written keeps its bytes
    assert resident_pages(region) <= 16  # that page (and what the kernel read around it)
    done = populate(arr.ctypes.data, SIZE)
    assert done == SIZE
    assert resident_pages(region) == SIZE // mmap.PAGESIZE
    assert arr[5 * 4096 + 7] == 42 and int(arr.sum()) == 42


@needs_populate
def test_prefaulter_stops_between_chunks(region, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "CHUNK_BYTES", 1 << 20)
    arr = np.frombuffer(region, dtype=np.uint8)
    stop = threading.Event()
    real = prefault._madvise()
    assert real is not None

    def one_chunk_then_stop(addr: int, size: int, advice: int) -> int:
        stop.set()  # as if close() came while this chunk was being populated
        return real(addr, size, advice)

    monkeypatch.setattr(prefault, "_madvise", lambda: one_chunk_then_stop)
    assert populate(arr.ctypes.data, SIZE, stop) == 1 << 20  # that chunk, then no more
    assert populate(arr.ctypes.data, SIZE, stop) == 0  # stopped before the first chunk
    monkeypatch.undo()
    p = Prefaulter(arr.ctypes.data, SIZE, "test")
    assert p.wait(10) and p.done_bytes == SIZE
    p.stop()  # idempotent after it finished
