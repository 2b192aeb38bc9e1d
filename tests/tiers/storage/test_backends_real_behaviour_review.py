"""Review: each L3 backend against what its real server does when it is full, restricted,
misaddressed or shared (Redis under `maxmemory` and ACL users, Mooncake with its segment
full, the file backend on a full filesystem). What the L3 store reports (breakers, health,
counters), whether a wrong byte can be served, whether pages are lost silently.

Tests marked `xfail(strict=True)` expose a bug (the reason says which); the others pin
behaviour no other test covers."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from storage_pages import Pool, keys, storage_config

from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.config import FileStorageConfig, MemberSpec
from hicache.controller.storage_io import L3Store, L3Written
from hicache.errors import BackendUnavailable, ConfigError
from hicache.tiers.storage import GetStatus, PutStatus, StorageBackend, build_backend
from hicache.types import ComponentKind, StorageBackendName

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "controller"))
from engine_sim import tiny_config

PAYLOAD = 4096
MEMBERS = [MemberSpec(name="full", component=ComponentKind.FULL, anchor=ComponentKind.FULL,
                      layers=1, bytes_per_page_per_layer=PAYLOAD, window_tokens=0)]
_ids = itertools.count()


class _Host:
    """The one thing L3Store asks of the host pools: a view of each page's object."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def object_views(self, member: str, ids: np.ndarray) -> list[np.ndarray]:
        return [self.pool.pages[i] for i in np.asarray(ids).tolist()]


def _counts(written: L3Written) -> tuple[int, int]:
    """(pages L3 holds, pages this write stored) of one `L3Store.write`."""
    return written.in_l3, written.stored


def _hashes(n: int) -> list[bytes]:
    tag = os.urandom(8)
    return [tag + i.to_bytes(8, "little") for i in range(n)]


def _l3(backend: StorageBackend, pool: Pool) -> L3Store:
    return L3Store(backend, _Host(pool), f"review-model-{next(_ids)}")  # type: ignore[arg-type]


def _fill_redis(admin: redis.Redis) -> None:
    """Fill the server up to its maxmemory (noeviction): until a SET is refused OOM, with
    large values, then with small ones (a refused large SET frees its query buffer, which
    leaves room for a small one)."""
    for size in (65536, 256):
        for i in range(100_000):
            try:
                admin.set(f"filler{size}-{i}", b"x" * size)
            except redis.exceptions.OutOfMemoryError:
                break
        else:
            raise AssertionError("redis never refused a write")


def _free_redis(admin: redis.Redis) -> None:
    for key in admin.scan_iter(match="filler*", count=1000):
        admin.delete(key)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (a filesystem that fills up); skipped where mounting is refused."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def _fill_disk(root: Path) -> None:
    """Write a filler file on `root`'s filesystem until it is full."""
    with open(root / "filler.bin", "wb", buffering=0) as f:
        block = b"\0" * 4096
        with contextlib.suppress(OSError):
            while True:
                f.write(block)


# =========================================================================== file backend


def test_a_full_disk_stops_backups_but_still_serves_what_the_directory_holds(tmpfs: Path) -> None:
    backend = build_backend(storage_config(StorageBackendName.FILE,
                                           file=FileStorageConfig(path=str(tmpfs))))
    try:
        pool = Pool(40, payload=PAYLOAD, seed=3)
        l3 = _l3(backend, pool)
        hashes = _hashes(40)
        assert _counts(l3.write("ns", hashes[:8], MEMBERS, np.arange(8))) == (8, 8)
        _fill_disk(tmpfs)
        for attempt in range(3):  # three backups refused by the full disk
            lo = 8 + 8 * attempt
            with contextlib.suppress(BackendUnavailable):
                l3.write("ns", hashes[lo : lo + 8], MEMBERS, np.arange(lo, lo + 8))
        assert backend.health().healthy  # (the shallow probe: directory there and writable)
        # What it holds is still served: found, and read back byte-exact.
        assert not l3.breaker.is_open
        assert l3.present_run("ns", hashes[:8], MEMBERS) == 8
        dst = Pool(8, payload=PAYLOAD, seed=None)
        assert _l3_on(backend, dst, l3).read("ns", hashes[:8], MEMBERS, np.arange(8)) == 8
        assert (dst.pages[:, 64:] == pool.pages[:8, 64:]).all()
    finally:
        backend.close()


