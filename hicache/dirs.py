"""Folders the daemon makes, each with the mode it means whatever the umask.

`Path.mkdir(parents=True)` and `os.makedirs` give the missing parents the umask's
default mode: under umask 000 a socket's folder was world-writable (anyone could replace
the socket with their own) and a file store readable and writable by every local user.
"""

from __future__ import annotations

import os

SHARED_DIR_MODE = 0o755  # folders above what the daemon owns (the socket's, the store's)
GROUP_DIR_MODE = 0o770  # what the daemon and its group's daemons write (the file store)
GROUP_FILE_MODE = 0o660  # what they write there (as the control socket and L1 segments)


def make_dirs(path: str | os.PathLike[str], mode: int = SHARED_DIR_MODE,
              parents_mode: int = SHARED_DIR_MODE) -> None:
    """Make `path` with `mode` and each missing parent with `parents_mode`, whatever the
    umask; an existing folder is left as it is. Raises `OSError`."""
    path = os.path.abspath(os.fspath(path))
    missing: list[str] = []
    at = path
    while not os.path.isdir(at):
        missing.append(at)
        up = os.path.dirname(at)
        if up == at:
            break
        at = up
    for i, folder in enumerate(reversed(missing)):
        want = mode if i == len(missing) - 1 else parents_mode
        try:
            os.mkdir(folder, want)
        except FileExistsError:
            if not os.path.isdir(folder):  # (another process's folder meanwhile is fine)
                raise
            continue
        _set_mode(folder, want)


def _set_mode(folder: str, mode: int) -> None:
    """`mode` on the folder just made (mkdir's mode lost what the umask takes: under 022 a
    group's folder had no group writer), through a descriptor opened without following a
    link (the folder replaced by a link meanwhile gets no mode of ours)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
