"""Review (session 23) of today's diff (e33d181..HEAD): namespace roots, per-tenant
sessions, the 1,024-character name limit, Stats for restricted tokens, the file
backend's canary folder removal, Redis GETEX fallback and run_id resets.

Tests marked `xfail(strict=True)` expose a bug (the reason says which); the others pin
behaviour verified correct. Real components: the tree, the file backend on a real
directory, a real redis-server, real daemons.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from hicache.config import FileStorageConfig, RedisStorageConfig, StorageConfig
from hicache.errors import InvalidArgument, PermissionDenied
from hicache.keys import CANARY_PREFIX
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.tiers.storage import HEADER_BYTES, GetStatus, PutStatus, build_backend
from hicache.tiers.storage import file as file_mod
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.integrity import key_digest
from hicache.tree import HiRadixTree
from hicache.tree.sessions import SessionTable
from hicache.types import ComponentKind, StorageBackendName

from .daemonkit import PAGE, Daemon, tokens

FULL = ComponentKind.FULL
PAYLOAD = 4096
TENANT = "s23-tenant-token-0123456789abcdef"
OPERATOR = "s23-operator-token-0123456789abcd"


def _toks(start: int, n: int) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


def _ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def _pages(n: int, seed: int = 0) -> list[np.ndarray]:
    slot = HEADER_BYTES + PAYLOAD
    raw = np.zeros(n * slot + 4096, dtype=np.uint8)
    skip = -raw.ctypes.data % 4096
    mem = raw[skip : skip + n * slot].reshape(n, slot)
    mem[:, HEADER_BYTES:] = np.random.default_rng(seed).integers(0, 256, (n, PAYLOAD), dtype=np.uint8)
    return [mem[i] for i in range(n)]


def _storage(backend: StorageBackendName, *, path: str = "", redis_url: str = "",
             ttl_s: int | None = None) -> StorageConfig:
    return StorageConfig(
        backend=backend,
        timeout_s=3.0,
        file=FileStorageConfig(path=path) if path else FileStorageConfig(),
        redis=RedisStorageConfig(url=redis_url or "redis://127.0.0.1:1/0", batch=8, ttl_s=ttl_s),
    )


# --------------------------------------------------------------------------- the tree


def test_a_refused_insert_into_a_new_namespace_keeps_no_root() -> None:
    """Today's rule: an empty root is never kept (`check_tree` asserts it). An Insert that
    raises (here: one page id for two pages) must change nothing, yet `_start_node` made
    the namespace's root before the pages were checked: each refused Insert into a fresh
    namespace keeps a root (and its name) for good, the growth the change meant to stop."""
    tree = HiRadixTree(4, {FULL: 0})
    for i in range(3):
        with pytest.raises(InvalidArgument):
            tree.insert(f"fresh-{i}", _toks(0, 8), {FULL: _ids(1)})
    assert not tree._roots, f"roots kept by refused inserts: {sorted(tree._roots)}"
    tree.check_integrity()


def test_empty_inserts_locks_and_sessions_on_new_namespaces_keep_no_root() -> None:
    """The paths that committed nothing: an empty Insert, a locked match with a session
    on an unknown namespace (its lock and session end at None), an Insert through that
    lock, a session closed after its namespace emptied."""
    tree = HiRadixTree(4, {FULL: 0})
    tree.insert("empty", b"", {FULL: _ids()}, session_id="s0")
    assert "empty" not in tree._roots
    m = tree.match("new", _toks(0, 8), lock=True, session_id="s1")
    assert m.lock is not None and m.lock.end is None and "new" not in tree._roots
    tree.check_integrity()
    r = tree.insert("new", _toks(0, 8), {FULL: _ids(5, 6)}, lock=m.lock)
    assert r.inserted_tokens == 8 and "new" in tree._roots
    tree.check_integrity()
    assert tree.close_session("s1") is not None
    tree.check_integrity()


def test_session_cap_is_per_tenant_and_one_tenant_without_tokens() -> None:
    """`SessionTable` per tenant: a tenant past the cap closes its own least recently used
    session only; without `tenant_of` every id is one tenant (the old global LRU), ids
    with '/' included. Closed records are per tenant too."""
    def tenant(sid: str) -> str:
        return sid.partition("/")[0]

    t = SessionTable(max_closed=2, max_open=2, tenant_of=tenant)
    t.open("A/1")
    t.open("B/1")
    t.open("A/2")
    t.open("A/3")
    assert t.over_cap("A/3") == "A/1" and t.over_cap("B/1") is None
    assert len(t) == 4
    assert t.close("A/1", lambda _s: 7) == 7
    assert t.over_cap("A/3") is None and len(t) == 3
    for i in range(3):  # A's closes push out A's records only
        t.open(f"A/x{i}")
        t.close(f"A/x{i}", lambda _s: 0)
    t.open("B/2")
    assert t.close("B/2", lambda _s: 4) == 4
    assert t.close("B/2", lambda _s: 99) == 4, "B's record pushed out by A's closes"
    assert len(t.sessions()) == len(t) == 3
    one = SessionTable(max_closed=4, max_open=2)
    one.open("A/1")
    one.open("B/1")
    one.open("C/1")
    assert one.over_cap("C/1") == "A/1", "without tokens the cap is one LRU over every id"


# --------------------------------------------------------------------------- file backend


def _canary_sharing_folder(key: str) -> str:
    """A canary key whose object lies in the same two fan-out folders as `key`'s."""
    want = key_digest(key).hex()[:4]
    i = 0
    while True:
        cand = f"{CANARY_PREFIX}s23-{i}"
        if key_digest(cand).hex()[:4] == want:
            return cand
        i += 1