def _l3_on(backend: StorageBackend, pool: Pool, like: L3Store) -> L3Store:
    """Another L3Store of the same model (and breakers) over other host pages."""
    other = L3Store(backend, _Host(pool), like.model_id,  # type: ignore[arg-type]
                    breaker=like.breaker, cache=like.cache)
    return other


def test_a_full_disk_leaves_no_temp_file_and_no_torn_object(tmpfs: Path) -> None:
    """ENOSPC in the middle of a batch: the call fails, and what is left in the directory
    is whole objects (each reads back byte-exact) and no temp file; a put once space is
    back stores the rest."""
    backend = build_backend(storage_config(StorageBackendName.FILE,
                                           file=FileStorageConfig(path=str(tmpfs))))
    try:
        n = 200  # 200 x 4160 bytes: more than the 512 KiB filesystem holds
        pool, ks = Pool(n, payload=PAYLOAD, seed=5), keys(n)
        # A full disk refuses keys (as a full Redis or Mooncake does), not the store.
        put = backend.put_from(ks, pool.slots())
        assert PutStatus.STORED in put and PutStatus.FAILED in put
        assert not [p for p in tmpfs.rglob("*.tmp")], "a temp file was left behind"
        dst = Pool(n, payload=PAYLOAD, seed=None)
        got = backend.get_into(ks, dst.slots())
        assert GetStatus.CORRUPT not in got and GetStatus.HIT in got
        for i, status in enumerate(got):
            if status is GetStatus.HIT:
                assert (dst.pages[i] == pool.pages[i]).all()
        assert backend.stats().unavailable == 0
        # (Two writer threads can both fail at the end, each freeing what it had taken:
        # room for a canary again. The room is taken, not by the store.)
        with contextlib.suppress(OSError), open(tmpfs / "filler", "wb") as filler:
            while True:
                filler.write(bytes(4096))
                filler.flush()
        deep = backend.health(deep=True)
        assert not deep.healthy and "canary write refused" in deep.detail
        stored = [k for k, s in zip(ks, got, strict=True) if s is GetStatus.HIT]
        assert backend.delete(stored) == len(stored)
        assert set(backend.put_from(ks[:20], pool.slots(list(range(20))))) == {PutStatus.STORED}
        assert backend.health(deep=True).healthy
    finally:
        backend.close()


# =========================================================================== redis


def test_an_acl_user_limited_to_the_daemons_keys_is_healthy_and_its_write_breaker_closes(
    redis_factory: Callable[[], RedisServer],
) -> None:
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("hicache", enabled=True, passwords=["+acl-secret-5"], keys=["hc2/*"],
                      commands=["+@all"])
    url = server.url.replace("redis://", "redis://hicache:acl-secret-5@")
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=url))
    try:
        pool = Pool(8, payload=PAYLOAD, seed=4)
        l3 = _l3(backend, pool)
        hashes = _hashes(8)
        assert _counts(l3.write("ns", hashes[:4], MEMBERS, np.arange(4))) == (4, 4)  # allowed
        assert l3.present_run("ns", hashes[:4], MEMBERS) == 4
        # A brief OOM opens the write breaker...
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + (256 << 10)))
        _fill_redis(admin)
        for i in range(3):
            l3.write("ns", hashes[4 + i : 5 + i], MEMBERS, np.arange(4 + i, 5 + i))
        assert l3.write_breaker.is_open
        _free_redis(admin)
        admin.config_set("maxmemory", "0")
        # ...and once the store takes writes again, the canary closes it.
        assert l3.probe_writes()
        assert backend.health(deep=True).healthy
    finally:
        backend.close()


