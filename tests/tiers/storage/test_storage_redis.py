"""Redis specifics: values that are no objects of ours, and users the store restricts."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import redis
from storage_pages import Pool, keys, storage_config

from hicache.bench.services import RedisServer
from hicache.tiers.storage import GetStatus, PutStatus, build_backend
from hicache.types import StorageBackendName


def test_a_key_of_another_type_is_that_key_corrupt_not_a_failed_batch(
    redis_server: RedisServer,
) -> None:
    """Someone's RPUSH on a page key: GET answers WRONGTYPE for it. That key reads as
    corrupt (zeroed, counted); the batch's other keys still hit, nothing is raised."""
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=redis_server.url))
    try:
        ks = keys(3)
        src, dst = Pool(3, seed=2), Pool(3, seed=8)
        assert backend.put_from([ks[0], ks[2]], src.slots([0, 2])) == [PutStatus.STORED] * 2
        redis.Redis.from_url(redis_server.url).rpush(ks[1], b"not an object")
        assert backend.exists_prefix(ks) == 3  # present, just not ours
        assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT, GetStatus.HIT]
        assert not dst.pages[1].any()
        assert (dst.pages[2] == src.pages[2]).all()
        assert backend.stats().corrupt == 1
    finally:
        backend.close()


def test_a_user_without_info_starts_and_reports_healthy(redis_server: RedisServer) -> None:
    """An ACL user allowed GET/SET/EXISTS/DEL but not INFO: the backend starts and is
    healthy (sizes unknown) rather than failing with an untyped NoPermissionError."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("hicache-limited", enabled=True, passwords=["+limited-secret-1"],
                      keys=["*"], commands=["+@all", "-info"])
    url = redis_server.url.replace("redis://", "redis://hicache-limited:limited-secret-1@")
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=url))
    try:
        health = backend.health(deep=True)
        assert health.healthy, health.detail
        assert "no INFO" in health.detail and health.capacity_bytes is None
    finally:
        backend.close()
        admin.acl_deluser("hicache-limited")


def test_a_password_in_the_urls_query_never_reaches_health_or_the_log(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py takes `?password=` as well as `user:password@`: only the latter was hidden
    in the start-up log line and in the health report's detail."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("hicache-query", enabled=True, passwords=["+query-secret-1"],
                      keys=["*"], commands=["+@all"])
    url = f"{redis_server.url}?username=hicache-query&pass%77ord=query-secret-1"  # (%77: w)
    try:
        with caplog.at_level(logging.INFO):
            backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=url))
        try:
            health = backend.health(deep=True)
            assert health.healthy, health.detail
            assert "query-secret-1" not in health.detail and "pass%77ord=***" in health.detail
            assert "query-secret-1" not in caplog.text
        finally:
            backend.close()
    finally:
        admin.acl_deluser("hicache-query")


def test_a_full_store_refuses_a_repeated_key_as_failed_not_present(redis_server: RedisServer) -> None:
    """Redis at maxmemory with noeviction refuses the put: every copy of a key repeated in
    the batch is FAILED (the later ones were reported PRESENT, with nothing stored)."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("maxmemory", "1mb")
    admin.config_set("maxmemory-policy", "noeviction")
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=redis_server.url))
    try:
        i = 0
        while True:  # fill the store up
            try:
                admin.set(f"filler{i}", b"x" * 65536)
                i += 1
            except redis.exceptions.ResponseError:
                break
        (k,) = keys(1)
        assert backend.put_from([k, k], Pool(2).slots()) == [PutStatus.FAILED, PutStatus.FAILED]
        assert backend.exists_prefix([k]) == 0
    finally:
        admin.flushall()
        admin.config_set("maxmemory", "0")
        backend.close()


