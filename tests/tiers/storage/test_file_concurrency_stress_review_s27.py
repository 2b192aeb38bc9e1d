"""Review (s27): a seeded, randomized stress of the file backend with a capacity.

Several threads put, get, check and delete objects of a small key space (40 keys, room
for 12 objects) on one `FileBackend`, so that evictions never stop and the same keys
collide across threads: puts wait for evictions and writes of their key under way
(`_await_quiet`), reads record uses while other threads evict, remove and write. A second
backend (no capacity) is started on the same directory mid-run, its walk racing the
traffic, and closed. The first backend's own start-time walk races the traffic too (the
store is seeded beforehand and `start` does not wait for the walk).

Each key has ONE fixed payload, so any HIT must return exactly it, whichever put of the
key stored it. The run is cut into phases; after each one (all threads joined, nothing
under way) the index is audited against the disk:

- `used_bytes` == the bytes of the `*.kv` files, and the index holds exactly those files;
- the disk holds at most the capacity; no temp file is left;
- no write, reservation or eviction is left under way (`_writing`, `_reserved`,
  `_evicting`);
- every indexed object reads back HIT with its key's payload.

During the run: no put answers FAILED (no fault is injected), no get answers CORRUPT or
a HIT of other bytes, no call raises, no call takes longer than a bound, and every thread
ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from file_kit import OBJECT, disk_bytes, gate_call, in_thread, sized_backend
from storage_pages import Pool, keys

from hicache.tiers.storage import HEADER_BYTES, GetStatus, PutStatus
from hicache.tiers.storage import file as file_backend
from hicache.tiers.storage.file import FileBackend

N_KEYS = 40
CAPACITY_OBJECTS = 12
TIMEOUT_S = 5.0
# A call may wait for its key's eviction or write PUT_ROUNDS times, each bounded by the
# timeout: anything longer is a thread stuck.
CALL_BOUND_S = TIMEOUT_S * file_backend.PUT_ROUNDS + 5.0
JOIN_BOUND_S = CALL_BOUND_S + 10.0


# ---------------------------------------------------------------------- helpers


def _backend(root: Path, capacity_objects: int | None, threads: int | None = None) -> FileBackend:
    return sized_backend(root, capacity_objects, timeout_s=TIMEOUT_S, threads=threads)


def _disk(root: Path) -> tuple[dict[str, int], list[str]]:
    """(digest -> bytes of each `*.kv` file, paths of the `*.tmp` files)."""
    objects: dict[str, int] = {}
    temps: list[str] = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".kv"):
                with contextlib.suppress(FileNotFoundError):
                    objects[name[: -len(".kv")]] = os.path.getsize(path)
            elif name.endswith(".tmp"):
                temps.append(path)
    return objects, temps


@dataclass
class Run:
    """What the threads of one run saw."""

    errors: list[str] = field(default_factory=list)  # broken promises, with their step
    wrong_bytes: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    ops: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, what: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(what)

    def timed(self, what: str, call: Callable[[], object]) -> object:
        t0 = time.monotonic()
        try:
            return call()
        except Exception as e:  # (no fault is injected: any raise is a finding)
            self.error(f"{what} raised {type(e).__name__}: {e}")
            return None
        finally:
            took = time.monotonic() - t0
            with self.lock:
                self.ops += 1
                self.slowest_s = max(self.slowest_s, took)
            if took > CALL_BOUND_S:
                self.error(f"{what} took {took:.1f} s")


class Store:
    """The key space, its fixed payloads and the model's checks."""

    def __init__(self, seed: int) -> None:
        self.keys = keys(N_KEYS, tag=f"stress{seed}")
        self.pool = Pool(N_KEYS, seed=seed)
        self.payloads = [self.pool.payload(i).copy() for i in range(N_KEYS)]

    def put_buffers(self) -> np.ndarray:
        """A thread's own copy of every key's object (a put writes the header into it)."""
        return self.pool.pages.copy()

    def check_hits(self, run: Run, where: str, idx: list[int], bufs: list[np.ndarray],
                   out: list[GetStatus]) -> None:
        for i, buf, status in zip(idx, bufs, out, strict=True):
            if status is GetStatus.CORRUPT:
                run.error(f"{where}: get of key {i} answered CORRUPT (no fault injected)")
            elif status is GetStatus.HIT and not np.array_equal(buf[HEADER_BYTES:], self.payloads[i]):
                with run.lock:
                    run.wrong_bytes.append(f"{where}: HIT of key {i} with other bytes")


