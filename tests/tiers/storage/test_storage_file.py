"""File backend specifics: fan-out, capacity eviction order, atomic writes, errors, mounts."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from storage_pages import Pool, keys
from unprivileged import as_nobody

from hicache.config import FileStorageConfig
from hicache.errors import BackendUnavailable
from hicache.tiers.storage import HEADER_BYTES, GetStatus, PutStatus
from hicache.tiers.storage import file as file_backend
from hicache.tiers.storage.fanout import SHARED_FS_THREADS, FileThreads, exists_rounds
from hicache.tiers.storage.file import STALE_TEMP_S, FileBackend
from hicache.tiers.storage.mounts import fs_type_of, is_shared_fs, parse_mountinfo

OBJECT = HEADER_BYTES + 4096


def _backend(path: Path, capacity_objects: int | None = None) -> FileBackend:
    cap = None if capacity_objects is None else capacity_objects * OBJECT / (1 << 30)
    backend = FileBackend(FileStorageConfig(path=str(path), capacity_gb=cap), timeout_s=2.0)
    backend.start()
    return backend


def test_keys_with_slashes_map_to_fanned_out_digest_names(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    key = "ns:a/../b//c:full:tp0:v1"
    path = Path(backend.path_of(key))
    assert path.parent.parent.parent == tmp_path and len(path.name) == 32 + len(".kv")
    backend.put_from([key], Pool(1).slots())
    assert path.is_file() and path.stat().st_size == OBJECT


def test_capacity_evicts_the_least_recently_used(tmp_path: Path) -> None:
    backend = _backend(tmp_path, capacity_objects=3)
    pool = Pool(4)
    k = keys(4)
    backend.put_from(k[:3], pool.slots([0, 1, 2]))
    assert backend.get_into([k[0]], Pool(1, seed=None).slots()) == [GetStatus.HIT]  # k0 is fresh

    backend.put_from([k[3]], pool.slots([3]))  # over capacity: k1 is the oldest use
    assert [backend.exists_prefix([key]) for key in k] == [1, 0, 1, 1]
    assert backend.used_bytes == 3 * OBJECT


def test_removing_an_object_whose_file_is_gone_drops_it_from_the_capacity_index(
    tmp_path: Path,
) -> None:
    """Two readers of a corrupt object both remove it; the slower one found it (and put
    it back in the index) after the faster one removed file and entry. Its removal finds
    no file and must still drop the entry, or the capacity count keeps a phantom (found
    by a review)."""
    backend = _backend(tmp_path, capacity_objects=3)
    (key,) = keys(1)
    backend.put_from([key], Pool(1).slots())
    os.unlink(backend.path_of(key))  # the faster remover's unlink; the entry is still there
    assert backend.used_bytes == OBJECT
    assert backend.delete([key]) == 0
    assert backend.used_bytes == 0


def test_evictions_count_pages_by_the_key_tail_they_were_given(tmp_path: Path) -> None:
    """`count_pages_of(tail)`: of the evicted objects, those whose key ends with `tail`
    are pages (one member's objects); objects removed by someone else (the eviction finds
    no file) are no eviction, and the page set holds indexed objects only."""
    backend = _backend(tmp_path, capacity_objects=4)
    backend.count_pages_of("/kv/tp0of1")
    names = [f"hc2/ns/m/{i:032x}/{member}/tp0of1" for i in range(4) for member in ("kv", "swa")]
    backend.put_from(names[:4], Pool(4).slots())  # pages 0 and 1: kv + swa each
    os.unlink(backend.path_of(names[0]))  # another node removed page 0's kv object
    backend.put_from(names[4:], Pool(4, seed=3).slots())  # evicts all four older ones
    stats = backend.stats()
    assert (stats.evicted, stats.evicted_pages) == (3, 1)  # page 1's kv; page 0's was gone
    assert backend._pages <= set(backend._lru) and len(backend._pages) == 2
    backend.put_from([f"hc2/ns/m/{9:032x}/kv/tp1of2"], Pool(1).slots())  # another rank's
    assert backend.stats().evicted_pages == 2  # (it evicted page 2's kv object)
    assert len(backend._pages) == 1


def _files(path: Path) -> int:
    return sum(name.endswith(".kv") for _, _, names in os.walk(path) for name in names)


def test_a_read_that_finds_the_file_gone_drops_it_from_the_capacity_index(tmp_path: Path) -> None:
    """Another node removed an object this node had indexed (its own eviction, a corrupt
    object's removal). The miss used to leave the entry: its bytes stayed counted, and
    this node evicted a good object it had room for (found by a review)."""
    a, b = _backend(tmp_path, capacity_objects=3), _backend(tmp_path, capacity_objects=3)
    k = keys(4)
    a.put_from(k[:3], Pool(3).slots())
    assert b.delete([k[2]]) == 1
    assert a.get_into([k[2]], Pool(1, seed=None).slots()) == [GetStatus.MISS]
    assert a.used_bytes == 2 * OBJECT
    a.put_from([k[3]], Pool(1, seed=5).slots())
    assert [a.exists_prefix([key]) for key in k] == [1, 1, 0, 1]  # k0 kept: there was room
    assert a.used_bytes == 3 * OBJECT == _files(tmp_path) * OBJECT


def test_a_read_during_an_eviction_does_not_record_the_evicted_object_again(tmp_path: Path) -> None:
    """A writer takes its victim out of the index under the lock and unlinks it after; a
    reader between the two used to record the victim again, so the index kept an object
    whose file the writer then removed. The writer's steps are run by hand, in order."""
    backend = _backend(tmp_path, capacity_objects=2)
    k = keys(2)
    backend.put_from(k, Pool(2).slots())
    w = "ff" * 16  # (the digest of the object the writer writes)
    victims = backend._reserve(w, OBJECT)  # the writer makes room: k0 leaves the index
    assert backend.get_into([k[0]], Pool(1, seed=None).slots()) == [GetStatus.HIT]  # the reader
    backend._unlink(victims)
    backend._unreserve(w, OBJECT)
    assert backend.used_bytes == OBJECT == _files(tmp_path) * OBJECT
    assert backend.exists_prefix([k[0]]) == 0 and not backend._evicting and not backend._writing


def test_index_is_rebuilt_from_mtimes_at_start(tmp_path: Path) -> None:
    first = _backend(tmp_path)
    k = keys(3)
    first.put_from(k, Pool(3).slots())
    for age, key in zip((10, 30, 20), k, strict=True):  # k1 oldest, then k2, then k0
        os.utime(first.path_of(key), (1e9 - age, 1e9 - age))

    second = _backend(tmp_path, capacity_objects=3)
    assert second.used_bytes == 3 * OBJECT
    second.put_from(keys(1), Pool(1).slots())
    assert [second.exists_prefix([key]) for key in k] == [1, 0, 1]


def test_a_write_is_invisible_until_renamed_and_a_failed_one_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tmp_path)
    key = keys(1)[0]
    seen: list[int] = []
    real_replace = os.replace

    def replace_after_looking(src: str, dst: str) -> None:
        seen.append(backend._exists_sync([key])[0])  # mid-write: the object is not there
        seen.append(os.path.getsize(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_looking)
    assert backend.put_from([key], Pool(1).slots()) == [PutStatus.STORED]
    assert seen == [False, OBJECT]

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(BackendUnavailable, match="EIO"):
        backend.put_from(keys(1), Pool(1).slots())
    leftovers = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and not p.name.startswith(Path(backend.path_of(key)).name)
    ]
    assert leftovers == []


