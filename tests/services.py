"""Fixtures that run real services (redis-server, mooncake_master) on free loopback ports.

Session-scoped instances are shared by tests that only read and write; tests that stop or
restart a service take a private one from a `*_factory` fixture. A test is skipped (never
failed) only when the binary is missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
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
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


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
