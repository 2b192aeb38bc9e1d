"""Shared fixtures. Keep this small: service fixtures live in tests/services.py."""

from __future__ import annotations

from services import (  # noqa: F401  (fixtures, found by name)
    mooncake_factory,
    mooncake_master,
    pausable_redis,
    redis_factory,
    redis_server,
)
