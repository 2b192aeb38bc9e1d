"""Fixtures of the daemon tests: one shared daemon for request tests, private ones on demand."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .daemonkit import Daemon, free_port


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, metrics_port: int) -> Iterator[Daemon]:
    """A daemon shared by a module's tests (they use distinct token ranges)."""
    d = Daemon(tmp_path_factory.mktemp("d"), f"metrics.port={metrics_port}").start()
    yield d
    d.close()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Private daemons (lifecycle tests), killed after the test if still running."""
    made: list[Daemon] = []

    def make(*sets: str, listen: str | None = None, start: bool = True,
             ca: bytes | None = None, config: Path | None = None) -> Daemon:
        d = Daemon(tmp_path, *sets, listen=listen, ca=ca, config=config)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.close()
