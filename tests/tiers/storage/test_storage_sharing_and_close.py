"""Review of the L3 backends (session 18): buffers shared within one batch, calls that
outlive `close()`, torn objects under a put, errors and counters. Each test is the
regression test of a bug the review found (now fixed: buffers sharing memory refused;
close() waits, bounded, for calls given up on and says whether one still runs; a
Mooncake region stays known while its unregistration could not run; a fanned-out call
ends when its backend closes; every failed key counted; a torn file object rewritten),
or pins behaviour no other test covers."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from storage_pages import Pool, keys, mooncake_config, storage_config

from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.config import FileStorageConfig
from hicache.errors import BackendTimedOut, BackendUnavailable, InvalidArgument, ObjectCorrupt
from hicache.tiers.storage import HEADER_BYTES, GetStatus, PutStatus, StorageBackend, build_backend
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.integrity import check_object
from hicache.types import StorageBackendName

TIMEOUT_S = 0.5
UNSTUCK_S = 15.0  # how long a stuck call may take to return once its service answers


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mooncake_backend(mooncake_master: MooncakeMaster) -> Iterator[StorageBackend]:
    """One client for the module (a Mooncake client takes seconds to set up and close)."""
    backend = build_backend(mooncake_config(mooncake_master))
    yield backend
    backend.close()


@pytest.fixture(params=["file", "redis", "mooncake"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    kind = request.param
    if kind == "mooncake":
        shared: StorageBackend = request.getfixturevalue("mooncake_backend")
        before = set(shared.regions)  # type: ignore[attr-defined]
        yield shared
        for start, _ in set(shared.regions) - before:  # type: ignore[attr-defined]
            shared.unregister_host_buffer(start)  # (the test's pools die with it)
        return
    if kind == "file":
        cfg = storage_config(StorageBackendName.FILE, file=FileStorageConfig(path=str(tmp_path)))
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        cfg = storage_config(StorageBackendName.REDIS, redis_url=server.url)
    b = build_backend(cfg)
    yield b
    b.close()


def _wait_unstuck(backend: StorageBackend) -> None:
    deadline = time.monotonic() + UNSTUCK_S
    while backend.stats().stuck_calls:
        assert time.monotonic() < deadline, "the stuck call never returned"
        time.sleep(0.02)


def _honest(backend: StorageBackend, ks: list[str], bufs: list[np.ndarray],
            call: Callable[[], list[GetStatus]]) -> None:
    """`call` (a get of `ks` into `bufs`) either refuses the batch, or every HIT's buffer
    holds that key's verified object once the call has returned; and no good object of
    `ks` is removed from the store either way."""
    try:
        out = call()
    except InvalidArgument:
        out = None
    if out is not None:
        for key, buf, status in zip(ks, bufs, out, strict=True):
            if status is GetStatus.HIT:
                try:
                    check_object(buf, key, buf.nbytes)
                except ObjectCorrupt as e:
                    pytest.fail(f"HIT for {key[-12:]} but its buffer holds something else: {e}")
    assert backend.exists_prefix(ks) == len(ks), "a good object was removed from the store"


# --------------------------------------------------------------------------- one buffer, two keys


@pytest.mark.parametrize("layout", ["same", "overlap"])
def test_get_into_two_keys_sharing_buffer_memory_is_refused_or_honest(
    backend: StorageBackend, layout: str
) -> None:
    src = Pool(2, seed=21).register(backend)
    ks = keys(2)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * 2
    dst = Pool(2, seed=None).register(backend)
    flat = dst.memory
    if layout == "same":
        bufs = [dst.pages[0], dst.pages[0]]
    else:  # the second starts one header into the first
        bufs = [flat[: src.slot], flat[HEADER_BYTES : HEADER_BYTES + src.slot]]
    _honest(backend, ks, bufs, lambda: backend.get_into(ks, bufs))


def test_a_key_repeated_into_the_very_same_buffer_is_a_hit(backend: StorageBackend) -> None:
    """The one sharing that is harmless (the same bytes twice): it must stay accepted."""
    src = Pool(1, seed=22).register(backend)
    (k,) = keys(1)
    assert backend.put_from([k], src.slots()) == [PutStatus.STORED]
    dst = Pool(1, seed=None).register(backend)
    assert backend.get_into([k, k], [dst.pages[0], dst.pages[0]]) == [GetStatus.HIT] * 2
    np.testing.assert_array_equal(dst.pages[0], src.pages[0])


def test_put_from_one_buffer_under_two_keys_stores_nothing_corrupt(backend: StorageBackend) -> None:
    src = Pool(1, seed=23).register(backend)
    ks = keys(2)
    try:
        out = backend.put_from(ks, [src.pages[0], src.pages[0]])
    except InvalidArgument:
        assert backend.exists_prefix(ks[:1]) == 0
        return
    dst = Pool(2, seed=None).register(backend)
    got = backend.get_into(ks, dst.slots())
    for key, put, status in zip(ks, out, got, strict=True):
        if put is PutStatus.STORED:
            assert status is GetStatus.HIT, f"{key[-12:]}: reported STORED, reads back {status}"


# --------------------------------------------------------------------------- calls that outlive close()


def _mooncake(master: MooncakeMaster) -> StorageBackend:
    return build_backend(mooncake_config(master, timeout_s=TIMEOUT_S))


def _stuck_call(backend: StorageBackend, then: Callable[[], None] = lambda: None) -> threading.Event:
    """A client call that does not answer in time (what a stopped master or a hung
    transfer gives, without depending on when the client library notices): it runs on in
    the backend's worker until the returned event is set, then does `then` (a late
    transfer landing). Returns once the backend counts it stuck."""
    gate = threading.Event()

    def call() -> None:
        gate.wait(UNSTUCK_S)
        then()

    with pytest.raises(BackendUnavailable):
        backend._caller.call(call)  # type: ignore[attr-defined]
    assert backend.stats().stuck_calls == 1
    return gate


def test_mooncake_close_waits_for_a_call_given_up_on_before_the_memory_goes(
    mooncake_factory: Callable[[], MooncakeMaster],
) -> None:
    """A call given up on runs on in the client and may still move data into the buffers:
    close() says so (False) while it runs, and, given time, waits for it and closes the
    client after it, so that nothing writes into the memory once it returned True (the
    controller frees L2 only then). It used to close at once, and a late transfer wrote
    into the memory afterwards."""
    master = mooncake_factory()
    backend = _mooncake(master)
    dst = Pool(1, seed=None).register(backend)
    gate = _stuck_call(backend, then=lambda: dst.memory.fill(7))  # (the late transfer)
    backend.unregister_host_buffer(dst.memory.ctypes.data)  # (fails fast: stays registered)
    assert backend.close() is False  # it still runs: the memory is not the caller's yet
    threading.Timer(0.3, gate.set).start()
    assert backend.close(wait_s=UNSTUCK_S) is True
    assert backend.stats().stuck_calls == 0 and dst.memory.all()  # it landed before
    dst.memory[:] = 0  # the caller reuses (here: clears) the memory it got back
    time.sleep(0.2)
    assert not dst.memory.any(), "something wrote into the buffer after close() returned True"


def test_mooncake_unregister_while_a_call_is_stuck_keeps_the_region_consistent(
    mooncake_factory: Callable[[], MooncakeMaster],
) -> None:
    """An unregistration that cannot run (a call is stuck: calls fail fast) leaves the
    region registered, and known as such: it used to be forgotten here while the client
    kept it, and registering it again failed (-600)."""
    master = mooncake_factory()
    backend = _mooncake(master)
    try:
        src, dst = Pool(1, seed=25).register(backend), Pool(1, seed=None).register(backend)
        ks = keys(1)
        assert backend.put_from(ks, src.slots()) == [PutStatus.STORED]
        gate = _stuck_call(backend)
        backend.unregister_host_buffer(dst.memory.ctypes.data)  # fails fast, logs
        gate.set()
        _wait_unstuck(backend)
        dst.register(backend)  # the same region again: known to both sides, or to neither
        assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT]
    finally:
        backend.close()


def test_redis_close_ends_a_timed_out_get_before_it_writes(
    redis_factory: Callable[[], RedisServer],
) -> None:
    """Redis's close() is a barrier: it disconnects the pool, so the stuck read fails
    instead of filling the buffer later."""
    server = redis_factory()
    backend = build_backend(storage_config(StorageBackendName.REDIS, timeout_s=TIMEOUT_S,
                                           redis_url=server.url))
    src, dst = Pool(1, seed=26), Pool(1, seed=None)
    ks = keys(1)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED]
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get_into(ks, dst.slots())
        backend.close()
        dst.memory[:] = 0
    finally:
        os.kill(server.pid, signal.SIGCONT)
    _wait_unstuck(backend)
    time.sleep(0.1)
    assert not dst.memory.any()


def _gate_os_open(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A hung mount: every `os.open` waits for the gate (like the test of hung mounts)."""
    gate, reached = threading.Event(), threading.Event()
    real_open = os.open

    def hung(*args, **kwargs):  # type: ignore[no-untyped-def]
        reached.set()
        gate.wait(UNSTUCK_S)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", hung)
    return gate, reached


