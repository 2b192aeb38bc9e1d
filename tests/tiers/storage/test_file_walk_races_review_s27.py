"""Review (s27): the file backend's start-time background walk racing live traffic.

`FileBackend.start` walks the store in a thread (`_index_in_background` ->
`_rebuild_index`) while the daemon serves; at its end the walk merges what it found into
the LRU index (objects used meanwhile stay the most recent) and evicts down to the
capacity. These tests pause the walk at chosen points (a wrapped `os.walk` that waits on
events in the indexer thread only), run traffic, then let it go on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from file_kit import OBJECT, disk_bytes, disk_objects, gate_call, sized_backend
from storage_pages import Pool, keys

from hicache.config import FileStorageConfig
from hicache.keys import CANARY_PREFIX
from hicache.tiers.storage import GetStatus, PutStatus
from hicache.tiers.storage import file as file_backend
from hicache.tiers.storage.file import FileBackend

INDEXER = "hicache-file-index"
WAIT = 10.0


def _backend(path: Path, capacity_objects: int | None = None) -> FileBackend:
    return sized_backend(path, capacity_objects)  # (not waiting for the walk: the races are with it)


def _present(backend: FileBackend, ks: list[str]) -> list[int]:
    return [backend.exists_prefix([k]) for k in ks]


def _seed(root: Path, ks: list[str], ages: list[float] | None = None) -> None:
    """Store `ks` with a backend of no capacity (closed after its walk), the i-th object's
    mtime `ages[i]` seconds in the past (older first, by default)."""
    writer = _backend(root)
    assert writer.wait_indexed(WAIT)
    assert writer.put_from(ks, Pool(len(ks), seed=1).slots()) == [PutStatus.STORED] * len(ks)
    now = time.time()
    for key, age in zip(ks, ages or [100.0 - i for i in range(len(ks))], strict=True):
        os.utime(writer.path_of(key), (now - age, now - age))
    writer.close()


class WalkGate:
    """Pauses the next start-time walk of `root` (in the indexer thread only): before it
    lists anything (`before`), and once every folder was listed and stat'ed, before the
    walk merges what it found into the index (`after`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, *, before: bool = False,
                 after: bool = True) -> None:
        self.root = str(root)
        self.pause_before, self.pause_after = before, after
        self.started, self.go = threading.Event(), threading.Event()
        self.listed, self.finish = threading.Event(), threading.Event()
        self.armed = True
        real_walk = os.walk
        monkeypatch.setattr(file_backend, "INDEX_WAIT_S", 0.0)  # (start does not wait)

        def walk(top: str, *args: object, **kwargs: object) -> Iterator[tuple[str, list[str], list[str]]]:
            if (not self.armed or threading.current_thread().name != INDEXER
                    or os.fspath(top) != self.root):
                yield from real_walk(top, *args, **kwargs)  # type: ignore[arg-type]
                return
            self.armed = False
            self.started.set()
            if self.pause_before:
                assert self.go.wait(WAIT)
            yield from real_walk(top, *args, **kwargs)  # type: ignore[arg-type]
            self.listed.set()
            if self.pause_after:
                assert self.finish.wait(WAIT)

        monkeypatch.setattr(os, "walk", walk)

    def release(self) -> None:
        self.go.set()
        self.finish.set()


# ============================================================= counting during the walk