def _worker(backend: FileBackend, store: Store, run: Run, rng: random.Random, name: str,
            until: float, mix: dict[str, int]) -> None:
    mine = store.put_buffers()
    gets = Pool(4, seed=None)
    ops, weights = list(mix), list(mix.values())
    while time.monotonic() < until:
        op = rng.choices(ops, weights)[0]
        n = rng.randint(1, 4)
        idx = [rng.randrange(N_KEYS) for _ in range(n)]
        ks = [store.keys[i] for i in idx]
        if op == "put":
            if len(set(idx)) != len(idx) and rng.random() < 0.5:
                idx = list(dict.fromkeys(idx))  # (mostly unique batches; some repeat keys)
                ks = [store.keys[i] for i in idx]
            bufs = [mine[i] for i in idx]  # (a repeated key comes with the same buffer)
            out = run.timed(f"{name} put {idx}", lambda ks=ks, bufs=bufs: backend.put_from(ks, bufs))
            if out is not None:
                assert isinstance(out, list)
                for i, status in zip(idx, out, strict=True):
                    if status is PutStatus.FAILED:
                        run.error(f"{name}: put of key {i} answered FAILED (no fault injected)")
        elif op == "get":
            idx = list(dict.fromkeys(idx))
            ks = [store.keys[i] for i in idx]
            bufs = gets.slots(range(len(idx)))
            out = run.timed(f"{name} get {idx}", lambda ks=ks, bufs=bufs: backend.get_into(ks, bufs))
            if out is not None:
                assert isinstance(out, list)
                store.check_hits(run, name, idx, bufs, out)
        elif op == "exists":
            got = run.timed(f"{name} exists {idx}", lambda ks=ks: backend.exists_prefix(ks))
            if got is not None and not (isinstance(got, int) and 0 <= got <= len(ks)):
                run.error(f"{name}: exists_prefix({idx}) answered {got!r}")
        elif op == "delete":
            got = run.timed(f"{name} delete {idx}", lambda ks=ks: backend.delete(ks))
            if got is not None and not (isinstance(got, int) and 0 <= got <= len(set(ks))):
                run.error(f"{name}: delete({idx}) answered {got!r}")
        elif op == "health":
            deep = rng.random() < 0.5
            h = run.timed(f"{name} health", lambda deep=deep: backend.health(deep=deep))
            if h is not None and not h.healthy:  # type: ignore[attr-defined]
                run.error(f"{name}: health(deep={deep}) unhealthy: {h.detail}")  # type: ignore[attr-defined]


def _second_backend(root: Path, store: Store, run: Run, rng: random.Random) -> None:
    """Another daemon on the same directory (no capacity: it removes nothing): its walk
    races the first's traffic; it reads a little meanwhile, then closes (sometimes before
    its walk is done)."""
    other = _backend(root, None)
    try:
        bufs = Pool(2, seed=None).slots()
        for _ in range(rng.randint(0, 20)):
            idx = rng.sample(range(N_KEYS), 2)
            out = run.timed("second get", lambda idx=idx: other.get_into(
                [store.keys[i] for i in idx], bufs))
            if out is not None:
                assert isinstance(out, list)
                store.check_hits(run, "second", idx, bufs, out)
        if rng.random() < 0.7 and not other.wait_indexed(JOIN_BOUND_S):
            run.error("the second backend's walk did not end")
    finally:
        other.close(wait_s=JOIN_BOUND_S)
        if not other.wait_indexed(0):
            run.error("the second backend's walk outlived its close")


