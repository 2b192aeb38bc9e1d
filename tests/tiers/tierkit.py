"""Shared helpers of the tier tests: the tiny model and the content oracle."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.config import HicacheConfig, build_config

# A tiny model: FULL (2 layers, 32 B per page-layer) with a sidecar of 3 layers (8 B),
# and MAMBA (2 layers, 24 B per slot-layer). 16 L1 pages, 4 L1 MAMBA slots, L2 = 2 x L1.
TINY: dict[str, Any] = {
    "model": {
        "page_size": 4,
        "components": {
            "full": {"layers": 2, "bytes_per_token_per_layer": 8},
            "mamba": {"layers": 2, "state_bytes_per_layer": 24},
        },
        "sidecars": {"idx": {"anchor": "full", "layers": 3, "bytes_per_token_per_layer": 2}},
    },
    "tiers": {"l1": {"tokens": 64, "mamba_slots": 4}, "l2": {"ratio": 2.0, "reserve_gb": 0}},
}


def tiny_config(layout: str = "layer_first", **l2: Any) -> HicacheConfig:
    raw = {**TINY, "tiers": {**TINY["tiers"], "l2": {**TINY["tiers"]["l2"], "layout": layout, **l2}}}
    return build_config(raw)


def oracle(member: str, page: int, layer: int, width: int, salt: int = 0) -> np.ndarray:
    """The bytes a test engine writes: a deterministic function of (member, page, layer)."""
    seed = zlib.crc32(f"{member}/{page}/{layer}/{salt}".encode())
    return np.random.default_rng(seed).integers(0, 256, width, dtype=np.uint8)


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `check()` comes true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
