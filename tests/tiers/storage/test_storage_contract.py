"""The protocol, scenario by scenario, against each real backend (file, Redis, Mooncake)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from storage_pages import Pool, keys, mooncake_config, storage_config

from hicache.bench.services import MooncakeMaster
from hicache.config import FileStorageConfig
from hicache.errors import InvalidArgument
from hicache.logthrottle import ThrottledLog
from hicache.tiers.storage import (
    HEADER_BYTES,
    BackendStats,
    GetStatus,
    PutStatus,
    StorageBackend,
    build_backend,
)
from hicache.types import StorageBackendName

Corrupt = Callable[[StorageBackend, str], None]
Replace = Callable[[StorageBackend, str, bytes], None]


def _flip_file_byte(backend: StorageBackend, key: str) -> None:
    path = backend.path_of(key)  # type: ignore[attr-defined]
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _replace_file(backend: StorageBackend, key: str, value: bytes) -> None:
    with open(backend.path_of(key), "wb") as f:  # type: ignore[attr-defined]
        f.write(value)


def _overwrite_redis(backend: StorageBackend, key: str) -> None:
    raw = backend.client  # type: ignore[attr-defined]
    value = bytearray(raw.get(key))
    value[HEADER_BYTES + 100] ^= 0xFF
    raw.set(key, bytes(value))


def _replace_redis(backend: StorageBackend, key: str, value: bytes) -> None:
    backend.client.set(key, value)  # type: ignore[attr-defined]


@dataclass
class Store:
    backend: StorageBackend
    corrupt: Corrupt  # flip one payload byte of a stored object
    replace: Replace  # store raw bytes under a key, bypassing the backend's header
    base: BackendStats  # counters when the test began (the Mooncake client is shared)

    def counted(self, name: str) -> int:
        return int(getattr(self.backend.stats(), name)) - int(getattr(self.base, name))


@pytest.fixture(scope="module")
def mooncake_pair(
    mooncake_master: MooncakeMaster,
) -> Iterator[tuple[StorageBackend, StorageBackend]]:
    """One backend and a second raw client, shared by the module: a Mooncake client takes
    2-4 s to close, so a pair per test would dominate the suite."""
    cfg = mooncake_config(mooncake_master)
    backend, raw = build_backend(cfg), build_backend(cfg)
    yield backend, raw
    backend.close()
    raw.close()


@pytest.fixture(params=["file", "file-threads", "redis", "mooncake"])
def store(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Store]:
    kind = request.param
    corrupt: Corrupt
    replace: Replace
    if kind.startswith("file"):
        # file-threads: calls spread over threads (`storage.file.threads: 4`)
        threads = 4 if kind == "file-threads" else None
        cfg = storage_config(StorageBackendName.FILE,
                             file=FileStorageConfig(path=str(tmp_path), threads=threads))
        backend, corrupt, replace = build_backend(cfg), _flip_file_byte, _replace_file
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")
        cfg = storage_config(StorageBackendName.REDIS, redis_url=server.url)
        backend, corrupt, replace = build_backend(cfg), _overwrite_redis, _replace_redis
    else:
        backend, raw = request.getfixturevalue("mooncake_pair")

        def replace(backend: StorageBackend, key: str, value: bytes) -> None:
            assert raw.store.upsert(key, value) == 0  # type: ignore[attr-defined]

        def corrupt(backend: StorageBackend, key: str) -> None:
            # The second raw client puts junk (same size, one payload byte flipped) over it.
            pool = Pool(1, seed=None).register(raw)
            assert raw.get_into([key], pool.slots()) == [GetStatus.HIT]
            raw.unregister_host_buffer(pool.memory.ctypes.data)
            value = bytearray(pool.pages[0].tobytes())
            value[HEADER_BYTES + 100] ^= 0xFF
            replace(backend, key, bytes(value))

    before = set(backend.regions) if kind == "mooncake" else set()  # type: ignore[attr-defined]
    yield Store(backend, corrupt, replace, backend.stats())
    if kind == "mooncake":
        # Pools die with the test; their memory must leave the shared client first.
        for start, _ in set(backend.regions) - before:  # type: ignore[attr-defined]
            backend.unregister_host_buffer(start)
    else:
        backend.close()


def test_round_trip_is_bit_exact_and_second_put_is_present(store: Store) -> None:
    backend = store.backend
    src, dst = Pool(20, seed=1).register(backend), Pool(20, seed=None).register(backend)
    ks = keys(20)

    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * 20
    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT] * 20
    np.testing.assert_array_equal(dst.pages, src.pages)  # headers and payloads
    assert backend.put_from(ks, src.slots()) == [PutStatus.PRESENT] * 20

    counts = [store.counted(n) for n in ("stored", "present", "hits", "corrupt")]
    assert counts == [20, 20, 20, 0]
    assert store.counted("bytes_written") == store.counted("bytes_read") == 20 * src.slot


def test_exists_prefix_stops_at_the_first_gap(store: Store) -> None:
    backend = store.backend
    pool = Pool(12).register(backend)
    ks = keys(12)
    present = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11]  # 9 is the gap, after a batch boundary (8)
    backend.put_from([ks[i] for i in present], pool.slots(present))

    assert backend.exists_prefix(ks) == 9
    assert backend.exists_prefix(ks[10:]) == 2
    assert backend.exists_prefix(ks[9:]) == 0
    assert backend.exists_prefix([]) == 0


@pytest.mark.parametrize("gap", [5, 40, 63, 64, 100, 149, None])
def test_exists_prefix_over_parallel_runs(store: Store, gap: int | None) -> None:
    """Enough keys that a backend may check them in parallel runs or in chunks (the file
    backend: 64 keys): a gap in the first run ends the answer there even though the later
    ones are whole, and one in a later run is found after the earlier runs' keys."""
    backend = store.backend
    n = 150
    pool = Pool(n).register(backend)
    ks = keys(n)
    present = [i for i in range(n) if i != gap]
    backend.put_from([ks[i] for i in present], pool.slots(present))
    assert backend.exists_prefix(ks) == (n if gap is None else gap)