def _audit(backend: FileBackend, root: Path, store: Store, phase: int
           ) -> tuple[list[str], list[str]]:
    """Nothing under way: the index against the disk. Returns the broken invariants: those
    the races below break (`drift`: the index and the disk apart), and the others."""
    bad: list[str] = []
    drift: list[str] = []
    with backend._lock:
        writing, reserved = dict(backend._writing), backend._reserved
        evicting, lru, used = set(backend._evicting), dict(backend._lru), backend._used
    objects, temps = _disk(root)
    if writing:
        bad.append(f"phase {phase}: writes left under way: {writing}")
    if reserved:
        bad.append(f"phase {phase}: {reserved} bytes left reserved")
    if evicting:
        bad.append(f"phase {phase}: evictions left under way: {evicting}")
    if temps:
        bad.append(f"phase {phase}: temp files left: {temps}")
    if used != sum(lru.values()):
        bad.append(f"phase {phase}: used_bytes {used} != the index's sum {sum(lru.values())}")
    disk_bytes = sum(objects.values())
    if used != disk_bytes:
        drift.append(f"phase {phase}: used_bytes {used} != {disk_bytes} bytes of objects on disk")
    phantom = sorted(set(lru) - set(objects))
    untracked = sorted(set(objects) - set(lru))
    if phantom:
        drift.append(f"phase {phase}: indexed but not on disk: {phantom}")
    if untracked:
        drift.append(f"phase {phase}: on disk but not indexed: {untracked}")
    assert backend.capacity_bytes is not None
    if disk_bytes > backend.capacity_bytes:
        drift.append(f"phase {phase}: {disk_bytes} bytes on disk > capacity {backend.capacity_bytes}")
    by_digest = {os.path.basename(backend.path_of(k))[: -len(".kv")]: i
                 for i, k in enumerate(store.keys)}
    foreign = sorted(h for h in lru if h not in by_digest)
    if foreign:
        bad.append(f"phase {phase}: index holds objects of no key of ours: {foreign}")
    idx = [by_digest[h] for h in lru if h in by_digest and h in objects]
    if idx:
        bufs = Pool(len(idx), seed=None).slots()
        out = backend.get_into([store.keys[i] for i in idx], bufs)
        for i, buf, status in zip(idx, bufs, out, strict=True):
            if status is not GetStatus.HIT:
                bad.append(f"phase {phase}: indexed key {i} reads back {status.value}")
            elif not np.array_equal(buf[HEADER_BYTES:], store.payloads[i]):
                bad.append(f"phase {phase}: indexed key {i} reads back other bytes")
    return bad, drift


