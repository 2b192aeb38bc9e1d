"""`none` backend: a null object, so callers never test `if backend is None`.

Every key is absent, puts are refused (`PutStatus.FAILED`: nothing is stored), health is
always fine. A get never touches its buffers (a put has had their headers written by the
base class, as for every backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache.tiers.storage.base import MISSING, PutStatus, StorageBackend


class NullBackend(StorageBackend):
    name = "none"

    def start(self) -> None:
        return None

    def close(self, wait_s: float = 0.0) -> bool:
        return True

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    def _read_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        return [MISSING] * len(keys)

    def _write_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        return [PutStatus.FAILED] * len(keys)

    def _remove(self, keys: Sequence[str]) -> int:
        return 0

    def _probe(self) -> tuple[str, int | None, int | None]:
        return "no L3 backend configured (storage.backend: none)", 0, 0

    def _canary_round_trip(self, payload: int = 0) -> None:
        return None
