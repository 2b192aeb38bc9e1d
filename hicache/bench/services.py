"""Start and stop real `redis-server` and `mooncake_master` processes on free loopback ports.

Used by the test fixtures (tests/services.py) and by `hicache bench` (l3.py), so both talk to
the real services the same way. Each service is stopped by its own pid, never by name.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

READY_TIMEOUT_S = 20.0


class ServiceError(RuntimeError):
    """What a benchmark needs here is missing (a service binary, CUDA) or a service did
    not become ready: `hicache bench` exits 2, "cannot run here"."""


@contextlib.contextmanager
def serving_daemon(args: Sequence[str], target: str, log_path: Path,
                   timeout_s: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """`hicache serve *args` as a subprocess logging to `log_path` (never a pipe nobody
    reads: a chatty daemon would block on it), yielded once it serves on `target`;
    terminated (killed after 30 s) on exit. Raises RuntimeError with the log's tail when
    it exits or is not ready within `timeout_s`."""
    from hicache.client import Client

    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", *args],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        with Client(target, retries=0, timeout_s=1.0) as probe:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"daemon exited ({proc.returncode}): {_tail(log_path)}")
                try:
                    if probe.serving():
                        break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"daemon not ready in {timeout_s:g} s: {_tail(log_path)}") from None
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


# Ports handed out from here: below the kernel's ephemeral range (32768-60999 by default),
# and above the ports Mooncake's transfer engine picks for itself (12601 in a test run here).
PORT_RANGE = (20_000, 30_000)
_handed: set[int] = set()
_ports = random.Random()  # (seeded from the OS: other processes pick others)


def free_port() -> int:
    """A loopback port free now, for a service started next. Taken outside the ephemeral
    range: a port from `bind(0)` is one the kernel also gives outgoing connections, which
    may take it in the seconds before the service binds it. Never the same twice in one
    process; falls back to `bind(0)` when the range is used up."""
    lo, hi = PORT_RANGE
    for _ in range(200):
        port = _ports.randrange(lo, hi)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_binary(name: str) -> str | None:
    """`name` on PATH, or next to the running interpreter (a venv's bin/ need not be on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which(name)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Service(abc.ABC):
    """One server process with fixed ports: `start()`, `stop()`, `restart()` (same ports)."""

    name = "service"

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        # Kept open for the life of the service (closed in close()), hence no `with`.
        self._log: IO[bytes] = tempfile.TemporaryFile(prefix=f"hicache-{self.name}-")  # noqa: SIM115

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line."""

    @abc.abstractmethod
    def ready_ports(self) -> list[int]:
        """Ports that accept connections once the service is ready."""

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self.proc = subprocess.Popen(
            self.argv(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(port_open(p) for p in self.ready_ports()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"{self.name} did not become ready: {self.log_tail()}")
            time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        """Stop the process (SIGKILL when `kill`, as a crash would) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, limit: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def close(self) -> None:
        self.stop()
        self._log.close()


class RedisServer(Service):
    name = "redis-server"

    def __init__(self, binary: str, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        """`extra_args`: more `redis-server` flags (e.g. `--enable-debug-command local`)."""
        super().__init__(binary)
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            *self.extra_args,
        ]

    def ready_ports(self) -> list[int]:
        return [self.port]


class MooncakeMaster(Service):
    """`mooncake_master` with its embedded HTTP metadata server and its own metrics port."""

    name = "mooncake_master"

    def __init__(self, binary: str, extra_args: Sequence[str] = ()) -> None:
        """`extra_args`: more `mooncake_master` flags (e.g. `--eviction_ratio=0`)."""
        super().__init__(binary)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.extra_args = tuple(extra_args)

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def argv(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]

    def ready_ports(self) -> list[int]:
        return [self.rpc_port, self.http_port]


def start_redis() -> RedisServer:
    binary = find_binary("redis-server")
    if binary is None:
        raise ServiceError("redis-server not found on PATH")
    server = RedisServer(binary)
    server.start()
    return server


def start_mooncake_master() -> MooncakeMaster:
    binary = find_binary("mooncake_master")
    if binary is None:
        raise ServiceError("mooncake_master not found (install mooncake-transfer-engine-non-cuda)")
    master = MooncakeMaster(binary)
    master.start()
    return master