def _stress(root: Path, monkeypatch: pytest.MonkeyPatch, seed: int, *, threads: int,
            phases: int, phase_s: float, mix: dict[str, int], file_threads: int | None,
            second: bool) -> tuple[Run, list[str], list[str], FileBackend]:
    rng = random.Random(seed)
    store = Store(seed)
    # A store seeded with half the keys (more than the capacity): the first backend's walk
    # indexes it, and evicts down to the capacity, while the traffic already runs.
    seeder = _backend(root, None)
    seeded = sorted(rng.sample(range(N_KEYS), N_KEYS // 2))
    assert seeder.put_from([store.keys[i] for i in seeded],
                           [store.put_buffers()[i] for i in seeded]) == [PutStatus.STORED] * len(seeded)
    seeder.close()
    monkeypatch.setattr(file_backend, "INDEX_WAIT_S", 0.0)  # (start does not wait for the walk)
    backend = _backend(root, CAPACITY_OBJECTS, threads=file_threads)
    run = Run()
    broken: list[str] = []
    drift: list[str] = []
    second_phase = rng.randrange(phases) if second else -1
    try:
        for phase in range(phases):
            until = time.monotonic() + phase_s
            workers = [threading.Thread(
                target=_worker, name=f"stress-{phase}-{t}",
                args=(backend, store, run, random.Random(seed * 1000 + phase * 100 + t),
                      f"p{phase}t{t}", until, mix), daemon=True)
                for t in range(threads)]
            if phase == second_phase:
                workers.append(threading.Thread(
                    target=_second_backend, name=f"stress-{phase}-second",
                    args=(root, store, run, random.Random(seed + 7)), daemon=True))
            for w in workers:
                w.start()
            deadline = time.monotonic() + phase_s + JOIN_BOUND_S
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
            stuck = [w.name for w in workers if w.is_alive()]
            assert not stuck, f"threads still running {JOIN_BOUND_S:.0f} s after the phase: {stuck}"
            if phase == 0:
                assert backend.wait_indexed(JOIN_BOUND_S), "the first backend's walk did not end"
            bad, apart = _audit(backend, root, store, phase)
            broken += bad
            drift += apart
    except BaseException:
        backend.close()
        raise
    return run, broken, drift, backend


# ---------------------------------------------------------------------- tests


STRESS_MIX = {"put": 40, "get": 35, "exists": 15, "delete": 8, "health": 2}
STRESS_CASES = [(1, None), (2, 4), (3, None)]  # (seed, storage.file.threads)
# A deep health check whose canary puts of other threads evicted before its read-back
# (test_a_deep_health_check_is_not_failed_by_puts_evicting_its_canary, below).
CANARY_EVICTED = "canary written but not found"


def _stress_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
                file_threads: int | None) -> tuple[Run, list[str], list[str], FileBackend]:
    return _stress(tmp_path, monkeypatch, seed, threads=6, phases=4, phase_s=0.6,
                   mix=STRESS_MIX, file_threads=file_threads, second=True)


@pytest.mark.parametrize(("seed", "file_threads"), STRESS_CASES)
def test_random_concurrent_traffic_fails_no_put_and_leaves_nothing_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, file_threads: int | None
) -> None:
    """Every invariant but the index's agreement with the disk (next test)."""
    run, broken, _, backend = _stress_run(tmp_path, monkeypatch, seed, file_threads)
    try:
        assert run.ops > 100, f"only {run.ops} calls ran"
        errors = [e for e in run.errors if CANARY_EVICTED not in e]
        assert not errors, "\n".join(errors)
        assert not run.wrong_bytes, "\n".join(run.wrong_bytes)
        assert not broken, "\n".join(broken)
        stats = backend.stats()
        assert stats.put_failed == 0 and stats.corrupt == 0 and stats.unavailable == 0
        assert stats.evicted > 0, "the run never evicted: the capacity was never reached"
    finally:
        assert backend.close(wait_s=JOIN_BOUND_S)


# Found by the review, fixed: BUG (fails in some runs, not all: a race): the index records
# uses and forgets objects after the file operation, outside the lock (file.py l.560, l.618,
# l.634-635, l.528-531): phantoms and untracked files survive to the end of a phase; the
# deterministic tests below force each race
@pytest.mark.parametrize(("seed", "file_threads"), STRESS_CASES)
def test_random_concurrent_traffic_keeps_the_index_equal_to_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, file_threads: int | None
) -> None:
    """After each phase: used_bytes == the bytes of the objects on disk, the index holds
    exactly the files on disk, and the disk holds at most the capacity."""
    run, _, drift, backend = _stress_run(tmp_path, monkeypatch, seed, file_threads)
    try:
        assert run.ops > 100, f"only {run.ops} calls ran"
        assert not drift, "\n".join(drift)
    finally:
        assert backend.close(wait_s=JOIN_BOUND_S)