def test_concurrent_calls_to_a_hung_server_end_within_the_timeout(redis_server: RedisServer) -> None:
    """More callers than pool connections (the daemon has 32 RPC threads, the pool 8): each
    call still ends within storage.timeout_s (redis-py bounds the pool wait and each socket
    read apart: ~2x before)."""
    import contextlib
    import os
    import signal
    import threading
    import time

    from hicache.errors import BackendUnavailable

    backend = build_backend(storage_config(StorageBackendName.REDIS, timeout_s=2.0,
                                           redis_url=redis_server.url))
    took: list[float] = []

    def lookup() -> None:
        t0 = time.monotonic()
        with contextlib.suppress(BackendUnavailable):
            backend.exists_prefix(ks)
        took.append(time.monotonic() - t0)

    try:
        ks = keys(4)
        backend.put_from(ks, Pool(4).slots())
        os.kill(redis_server.pid, signal.SIGSTOP)  # alive, not answering
        try:
            threads = [threading.Thread(target=lookup) for _ in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert max(took) < 3.0, max(took)  # (2 s; twice that before)
    finally:
        backend.close()


def test_the_present_run_is_exact_for_every_shape_of_presence(redis_server: RedisServer) -> None:
    """Existence is counted with multi-key EXISTS (one command for all-or-none, two for a
    leading run, a binary search over holes): every pattern of present keys, keys named
    twice and batch boundaries (batch 8) gives the run a key-by-key check gives."""
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=redis_server.url))
    raw = redis.Redis.from_url(redis_server.url)
    rng = random.Random(7)
    try:
        for trial in range(300):
            n = rng.randint(1, 30)
            names = keys(n)
            shape = trial % 4
            if shape == 0:  # a leading run
                present = names[: rng.randint(0, n)]
            elif shape == 1:  # holes anywhere
                present = [k for k in names if rng.random() < 0.8]
            else:  # all but one
                present = [k for i, k in enumerate(names) if i != rng.randrange(n)]
            if present:
                raw.mset(dict.fromkeys(present, b"x"))
            asked = list(names)
            if shape == 3:  # some keys named twice, in any order
                asked += [rng.choice(names) for _ in range(rng.randint(1, 3))]
                rng.shuffle(asked)
            truth = 0
            for key in asked:
                if not raw.exists(key):
                    break
                truth += 1
            assert backend.exists_prefix(asked) == truth, (trial, asked, present)
            raw.delete(*names)
    finally:
        raw.close()
        backend.close()


def test_an_empty_value_is_removed_so_a_good_copy_can_be_stored(redis_server: RedisServer) -> None:
    """An empty value under our key is nobody's valid object (every one has a 64-byte
    header): removed at its read, so the page can be stored again; a value of another type
    is someone else's, and stays."""
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=redis_server.url))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        empty, listed = keys(2)
        raw.set(empty, b"")
        raw.rpush(listed, b"x")
        assert backend.get_into([empty, listed], Pool(2, seed=None).slots()) == [GetStatus.CORRUPT] * 2
        assert backend.stats().corrupt_removed == 1
        assert raw.exists(empty) == 0 and raw.exists(listed) == 1
        assert backend.put_from([empty], Pool(1, seed=3).slots()) == [PutStatus.STORED]
    finally:
        raw.close()
        backend.close()


def test_with_a_ttl_a_read_renews_it_so_objects_in_use_stay(redis_server: RedisServer) -> None:
    """`storage.redis.ttl_s`: an object expires that long after its last read or write, so
    a hot prefix does not vanish `ttl_s` after it was first written."""
    cfg = storage_config(StorageBackendName.REDIS, redis_url=redis_server.url)
    cfg = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, ttl_s=100))
    backend = build_backend(cfg)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        read, unread = keys(2)
        assert backend.put_from([read, unread], Pool(2, seed=1).slots()) == [PutStatus.STORED] * 2
        raw.expire(read, 5)  # as if written long ago: 5 s left
        raw.expire(unread, 5)
        assert backend.get_into([read], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        assert raw.ttl(read) > 90  # renewed to the full TTL
        assert raw.ttl(unread) <= 5
    finally:
        raw.close()
        backend.close()


def test_without_getex_a_read_still_renews_the_ttl(redis_server: RedisServer) -> None:
    """A server without GETEX (before 6.2; here a user not allowed it): GET, then EXPIRE,
    in the same round trip."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("hicache-old", enabled=True, passwords=["+old-secret-1"],
                      keys=["*"], commands=["+@all", "-getex"])
    url = redis_server.url.replace("redis://", "redis://hicache-old:old-secret-1@")
    cfg = storage_config(StorageBackendName.REDIS, redis_url=url)
    backend = build_backend(dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, ttl_s=100)))
    try:
        src, dst = Pool(3, seed=1), Pool(3, seed=None)
        ks = keys(3)
        assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * 3
        for key in ks:
            admin.expire(key, 5)
        assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT] * 3
        assert (dst.pages == src.pages).all() and backend._getex is False
        assert all(admin.ttl(key) > 90 for key in ks)
    finally:
        backend.close()
        admin.acl_deluser("hicache-old")
        admin.close()