def test_missing_keys_are_misses_and_others_still_hit(store: Store) -> None:
    backend = store.backend
    src, dst = Pool(3, seed=2).register(backend), Pool(3, seed=None).register(backend)
    ks = keys(3)
    backend.put_from([ks[0], ks[2]], src.slots([0, 2]))

    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.MISS, GetStatus.HIT]
    np.testing.assert_array_equal(dst.payload(2), src.payload(2))
    assert store.counted("misses") == 1


def test_object_corrupted_in_the_store_is_a_counted_miss_and_zeroed(
    store: Store,
) -> None:
    backend, corrupt = store.backend, store.corrupt
    src, dst = Pool(2, seed=3).register(backend), Pool(2, seed=4).register(backend)
    ks = keys(2)
    backend.put_from(ks, src.slots())
    corrupt(backend, ks[1])

    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT]
    assert not dst.pages[1].any()  # no byte of the corrupt object survives
    np.testing.assert_array_equal(dst.pages[0], src.pages[0])
    assert store.counted("corrupt") == 1


def test_a_corrupt_object_is_removed_so_that_a_good_copy_can_be_stored_again(
    store: Store,
) -> None:
    """Left in place, a corrupt object would count as present at every lookup and make
    every put skip its key: that prefix could never be served from L3 again."""
    backend, corrupt = store.backend, store.corrupt
    src, dst = Pool(3, seed=8).register(backend), Pool(3, seed=None).register(backend)
    ks = keys(3)
    backend.put_from(ks, src.slots())
    corrupt(backend, ks[1])
    assert backend.exists_prefix(ks) == 3  # presence is not content

    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT, GetStatus.HIT]
    assert store.counted("corrupt_removed") == 1
    assert backend.exists_prefix(ks) == 1  # gone: the run stops there now
    assert backend.put_from(ks, src.slots()) == [PutStatus.PRESENT, PutStatus.STORED, PutStatus.PRESENT]
    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT] * 3
    np.testing.assert_array_equal(dst.pages, src.pages)