READ_MIX = {"put": 35, "get": 55, "delete": 10}


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_gets_racing_puts_evictions_and_deletes_never_return_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Only what the readers saw is judged here (the index is audited above)."""
    run, _, _, backend = _stress(tmp_path, monkeypatch, seed, threads=8, phases=2,
                              phase_s=0.8, mix=READ_MIX, file_threads=None, second=True)
    try:
        assert run.ops > 100, f"only {run.ops} calls ran"
        assert not run.wrong_bytes, "\n".join(run.wrong_bytes)
        assert not [e for e in run.errors if "CORRUPT" in e or "raised" in e], "\n".join(run.errors)
        assert backend.stats().corrupt == 0
    finally:
        assert backend.close(wait_s=JOIN_BOUND_S)


# ---------------------------------------------------------------------- the races it found
#
# Each one forced with a gate (never a sleep). They share a cause: the index records a use
# (a read's hit, a put's PRESENT or STORED) or forgets an object AFTER the file operation
# that justified it, outside the lock, so a remove, an eviction or a write that ran in
# between is undone: the index ends up holding an object no disk holds (a phantom: its
# bytes counted, a good object evicted for its room) or missing one the disk holds (an
# untracked file: never evicted, the disk grows past the capacity).


# Found by the review, fixed: file.py _read_sync l.560 records a hit via _touch after the
# read, outside the lock; an eviction whose unlink completed meanwhile (so _evicting no longer
# holds it) is undone: the index keeps an object no disk holds and evicts a good one for its
# room
def test_a_read_that_outlives_its_objects_eviction_does_not_record_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for 2: a (least recent), b. A read of a has read its bytes (not recorded yet)
    when a put of c evicts a and unlinks it. The read's record then brings a back into the
    index, and b, a good object, is evicted for a's room."""
    backend = _backend(tmp_path, 2)
    a, b, c = keys(3, "evictread")
    try:
        assert backend.put_from([a, b], Pool(2, seed=1).slots()) == [PutStatus.STORED] * 2
        reached, go = gate_call(monkeypatch, file_backend, "_read_object", after=True)
        reader, got = in_thread(lambda: backend.get_into([a], Pool(1, seed=None).slots()))
        assert reached.wait(10.0)  # a's bytes are read, its use not recorded yet
        assert backend.put_from([c], Pool(1, seed=3).slots()) == [PutStatus.STORED]
        assert not os.path.exists(backend.path_of(a))  # evicted: unlinked, the eviction over
        go.set()
        reader.join(10.0)
        assert got == [[GetStatus.HIT]]  # (its bytes were read whole: a hit is right)
        assert backend.used_bytes == disk_bytes(tmp_path), "the index counts an object no disk holds"
        assert [backend.exists_prefix([k]) for k in (a, b, c)] == [0, 1, 1], \
            "b was evicted for the room of a, which is gone"
    finally:
        go.set()
        backend.close()


# Found by the review, fixed: file.py _read_sync l.560 records a hit via _touch after the
# read, outside the lock; a delete (_remove_sync l.684-701: unlink and index pop under the
# lock) that ran in between is undone: the index keeps the deleted object
def test_a_read_that_outlives_a_delete_of_its_object_does_not_record_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tmp_path, 4)
    a, b = keys(2, "deleteread")
    try:
        assert backend.put_from([a, b], Pool(2, seed=1).slots()) == [PutStatus.STORED] * 2
        reached, go = gate_call(monkeypatch, file_backend, "_read_object", after=True)
        reader, got = in_thread(lambda: backend.get_into([a], Pool(1, seed=None).slots()))
        assert reached.wait(10.0)
        assert backend.delete([a]) == 1
        go.set()
        reader.join(10.0)
        assert got == [[GetStatus.HIT]]
        assert backend.used_bytes == disk_bytes(tmp_path) == OBJECT, \
            "the index counts the deleted object"
    finally:
        go.set()
        backend.close()


# Found by the review, fixed: file.py _present_or_reserve (l.634-639): _holds_whole looks at
# the file outside the lock, then _present_or_busy records it; a delete in between leaves the
# index holding the deleted object (and the put answers PRESENT for it)
def test_a_put_found_present_as_a_delete_removes_it_does_not_index_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tmp_path, 4)
    (a,) = keys(1, "deletepresent")
    try:
        assert backend.put_from([a], Pool(1, seed=1).slots()) == [PutStatus.STORED]
        reached, go = gate_call(monkeypatch, file_backend, "_holds_whole", after=True)
        putter, got = in_thread(lambda: backend.put_from([a], Pool(1, seed=1).slots()))
        assert reached.wait(10.0)  # the put found a whole, not recorded yet
        assert backend.delete([a]) == 1
        go.set()
        putter.join(10.0)
        # Either order is linearizable: put then delete (PRESENT, nothing left), or delete
        # then put (the put looks again and writes it anew): the index counts the disk.
        assert got in ([[PutStatus.PRESENT]], [[PutStatus.STORED]])
        left = 0 if got == [[PutStatus.PRESENT]] else OBJECT
        assert backend.used_bytes == disk_bytes(tmp_path) == left, \
            "the index counts the deleted object"
    finally:
        go.set()
        backend.close()


