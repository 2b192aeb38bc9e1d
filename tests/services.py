"""Fixtures that run real services (redis-server, mooncake_master) on free loopback ports.

Session-scoped instances are shared by tests that only read and write; tests that stop or
restart a service take a private one from a `*_factory` fixture. A test is skipped (never
failed) only when the binary is missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from hicache.bench.services import (
    MooncakeMaster,
    RedisServer,
    Service,
    find_binary,
)


def _binary(name: str) -> str:
    path = find_binary(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def _mooncake_importable() -> None:
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(_binary("redis-server"))
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def pausable_redis() -> Iterator[RedisServer]:
    """A redis-server of one module's own, which its tests may stop (`held`) to hold the
    calls under way; resumed before it is stopped."""
    server = RedisServer(_binary("redis-server"))
    server.start()
    yield server
    if server.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
    server.close()


@contextlib.contextmanager
def held(server: RedisServer) -> Iterator[None]:
    """`server` stopped (SIGSTOP: no answer, no refusal) for the block: calls started stay
    in flight."""
    assert server.pid is not None
    freeze(server.pid)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it has stopped. (The kill returns when
    the stop is queued; the thread chosen to take it starts the group stop only when it
    is next scheduled, and on a loaded machine the process's other threads meanwhile go
    on serving: a call sent right after the kill could still be answered.)"""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid}: not every thread stopped {timeout_s} s after "
                                 "SIGSTOP")
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # (gone: nothing of it runs)
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # (that thread exited)
        state = stat[stat.rfind(")") + 2:][:1]  # (after the command name, which may hold ")")
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    _mooncake_importable()
    master = MooncakeMaster(_binary("mooncake_master"))
    master.start()
    yield master
    master.close()


@pytest.fixture
def redis_factory() -> Iterator[Callable[[], RedisServer]]:
    """Private redis-server instances (for stop/restart tests), stopped after the test;
    `make(*flags, port=...)` passes more flags to the server, or takes a given port."""
    started: list[Service] = []

    def make(*flags: str, port: int | None = None) -> RedisServer:
        server = RedisServer(_binary("redis-server"), port, flags)
        started.append(server)
        server.start()
        return server

    yield make
    for service in started:
        service.close()


@pytest.fixture
def mooncake_factory() -> Iterator[Callable[[], MooncakeMaster]]:
    """Private mooncake_master instances (for stop/restart tests), stopped after the test;
    `make(*flags)` passes more flags to the master."""
    _mooncake_importable()
    started: list[Service] = []

    def make(*extra_args: str) -> MooncakeMaster:
        master = MooncakeMaster(_binary("mooncake_master"), extra_args)
        started.append(master)
        master.start()
        return master

    yield make
    for service in started:
        service.close()
