"""Running a piece of a test as an unprivileged user: root passes every permission check,
so a test of a refusal drops to `nobody` (uid/gid 65534) in a forked child first."""

from __future__ import annotations

import os
from collections.abc import Callable

NOBODY = 65534


def as_nobody(work: Callable[[], str]) -> str:
    """`work()`'s report, computed in a forked child that drops to `nobody` first when this
    runs as root. The child reports through a pipe and never returns into pytest; one that
    raised fails the caller with the exception's repr. `work` should need no file `nobody`
    cannot read (import what it uses, and make its lazy imports, before calling this)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        code = 1
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            os.write(write_end, work().encode())
            code = 0
        except BaseException as e:
            os.write(write_end, repr(e).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        report = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report
    return report
