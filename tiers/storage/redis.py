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
# A reply of the wrong shape (a server that is no Redis, or a broken one) is too: redis-py
# hands it on as it came, and parsing it raises these.
_DOWN = (redis.RedisError, OSError, ValueError, TypeError, AttributeError)
# Refusals of a write command by a server that still serves reads (no replica to write
# to, a failed save, a replica, an ACL, no memory): GETEX, which renews a TTL, is one.
_WRITE_REFUSED = (redis.exceptions.ReadOnlyError, redis.exceptions.NoPermissionError,
                  redis.exceptions.OutOfMemoryError)
_WRITE_REFUSED_CODES = ("NOREPLICAS", "MISCONF", "READONLY", "NOPERM", "OOM")


def _write_refused(value: object) -> bool:
    return isinstance(value, _WRITE_REFUSED) or (
        isinstance(value, redis.ResponseError) and str(value).startswith(_WRITE_REFUSED_CODES))


def _count(reply: object) -> int:
    """An integer reply (EXISTS, DEL); anything else is a server we cannot trust."""
    if not isinstance(reply, int):
        raise BackendUnavailable(f"redis: malformed reply (an integer expected): {reply!r:.80}")
    return reply


# Never stored: asking for it tells if GETEX exists (under the page keys' prefix, which an
# ACL user of the daemon may be limited to).
GETEX_PROBE_KEY = f"{CANARY_PREFIX}getex-probe"
CANARY_TTL_S = 60  # a deep check's canary key expires this long after its write


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
        self._run_id: str | None = None  # the server run the last probe reached

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
        count = _count(client.exists(*keys))
        if count == 0 or count >= n:
            return min(count, n)
        if _count(client.exists(*keys[:count])) == count:
            return count  # the first `count` are there, and no other key is
        present, absent = 0, count  # the first `present` keys are there; `absent` is not all
        while absent - present > 1:
            mid = (present + absent) // 2
            if _count(client.exists(*keys[:mid])) == mid:
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
                if getex and any(_write_refused(v) for v in values):
                    # The server refuses write commands but serves reads: read with GET
                    # (the TTLs are not renewed while it refuses).
                    self._warn.warning("getex-refused", "redis refuses GETEX (a write "
                                       "command): reading with GET, TTLs not renewed (%s)",
                                       next(v for v in values if _write_refused(v)))
                    pipe = self.client.pipeline(transaction=False)
                    for key in batch:
                        pipe.get(key)
                    values = pipe.execute(raise_on_error=False)
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
        if len(keys) == 1 and keys[0].startswith(CANARY_PREFIX):
            ttl = CANARY_TTL_S  # (one a daemon killed mid-check never removes goes by itself)
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
                removed += _count(self.client.delete(*keys[lo : lo + self.cfg.batch]))
        except _DOWN as e:
            raise _unavailable(e) from None
        return removed

    def _probe(self) -> tuple[str, int | None, int | None]:
        return self._caller.call(self._probe_sync)

    def _probe_sync(self) -> tuple[str, int | None, int | None]:
        url = redact_url(self.cfg.url)
        try:
            if self.client.ping() is not True:
                raise BackendUnavailable(f"redis: {url} did not answer PING with PONG")
        except _DOWN as e:
            raise _unavailable(e) from None
        try:
            server = self.client.info("server")
            info = self.client.info("memory")
        except redis.ResponseError as e:  # e.g. an ACL user without INFO: sizes unknown
            return f"redis {url} PING ok (no INFO: {e})", None, None
        except _DOWN as e:
            raise _unavailable(e) from None
        # Another server than the last probe's (restarted, replaced): what this daemon
        # knew present there is not (the controller forgets it on `resets`).
        run_id = server.get("run_id") if isinstance(server, dict) else None
        if run_id is not None:
            if self._run_id is not None and run_id != self._run_id:
                self.resets += 1
                log.warning("redis: %s is another server run than before (restarted or "
                            "replaced): what it held is taken as gone", url)
            self._run_id = run_id
        try:
            return f"redis {url} PING ok", _size(info, "maxmemory") or None, _size(info, "used_memory")
        except BackendUnavailable as e:
            raise BackendUnavailable(f"{e} from {url}") from None


def _size(info: object, field: str) -> int | None:
    """A byte count of an INFO reply (None: not in it); one that is no count is a server
    we cannot trust."""
    if not isinstance(info, dict):
        raise BackendUnavailable(f"redis: malformed INFO reply: {info!r:.80}")
    value = info.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BackendUnavailable(f"redis: malformed INFO reply ({field}: {value!r:.40})")
    return value


def _unavailable(e: Exception) -> BackendUnavailable:
    return BackendUnavailable(f"redis: {type(e).__name__}: {e}")


__all__ = ["RedisBackend"]
