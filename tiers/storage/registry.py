"""Storage backends by name. Each factory imports its module only when called, so the
Mooncake wheel (and redis-py) are loaded only where configured."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from hicache.config import StorageConfig
from hicache.errors import ConfigError
from hicache.tiers.storage.base import StorageBackend
from hicache.types import StorageBackendName

Factory = Callable[[StorageConfig], StorageBackend]


def _null(cfg: StorageConfig) -> StorageBackend:
    from hicache.tiers.storage.null import NullBackend

    return NullBackend(cfg.timeout_s)


def _file(cfg: StorageConfig) -> StorageBackend:
    from hicache.tiers.storage.file import FileBackend

    return FileBackend(cfg.file, cfg.timeout_s)


def _mooncake(cfg: StorageConfig) -> StorageBackend:
    from hicache.tiers.storage.mooncake import MooncakeBackend

    return MooncakeBackend(cfg.mooncake, cfg.timeout_s)


def _redis(cfg: StorageConfig) -> StorageBackend:
    from hicache.tiers.storage.redis import RedisBackend

    return RedisBackend(cfg.redis, cfg.timeout_s)


FACTORIES: dict[StorageBackendName, Factory] = {
    StorageBackendName.NONE: _null,
    StorageBackendName.FILE: _file,
    StorageBackendName.MOONCAKE: _mooncake,
    StorageBackendName.REDIS: _redis,
}


def build_backend(cfg: StorageConfig, *, start: bool = True) -> StorageBackend:
    """Build the configured backend and (by default) `start()` it.

    `cfg.backend` may also be given as its string value. Raises `ConfigError` naming the
    allowed names for an unknown one, `BackendUnavailable` when the store cannot be reached
    (the caller decides, by `storage.required`, whether that stops the daemon).
    """
    name = cfg.backend
    if not isinstance(name, StorageBackendName):
        try:
            name = StorageBackendName(name)
        except ValueError:
            raise ConfigError(
                f"storage.backend: {name!r} is not one of {sorted(n.value for n in FACTORIES)}"
            ) from None
    backend = FACTORIES[name](cfg)
    if start:
        try:
            backend.start()
        except BaseException:
            # Its threads (a walk of the store, a connection pool) go with it: a daemon
            # retrying a store that is down must not gather one set each attempt.
            with contextlib.suppress(Exception):
                backend.close()
            raise
    return backend