# Found by the review, fixed: file.py _write_sync l.618: the write's _touch(wrote=True)
# records the object after os.replace, outside the lock; a delete between the rename and the
# record (which unlinks the new file and pops nothing) is undone: the index keeps the deleted
# object
def test_a_write_recorded_after_a_delete_removed_its_file_does_not_index_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tmp_path, 4)
    (a,) = keys(1, "deletewrite")
    try:
        reached, go = gate_call(monkeypatch, os, "replace", after=True,
                                when=lambda src, dst: dst == backend.path_of(a))
        putter, got = in_thread(lambda: backend.put_from([a], Pool(1, seed=1).slots()))
        assert reached.wait(10.0)  # renamed into place, not recorded yet
        assert backend.delete([a]) == 1
        go.set()
        putter.join(10.0)
        assert got == [[PutStatus.STORED]]
        assert backend._writing == {} and backend._reserved == 0
        assert backend.used_bytes == disk_bytes(tmp_path) == 0, \
            "the index counts the deleted object"
    finally:
        go.set()
        backend.close()


# Found by the review, fixed: file.py _read_sync l.528-531 / _forget l.419-425: a read that
# found no file forgets the key later, outside the lock, without looking again; a put that
# wrote and recorded the key in between loses its entry: its file is never evicted and the
# disk grows past the capacity
def test_a_miss_forgotten_after_a_put_recorded_the_key_does_not_untrack_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for 2. A read of a finds no file; before it forgets a, a put stores a. The
    forget drops the new entry: a's file is on disk but not indexed, so two more puts
    leave three objects on a disk with room for two."""
    backend = _backend(tmp_path, 2)
    a, b, c = keys(3, "forget")
    try:
        reached, go = gate_call(monkeypatch, backend, "_forget", after=False)
        reader, got = in_thread(lambda: backend.get_into([a], Pool(1, seed=None).slots()))
        assert reached.wait(10.0)  # the read found no file of a, not forgotten yet
        assert backend.put_from([a], Pool(1, seed=1).slots()) == [PutStatus.STORED]
        go.set()
        reader.join(10.0)
        assert got == [[GetStatus.MISS]]
        assert backend.used_bytes == disk_bytes(tmp_path) == OBJECT, "a's file is not indexed"
        assert backend.put_from([b, c], Pool(2, seed=2).slots()) == [PutStatus.STORED] * 2
        assert disk_bytes(tmp_path) <= backend.capacity_bytes, "the disk holds more than the capacity"
    finally:
        go.set()
        backend.close()


# Found by the review, fixed: base.py _canary_in l.596-602 with file.py's capacity: the deep
# health check's canary is an ordinary LRU object; puts that need room between its write and
# its read-back evict it, and the check reports a store that takes writes as unavailable
# ('canary written but not found')
def test_a_deep_health_check_is_not_failed_by_puts_evicting_its_canary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tmp_path, 3)
    others = keys(3, "canary")
    real_read_into = backend._read_into

    def read_into(ks, bufs):  # type: ignore[no-untyped-def]
        if ks[0].startswith(file_backend.CANARY_PREFIX):  # (other daemons' traffic meanwhile)
            assert backend.put_from(others, Pool(3, seed=2).slots()) == [PutStatus.STORED] * 3
        return real_read_into(ks, bufs)

    monkeypatch.setattr(backend, "_read_into", read_into)
    try:
        h = backend.health(deep=True)
        assert h.healthy, h.detail
    finally:
        backend.close()
