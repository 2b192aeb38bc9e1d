"""Listen addresses: parsing, the loopback rule for plaintext TCP, and the socket lock.

An address is `unix:///absolute/path` or `host:port` (IPv6 as `[::1]:port`). A unix socket
is guarded by an exclusive `flock` on `<path>.lock`: a second daemon on the same path
fails to take it and refuses to start; a socket file left by a killed daemon (its lock died
with it) is replaced.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from hicache.dirs import make_dirs
from hicache.errors import FailedPrecondition, InvalidArgument

UNIX_PREFIX = "unix://"


@dataclass(frozen=True)
class Endpoint:
    address: str  # as configured
    path: Path | None  # unix socket path, or None for TCP
    host: str = ""
    port: int = 0

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    @property
    def target(self) -> str:
        """The gRPC target string for this address, for gRPC's channels and ports (not an
        address to parse again: that is `address`). gRPC reads a unix target as a URI: the
        path is percent-encoded, or a '#' or '?' in it would end it for the client (the
        server binds it whole) and a '%41' would bind 'A'."""
        if self.path is not None:
            return f"unix://{urllib.parse.quote(str(self.path), safe='/')}"
        return f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.path is not None:
            return True
        host = self.host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def instance_name(self) -> str:
        """A name for this daemon's shared-memory segments, unique per listen address
        (letters, digits, '_' and '.' only)."""
        base = self.path.name if self.path is not None else f"tcp{self.port}"
        stem = re.sub(r"[^A-Za-z0-9_]", "_", base)[:32] or "hicache"
        digest = hashlib.sha1(self.address.encode()).hexdigest()[:8]
        return f"{stem}_{digest}"


# A host: a name or IPv4 address, or a bracketed IPv6 address (no scheme, no path).
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r"[0-9]{1,5}")


def split_host_port(address: str) -> tuple[str, int] | None:
    """`host:port` as (host, port), or None when it is not one."""
    host, sep, port = address.rpartition(":")
    # (ASCII digits: `isdigit` takes '²', which int() refuses, and '٣', which it reads as 3)
    if not sep or not _HOST.fullmatch(host) or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def parse_address(address: str) -> Endpoint:
    if address.startswith(UNIX_PREFIX):
        return Endpoint(address=address, path=_socket_path(address))
    host_port = split_host_port(address)
    if host_port is None:
        raise InvalidArgument(f"{address!r} is neither unix:///path nor host:port")
    return Endpoint(address=address, path=None, host=host_port[0], port=host_port[1])


# sockaddr_un.sun_path holds 108 bytes on Linux, the last one a NUL.
MAX_SOCKET_PATH_BYTES = 107


def _socket_path(address: str) -> Path:
    path = address[len(UNIX_PREFIX) :]
    if not path.startswith("/"):
        raise InvalidArgument(f"{address!r}: a unix socket address is unix:///absolute/path")
    if path.endswith("/"):
        raise InvalidArgument(f"{address!r}: names a directory, not a socket file")
    if "\x00" in path:
        raise InvalidArgument(f"{address!r}: a socket path holds no NUL character")
    try:
        path.encode()
    except UnicodeEncodeError:  # (bytes of another encoding, as argv hands them over)
        raise InvalidArgument(f"{address!r}: the socket path is not UTF-8 text") from None
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise InvalidArgument(
            f"{address!r}: the socket path is {size} bytes, over the {MAX_SOCKET_PATH_BYTES} "
            "a unix socket address holds: use a shorter path"
        )
    return Path(path)


class SocketLock:
    """Exclusive ownership of a unix socket path for the life of this process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and clear a stale socket file; `FailedPrecondition` when another
        live daemon holds it or the path is something other than a socket."""
        try:
            make_dirs(self.path.parent)
            # Never through a link (anyone may plant one in /tmp: the pid written below
            # would overwrite what it points at), and only our own plain file.
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644)
        except OSError as e:
            raise FailedPrecondition(
                f"server.listen=unix://{self.path}: cannot create the socket there "
                f"({e.strerror}: {e.filename or self.lock_path})"
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise FailedPrecondition(
                f"{self.lock_path} is not a plain file of this user (uid {st.st_uid}, "
                f"{st.st_nlink} links): refusing to use it as the socket's lock; remove it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"another hicache daemon (pid {owner}) is serving unix://{self.path}; "
                f"refusing to start a second one on the same socket"
            ) from None
        try:
            if self.path.exists() or self.path.is_symlink():
                if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    raise FailedPrecondition(
                        f"{self.path} exists and is not a socket; refusing to replace it"
                    )
                self.path.unlink()  # left by a daemon that died: its lock went with it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # (a full filesystem: no room for the pid)
            os.close(fd)
            raise FailedPrecondition(
                f"server.listen=unix://{self.path}: cannot create the socket there "
                f"({e.strerror}: {e.filename or self.lock_path})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Remove the socket file, then drop the lock (the lock file stays: unlinking it
        would let a newcomer lock a fresh file while someone still holds the old one)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)
            self._fd = None
