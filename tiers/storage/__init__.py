"""L3 storage: one protocol (base.py), backends by name (registry.py)."""

from __future__ import annotations

from hicache.tiers.storage.base import (
    BackendHealth,
    BackendStats,
    GetStatus,
    PutStatus,
    StorageBackend,
)
from hicache.tiers.storage.integrity import HEADER_BYTES
from hicache.tiers.storage.registry import build_backend

__all__ = [
    "HEADER_BYTES",
    "BackendHealth",
    "BackendStats",
    "GetStatus",
    "PutStatus",
    "StorageBackend",
    "build_backend",
]
