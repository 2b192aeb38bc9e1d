"""Backends by name; Mooncake imported only when chosen; the null object."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from storage_pages import Pool, keys

from hicache.config import FileStorageConfig, StorageConfig
from hicache.errors import ConfigError
from hicache.tiers.storage import GetStatus, PutStatus, build_backend
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.null import NullBackend
from hicache.types import StorageBackendName


def test_picks_the_backend_by_name(tmp_path: Path) -> None:
    cfg = StorageConfig(backend=StorageBackendName.FILE, file=FileStorageConfig(path=str(tmp_path)))
    backend = build_backend(cfg)
    assert isinstance(backend, FileBackend) and backend.root == str(tmp_path)
    by_string = dataclasses.replace(cfg, backend="file")  # type: ignore[arg-type]
    assert isinstance(build_backend(by_string, start=False), FileBackend)


def test_unknown_name_lists_the_allowed_ones() -> None:
    cfg = dataclasses.replace(StorageConfig(), backend="s3")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError,
        match=r"storage.backend: 's3' is not one of \['file', 'mooncake', 'none', 'redis'\]",
    ):
        build_backend(cfg)


def test_none_is_a_null_object_that_stores_nothing() -> None:
    backend = build_backend(StorageConfig())
    assert isinstance(backend, NullBackend)
    pool = Pool(2)
    before = pool.pages.copy()
    k = keys(2)
    assert backend.put_from(k, pool.slots()) == [PutStatus.FAILED] * 2
    assert backend.exists_prefix(k) == 0
    assert backend.get_into(k, pool.slots()) == [GetStatus.MISS] * 2
    np.testing.assert_array_equal(pool.pages[:, 64:], before[:, 64:])
    assert backend.health(deep=True).healthy


def test_mooncake_is_imported_only_when_configured(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from hicache.config import StorageConfig, FileStorageConfig\n"
        "from hicache.tiers.storage import build_backend\n"
        f"build_backend(StorageConfig(backend='file', file=FileStorageConfig(path={str(tmp_path)!r})))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mooncake', 'redis'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stderr
