"""The unix socket's lock (`hicache.endpoint.SocketLock`) under the cases its mutants lived
through (session 31): the daemon tests start real daemons, where gRPC's own unlinking of a
socket file at bind and at shutdown hides what the lock itself must do. These hold the
lock to its contract directly, on real files, sockets and flocks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hicache.dirs import make_dirs
from hicache.endpoint import SocketLock
from hicache.errors import FailedPrecondition


def _leave_socket_file(path: Path) -> None:
    """A socket file at `path` with no one listening: what a killed daemon leaves."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    finally:
        s.close()
    assert path.is_socket()


def test_a_socket_file_left_by_a_dead_daemon_is_removed_when_the_lock_is_taken(
    tmp_path: Path,
) -> None:
    # (mutant: the stale socket's unlink skipped)
    sock = tmp_path / "h.sock"
    _leave_socket_file(sock)
    lock = SocketLock(sock)
    lock.acquire()
    try:
        assert not sock.exists() and not sock.is_symlink()
    finally:
        lock.release()


def test_release_removes_the_socket_file_keeps_the_lock_file_and_frees_the_path(
    tmp_path: Path,
) -> None:
    # (mutant: release's unlink skipped)
    sock = tmp_path / "h.sock"
    lock = SocketLock(sock)
    lock.acquire()
    _leave_socket_file(sock)  # (the server bound it meanwhile)
    lock.release()
    assert not sock.exists()
    assert lock.lock_path.exists()  # (kept: see release's docstring)
    assert lock.lock_path.read_text() == ""  # no pid left naming a daemon that is gone
    again = SocketLock(sock)
    again.acquire()
    again.release()


def test_a_second_holder_is_refused_naming_the_first_holders_pid_exactly(tmp_path: Path) -> None:
    """The refusal names the live daemon's pid, even where the lock file held a longer
    leftover (a pid written over an earlier, longer one would read as another number)."""
    # (mutant: the lock file not truncated before the pid is written)
    sock = tmp_path / "h.sock"
    make_dirs(sock.parent)
    Path(str(sock) + ".lock").write_text("987654321987654321\n")
    first = SocketLock(sock)
    first.acquire()
    try:
        with pytest.raises(FailedPrecondition) as e:
            SocketLock(sock).acquire()  # (another open file: flock refuses it)
        assert f"(pid {os.getpid()})" in str(e.value), e.value
        assert "refusing to start a second one" in str(e.value)
    finally:
        first.release()


def test_a_dangling_link_at_the_socket_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A link whose target does not exist still is not a socket: refused by name, as a
    link to an existing file is, instead of reaching the bind with it in place."""
    # (mutant: only `exists()` checked, which is False for a dangling link)
    sock = tmp_path / "h.sock"
    target = tmp_path / "nowhere"
    os.symlink(target, sock)
    with pytest.raises(FailedPrecondition, match="exists and is not a socket"):
        SocketLock(sock).acquire()
    assert sock.is_symlink() and os.readlink(sock) == str(target)
    assert not target.exists()
    # (the refused attempt left the lock free)
    lock = SocketLock(tmp_path / "other.sock")
    lock.acquire()
    lock.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the lock file to another user")
def test_a_lock_file_of_another_user_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A root daemon must not take (and write its pid into) a lock file someone else owns:
    anyone can create one at a path under /tmp first."""
    # (mutant: the owner check dropped)
    sock = tmp_path / "h.sock"
    lock_path = Path(str(sock) + ".lock")
    lock_path.write_text("theirs\n")
    os.chown(lock_path, 65534, 65534)
    with pytest.raises(FailedPrecondition, match=r"not a plain file of this user \(uid 65534"):
        SocketLock(sock).acquire()
    assert lock_path.read_text() == "theirs\n"
    assert lock_path.stat().st_uid == 65534
