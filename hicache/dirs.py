"""Folders the daemon makes, each with the mode it means whatever the umask allows.

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
    """Make `path` with `mode` and each missing parent with `parents_mode` (the umask can
    only take bits away); an existing folder is left as it is. Raises `OSError`."""
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
        try:
            os.mkdir(folder, mode if i == len(missing) - 1 else parents_mode)
        except FileExistsError:
            if not os.path.isdir(folder):  # (another process's folder meanwhile is fine)
                raise
