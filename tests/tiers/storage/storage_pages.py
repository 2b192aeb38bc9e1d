"""Page buffers standing in for L2 slots, and backends wired to the test services."""

from __future__ import annotations

import uuid

import numpy as np

from hicache.bench.services import MooncakeMaster
from hicache.config import (
    FileStorageConfig,
    MooncakeStorageConfig,
    RedisStorageConfig,
    StorageConfig,
)
from hicache.tiers.storage import HEADER_BYTES, StorageBackend, build_backend
from hicache.types import StorageBackendName

PAYLOAD = 4096
PAGE_ALIGN = 4096


class Pool:
    """`n` slots of HEADER_BYTES + payload in one page-aligned allocation (like an L2 pool)."""

    def __init__(self, n: int, payload: int = PAYLOAD, seed: int | None = 0) -> None:
        self.slot = HEADER_BYTES + payload
        raw = np.zeros(n * self.slot + PAGE_ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % PAGE_ALIGN
        self.memory = raw[skip : skip + n * self.slot]
        self.pages = self.memory.reshape(n, self.slot)
        if seed is not None:
            rng = np.random.default_rng(seed)
            self.pages[:, HEADER_BYTES:] = rng.integers(0, 256, (n, payload), dtype=np.uint8)

    def slots(self, idx: range | list[int] | None = None) -> list[np.ndarray]:
        rows = range(len(self.pages)) if idx is None else idx
        return [self.pages[i] for i in rows]

    def payload(self, i: int) -> np.ndarray:
        return self.pages[i, HEADER_BYTES:]

    def register(self, backend: StorageBackend) -> Pool:
        backend.register_host_buffer(self.memory.ctypes.data, self.memory.nbytes)
        return self


def keys(n: int, tag: str = "") -> list[str]:
    """Keys shaped like hicache/keys.py ones (with '/' and ':'), unique per call."""
    ns = f"ns:{tag or uuid.uuid4().hex[:8]}/demo-model/bfloat16"
    return [f"{ns}/{i:064x}:full:tp0:v1" for i in range(n)]


def storage_config(
    backend: StorageBackendName,
    *,
    timeout_s: float = 2.0,
    file: FileStorageConfig | None = None,
    redis_url: str = "",
    redis_batch: int = 8,
    mooncake_master: str = "",
    mooncake_metadata: str = "",
) -> StorageConfig:
    return StorageConfig(
        backend=backend,
        timeout_s=timeout_s,
        file=file or FileStorageConfig(),
        redis=RedisStorageConfig(url=redis_url or "redis://127.0.0.1:1/0", batch=redis_batch),
        mooncake=MooncakeStorageConfig(
            master=mooncake_master or None,
            metadata_server=mooncake_metadata or None,
            global_segment_size=64 << 20,
            local_buffer_size=16 << 20,
        ),
    )


def mooncake_config(master: MooncakeMaster, timeout_s: float = 2.0) -> StorageConfig:
    """`storage_config` for the test's `mooncake_master` (its master and metadata server)."""
    return storage_config(StorageBackendName.MOONCAKE, timeout_s=timeout_s,
                          mooncake_master=master.master,
                          mooncake_metadata=master.metadata_server)


def open_backend(cfg: StorageConfig) -> StorageBackend:
    return build_backend(cfg)