def test_file_close_says_a_timed_out_read_still_runs_and_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung mount: the read given up on still runs. close(0) says so (False); a second
    close given time waits for it (True), and nothing writes into the buffer after that."""
    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=TIMEOUT_S)
    backend.start()
    src, dst = Pool(1, seed=27), Pool(1, seed=None)
    ks = keys(1)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED]
    gate, reached = _gate_os_open(monkeypatch)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get_into(ks, dst.slots())
        assert reached.is_set()
        assert backend.close() is False
        threading.Timer(0.3, gate.set).start()
        assert backend.close(wait_s=UNSTUCK_S) is True
    finally:
        monkeypatch.undo()
        gate.set()
    dst.memory[:] = 0
    time.sleep(0.1)
    assert not dst.memory.any(), "the late read wrote into the buffer after close() returned True"


# --------------------------------------------------------------------------- errors and counters


def test_close_during_a_fanned_out_get_ends_it_at_once_as_closed(tmp_path: Path) -> None:
    """`storage.file.threads: 2`: a get of 64 objects runs as two parts (`BoundedCaller.map`);
    close() cancels the parts still queued for a worker. A single call (`call`) ends at
    once with "closed"; a fanned-out one should too."""
    timeout_s = 3.0
    backend = FileBackend(FileStorageConfig(path=str(tmp_path), threads=2), timeout_s=timeout_s)
    backend.start()
    n = 64
    ks, src, dst = keys(n), Pool(n, seed=28), Pool(n, seed=None)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * n
    hold = threading.Event()
    caller = backend._caller
    busy = [caller.submit(hold.wait, 10) for _ in range(caller._pool._max_workers)]
    raised: list[BaseException] = []
    ended: list[float] = []

    def get() -> None:
        try:
            backend.get_into(ks, dst.slots())
        except BaseException as e:  # (whatever the caller would see)
            raised.append(e)
        ended.append(time.monotonic())

    worker = threading.Thread(target=get)
    worker.start()
    time.sleep(0.2)  # its parts are queued behind the busy workers
    closed = time.monotonic()
    backend.close()
    worker.join(timeout_s + 5)
    hold.set()
    for future in busy:
        future.result(10)
    assert len(raised) == 1 and isinstance(raised[0], BackendUnavailable), raised
    assert ended[0] - closed < 1.0, f"ended {ended[0] - closed:.1f} s after close()"
    assert not isinstance(raised[0], BackendTimedOut), raised[0]


def test_every_failed_key_of_a_put_is_counted(tmp_path: Path) -> None:
    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=2.0)
    backend.start()
    try:
        (k,) = keys(1)
        folder = os.path.dirname(os.path.dirname(backend.path_of(k)))
        with open(folder, "wb") as f:  # a file where the key's fan-out folder belongs
            f.write(b"not a folder")
        pool = Pool(2, seed=29)
        assert backend.put_from([k, k], pool.slots()) == [PutStatus.FAILED] * 2
        s = backend.stats()
        assert s.puts == 2
        assert s.stored + s.present + s.put_failed == s.puts, s
    finally:
        backend.close()


@pytest.mark.parametrize("left", [0, 10, HEADER_BYTES + 100])
def test_a_file_put_over_a_torn_object_writes_it_whole(tmp_path: Path, left: int) -> None:
    """An object cut short (a writer that died without fsync: empty, shorter than a
    header, or header and part of the payload) is written again by the next put: it used
    to answer PRESENT, and the writer recorded in L3 a page no node could read."""
    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=2.0)
    backend.start()
    try:
        src, dst = Pool(1, seed=30), Pool(1, seed=None)
        (k,) = keys(1)
        assert backend.put_from([k], src.slots()) == [PutStatus.STORED]
        with open(backend.path_of(k), "r+b") as f:
            f.truncate(left)
        assert backend.put_from([k], src.slots()) == [PutStatus.STORED]
        assert backend.get_into([k], dst.slots()) == [GetStatus.HIT]
        np.testing.assert_array_equal(dst.pages[0], src.pages[0])
    finally:
        backend.close()


def test_a_file_put_leaves_a_longer_object_alone(tmp_path: Path) -> None:
    """A longer object at the key is not ours to judge (reads leave it alone too): PRESENT,
    its bytes untouched."""
    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=2.0)
    backend.start()
    try:
        src = Pool(1, seed=31)
        (k,) = keys(1)
        path = backend.path_of(k)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        junk = b"\x07" * (src.slot + 10)
        with open(path, "wb") as f:
            f.write(junk)
        assert backend.put_from([k], src.slots()) == [PutStatus.PRESENT]
        with open(path, "rb") as f:
            assert f.read() == junk
    finally:
        backend.close()


def test_a_start_indexes_only_the_objects_it_names(tmp_path: Path) -> None:
    """A `.kv` file this code never writes (another name, or a digest name in another
    folder) is not counted against the capacity: counted, it could never be found to
    evict (the eviction unlinks the path the digest names) and the store's room shrank
    for good. It is left alone."""
    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=2.0)
    backend.start()
    src = Pool(1, seed=32)
    (k,) = keys(1)
    assert backend.put_from([k], src.slots()) == [PutStatus.STORED]
    backend.close()
    digest = os.path.basename(backend.path_of(k))
    strangers = [tmp_path / "zz" / "notes.kv", tmp_path / "00" / "00" / digest]
    for path in strangers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 5000)
    again = FileBackend(FileStorageConfig(path=str(tmp_path), capacity_gb=1.0), timeout_s=2.0)
    again.start()
    try:
        assert again.used_bytes == src.slot
        assert all(path.exists() for path in strangers)
    finally:
        again.close()
