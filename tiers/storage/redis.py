"""`redis` backend: redis-py over a blocking connection pool, pipelined binary commands.

Batches of `storage.redis.batch` keys go out as one pipeline (`EXISTS`, `GET`, `SET NX`),
optionally with a TTL (`EX`). Values are sent as memoryviews of the caller's buffers: redis-py
writes a memoryview as its own chunk, so a put copies nothing in Python; a get receives
`bytes` (one copy, unavoidable with redis-py) and copies them into the buffer.

Timeouts: socket connect/read timeouts and the wait for a pooled connection are all
`storage.timeout_s`; connection errors and timeouts raise `BackendUnavailable`. A command
error for one key (e.g. OOM under `maxmemory`) is `PutStatus.FAILED` for that key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import redis

from hicache.config import RedisStorageConfig, redact_url
from hicache.errors import BackendUnavailable
from hicache.keys import CANARY_PREFIX
from hicache.tiers.storage.base import (
    MISSING,
    NOT_AN_OBJECT,
    PIPELINE_CHUNK,
    PutStatus,
    StorageBackend,
)

log = logging.getLogger(__name__)

# Any error of the client (connection, timeout, loading, READONLY, NOPERM, ...) for a
# whole call: the store is unavailable to us, a typed error the controller handles.
_DOWN = (redis.RedisError, OSError)


# Never stored: asking for it tells if GETEX exists (under the page keys' prefix, which an
# ACL user of the daemon may be limited to).
GETEX_PROBE_KEY = f"{CANARY_PREFIX}getex-probe"


class RedisBackend(StorageBackend):
    name = "redis"

    def __init__(self, cfg: RedisStorageConfig, timeout_s: float) -> None:
        # redis-py bounds the pool wait, the connect and each socket read apart, so a call
        # under load could take a multiple of timeout_s: each call runs bounded instead,
        # on as many threads as the pool has connections.
        super().__init__(timeout_s, workers=max(4, cfg.pool_size))
        self.cfg = cfg
        # A read or write pipelines `batch` keys a round trip (the base class cuts calls
        # into chunks, each one its round trips; a smaller chunk would cap `batch`).
        self.pipeline_chunk = max(cfg.batch, PIPELINE_CHUNK)
        self._pool: redis.BlockingConnectionPool | None = None
        self._client: redis.Redis | None = None
        self._getex: bool | None = None  # whether the server has GETEX (asked at first need)

    def start(self) -> None:
        try:
            pool = redis.BlockingConnectionPool.from_url(
                self.cfg.url,
                max_connections=self.cfg.pool_size,
                timeout=self.timeout_s,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
            )
        except ValueError:  # (the configuration checks the URL first: not expected here)
            raise BackendUnavailable(
                f"redis {redact_url(self.cfg.url)}: redis-py cannot read the URL") from None
        self._pool, self._client = pool, redis.Redis(connection_pool=pool)
        try:
            self._probe()
        except BackendUnavailable as e:  # (which store: the URL, its credentials left out)
            raise BackendUnavailable(f"{e} (at {redact_url(self.cfg.url)})") from None
        log.info(  # (once it answered: a daemon retrying a store that is down says so once)
            "L3 redis backend: %s, batch %d, pool %d, ttl %s",
            redact_url(self.cfg.url),
            self.cfg.batch,
            self.cfg.pool_size,
            self.cfg.ttl_s,
        )

    def close(self, wait_s: float = 0.0) -> bool:
        self._caller.close()
        if self._client is not None:
            self._client.close()
        if self._pool is not None:
            self._pool.disconnect()  # a stuck call's socket closes under it: it fails
        self._client = self._pool = None
        return self._caller.wait_idle(wait_s)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            raise BackendUnavailable("redis: backend not started or closed")
        return self._client

    def _batches(self, n: int) -> range:
        return range(0, n, self.cfg.batch)

    # ------------------------------------------------------------------ backend hooks

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return self._caller.call(self._exists_sync, keys)

    def _exists_sync(self, keys: Sequence[str]) -> list[bool]:
        """The leading run of present keys, then the first absent one (the base class
        counts the run): batch by batch, each with `_present_run`."""
        out: list[bool] = []
        try:
            for lo in self._batches(len(keys)):
                batch = keys[lo : lo + self.cfg.batch]
                run = self._present_run(batch)
                out += [True] * run
                if run < len(batch):
                    out.append(False)
                    break
        except _DOWN as e:
            raise _unavailable(e) from None
        return out

    def _present_run(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are present, counted by multi-key EXISTS (which counts
        a key once per time it is named): one command when all or none are there, two
        when exactly a leading run is (the usual shapes of a prefix in the store), a
        binary search over leading runs otherwise (holes: log n commands).

        NOTE: measured here, a pipeline of one EXISTS per key cost 1.2-2.4 ms for 64 keys
        (redis-py packs and parses each command in Python); one command naming them all
        0.2-0.3 ms. Multi-key EXISTS needs the keys in one hash slot on Redis Cluster: this
        backend talks to one standalone server (`storage.redis.url`)."""
        client = self.client
        n = len(keys)
        count = int(client.exists(*keys))
        if count == 0 or count >= n:
            return min(count, n)
        if int(client.exists(*keys[:count])) == count:
            return count  # the first `count` are there, and no other key is
        present, absent = 0, count  # the first `present` keys are there; `absent` is not all
        while absent - present > 1:
            mid = (present + absent) // 2
            if int(client.exists(*keys[:mid])) == mid:
                present = mid
            else:
                absent = mid
        return present

    def _read_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        return self._caller.call(self._read_sync, keys, buffers)

    def _read_sync(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        out: list[int] = []
        try:
            for lo in self._batches(len(keys)):
                pipe = self.client.pipeline(transaction=False)
                batch = keys[lo : lo + self.cfg.batch]
                # With a TTL, a read renews it: objects in use stay, the ones nobody reads
                # expire `ttl_s` after their last read, not after their write.
                ttl = self.cfg.ttl_s
                getex = ttl is not None and self._has_getex()
                for key in batch:
                    if getex:
                        pipe.getex(key, ex=ttl)
                    else:
                        pipe.get(key)
                if ttl is not None and not getex:  # (Redis before 6.2: GET, then EXPIRE)
                    for key in batch:
                        pipe.expire(key, ttl)
                # Per-key errors come back as values: one key of another type (someone
                # else's RPUSH) must not fail the batch, or the breaker, every time.
                values = pipe.execute(raise_on_error=False)[: len(batch)]
                for buf, value in zip(buffers[lo : lo + self.cfg.batch], values, strict=True):
                    if value is None:
                        out.append(MISSING)
                        continue
                    if isinstance(value, redis.ConnectionError | redis.TimeoutError):
                        raise value
                    if not isinstance(value, bytes):
                        log.debug("redis: a get returned %r; the object is corrupt", value)
                        out.append(NOT_AN_OBJECT)
                        continue
                    if len(value) <= buf.nbytes:  # (a short one too: its header tells whose)
                        buf[: len(value)] = np.frombuffer(value, dtype=np.uint8)
                    out.append(len(value))
        except _DOWN as e:
            raise _unavailable(e) from None
        return out

    def _has_getex(self) -> bool:
        """Whether the server knows GETEX (Redis 6.2+), asked once."""
        if self._getex is None:
            try:
                self.client.getex(GETEX_PROBE_KEY, ex=1)
                self._getex = True
            except redis.ResponseError:  # unknown command (or not allowed for this user)
                self._getex = False
        return self._getex

    def _write_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        return self._caller.call(self._write_sync, keys, buffers)

    def _write_sync(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        out: list[PutStatus] = []
        ttl = self.cfg.ttl_s
        try:
            for lo in self._batches(len(keys)):
                pipe = self.client.pipeline(transaction=False)
                for key, buf in zip(
                    keys[lo : lo + self.cfg.batch], buffers[lo : lo + self.cfg.batch], strict=True
                ):
                    pipe.set(key, buf.data, nx=True, ex=ttl)
                    if ttl is not None:  # one found there is written to again: it lives on
                        pipe.expire(key, ttl)
                replies = pipe.execute(raise_on_error=False)
                for reply in replies if ttl is None else replies[::2]:
                    if isinstance(reply, Exception):
                        self._warn.warning("put-refused", "redis refused a put: %s", reply)
                        out.append(PutStatus.FAILED)
                    else:
                        out.append(PutStatus.STORED if reply else PutStatus.PRESENT)
        except _DOWN as e:
            raise _unavailable(e) from None
        return out

    def _remove(self, keys: Sequence[str]) -> int:
        return self._caller.call(self._remove_sync, keys)

    def _remove_sync(self, keys: Sequence[str]) -> int:
        removed = 0
        try:
            for lo in self._batches(len(keys)):
                removed += int(self.client.delete(*keys[lo : lo + self.cfg.batch]))
        except _DOWN as e:
            raise _unavailable(e) from None
        return removed

    def _probe(self) -> tuple[str, int | None, int | None]:
        return self._caller.call(self._probe_sync)

    def _probe_sync(self) -> tuple[str, int | None, int | None]:
        try:
            self.client.ping()
        except _DOWN as e:
            raise _unavailable(e) from None
        try:
            info = self.client.info("memory")
        except redis.ResponseError as e:  # e.g. an ACL user without INFO: sizes unknown
            return f"redis {redact_url(self.cfg.url)} PING ok (no INFO: {e})", None, None
        except _DOWN as e:
            raise _unavailable(e) from None
        maxmemory = int(info.get("maxmemory", 0)) or None
        used = int(info.get("used_memory", 0))
        return f"redis {redact_url(self.cfg.url)} PING ok", maxmemory, used


def _unavailable(e: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"redis: {type(e).__name__}: {e}")


__all__ = ["RedisBackend"]