def test_redis_full_without_eviction_stops_backups_not_reads(
    redis_factory: Callable[[], RedisServer],
) -> None:
    """maxmemory + noeviction: puts are refused OOM per key (FAILED, counted); three such
    backups open the WRITE breaker only; every page the store holds is still found and
    read back byte-exact; deep health says why writes fail; once memory is freed the
    canary write closes the write breaker."""
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=server.url))
    try:
        pool = Pool(16, payload=PAYLOAD, seed=6)
        l3 = _l3(backend, pool)
        hashes = _hashes(16)
        assert _counts(l3.write("ns", hashes[:4], MEMBERS, np.arange(4))) == (4, 4)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + (256 << 10)))
        _fill_redis(admin)
        for i in range(3):
            assert _counts(l3.write("ns", hashes[4 + i : 5 + i], MEMBERS,
                            np.arange(4 + i, 5 + i))) == (0, 0)
        stats = backend.stats()
        assert stats.put_failed == 3 and stats.unavailable == 0
        assert l3.write_breaker.is_open and not l3.breaker.is_open and not l3.takes_writes
        l3.cache.clear()  # (asked again: the store itself answers)
        assert l3.present_run("ns", hashes, MEMBERS) == 4
        dst = Pool(4, payload=PAYLOAD, seed=None)
        assert _l3_on(backend, dst, l3).read("ns", hashes[:4], MEMBERS, np.arange(4)) == 4
        assert (dst.pages == pool.pages[:4]).all()
        deep = backend.health(deep=True)
        assert not deep.healthy and "canary" in deep.detail
        assert not l3.probe_writes() and l3.write_breaker.is_open
        _free_redis(admin)
        admin.config_set("maxmemory", "0")
        assert l3.probe_writes() and l3.takes_writes
        assert _counts(l3.write("ns", hashes[4:8], MEMBERS, np.arange(4, 8))) == (4, 4)
    finally:
        with contextlib.suppress(Exception):
            admin.config_set("maxmemory", "0")
        backend.close()


def test_redis_lru_eviction_loses_pages_as_misses_never_as_wrong_bytes(
    redis_factory: Callable[[], RedisServer],
) -> None:
    """maxmemory + allkeys-lru: every put is STORED while Redis evicts older objects on
    its own (uncounted: documented). A page the existence cache still holds present but
    Redis evicted reads as a miss, is forgotten, and the next lookup is exact; no wrong
    byte is ever served."""
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + (512 << 10)))
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=server.url))
    try:
        n = 256  # ~1 MiB of objects: twice what the server keeps
        pool = Pool(n, payload=PAYLOAD, seed=7)
        l3 = _l3(backend, pool)
        hashes = _hashes(n)
        for lo in range(0, n, 32):
            assert _counts(l3.write("ns", hashes[lo : lo + 32], MEMBERS, np.arange(lo, lo + 32))) == (32, 32)
        assert backend.stats().put_failed == 0 and not l3.write_breaker.is_open
        assert int(admin.info("stats")["evicted_keys"]) > 0
        # The cache says all are there; the store lost the oldest.
        assert l3.present_run("ns", hashes, MEMBERS) == n
        dst = Pool(n, payload=PAYLOAD, seed=None)
        got = _l3_on(backend, dst, l3).read("ns", hashes, MEMBERS, np.arange(n))
        assert got < n
        assert (dst.pages[:got] == pool.pages[:got]).all()
        assert l3.present_run("ns", hashes, MEMBERS) == got  # forgotten: asked again, exact
        statuses = backend.get_into(l3.keys("ns", hashes, MEMBERS), dst.slots())
        assert GetStatus.CORRUPT not in statuses
        for i, status in enumerate(statuses):
            if status is GetStatus.HIT:
                assert (dst.pages[i] == pool.pages[i]).all()
    finally:
        backend.close()


def test_a_wrong_redis_password_is_named_without_the_password(redis_factory: Callable[[], RedisServer]) -> None:
    """requirepass set: a daemon with the wrong password fails to start L3 with a message
    that names authentication and holds neither password; with the right one it works."""
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("requirepass", "right-secret-31")
    try:
        wrong = server.url.replace("redis://", "redis://:wrong-secret-42@")
        with pytest.raises(BackendUnavailable) as e:
            build_backend(storage_config(StorageBackendName.REDIS, redis_url=wrong, timeout_s=1.0))
        assert "Authentication" in str(e.value)
        assert "wrong-secret-42" not in str(e.value) and "right-secret-31" not in str(e.value)
        right = server.url.replace("redis://", "redis://:right-secret-31@")
        backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=right))
        try:
            health = backend.health(deep=True)
            assert health.healthy and "right-secret-31" not in health.detail
        finally:
            backend.close()
    finally:
        redis.Redis.from_url(server.url.replace("redis://", "redis://:right-secret-31@")).config_set(
            "requirepass", "")


