"""Mutation review, session 31's third round (L3 storage: the file, Redis and Mooncake backends, the
object header and the shared contract): behaviour no other test pinned, each test naming
the mutant it kills."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from file_kit import OBJECT, disk_objects, sized_backend
from storage_pages import Pool, keys, mooncake_config, storage_config

from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.dirs import GROUP_FILE_MODE
from hicache.errors import BackendUnavailable, InvalidArgument
from hicache.tiers.storage import GetStatus, PutStatus, StorageBackend, build_backend
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.integrity import key_digest
from hicache.types import StorageBackendName


@pytest.fixture
def file_store(tmp_path: Path) -> Iterator[FileBackend]:
    backend = sized_backend(tmp_path / "store")
    yield backend
    backend.close()


# ---------------------------------------------------------------------------- file backend


def test_a_put_over_an_object_file_shorter_than_a_header_writes_it_again(
    file_store: FileBackend,
) -> None:
    """A crash without fsync can leave a key's object file with fewer bytes than a header
    (the rename landed, the data did not). A put of that key must write it again (STORED)
    so that a later get HITs; answering PRESENT would have the caller record a page in L3
    that no node can read.
    Mutant killed: `_holds_whole` returning True for a file shorter than HEADER_BYTES."""
    pool = Pool(1)
    (key,) = keys(1)
    path = Path(file_store.path_of(key))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * 10)
    assert file_store.put_from([key], pool.slots()) == [PutStatus.STORED]
    out = Pool(1, seed=None)
    assert file_store.get_into([key], out.slots()) == [GetStatus.HIT]
    assert np.array_equal(out.payload(0), pool.payload(0))


def test_a_put_leaves_a_fifo_at_the_keys_path_in_place(file_store: FileBackend) -> None:
    """Something that is no file of ours at a key's path (a FIFO someone made there) is left
    alone by a put, as reads leave it: the put answers PRESENT without replacing it, and a
    get of the key is CORRUPT (never blocks on the FIFO, never wrong bytes).
    Mutant killed: `_holds_whole` judging a FIFO by its size (0: shorter than a header),
    so the put replaced someone else's FIFO with an object."""
    pool = Pool(1)
    (key,) = keys(1)
    path = Path(file_store.path_of(key))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert file_store.put_from([key], pool.slots()) == [PutStatus.PRESENT]
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert file_store.get_into([key], Pool(1, seed=None).slots()) == [GetStatus.CORRUPT]
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_objects_are_group_readable_and_writable_whatever_the_umask(
    file_store: FileBackend,
) -> None:
    """Nodes of one group share the file store: an object file is GROUP_FILE_MODE (0660)
    even when the daemon runs under a restrictive umask (077), or another node's daemon
    could not read (or replace) it.
    Mutant killed: `_write_file` without its `os.fchmod` (the umask takes the group bits)."""
    pool = Pool(1)
    (key,) = keys(1)
    old = os.umask(0o077)
    try:
        assert file_store.put_from([key], pool.slots()) == [PutStatus.STORED]
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(file_store.path_of(key)).st_mode) == GROUP_FILE_MODE


def test_a_deep_health_check_leaves_no_fan_out_folders_behind(tmp_path: Path) -> None:
    """Each deep health check writes a canary under a fresh key, so into fresh fan-out
    folders: they go with it (a probe every 10 s would otherwise leave thousands of empty
    folders in the operator's store).
    Mutant killed: `_remove_sync` not calling `_remove_empty_folders` for a canary."""
    root = tmp_path / "store"
    backend = sized_backend(root)
    try:
        for _ in range(3):
            health = backend.health(deep=True)
            assert health.healthy, health.detail
        assert sorted(os.listdir(root)) == []
    finally:
        backend.close()


