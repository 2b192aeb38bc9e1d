"""Fixtures of the tier tests: a tiny model, unique daemon instances, a content oracle."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import pytest

from hicache.config import HicacheConfig
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools, build_host_pools

_counter = itertools.count()

@pytest.fixture
def instance() -> str:
    """A daemon instance name no other test (or test run) uses."""
    return f"t{os.getpid()}_{next(_counter)}"


@pytest.fixture
def make_device(instance: str) -> Iterator[Callable[[HicacheConfig], ShmDevicePools]]:
    made: list[ShmDevicePools] = []

    def make(cfg: HicacheConfig) -> ShmDevicePools:
        pools = ShmDevicePools.create(cfg, instance)
        made.append(pools)
        return pools

    yield make
    for pools in made:
        pools.check_integrity()
        pools.close()


@pytest.fixture
def make_host() -> Iterator[Callable[[HicacheConfig], HostBufferPools]]:
    made: list[HostBufferPools] = []

    def make(cfg: HicacheConfig) -> HostBufferPools:
        pools = build_host_pools(cfg, pin=False)
        made.append(pools)
        return pools

    yield make
    for pools in made:
        pools.check_integrity()
        pools.close()