@pytest.mark.parametrize("tail", ["127.0.0.1:1/0?db=x", "127.0.0.1:99999/0"])
def test_a_redis_url_that_redis_py_cannot_parse_is_a_config_error_or_l3_down(
    tmp_path: Path, tail: str
) -> None:
    from hicache.controller.controller import build_controller

    url = f"redis://:url-secret-8@{tail}"
    try:
        cfg = tiny_config(tmp_path, backend="redis", storage__redis={"url": url},
                          storage__timeout_s=1)
    except ConfigError as e:  # (refused up front: fine, if it names the key, not the secret)
        assert "storage.redis.url" in str(e) and "url-secret-8" not in str(e)
        return
    ctl = build_controller(cfg, f"brr{next(_ids)}x{os.getpid() % 10000}")
    try:
        (health,) = ctl.health(False)
        assert not health.healthy and "url-secret-8" not in health.detail
    finally:
        ctl.close()


def test_a_value_another_client_replaced_is_never_served(redis_factory: Callable[[], RedisServer]) -> None:
    """Another client overwrites page objects: with a longer value, with a copy of another
    page's (valid) object, with junk of the right size. Each reads as corrupt and zeroed;
    the L3 store counts that page absent (the longer one is left: not ours to judge)
    and its next lookup does not promise it; the pages before it are served."""
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=server.url))
    try:
        pool = Pool(4, payload=PAYLOAD, seed=9)
        l3 = _l3(backend, pool)
        hashes = _hashes(4)
        ks = l3.keys("ns", hashes, MEMBERS)
        for victim, value in ((3, pool.pages[0].tobytes() + b"tail"),   # longer
                              (2, None),                                  # another page's object
                              (1, os.urandom(pool.slot))):                # junk, right size
            assert l3.write("ns", hashes, MEMBERS, np.arange(4)).in_l3 == 4
            if value is None:
                value = admin.get(ks[0])
            admin.set(ks[victim], value)
            dst = Pool(4, payload=PAYLOAD, seed=None)
            assert _l3_on(backend, dst, l3).read("ns", hashes, MEMBERS, np.arange(4)) == victim
            assert (dst.pages[:victim] == pool.pages[:victim]).all()
            assert not dst.pages[victim].any()
            assert l3.present_run("ns", hashes, MEMBERS) == victim
            l3.cache.clear()
            admin.delete(ks[victim])
        assert backend.stats().corrupt == 3
    finally:
        backend.close()


# =========================================================================== mooncake


def test_mooncake_segment_full_fails_puts_per_key_and_keeps_what_it_holds(
    mooncake_factory: Callable[[], MooncakeMaster],
) -> None:
    """A 64 MiB segment filled with 4 MiB objects: the master refuses further puts
    (-200, no handle), each FAILED and counted, never an outage; an object larger than
    the whole segment is FAILED too; what is still there reads back byte-exact (the
    master may have evicted some of what was stored: those are misses, never corrupt)."""
    master = mooncake_factory()
    backend = build_backend(storage_config(StorageBackendName.MOONCAKE,
                                           mooncake_master=master.master,
                                           mooncake_metadata=master.metadata_server))
    try:
        n = 20  # 80 MiB of objects for a 64 MiB segment
        pool = Pool(n, payload=4 << 20, seed=11).register(backend)
        ks = keys(n)
        # One batch: the master places all of it at once (in smaller batches its own
        # eviction, running meanwhile, may free room for every one of them)
        statuses = backend.put_from(ks, pool.slots())
        stored = statuses.count(PutStatus.STORED)
        assert 0 < stored < n and PutStatus.PRESENT not in statuses
        stats = backend.stats()
        assert stats.put_failed == n - stored and stats.unavailable == 0
        dst = Pool(n, payload=4 << 20, seed=None).register(backend)
        got = backend.get_into(ks, dst.slots())
        assert GetStatus.CORRUPT not in got
        assert GetStatus.HIT in got
        for i, status in enumerate(got):
            # (a stored object may be gone: the master evicts on its own near the
            # segment's high watermark, uncounted here; documented)
            assert status is GetStatus.MISS or statuses[i] is PutStatus.STORED
            if status is GetStatus.HIT:
                assert (dst.pages[i] == pool.pages[i]).all()
        big = Pool(1, payload=80 << 20, seed=None).register(backend)
        assert backend.put_from(keys(1), big.slots()) == [PutStatus.FAILED]
        assert backend.health().healthy
    finally:
        backend.close(5.0)