def test_health_reports_the_bytes_a_bounded_store_holds(tmp_path: Path) -> None:
    """The health of a file store with a capacity tells the operator its capacity and how
    much of it the objects take: three objects stored, `used_bytes` is their size.
    Mutant killed: the probe returning 0 used bytes instead of the index's count."""
    backend = sized_backend(tmp_path, 10, indexed=True)
    try:
        pool = Pool(3)
        assert backend.put_from(keys(3), pool.slots()) == [PutStatus.STORED] * 3
        health = backend.health()
        assert health.healthy, health.detail
        assert health.used_bytes == 3 * OBJECT
        assert health.capacity_bytes == backend.capacity_bytes
    finally:
        backend.close()


def test_a_stored_object_longer_than_the_buffer_is_never_a_hit(file_store: FileBackend) -> None:
    """An object file longer than the page it should be (a whole object of ours with bytes
    appended) is no object of this geometry: the get is CORRUPT with the buffer zeroed,
    never a HIT, and the file is left alone (not this daemon's to judge).
    Mutant killed: `verified_objects` taking objects with `stored_bytes >= nbytes` as
    fitting (the first `nbytes` verify, so the wrong-sized object was served)."""
    pool = Pool(1)
    (key,) = keys(1)
    assert file_store.put_from([key], pool.slots()) == [PutStatus.STORED]
    with open(file_store.path_of(key), "ab") as f:
        f.write(b"\x01")
    out = Pool(1, seed=None)
    out.pages[:] = 7
    assert file_store.get_into([key], out.slots()) == [GetStatus.CORRUPT]
    assert not out.pages.any()
    assert os.path.getsize(file_store.path_of(key)) == OBJECT + 1
    assert file_store.stats().corrupt_removed == 0


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_smaller_object_of_another_geometry_under_the_key_is_left_in_the_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An object of ours with a smaller payload (another model geometry under the same key,
    a misconfiguration) read into a larger page is CORRUPT for that read but not removed:
    it is whole, with its own length in its header, and the daemon that wrote it still
    reads it. (Removing it would have two daemons undo each other's writes.)
    Mutant killed: `truncated_of_ours` not comparing the header's payload length (another
    geometry's object taken for a torn one of ours, and removed)."""
    if kind == "file":
        backend: StorageBackend = sized_backend(tmp_path / "store")
    else:
        server = request.getfixturevalue("redis_server")
        backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=server.url))
    try:
        (key,) = keys(1)
        small = Pool(1, payload=1024, seed=3)
        assert backend.put_from([key], small.slots()) == [PutStatus.STORED]
        large = Pool(1, payload=4096, seed=None)
        assert backend.get_into([key], large.slots()) == [GetStatus.CORRUPT]
        assert backend.stats().corrupt_removed == 0
        again = Pool(1, payload=1024, seed=None)
        assert backend.get_into([key], again.slots()) == [GetStatus.HIT]
        assert np.array_equal(again.payload(0), small.payload(0))
        backend.delete([key])
    finally:
        backend.close()


def test_a_key_repeated_in_a_put_batch_shares_its_first_copys_failure(
    file_store: FileBackend,
) -> None:
    """A key given twice in one put whose store refuses it (a stray file where its fan-out
    folder belongs) fails for both copies: reporting the second copy PRESENT would have the
    caller count a page in L3 that is not there.
    Mutant killed: `put_from` answering PRESENT for every later copy of a key, whatever the
    first copy's outcome."""
    (key,) = keys(1)
    h = key_digest(key).hex()
    folder = Path(file_store.root) / h[0:2]
    folder.mkdir(parents=True)
    (folder / h[2:4]).write_bytes(b"not a folder")
    pool = Pool(2)
    assert file_store.put_from([key, key], pool.slots()) == [PutStatus.FAILED] * 2
    stats = file_store.stats()
    assert (stats.put_failed, stats.present, stats.stored) == (2, 0, 0)
    assert file_store.exists_prefix([key]) == 0