def test_puts_gets_and_presents_during_the_walk_are_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects stored before the walk lists them (found by it and in the index) and after
    (in the index only), PRESENT puts and hits of objects the walk found: each counted
    once; the index holds exactly what is on disk, and every put object reads back."""
    old = keys(4, "old")
    _seed(tmp_path, old)
    gate = WalkGate(monkeypatch, tmp_path, before=True, after=True)
    backend = _backend(tmp_path, capacity_objects=20)
    try:
        assert gate.started.wait(WAIT)
        early, late = keys(3, "early"), keys(3, "late")
        assert backend.put_from(early, Pool(3, seed=2).slots()) == [PutStatus.STORED] * 3
        gate.go.set()  # the walk lists and stats the old objects and the early ones
        assert gate.listed.wait(WAIT)
        assert backend.put_from(late, Pool(3, seed=3).slots()) == [PutStatus.STORED] * 3
        assert backend.put_from(old[:2], Pool(2, seed=1).slots()) == [PutStatus.PRESENT] * 2
        assert backend.get_into(old[2:3], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        assert backend.exists_prefix(old + early + late) == 10
        gate.finish.set()
        assert backend.wait_indexed(WAIT)
        assert backend.used_bytes == disk_bytes(tmp_path) == 10 * OBJECT
        assert len(backend._lru) == len(disk_objects(tmp_path)) == 10
        dst = Pool(6, seed=None)
        assert backend.get_into(early + late, dst.slots()) == [GetStatus.HIT] * 6
        assert np.array_equal(dst.payload(0), Pool(3, seed=2).payload(0))
        assert np.array_equal(dst.payload(5), Pool(3, seed=3).payload(2))
    finally:
        gate.release()
        backend.close()


def test_a_store_filled_past_capacity_during_the_walk_is_brought_back_to_it_lru_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During the walk the index only holds what was used since the start, so puts go
    past the capacity; the merge evicts down to it: the walk's untouched objects oldest
    first, never one used meanwhile (a hit or a PRESENT put) before an older untouched
    one."""
    old = keys(4, "old")  # mtimes: old[0] oldest ... old[3] newest
    _seed(tmp_path, old)
    gate = WalkGate(monkeypatch, tmp_path, before=False, after=True)
    backend = _backend(tmp_path, capacity_objects=5)
    try:
        assert gate.listed.wait(WAIT)
        assert backend.get_into(old[:1], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        assert backend.put_from(old[1:2], Pool(1, seed=1).slots([0])) == [PutStatus.PRESENT]
        new = keys(3, "new")
        assert backend.put_from(new, Pool(3, seed=4).slots()) == [PutStatus.STORED] * 3
        assert len(disk_objects(tmp_path)) == 7  # (past the capacity while the walk runs)
        gate.finish.set()
        assert backend.wait_indexed(WAIT)
        # 7 objects, room for 5: old[2] and old[3] (untouched) go, old[0] and old[1] stay.
        assert _present(backend, old + new) == [1, 1, 0, 0, 1, 1, 1]
        assert backend.used_bytes == disk_bytes(tmp_path) == 5 * OBJECT
        # Then the order is the use order: old[0], old[1], new...
        assert backend.put_from(keys(1, "next"), Pool(1, seed=5).slots()) == [PutStatus.STORED]
        assert _present(backend, old[:2]) == [0, 1]
        assert backend.used_bytes == disk_bytes(tmp_path) == 5 * OBJECT
    finally:
        gate.release()
        backend.close()


def test_an_object_evicted_during_the_walk_does_not_stay_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put during the walk evicts an object the walk had found (the merge puts its
    entry back: the NOTE in `_rebuild_index`); the merge's own eviction, the index being
    full again, takes that entry first: once quiet the count is what is on disk."""
    old = keys(2, "old")
    _seed(tmp_path, old)
    gate = WalkGate(monkeypatch, tmp_path, before=True, after=True)
    backend = _backend(tmp_path, capacity_objects=3)
    try:
        assert gate.started.wait(WAIT)
        new = keys(4, "new")
        assert backend.put_from(new[:3], Pool(3, seed=9).slots()) == [PutStatus.STORED] * 3
        gate.go.set()
        assert gate.listed.wait(WAIT)  # the walk found old and new[:3]
        assert backend.put_from(new[3:], Pool(1, seed=9).slots()) == [PutStatus.STORED]
        assert not os.path.exists(backend.path_of(new[0]))  # (evicted during the walk)
        gate.finish.set()
        assert backend.wait_indexed(WAIT)
        assert _present(backend, old + new) == [0, 0, 0, 1, 1, 1]
        assert backend.used_bytes == disk_bytes(tmp_path) == 3 * OBJECT
        assert len(backend._lru) == 3
    finally:
        gate.release()
        backend.close()


# Found by the review, fixed: an object deleted while the walk runs (after the walk stat'ed
# it) is put back in the index by the merge: used_bytes counts a phantom and a later put
# evicts a real object although the store had room
def test_an_object_deleted_during_the_walk_is_not_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = keys(2, "ab")
    _seed(tmp_path, [a, b], ages=[50.0, 40.0])  # a older than b
    gate = WalkGate(monkeypatch, tmp_path, before=False, after=True)
    backend = _backend(tmp_path, capacity_objects=3)
    try:
        assert gate.listed.wait(WAIT)  # the walk found a and b
        assert backend.delete([b]) == 1
        gate.finish.set()
        assert backend.wait_indexed(WAIT)
        c, d = keys(2, "cd")
        assert backend.put_from([c, d], Pool(2, seed=6).slots()) == [PutStatus.STORED] * 2
        # Three objects (a, c, d) in a store with room for three: none had to go.
        assert _present(backend, [a, c, d]) == [1, 1, 1]
        assert backend.used_bytes == disk_bytes(tmp_path) == 3 * OBJECT
    finally:
        gate.release()
        backend.close()


# Found by the review, fixed: a deep health check's canary found by the walk and deleted (with
# its fan-out folder) before the merge comes back in the index: the next probe finds its
# folder gone and bumps `resets`, so the controller clears its whole L3 cache
def test_a_canary_the_walk_saw_does_not_make_the_next_probe_report_a_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = WalkGate(monkeypatch, tmp_path, before=True, after=True)
    backend = _backend(tmp_path)
    try:
        assert gate.started.wait(WAIT)
        real_read = backend._read_into

        def read_into(ks, buffers):  # type: ignore[no-untyped-def]
            if ks and ks[0].startswith(CANARY_PREFIX) and not gate.go.is_set():
                gate.go.set()  # the walk lists the store while the canary is in it
                assert gate.listed.wait(WAIT)
            return real_read(ks, buffers)

        monkeypatch.setattr(backend, "_read_into", read_into)
        health = backend.health(deep=True)
        assert health.healthy, health.detail
        assert not disk_objects(tmp_path)  # (the canary and its folders are gone)
        gate.finish.set()
        assert backend.wait_indexed(WAIT)
        assert backend.health().healthy
        assert (backend.resets, backend.used_bytes) == (0, 0)
    finally:
        gate.release()
        backend.close()


# Found by the review, fixed: a write renamed into place but not yet recorded (`_touch`) when
# the walk merges is counted twice (the walk's entry plus its reservation): the merge evicts
# an object the capacity had room for
def test_a_write_landing_as_the_walk_merges_is_not_counted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = keys(2, "ab")
    _seed(tmp_path, [a, b])
    gate = WalkGate(monkeypatch, tmp_path, before=True, after=False)
    backend = _backend(tmp_path, capacity_objects=3)
    (w,) = keys(1, "w")
    renamed, go_on = gate_call(
        monkeypatch, os, "replace",
        lambda src, dst: threading.current_thread().name != INDEXER
        and dst == backend.path_of(w), after=True)
    out: list[object] = []
    writer = threading.Thread(target=lambda: out.append(
        backend.put_from([w], Pool(1, seed=7).slots())))
    try:
        assert gate.started.wait(WAIT)
        writer.start()
        assert renamed.wait(WAIT)  # w's file is in place, its index entry not yet made
        gate.go.set()  # the walk finds a, b and w, and merges
        assert backend.wait_indexed(WAIT)
        go_on.set()
        writer.join(WAIT)
        assert out == [[PutStatus.STORED]]
        # Three objects in room for three: a, b and w all stay.
        assert _present(backend, [a, b, w]) == [1, 1, 1]
        assert backend.used_bytes == disk_bytes(tmp_path) == 3 * OBJECT
    finally:
        gate.release()
        go_on.set()
        writer.join(WAIT)
        backend.close()


# ============================================================= the merge's evictions


# Found by the review, fixed: a put of an object the walk's merge chose to evict (popped, in
# `_evicting`, not unlinked yet) answers PRESENT and records nothing; the unlink then removes
# it, so the caller counts an object in L3 that no one can read
def test_a_put_answered_present_during_the_merges_eviction_leaves_the_object_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = keys(3, "old")  # old[0] the oldest: the merge's victim
    _seed(tmp_path, old)
    monkeypatch.setattr(file_backend, "INDEX_WAIT_S", 0.0)
    victim_path: list[str] = []
    reached, go = gate_call(
        monkeypatch, os, "unlink",
        lambda path: threading.current_thread().name == INDEXER and [path] == victim_path)
    probe = FileBackend(FileStorageConfig(path=str(tmp_path)), 1.0)  # (names only)
    victim_path.append(probe.path_of(old[0]))
    probe.close()
    backend = _backend(tmp_path, capacity_objects=2)
    out: list[list[PutStatus]] = []
    putter = threading.Thread(target=lambda: out.append(
        backend.put_from(old[:1], Pool(1, seed=1).slots())))
    try:
        assert reached.wait(WAIT)  # the merge is about to unlink old[0]
        putter.start()  # (it waits for that unlink, then writes the object anew)
        putter.join(0.3)
        go.set()
        putter.join(WAIT)
        assert backend.wait_indexed(WAIT)
        assert out == [[PutStatus.STORED]]
        assert backend.get_into(old[:1], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        assert backend.used_bytes == disk_bytes(tmp_path)
    finally:
        go.set()
        if putter.is_alive():
            putter.join(WAIT)
        backend.close()


# ============================================================= temp files


def test_the_walk_keeps_a_live_writers_temp_file_and_removes_a_dead_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put in a thread of this process, its temp file written and not renamed yet,
    while the walk lists that very folder: the temp (this host, this pid, fresh) stays;
    a dead writer's temp beside it goes; the put answers STORED and reads back."""
    gate = WalkGate(monkeypatch, tmp_path, before=True, after=False)
    backend = _backend(tmp_path, capacity_objects=10)
    (w,) = keys(1, "w")
    path = backend.path_of(w)
    reached, go_on = gate_call(
        monkeypatch, os, "replace",
        lambda src, dst: threading.current_thread().name != INDEXER and dst == path)
    out: list[object] = []
    writer = threading.Thread(target=lambda: out.append(
        backend.put_from([w], Pool(1, seed=8).slots())))
    try:
        assert gate.started.wait(WAIT)
        writer.start()
        assert reached.wait(WAIT)
        (live,) = [os.path.join(os.path.dirname(path), n)
                   for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]
        dead = f"{path}.{backend._host}.{2**22 + 4321}.9.tmp"  # (no such pid)
        with open(dead, "wb") as f:
            f.write(b"\0" * 64)
        gate.go.set()
        assert backend.wait_indexed(WAIT)
        assert os.path.exists(live) and not os.path.exists(dead)
        go_on.set()
        writer.join(WAIT)
        assert out == [[PutStatus.STORED]]
        dst = Pool(1, seed=None)
        assert backend.get_into([w], dst.slots()) == [GetStatus.HIT]
        assert np.array_equal(dst.payload(0), Pool(1, seed=8).payload(0))
        assert backend.used_bytes == disk_bytes(tmp_path) == OBJECT
        assert not [n for _, _, ns in os.walk(tmp_path) for n in ns if n.endswith(".tmp")]
    finally:
        gate.release()
        go_on.set()
        writer.join(WAIT)
        backend.close()


# ============================================================= close during the walk


def _many_objects(root: Path, n: int, size: int = 100) -> None:
    probe = FileBackend(FileStorageConfig(path=str(root)), 1.0)  # (names only)
    data = b"\1" * size
    for key in keys(n, "many"):
        path = probe.path_of(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
        os.write(fd, data)
        os.close(fd)
    probe.close()


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in /dev/shm (tens of thousands of files are made in ~1 s there, several
    on a busy disk); `tmp_path` where there is none."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="hicache-s27-", dir="/dev/shm")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _count_stats(monkeypatch: pytest.MonkeyPatch, at: int) -> tuple[threading.Event, threading.Event]:
    """`reached` is set once the indexer thread makes its `at`-th lstat call, which then
    waits for `resume` (so the walk is surely under way when the test acts)."""
    real = os.lstat
    seen = [0]
    reached, resume = threading.Event(), threading.Event()

    def lstat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == INDEXER:
            seen[0] += 1
            if seen[0] == at:
                reached.set()
                resume.wait(WAIT)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    return reached, resume


def test_close_during_a_long_walk_stops_it_and_a_new_backend_indexes_the_store(
    fast_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = fast_dir
    n = 20_000
    _many_objects(tmp_path, n)
    monkeypatch.setattr(file_backend, "INDEX_WAIT_S", 0.0)
    midway, resume = _count_stats(monkeypatch, 2_000)
    first = _backend(tmp_path, capacity_objects=n)  # (room for all: nothing is evicted)
    assert midway.wait(WAIT) and first._indexer is not None and first._indexer.is_alive()
    t0 = time.perf_counter()
    first.close()
    assert time.perf_counter() - t0 < 0.5
    resume.set()  # (the walk goes on with the folder it was in)
    first._indexer.join(2.0)
    assert not first._indexer.is_alive()  # (stopped at its next folder)
    assert not first._lru and first.used_bytes == 0  # (no merge after the close)
    assert len(disk_objects(tmp_path)) == n  # (and nothing removed)

    second = _backend(tmp_path, capacity_objects=n)
    try:
        assert second.wait_indexed(30)
        assert len(second._lru) == n and second.used_bytes == 100 * n
        assert not [t for t in threading.enumerate() if t is first._indexer]
    finally:
        second.close()


# Found by the review, fixed: close() does not stop a walk that has listed its last folder: it
# returns, then the closed backend's merge evicts (unlinks) objects, here one a new backend on
# the same store had just read, leaving that backend's index counting a file that is gone
def test_a_closed_backends_walk_removes_nothing_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = keys(3, "old")  # old[0] oldest
    _seed(tmp_path, old)
    gate = WalkGate(monkeypatch, tmp_path, before=False, after=True)
    first = _backend(tmp_path, capacity_objects=2)  # (a smaller capacity: one must go)
    assert gate.listed.wait(WAIT)  # its walk has stat'ed the whole store
    first.close()  # (a reconnect: the storage layer is built again)
    second = _backend(tmp_path, capacity_objects=3)
    try:
        assert second.wait_indexed(WAIT)
        assert second.get_into(old[:1], Pool(1, seed=None).slots()) == [GetStatus.HIT]
        gate.finish.set()  # the closed backend's walk goes on to its merge
        assert first.wait_indexed(WAIT)
        assert _present(second, old) == [1, 1, 1]
        assert second.used_bytes == disk_bytes(tmp_path) == 3 * OBJECT
    finally:
        gate.release()
        second.close()


# Found by the review, fixed: close(wait_s) did not wait for the start's walk thread
def test_close_waits_for_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _many_objects(tmp_path, 300)
    monkeypatch.setattr(file_backend, "INDEX_WAIT_S", 0.0)
    real = os.lstat
    in_stat, go = threading.Event(), threading.Event()

    def lstat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == INDEXER and not in_stat.is_set():
            in_stat.set()  # one slow stat (a shared mount): ~0.3 s
            go.wait(0.3)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    backend = _backend(tmp_path)
    assert in_stat.wait(WAIT)
    try:
        # It waits for the walk (which then merges nothing) up to wait_s; its answer is
        # about calls only (the walk holds no caller's buffer: True keeps no memory).
        done = backend.close(wait_s=2.0)
        assert done is True and not backend._indexer.is_alive()  # type: ignore[union-attr]
    finally:
        go.set()
        assert backend._indexer is not None
        backend._indexer.join(WAIT)
