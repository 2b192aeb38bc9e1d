"""The controller's mutex, and the work a reply does not wait for.

An RPC's reply often depends on only part of what it changes: an Insert answers with the
token counts its tree insert found, while freeing the pages it made redundant, ending its
lock and allocation and queuing the write-through of what it added change nothing the
caller reads in the reply. Such work is *owed* (`owe`): it runs the next time anyone takes
the mutex, before that holder does anything else; the RPC's end (its reply on the wire)
takes the mutex for that (`HybridCacheController.hold_background`'s release), unless
someone else took it first. Every reader of the controller's state holds the mutex, so
every reader sees the owed work done: the order of effects is the order of the calls, as
if the work had run inline. Only the time it runs moves, off the caller's wait.

Owed work must change only what the mutex guards: a copy an engine then reads or writes
in the mapped pools outside the daemon (the copy-on-write of a MAMBA checkpoint an Insert
with `keep_lock` hands back) is done inline.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from hicache.logthrottle import ThrottledLog

log = logging.getLogger("hicache.controller")
_failed = ThrottledLog(log)


class OwingMutex:
    """A re-entrant lock that runs the work owed under it whenever it is taken, before the
    taker goes on; not when its holder re-enters it (owed work never runs in the middle
    of an operation), nor from inside that work. Usable with `threading.Condition`: a
    waiter taking the lock back pays too (others ran whole operations while it waited)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owed: deque[Callable[[], None]] = deque()
        self._paying = False
        self.failures = 0  # owed work that raised (logged; the rest still ran)

    # ------------------------------------------------------------------ the lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        entering = not self._lock._is_owned()  # type: ignore[attr-defined]
        if not self._lock.acquire(blocking, timeout):
            return False
        if entering and self._owed and not self._paying:
            self._pay_locked()
        return True

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def condition(self) -> threading.Condition:
        """A condition variable over this mutex."""
        return threading.Condition(self)  # type: ignore[arg-type]  # (the lock protocol below)

    # threading.Condition's protocol for a re-entrant lock: a wait releases every level.
    def _release_save(self) -> Any:
        return self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)  # type: ignore[attr-defined]
        if self._owed and not self._paying:
            self._pay_locked()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined,no-any-return]

    # ------------------------------------------------------------------ owed work

    def owe(self, work: Callable[[], None]) -> None:
        """Caller holds the lock: `work` runs before anyone else's next use of what the
        lock guards (or at `pay`)."""
        self._owed.append(work)

    @property
    def owing(self) -> bool:
        return bool(self._owed)

    def _pay_locked(self) -> None:
        self._paying = True
        try:
            while self._owed:
                work = self._owed.popleft()
                try:
                    work()
                except Exception as exc:  # the owing call has answered: log, go on
                    self.failures += 1
                    _failed.error(f"owed:{type(exc).__name__}", "work owed by an answered call "
                                  "failed", exc_info=exc)
        finally:
            self._paying = False
