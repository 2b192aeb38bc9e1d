"""How the file backend spreads one call over threads (`storage.file.threads`).

On a local filesystem the kernel's page cache answers a check or a read in microseconds,
and hand-offs between threads cost more than they overlap: checks and reads run in one
thread, writes (mostly system calls that release the GIL: two threads measured ~1.3x one
here) in two, each thread taking a run of at least `MIN_PART` objects. Reads stay in one
because they are mostly the kernel's copy plus hashing under the GIL (a second thread
measured no faster, and the verification then runs in the thread that just read the
object, on bytes still in the CPU cache).

On a shared (network) filesystem every check and read is a round trip to a server:
calls fan out over `SHARED_FS_THREADS` threads, down to one object a thread. Existence
checks then go in rounds (`exists_rounds`): the first key alone, so that a prompt the
store does not hold costs one round trip; then rounds as large as everything checked so
far (at least one key a thread), so that the keys checked past a miss are never more
than those before it (or a thread's worth less one), and a run found costs a few round
trips, not one per page.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

WRITE_THREADS = 2
READ_THREADS = 1
MIN_PART = 16  # objects a thread takes at least, on a local filesystem
SHARED_FS_THREADS = 16


@dataclass(frozen=True)
class FileThreads:
    """Threads per call by kind of call, and the fewest objects a thread takes."""

    exists: int
    read: int
    write: int
    min_part: int

    @classmethod
    def resolve(cls, configured: int | None, shared: bool) -> FileThreads:
        """`storage.file.threads` (None: by filesystem) on a `shared` filesystem or not."""
        part = 1 if shared else MIN_PART
        if configured is not None:
            return cls(configured, configured, configured, part)
        if shared:
            return cls(SHARED_FS_THREADS, SHARED_FS_THREADS, SHARED_FS_THREADS, part)
        return cls(1, READ_THREADS, WRITE_THREADS, part)


def runs(total: int, threads: int, min_part: int) -> list[tuple[int, int]]:
    """(start, length) of at most `threads` runs of at least `min_part` covering `total`."""
    if total <= 0:
        return [(0, 0)]
    n = max(1, min(threads, total // max(1, min_part)))
    size = -(-total // n)
    return [(lo, min(size, total - lo)) for lo in range(0, total, size)]


def exists_rounds(total: int, threads: int) -> Iterator[tuple[int, int]]:
    """(start, length) of the rounds a fanned-out existence check of `total` keys goes in:
    1, then `threads`, then each as large as all the rounds before it."""
    lo, size = 0, 1
    while lo < total:
        end = min(total, lo + size)
        yield lo, end - lo
        lo = end
        size = max(threads, lo)
