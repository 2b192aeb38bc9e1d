"""The C allocator's settings for a process that allocates and frees large arrays per request.

glibc serves an allocation of 128 KiB or more with an mmap of its own and unmaps it on
free (its threshold adapts upwards only for the size just freed), and returns the top of
the heap to the kernel once 128 KiB of it is free. A page-id array of 16K ids (a
16K-token prompt at page size 1, FULL and SWA each) is that large, so every request
faulted its pages in again: ~40 page faults a request in `hicache bench tree`, where
FULL's match of a 128K-token prompt took 162 us with the defaults and 94 us with `tune()`.
`tune()` raises both thresholds once, at start, so such arrays come from the heap, whose
memory stays mapped. The cost: memory such arrays free stays with the process for its
next allocations rather than going back to the kernel at once (freed chunks inside the
heap never did; now the large ones are among them), so the process keeps up to the peak
it had in use, plus up to `trim_threshold` bytes at the heap's top.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serve allocations below `mmap_threshold` from the heap and keep up to
    `trim_threshold` bytes of free heap mapped. True when the C library took both
    settings (glibc); False where it has no `mallopt` or refused (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