def test_canary_folder_removal_never_fails_a_concurrent_write(tmp_path: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep health check deletes its canary and now removes the canary's fan-out folders
    when empty. A writer whose key shares those folders makes them (`os.makedirs`) and then
    opens its temp file: a canary delete landing in between removes the folders it just
    made, the open finds no folder (ENOENT, a "bad path") and the page is FAILED, never
    stored, though the store is healthy. Forced here at that exact point."""
    backend = build_backend(_storage(StorageBackendName.FILE, path=str(tmp_path / "store")))
    assert isinstance(backend, FileBackend)
    try:
        assert backend.wait_indexed(10)
        key = f"ns:s23/model/bf16/{'ab' * 32}:full:tp0:v1"
        canary = _canary_sharing_folder(key)
        folder = os.path.dirname(backend.path_of(key))
        assert folder == os.path.dirname(backend.path_of(canary))
        real_make_dirs = file_mod.make_dirs
        fired: list[int] = []

        def make_dirs(path: Any, *a: Any, **kw: Any) -> None:
            real_make_dirs(path, *a, **kw)
            if os.fspath(path) == folder and not fired:
                fired.append(backend.delete([canary]))  # the health check's delete

        monkeypatch.setattr(file_mod, "make_dirs", make_dirs)
        statuses = backend.put_from([key], _pages(1))
        monkeypatch.setattr(file_mod, "make_dirs", real_make_dirs)
        assert fired == [0]
        assert statuses == [PutStatus.STORED], statuses
    finally:
        backend.close()


def test_canary_folders_go_but_an_objects_folder_stays(tmp_path: Any) -> None:
    """The deep check's canary leaves no folders; a canary sharing a page's folder leaves
    the page (rmdir of a non-empty folder fails quietly) and the page is still served."""
    backend = build_backend(_storage(StorageBackendName.FILE, path=str(tmp_path / "store")))
    try:
        assert backend.wait_indexed(10)
        for _ in range(5):
            assert backend.health(deep=True).healthy
        root = tmp_path / "store"
        assert not os.listdir(root), os.listdir(root)
        key = f"ns:s23/model/bf16/{'cd' * 32}:full:tp0:v1"
        src = _pages(1, seed=3)
        assert backend.put_from([key], src) == [PutStatus.STORED]
        canary = _canary_sharing_folder(key)
        assert backend.put_from([canary], _pages(1, seed=4)) == [PutStatus.STORED]
        assert backend.delete([canary]) == 1
        out = _pages(1, seed=9)
        assert backend.get_into([key], out) == [GetStatus.HIT]
        assert np.array_equal(out[0][HEADER_BYTES:], src[0][HEADER_BYTES:])
    finally:
        backend.close()


# --------------------------------------------------------------------------- redis


def test_redis_refusing_writes_still_serves_reads_with_ttl_and_no_false_reset(
        redis_factory: Callable[[], Any]) -> None:
    """A real redis-server with `min-replicas-to-write 1` (no replica) refuses GETEX with
    NOREPLICAS: reads fall back to GET and hit. Repeated probes of the same server run
    count no reset (run_id stable); a real restart counts one."""
    server = redis_factory()
    backend = build_backend(_storage(StorageBackendName.REDIS, redis_url=server.url, ttl_s=60))
    admin = redis.Redis.from_url(server.url)
    try:
        keys = [f"ns:s23/model/bf16/{i:064x}:full:tp0:v1" for i in range(3)]
        src = _pages(3, seed=5)
        assert backend.put_from(keys, src) == [PutStatus.STORED] * 3
        admin.config_set("min-replicas-to-write", 1)
        out = _pages(3, seed=6)
        assert backend.get_into(keys, out) == [GetStatus.HIT] * 3
        for a, b in zip(out, src, strict=True):
            assert np.array_equal(a[HEADER_BYTES:], b[HEADER_BYTES:])
        admin.config_set("min-replicas-to-write", 0)
        for _ in range(3):
            assert backend.health().healthy
        assert backend.resets == 0
    finally:
        admin.close()
        backend.close()


# --------------------------------------------------------------------------- daemon


@pytest.fixture
def tenant_daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    return make_daemon(
        f"server.tokens=[{{token: {TENANT}, namespaces: [t]}}, "
        f"{{token: {OPERATOR}, namespaces: ['*']}}]",
    )


def test_stats_refused_to_a_restricted_token_everywhere_and_names_limited(tenant_daemon: Daemon) -> None:
    """Stats: PERMISSION_DENIED for a restricted token (unary and Batch, no retry loop),
    served to '*'. Names past 1,024 characters: INVALID_ARGUMENT in unary and Batch ops;
    1,024 exactly is fine."""
    with tenant_daemon.client(token=TENANT, engine_id="s23-t", retries=0) as c, \
            tenant_daemon.client(token=OPERATOR, engine_id="s23-op", retries=0) as op:
        c.attach(map_pools=False)
        with pytest.raises(PermissionDenied):
            c.stats()
        res = c.batch([pb.BatchOp(stats=pb.StatsRequest())])
        assert isinstance(res[0], PermissionDenied), res
        assert op.stats() is not None
        prompt = tokens(PAGE, start=910_000)
        with pytest.raises(InvalidArgument, match="session_id"):
            c.match(prompt, "t", lock=True, session_id="s" * 1025)
        res = c.batch([pb.BatchOp(match_prefix=pb.MatchPrefixRequest(
            namespace="t", tokens=prompt, request_id="r" * 1025))])
        assert isinstance(res[0], InvalidArgument), res
        m = c.match(prompt, "t", lock=True, session_id="s" * 1024)
        c.release(lock_id=m.lock_id)


def test_close_session_with_an_overlong_id_is_invalid_argument(tenant_daemon: Daemon) -> None:
    """README: "A namespace, session_id or request_id longer than 1,024 characters is
    INVALID_ARGUMENT naming the field". `check_name` runs for MatchPrefix, Allocate and
    Insert only; CloseSession (unary and Batch) takes any length and answers NOT_FOUND."""
    with tenant_daemon.client(token=TENANT, engine_id="s23-cs", retries=0) as c:
        c.attach(map_pools=False)
        with pytest.raises(InvalidArgument, match="session_id"):
            c.close_session("s" * 2000)
