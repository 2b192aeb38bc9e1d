"""The signals of a `hicache serve` process that do not stop it, caught from its first
moment: `hicache.cli` sets them before it imports the server (grpc, numpy: ~0.3 s in
which a signal's default action would end the process), and `hicache.server.serve`
acts on them once the daemon runs. The stop (SIGTERM, SIGINT) is `serve`'s own.

- SIGHUP: a configuration reload (`hicache.reload`), noted here, run once ready. By
  default it ended the process at once: no flush, its socket and shared memory left
  behind.
- SIGUSR1: every thread's Python stack to stderr (`faulthandler`, written from the
  signal itself: a daemon stuck on a lock or a file, even in its start, can still say
  where); the process goes on. A crash in native code writes the same before it dies.
"""

from __future__ import annotations

import faulthandler
import signal
import sys


def watch_hangups(hangups: list[int] | None = None) -> list[int]:
    """Note every SIGHUP in `hangups` (returned; a new list without one) from now on.
    Main thread only."""
    noted: list[int] = [] if hangups is None else hangups
    signal.signal(signal.SIGHUP, lambda signum, _frame: noted.append(signum))
    return noted


def watch_stack_dumps() -> None:
    """SIGUSR1 dumps every thread's stack to stderr, as does a fatal signal."""
    stderr = sys.__stderr__  # (the process's own, even where sys.stderr is replaced)
    if stderr is None:
        return
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True, chain=False)
    faulthandler.enable(file=stderr, all_threads=True)