def test_a_root_without_write_permission_fails_writes_not_the_store(tmp_path: Path) -> None:
    """A read-only folder, written by an unprivileged process (root ignores permissions,
    so a forked child drops to `nobody` first). Under /tmp: pytest's tmp_path is private.
    The writes fail (the write breaker's part) but the store is not down: what it holds is
    still read; the deep check's canary is refused, and says the root is not writable."""
    store = Path(tempfile.mkdtemp(prefix="hicache-ro-"))
    store.chmod(0o555)
    # The same calls once here, so that the child (which may not read root's interpreter
    # files) imports nothing lazily.
    _backend(tmp_path).put_from(keys(1), Pool(1).slots())
    _backend(tmp_path).health(deep=True)

    def unprivileged() -> str:
        backend = _backend(store)
        try:
            report = ",".join(s.value for s in backend.put_from(keys(1), Pool(1).slots()))
        except BackendUnavailable as e:
            report = f"unavailable {e}"
        health = backend.health(deep=True)
        return report + f"; healthy {health.healthy}; {health.detail}"

    try:
        report = as_nobody(unprivileged)
    finally:
        store.rmdir()
    assert report.startswith("failed; healthy False; file: canary write refused"), report
    assert "not writable: backups fail" in report, report


def test_warns_when_the_directory_is_not_on_a_shared_mount(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hicache.tiers.storage.file"):
        _backend(tmp_path)
    fstype = fs_type_of(str(tmp_path))
    warned = [
        r for r in caplog.records if r.levelno == logging.WARNING and "NOT shared" in r.message
    ]
    assert bool(warned) == (not is_shared_fs(fstype))


MOUNTINFO = textwrap.dedent("""\
    22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
    30 22 0:40 / /mnt/shared rw,relatime shared:2 - nfs4 server:/export rw
    31 30 0:41 / /mnt/shared/local\\040dir rw - tmpfs tmpfs rw
    32 22 0:42 / /mnt/fuse rw - fuse.juicefs JuiceFS:vol rw
""")


@pytest.mark.parametrize(
    ("path", "fstype", "shared"),
    [
        ("/var/cache/hicache", "ext4", False),
        ("/mnt/shared/hicache", "nfs4", True),
        ("/mnt/shared/local dir/x", "tmpfs", False),
        ("/mnt/fuse/kv", "fuse.juicefs", True),
    ],
)
def test_mount_type_is_taken_from_the_longest_mount_point(
    path: str, fstype: str, shared: bool
) -> None:
    assert fs_type_of(path, MOUNTINFO) == fstype
    assert is_shared_fs(fstype) is shared
    assert len(parse_mountinfo(MOUNTINFO)) == 4


def test_a_hung_mount_fails_every_call_within_the_timeout_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount that stops answering (e.g. NFS) blocks syscalls: existence checks, reads
    and writes each reach it and fail within the timeout instead of hanging the caller;
    once it answers again, calls go through."""
    import threading
    import time

    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=0.5)
    backend.start()
    stored = keys(2)
    assert backend.put_from(stored, Pool(2).slots()) == [PutStatus.STORED] * 2
    real_access, real_open = os.access, os.open
    calls = (
        lambda: backend.exists_prefix(stored),
        lambda: backend.get_into(stored, Pool(2, seed=None).slots()),
        lambda: backend.put_from(keys(1), Pool(1).slots()),
    )
    for call in calls:
        gate, reached = threading.Event(), threading.Event()

        def hung(real, gate=gate, reached=reached):  # type: ignore[no-untyped-def]
            def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
                reached.set()
                gate.wait(30)
                return real(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(os, "access", hung(real_access))
        monkeypatch.setattr(os, "open", hung(real_open))
        try:
            t0 = time.monotonic()
            with pytest.raises(BackendUnavailable):
                call()
            assert time.monotonic() - t0 < 0.5 + 2.0
            assert reached.is_set(), "the call failed before it reached the mount"
        finally:
            monkeypatch.undo()
            gate.set()
        deadline = time.monotonic() + 10
        while backend.stats().stuck_calls:  # the stuck call returns once the mount answers
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert backend.exists_prefix(stored) == 2
    backend.close()


@pytest.mark.parametrize("junk", ["directory", "fifo", "symlink"])
def test_something_else_at_an_object_path_is_that_key_corrupt_not_a_dead_store(
    tmp_path: Path, junk: str
) -> None:
    """Anyone who can write to a shared directory can leave a directory, a FIFO or a link
    where an object belongs: that key reads as corrupt (zeroed, counted), the rest of the
    batch still hits, and nothing blocks (a FIFO opened for reading would)."""
    backend = _backend(tmp_path / "store")
    ks = keys(3)
    src, dst = Pool(3, seed=1), Pool(3, seed=9)
    assert backend.put_from([ks[0], ks[2]], src.slots([0, 2])) == [PutStatus.STORED] * 2
    path = backend.path_of(ks[1])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if junk == "directory":
        os.mkdir(path)
    elif junk == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(backend.path_of(ks[0]), path)  # a valid object, but someone else's key
    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT, GetStatus.HIT]
    assert not dst.pages[1].any()
    assert (dst.pages[2] == src.pages[2]).all()
    assert backend.stats().corrupt == 1
    # Not ours: left in place (a FIFO reads as empty, which used to pass for an object a
    # crash left empty, and was removed).
    assert os.path.lexists(path) and backend.stats().corrupt_removed == 0
    assert backend.health().healthy
    backend.close()


def test_a_vanished_object_on_a_shared_mount_is_a_miss_not_a_dead_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS: another node unlinked an object this node opened (its capacity eviction, a
    corrupt object's removal): the read fails with ESTALE. That object is gone, as if the
    open had not found it; the batch's other objects still hit, the store stays up."""
    backend = _backend(tmp_path)
    src, dst = Pool(3, seed=1), Pool(3, seed=None)
    ks = keys(3)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * 3
    real_open, real_readv = os.open, os.readv
    stale_open, stale_read = backend.path_of(ks[0]), backend.path_of(ks[1])

    def open_(path: str, flags: int, *args: int) -> int:
        if path == stale_open:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real_open(path, flags, *args)

    def readv(fd: int, buffers: list[memoryview]) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == stale_read:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "readv", readv)
    assert backend.get_into(ks, dst.slots()) == [GetStatus.MISS, GetStatus.MISS, GetStatus.HIT]
    assert (dst.pages[2] == src.pages[2]).all()
    assert backend.used_bytes == OBJECT  # the two gone objects left the capacity index