def test_a_put_finding_another_nodes_object_evicts_for_it_on_disk(tmp_path: Path) -> None:
    """A bounded node whose put finds the object already there (another node sharing the
    directory wrote it) counts it, and when that passes its capacity evicts its least
    recently used object: the victim's FILE goes (the store stays within its capacity on
    disk), it is counted evicted, and the key can be stored again at once.
    Mutant killed: `_present_or_reserve` not unlinking the victims of a PRESENT put (the
    file stays on disk uncounted, and the key is left marked as being evicted)."""
    node = sized_backend(tmp_path, 2, indexed=True, timeout_s=1.0)
    other = sized_backend(tmp_path)  # another node, unbounded, on the same directory
    try:
        k1, k2, k3 = keys(3)
        pool = Pool(3)
        assert node.put_from([k1, k2], pool.slots([0, 1])) == [PutStatus.STORED] * 2
        assert other.put_from([k3], pool.slots([2])) == [PutStatus.STORED]
        assert node.put_from([k3], pool.slots([2])) == [PutStatus.PRESENT]
        digests = {key_digest(k).hex() for k in (k2, k3)}
        assert set(disk_objects(tmp_path)) == digests
        assert node.stats().evicted == 1
        assert node.used_bytes == 2 * OBJECT
        assert node.put_from([k1], pool.slots([0])) == [PutStatus.STORED]
    finally:
        other.close()
        node.close()


# ---------------------------------------------------------------------------- redis


def test_a_fresh_redis_backend_counts_no_reset(redis_server: RedisServer) -> None:
    """A Redis backend's first probe (at start) meets the server for the first time: that
    is no restart, so `resets` (on which the controller forgets what it knew present, with
    a warning that the server was restarted or replaced) stays 0, and so it does while the
    same server answers later probes.
    Mutant killed: the run-id check counting a reset when no earlier run was known."""
    backend = build_backend(storage_config(StorageBackendName.REDIS, redis_url=redis_server.url))
    try:
        assert backend.resets == 0
        assert backend.health().healthy
        assert backend.health(deep=True).healthy
        assert backend.resets == 0
    finally:
        backend.close()


# ---------------------------------------------------------------------------- mooncake


@pytest.fixture
def mooncake(mooncake_master: MooncakeMaster) -> Iterator[StorageBackend]:
    backend = build_backend(mooncake_config(mooncake_master))
    yield backend
    backend.close()


def test_an_unregistered_mooncake_pool_takes_no_more_transfers(mooncake: StorageBackend) -> None:
    """Once the L2 pool's memory is unregistered (it is about to be freed), the backend
    forgets the region: a get or put with a buffer in it is refused with InvalidArgument,
    never handed to the client (which would move bytes to or from memory it no longer
    knows), and registering it again registers it with the client again.
    Mutant killed: `unregister_host_buffer` keeping the region in its list."""
    pool = Pool(2).register(mooncake)
    address = pool.memory.ctypes.data
    key_list = keys(2)
    assert mooncake.put_from(key_list, pool.slots()) == [PutStatus.STORED] * 2
    mooncake.unregister_host_buffer(address)
    assert all(start != address for start, _ in mooncake.regions)  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument):
        mooncake.get_into(key_list, pool.slots())
    pool.register(mooncake)
    try:
        stored = pool.pages.copy()
        pool.pages[:] = 0  # (read back into the re-registered pool itself)
        assert mooncake.get_into(key_list, pool.slots()) == [GetStatus.HIT] * 2
        assert np.array_equal(pool.pages, stored)
    finally:
        mooncake.unregister_host_buffer(address)
        mooncake.delete(key_list)


def test_a_get_from_a_killed_mooncake_master_is_an_unavailable_store_not_misses(
    mooncake_factory: Callable[[], MooncakeMaster],
) -> None:
    """With the Mooncake master killed, a get raises BackendUnavailable (the controller's
    breaker opens and the store is reported down); its transport error codes (-900 ...)
    are never taken for per-key misses of a healthy store.
    Mutant killed: `_read_into` not checking `batch_get_into`'s codes for an unreachable
    master (every key a MISS)."""
    master = mooncake_factory()
    backend = build_backend(mooncake_config(master, timeout_s=1.0))
    try:
        pool = Pool(1).register(backend)
        key_list = keys(1)
        assert backend.put_from(key_list, pool.slots()) == [PutStatus.STORED]
        master.stop(kill=True)
        with pytest.raises(BackendUnavailable):
            backend.get_into(key_list, pool.slots())
    finally:
        backend.close()
