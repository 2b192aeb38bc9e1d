"""Small shared vocabulary: tiers, component kinds, id types."""

from __future__ import annotations

import enum
from typing import NewType

PageHash = NewType("PageHash", bytes)


class Tier(enum.IntEnum):
    """Where a page lives. Lower value = closer to the engine."""

    DEVICE = 0  # L1: GPU memory (shared memory on a CPU-only node)
    HOST = 1  # L2: pinned host memory
    STORAGE = 2  # L3: shared store (file directory, Mooncake, Redis)


class ComponentKind(enum.Enum):
    """The kind of state a component holds; each has its own reuse rule (DESIGN §1)."""

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"

    # Members compare by identity, so identity hashing is consistent, and it runs in C:
    # Enum's own __hash__ (a Python call) showed up on every page-dict lookup of the tree.
    __hash__ = object.__hash__


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    LFU = "lfu"


class L1Device(enum.Enum):
    """Where L1 lives: `auto` on the GPU when CUDA is available, else in shared memory."""

    AUTO = "auto"
    CUDA = "cuda"
    SHM = "shm"


class HostLayout(enum.Enum):
    AUTO = "auto"
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"


class StorageBackendName(enum.Enum):
    NONE = "none"
    FILE = "file"
    MOONCAKE = "mooncake"
    REDIS = "redis"