def test_an_empty_object_left_by_a_crash_is_removed_so_a_good_copy_can_be_stored(
    tmp_path: Path,
) -> None:
    """Without fsync (the default) a crash after the rename can leave an empty file. It is
    nobody's valid object (every one has a 64-byte header): removed at its read, so the
    next put stores the page again (left, every put answered PRESENT: the key was lost to
    L3 for good, on every node)."""
    writer, reader = _backend(tmp_path), _backend(tmp_path)  # two nodes, one directory
    src, dst = Pool(3, seed=1), Pool(3, seed=None)
    ks = keys(3)
    assert writer.put_from(ks, src.slots()) == [PutStatus.STORED] * 3
    os.truncate(writer.path_of(ks[1]), 0)
    assert reader.get_into(ks, dst.slots()) == [GetStatus.HIT, GetStatus.CORRUPT, GetStatus.HIT]
    assert reader.stats().corrupt_removed == 1 and not os.path.exists(writer.path_of(ks[1]))
    assert reader.put_from(ks, src.slots()) == [PutStatus.PRESENT, PutStatus.STORED, PutStatus.PRESENT]
    assert writer.get_into(ks, dst.slots()) == [GetStatus.HIT] * 3


def test_a_restart_removes_its_hosts_dead_writers_temp_files_whatever_their_age(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon killed between a temp file's creation and its rename, restarted within
    seconds (Kubernetes): its leftovers are too young for the age rule (STALE_TEMP_S) and
    used to stay until some later restart. This host's temp files whose writer process is
    gone (or is a previous incarnation with this pid) go at start; a live writer's, and
    another host's young ones, stay; anyone's older than STALE_TEMP_S go."""
    first = _backend(tmp_path)
    # (its own start's walk sweeps temp files too: let it end before planting them)
    assert first.wait_indexed(10)
    (k,) = keys(1)
    host = first._host
    base = first.path_of(k)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    dead_pid = 2**22 + 12345  # above any pid_max default: no such process
    now = time.time()
    temps = {
        "dead": (f"{base}.{host}.{dead_pid}.7.tmp", now),
        "live": (f"{base}.{host}.{os.getppid()}.7.tmp", now),  # (the test runner's parent)
        "this process, before it started": (f"{base}.{host}.{os.getpid()}.7.tmp", now - 3600),
        "other host": (f"{base}.otherhost.{dead_pid}.7.tmp", now),
        "other host, old": (f"{base}.otherhost.4242.7.tmp", now - STALE_TEMP_S - 60),
        "old naming": (f"{base}.{dead_pid}.7.tmp", now),
    }
    for path, mtime in temps.values():
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        os.utime(path, (mtime, mtime))
    restarted = _backend(tmp_path)
    assert restarted.wait_indexed(10)  # (the walk that sweeps them runs in the background)
    left = {name for name, (path, _) in temps.items() if os.path.exists(path)}
    assert left == {"live", "other host", "old naming"}
    # Its own writes carry the host: two nodes' writers with one pid never share a name.
    renamed: list[str] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        renamed.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert restarted.put_from(keys(1), Pool(1).slots()) == [PutStatus.STORED]
    assert host and "." not in host and f".{host}.{os.getpid()}." in renamed[0]


def test_threads_follow_the_filesystem_unless_configured(tmp_path: Path, monkeypatch) -> None:
    many = SHARED_FS_THREADS
    assert FileThreads.resolve(None, shared=False) == FileThreads(1, 1, 2, min_part=16)
    assert FileThreads.resolve(None, shared=True) == FileThreads(many, many, many, min_part=1)
    assert FileThreads.resolve(4, shared=False) == FileThreads(4, 4, 4, min_part=16)
    assert FileThreads.resolve(4, shared=True) == FileThreads(4, 4, 4, min_part=1)
    monkeypatch.setattr(file_backend, "is_shared_fs", lambda _fstype: False)
    assert _backend(tmp_path / "local").threads == FileThreads.resolve(None, shared=False)
    monkeypatch.setattr(file_backend, "is_shared_fs", lambda _fstype: True)  # as on an NFS mount
    shared = _backend(tmp_path / "shared")
    assert shared.threads == FileThreads.resolve(None, shared=True)
    pool = Pool(40)
    k = keys(40)
    assert shared.put_from(k, pool.slots()) == [PutStatus.STORED] * 40
    assert shared.exists_prefix(k) == 40
    back = Pool(40, seed=None)
    assert shared.get_into(k, back.slots()) == [GetStatus.HIT] * 40
    assert (back.memory == pool.memory).all()


@pytest.mark.parametrize("threads", [2, 4, 16])
def test_existence_rounds_cover_the_keys_and_check_few_past_a_miss(threads: int) -> None:
    for total in (0, 1, 2, 17, 100, 512):
        rounds = list(exists_rounds(total, threads))
        sizes = [n for _, n in rounds]
        assert [lo for lo, _ in rounds] == list(itertools.accumulate(sizes[:-1], initial=0))[: len(rounds)]
        assert sum(n for _, n in rounds) == total and all(n > 0 for _, n in rounds)
        if total > 1:
            assert rounds[0] == (0, 1) and rounds[1][1] == min(threads, total - 1)
        for miss in range(total):  # a miss ends its round: at most this much is checked past it
            end = next(lo + n for lo, n in rounds if miss < lo + n)
            assert end - (miss + 1) <= max(miss, threads - 1)


class _Checks:
    """`os.access` counted, each check taking `delay` seconds (a network filesystem's
    round trip), with the most that ran at once."""

    def __init__(self, delay: float = 0.001) -> None:
        self.calls = 0
        self.running = 0
        self.most = 0
        self.delay = delay
        self._lock = threading.Lock()
        self._access = os.access

    def __call__(self, path: str, mode: int, **kw: object) -> bool:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.delay)
        try:
            return self._access(path, mode, **kw)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.parametrize("gap", [None, 0, 1, 5, 10, 40, 79, 99])
def test_fanned_out_checks_run_at_once_and_stop_with_the_round_of_a_miss(
    tmp_path: Path, monkeypatch, gap: int | None
) -> None:
    backend = FileBackend(FileStorageConfig(path=str(tmp_path), threads=4), timeout_s=30.0)
    backend.start()
    n = 100
    k = keys(n)
    present = [i for i in range(n) if i != gap]
    backend.put_from([k[i] for i in present], Pool(n).slots(present))
    checks = _Checks()
    monkeypatch.setattr(os, "access", checks)
    assert backend.exists_prefix(k) == (n if gap is None else gap)
    if gap is None:  # (its last rounds give each thread 5-10 keys: they overlap)
        assert checks.most > 1
    # Each key at most once, and every key up to the end of the round with the miss:
    # rounds of 1, 4, then as large as all before them (1, 4, 5, 10, 20, 40, 20 here).
    last = n - 1 if gap is None else gap
    assert checks.calls == next(lo + m for lo, m in exists_rounds(n, 4) if last < lo + m)
    backend.close()


def test_fanned_out_checks_share_one_timeout(tmp_path: Path, monkeypatch) -> None:
    """Every round would end within `storage.timeout_s`, all of them together not: the
    check gives up at the timeout, as one call would."""
    writer = _backend(tmp_path)
    k = keys(512)
    writer.put_from(k, Pool(512).slots())
    writer.close()
    backend = FileBackend(FileStorageConfig(path=str(tmp_path), threads=16), timeout_s=0.5)
    backend.start()
    # Rounds of 1, 16, 17, 34, 68, 136 and 240 keys over 16 threads, 100 ms a check: each
    # round 0.1-1.5 s, ~3.6 s in all.
    monkeypatch.setattr(os, "access", _Checks(delay=0.1))
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"no answer within"):
        backend.exists_prefix(k)
    assert time.monotonic() - t0 < 2.0  # at the timeout (0.5 s), not after the rounds
    backend.close()


def test_parallel_writers_each_make_room_counting_the_others(tmp_path: Path, monkeypatch) -> None:
    """A full store and 8 writers starting at once: each evicts for its own object while
    counting the objects the others are writing, so with all 8 under way the files on disk
    and being written are still within the capacity (found by a review: each used to make
    room only for itself, the in-flight objects uncounted, and 8 writers took a full store
    7 objects past its capacity)."""
    cap = 32
    backend = FileBackend(
        FileStorageConfig(path=str(tmp_path), capacity_gb=cap * OBJECT / (1 << 30), threads=8),
        timeout_s=5.0,
    )
    backend.start()
    k = keys(cap + 128)
    assert backend.put_from(k[:cap], Pool(cap).slots()) == [PutStatus.STORED] * cap  # full
    seen: list[int] = []

    def count() -> None:  # (all 8 are waiting: their room made, their victims removed)
        seen.append(sum(n.endswith(".kv") for _, _, names in os.walk(tmp_path) for n in names))

    together = threading.Barrier(8, action=count, timeout=5.0)
    started: set[int] = set()
    write_file = backend._write_file

    def first_writes_meet(tmp: str, path: str, data: memoryview) -> None:
        if threading.get_ident() not in started:  # each writer's first object
            started.add(threading.get_ident())
            together.wait()
        write_file(tmp, path, data)

    monkeypatch.setattr(backend, "_write_file", first_writes_meet)
    # 128 objects in 8 runs of 16 (threads=8): the 8 writers start together.
    assert backend.put_from(k[cap:], Pool(128).slots()) == [PutStatus.STORED] * 128
    assert seen and seen[0] + 8 <= cap, seen
    assert backend.used_bytes == cap * OBJECT
    assert sum(n.endswith(".kv") for _, _, names in os.walk(tmp_path) for n in names) == cap
    backend.close()


def test_a_pipelined_call_waits_for_a_free_pipeline_thread_within_the_timeout(tmp_path: Path) -> None:
    """Batches over one chunk go to a pool of pipeline threads the whole process shares;
    the time a chunk waited there for a free thread was not bounded (16 callers of a stuck
    store: one took 2x storage.timeout_s). A chunk still queued at the timeout is
    cancelled (it never runs, nor writes into the caller's buffers)."""
    import threading

    from hicache.tiers.storage import base

    backend = FileBackend(FileStorageConfig(path=str(tmp_path)), timeout_s=0.5)
    backend.start()
    n = 2 * FileBackend.pipeline_chunk  # two chunks: pipelined
    ks, src, dst = keys(n), Pool(n, seed=1), Pool(n, seed=None)
    assert backend.put_from(ks, src.slots()) == [PutStatus.STORED] * n
    hold = threading.Event()
    busy = [base._PIPELINE.submit(hold.wait, 10) for _ in range(base._PIPELINE._max_workers)]
    try:
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"no pipeline thread free within 0\.5 s"):
            backend.get_into(ks, dst.slots())
        assert backend.stats().unavailable == 1
        assert time.monotonic() - start < 5.0
    finally:
        hold.set()
        for future in busy:
            future.result(10)
    assert backend.get_into(ks, dst.slots()) == [GetStatus.HIT] * n
    backend.close()


def test_a_page_sized_canary_writes_an_object_that_size_and_keeps_its_area(tmp_path: Path) -> None:
    """`health(deep=True, canary_bytes=N)` (the write breaker's probe) proves the store
    takes an object of a page's size, not only a small one; its area is kept for the next
    probe (and grown once when a larger one is asked), and nothing stays in the store."""
    backend = _backend(tmp_path)
    sizes: list[int] = []
    write = backend._write_from

    def recorded(keys, buffers):  # type: ignore[no-untyped-def]
        sizes.extend(b.nbytes for b in buffers)
        return write(keys, buffers)

    backend._write_from = recorded  # type: ignore[method-assign]
    try:
        assert backend.health(deep=True).healthy
        assert sizes == [64 + 4096]  # (the small canary: header + 4 KiB)
        assert backend.health(deep=True, canary_bytes=1 << 20).healthy
        assert sizes[-1] == 1 << 20
        area = backend._page_canary
        assert area is not None and backend.health(deep=True, canary_bytes=1 << 19).healthy
        assert backend._page_canary is area and sizes[-1] == 1 << 19
        assert backend.health(deep=True, canary_bytes=1 << 21).healthy
        assert backend._page_canary is not area and sizes[-1] == 1 << 21
        assert _files(tmp_path) == 0
    finally:
        backend.close()


def test_health_reports_an_unexpected_error_and_never_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's error of no expected type (junk a client library could not parse) is
    an unhealthy report naming it, not an exception out of `health`."""
    backend = _backend(tmp_path)
    try:
        def broken() -> tuple[str, int | None, int | None]:
            raise ValueError("junk from the store")

        monkeypatch.setattr(backend, "_probe", broken)
        health = backend.health(deep=True)
        assert not health.healthy and health.detail == "ValueError: junk from the store"
    finally:
        backend.close()


def test_a_root_every_local_user_may_write_is_refused_unless_sticky(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone could replace the objects of a world-writable root (their checksum is no
    signature): refused, naming the mode. A sticky one (a tmpfs mount's root, 1777) keeps
    each file its owner's: used, with a warning (others may make its folders first)."""
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o777)
    loose = FileBackend(FileStorageConfig(path=str(root)), timeout_s=2.0)
    with pytest.raises(BackendUnavailable, match=r"writable by every local user \(mode 777\)"):
        loose.start()
    loose.close()
    os.chmod(root, 0o1777)
    sticky = _backend(root)
    try:
        assert any(str(root) in r.getMessage() and "writable by every local user" in r.getMessage()
                   for r in caplog.records if r.levelname == "WARNING")
        assert sticky.put_from(["k"], Pool(1).slots()) == [PutStatus.STORED]
    finally:
        sticky.close()


def test_what_the_store_makes_has_no_bits_for_other_users_whatever_the_umask(tmp_path: Path) -> None:
    root = tmp_path / "a" / "store"
    old = os.umask(0)
    try:
        backend = _backend(root)
        try:
            assert backend.put_from(["k"], Pool(1).slots()) == [PutStatus.STORED]
        finally:
            backend.close()
    finally:
        os.umask(old)
    made = [root.parent, root, *root.rglob("*")]
    assert oct(os.stat(root.parent).st_mode & 0o777) == oct(0o755)  # (above the store)
    assert all(os.stat(p).st_mode & 0o007 == 0 for p in made[1:]), [
        (str(p), oct(os.stat(p).st_mode)) for p in made]