def test_a_store_full_of_corrupt_objects_logs_one_warning_and_removes_them_all(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One warning per corrupt object would flood the log at the read rate of a store full
    of junk; every object is still counted and removed."""
    backend, corrupt = store.backend, store.corrupt
    # A fresh throttle: the Mooncake client is shared by the tests (an earlier one's
    # warning would hold this one back).
    monkeypatch.setattr(backend, "_warn", ThrottledLog(backend._warn.logger))
    src, dst = Pool(12, seed=10).register(backend), Pool(12, seed=None).register(backend)
    ks = keys(12)
    backend.put_from(ks, src.slots())
    for key in ks:
        corrupt(backend, key)
    with caplog.at_level(logging.WARNING):
        assert backend.get_into(ks, dst.slots()) == [GetStatus.CORRUPT] * 12
    removing = [r for r in caplog.records if "removing it from the store" in r.getMessage()]
    assert len(removing) == 1
    assert store.counted("corrupt") == 12 and store.counted("corrupt_removed") == 12
    assert backend.exists_prefix(ks) == 0


def test_objects_not_ours_to_judge_are_left_in_the_store(store: Store) -> None:
    """Another size (another model geometry under the same key) or another header format
    version (another daemon version): a miss for this reader, never removed by it."""
    backend = store.backend
    src = Pool(2, seed=9).register(backend)
    ks = keys(2)
    backend.put_from(ks, src.slots())
    newer = src.pages[1].copy()
    newer[4] += 1  # the header's format version field (little endian u16 at offset 4)
    store.replace(backend, ks[1], bytes(newer))

    small = Pool(1, payload=1024, seed=None).register(backend)
    assert backend.get_into(ks[:1], small.slots()) == [GetStatus.CORRUPT]
    dst = Pool(2, seed=None).register(backend)
    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT]
    assert store.counted("corrupt") == 2 and store.counted("corrupt_removed") == 0
    assert backend.exists_prefix(ks) == 2


def test_wrong_sized_buffer_is_corrupt_not_a_partial_copy(store: Store) -> None:
    backend = store.backend
    src = Pool(1, seed=5).register(backend)
    small, large = (
        Pool(1, payload=1024, seed=6).register(backend),
        Pool(1, payload=8192, seed=7).register(backend),
    )
    ks = keys(1)
    backend.put_from(ks, src.slots())

    assert backend.get_into(ks, small.slots()) == [GetStatus.CORRUPT]
    assert backend.get_into(ks, large.slots()) == [GetStatus.CORRUPT]
    assert not small.pages.any() and not large.pages.any()


def test_duplicate_keys_in_a_put_batch_are_stored_once(store: Store) -> None:
    backend = store.backend
    pool = Pool(3).register(backend)
    a, b = keys(2)
    assert backend.put_from([a, a, b], pool.slots()) == [
        PutStatus.STORED,
        PutStatus.PRESENT,
        PutStatus.STORED,
    ]


def test_a_key_repeated_in_a_get_batch_fills_each_of_its_buffers(store: Store) -> None:
    """(Mooncake's client filled only the last buffer of a repeated key; the first then
    looked corrupt and the good object was removed.)"""
    backend = store.backend
    src, dst = Pool(2, seed=11).register(backend), Pool(3, seed=12).register(backend)
    a, b = keys(2)
    backend.put_from([a, b], src.slots())
    assert backend.get_into([a, b, a], dst.slots()) == [GetStatus.HIT] * 3
    np.testing.assert_array_equal(dst.pages[0], src.pages[0])
    np.testing.assert_array_equal(dst.pages[2], src.pages[0])
    assert store.counted("corrupt") == 0 and backend.exists_prefix([a, b]) == 2


def test_a_repeated_key_with_a_buffer_of_another_size_removes_nothing(store: Store) -> None:
    """The repeat that is not read into (its buffer has another size) is corrupt to its
    reader, but never taken for a corrupt object of ours (it removed the good object)."""
    backend = store.backend
    src = Pool(1, seed=14).register(backend)
    small = Pool(1, payload=1024, seed=None).register(backend)
    (k,) = keys(1)
    backend.put_from([k], src.slots())
    dst = Pool(1, seed=None).register(backend)
    assert backend.get_into([k, k], [small.slots()[0], dst.slots()[0]]) == [GetStatus.CORRUPT,
                                                                           GetStatus.HIT]
    assert store.counted("corrupt_removed") == 0 and backend.exists_prefix([k]) == 1


def test_a_truncated_object_of_ours_is_removed(store: Store) -> None:
    """Our header, our key and our length but fewer bytes stored (a torn write): removed
    like any corrupt object of ours, so that a good copy can replace it."""
    backend = store.backend
    src, dst = Pool(1, seed=13).register(backend), Pool(1, seed=None).register(backend)
    (k,) = keys(1)
    backend.put_from([k], src.slots())
    store.replace(backend, k, src.pages[0].tobytes()[: src.slot // 2])
    assert backend.get_into([k], dst.slots()) == [GetStatus.CORRUPT]
    assert store.counted("corrupt_removed") == 1 and backend.exists_prefix([k]) == 0
    assert backend.put_from([k], src.slots()) == [PutStatus.STORED]


def test_delete_removes_and_counts_only_present_keys(store: Store) -> None:
    backend = store.backend
    pool = Pool(3).register(backend)
    ks = keys(3)
    backend.put_from(ks[:2], pool.slots([0, 1]))

    assert backend.delete(ks) == 2
    assert backend.exists_prefix(ks) == 0
    assert backend.delete([]) == 0


def test_empty_batches_and_bad_arguments(store: Store) -> None:
    backend = store.backend
    pool = Pool(2).register(backend)
    assert backend.get_into([], []) == [] and backend.put_from([], []) == []
    with pytest.raises(InvalidArgument):
        backend.put_from(keys(1), pool.slots())
    with pytest.raises(InvalidArgument):
        backend.put_from(["caf\u00e9"], pool.slots([0]))
    with pytest.raises(InvalidArgument):
        backend.get_into(keys(1), [pool.pages[0].view(np.int8)])


def test_deep_health_runs_a_canary_and_leaves_nothing_behind(store: Store) -> None:
    backend = store.backend
    health = backend.health(deep=True)
    assert health.healthy, health.detail
    assert "canary" in health.detail and health.latency_ms > 0
    assert store.counted("stored") == 0  # the canary bypasses the counters


class _TornFirstRead:
    """A Mooncake client whose next `batch_get_into` returns torn bytes (one payload byte
    of each object it read flipped), as a read racing a forced delete can; the rest is
    the real client's."""

    def __init__(self, real: object, torn_reads: int) -> None:
        self._real = real
        self.torn_reads = torn_reads
        self.reads = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        codes = self._real.batch_get_into(keys, addrs, sizes)  # type: ignore[attr-defined]
        self.reads += 1
        if self.reads <= self.torn_reads:
            for addr, code in zip(addrs, codes, strict=True):
                if code > HEADER_BYTES + 100:
                    byte = ctypes.c_uint8.from_address(addr + HEADER_BYTES + 100)
                    byte.value ^= 0xFF
        return codes


@pytest.mark.parametrize(("torn_reads", "status"), [(1, GetStatus.HIT), (2, GetStatus.CORRUPT)])
def test_mooncake_reads_a_failed_check_again_before_calling_it_corrupt(
    mooncake_pair: tuple[StorageBackend, StorageBackend], monkeypatch: pytest.MonkeyPatch,
    torn_reads: int, status: GetStatus,
) -> None:
    """A read racing a delete fails its check once: read again, it is the good object,
    a hit, and the object stays (its removal would lose a good copy). Torn twice, it is
    corrupt and removed."""
    backend, _ = mooncake_pair
    src, dst = Pool(1, seed=7).register(backend), Pool(1, seed=None).register(backend)
    (key,) = keys(1)
    try:
        assert backend.put_from([key], src.slots()) == [PutStatus.STORED]
        before = backend.stats()
        torn = _TornFirstRead(backend.store, torn_reads)  # type: ignore[attr-defined]
        monkeypatch.setattr(backend, "_store", torn)
        assert backend.get_into([key], dst.slots()) == [status]
        monkeypatch.undo()
        after = backend.stats()
        assert torn.reads == 2
        assert (after.corrupt - before.corrupt, after.corrupt_removed - before.corrupt_removed) == (
            (0, 0) if status is GetStatus.HIT else (1, 1))
        assert backend.exists_prefix([key]) == (1 if status is GetStatus.HIT else 0)
        if status is GetStatus.HIT:
            assert np.array_equal(dst.pages[0], src.pages[0])
    finally:
        backend.delete([key])
        for pool in (src, dst):
            backend.unregister_host_buffer(pool.memory.ctypes.data)
