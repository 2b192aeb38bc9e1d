"""`file` backend: one file per object in a directory, fanned out by key digest.

Layout: `<root>/<h[0:2]>/<h[2:4]>/<h>.kv`, where `h` is the hex key digest (integrity.py),
so any ASCII key maps to a safe name and no folder holds more than ~1/65536 of the objects.
Writes go to a temp file in the same folder, then `os.replace` (atomic: readers see the
whole object or nothing; `fsync` before the rename when `storage.file.fsync`).

Capacity (optional `capacity_gb`): an in-memory LRU index of this node's view (rebuilt from
file mtimes at start, updated on every put and hit) evicts least-recently-used files before a
write would pass the capacity. Other nodes sharing the directory keep their own index; a file
another node removed is simply a miss here.

Threads (`storage.file.threads`): one call's checks, reads and writes spread over threads
by filesystem (`fanout.py`): few on a local one, many on a shared one.

Every OSError other than "no such file" (EIO, ...) raises `BackendUnavailable`, as does a
call that exceeds `storage.timeout_s` (a hung NFS mount); a full disk or quota (ENOSPC,
EDQUOT) and a store that refuses writes (a read-only filesystem, a root without write
permission) fail the write's keys instead (`PutStatus.FAILED`), as a full Redis or
Mooncake does: reads go on. A folder of the store refusing writes while the root takes
them fails that folder's keys only.

The index is built at start by a walk of the directory (which also removes dead writers'
temp files): a large store is walked in the background, and the daemon serves meanwhile.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hicache.config import FileStorageConfig, GiB
from hicache.dirs import GROUP_DIR_MODE, GROUP_FILE_MODE, make_dirs
from hicache.errors import BackendUnavailable, ObjectCorrupt
from hicache.keys import CANARY_PREFIX
from hicache.logthrottle import ThrottledLog
from hicache.tiers.storage.base import (
    HEADER_BYTES,
    MISSING,
    NOT_AN_OBJECT,
    VERIFIED,
    PutStatus,
    StorageBackend,
)
from hicache.tiers.storage.fanout import (
    SHARED_FS_THREADS,
    WRITE_THREADS,
    FileThreads,
    exists_rounds,
    runs,
)
from hicache.tiers.storage.integrity import check_object, key_digest, truncated_of_ours
from hicache.tiers.storage.mounts import fs_type_of, is_shared_fs

log = logging.getLogger(__name__)
_bad_path = ThrottledLog(log)  # one record a path (a batch may meet it for every put)

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
# A temp file is `<object path>.<host>.<pid>.<thread>.tmp`: the host (the pod name under
# Kubernetes) keeps two nodes' writers with equal pids apart, and tells a starting daemon
# which leftovers are its own host's: those whose process is dead (or is itself: a
# restarted container's daemon has PID 1 again) are removed at start, whatever their age.
# Other hosts' leftovers are removed once older than STALE_TEMP_S.
STALE_TEMP_S = 600.0


def _host_tag() -> str:
    """This host's name as one temp-name field (no dots, no separators)."""
    name = socket.gethostname() or "host"
    return "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_"
                   for c in name)[:64]  # (what `_HOST` matches)


# About when this process started: a temp file of this host named with this process's pid
# but older than that is a previous incarnation's (a restarted container's daemon has the
# same pid). The margin covers file times set by a file server whose clock runs ahead.
_PROCESS_STARTED = time.time()
_CLOCK_MARGIN_S = 2.0


_PID = re.compile(r"[0-9]+")  # (ASCII digits: `isdigit` takes '²', which int() refuses)
_DIGEST = re.compile(r"[0-9a-f]{32}")  # an object's name: its key's digest, in hex
_HOST = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a temp name's host field (`_host_tag`)


def _writer_gone(pid: int, mtime: float) -> bool:
    """Whether the process `pid` of this host that wrote a temp file at `mtime` is gone."""
    if pid == os.getpid():
        return mtime < _PROCESS_STARTED - _CLOCK_MARGIN_S
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (past a pid_t: no such process either)
        return True
    except OSError:  # (EPERM: alive, another user's)
        return False
    return False
# A put of an object whose eviction or write by another thread is under way waits for it
# and looks again, this many times at most (each wait bounded by `storage.timeout_s`).
PUT_ROUNDS = 4
# Existence checks run in chunks of this many keys (a miss ends the run: at most one chunk
# is checked past it).
EXISTS_CHUNK = 64


class FileBackend(StorageBackend):
    name = "file"
    # Objects are verified in the reading thread and written by WRITE_THREADS threads: no
    # idle CPU is left for pipelining chunks, whose thread hops only cost.
    pipeline_chunk = 256

    def __init__(self, cfg: FileStorageConfig, timeout_s: float) -> None:
        # Room for a fanned-out call of each kind at once (idle workers are never made).
        most = cfg.threads or max(SHARED_FS_THREADS, WRITE_THREADS)
        super().__init__(timeout_s, workers=max(4, 3 * most))
        self._configured_threads = cfg.threads
        self.threads = FileThreads.resolve(cfg.threads, shared=False)  # (known at `start`)
        self.root = os.path.abspath(cfg.path)
        self.fsync = cfg.fsync
        self.capacity_bytes = None if cfg.capacity_gb is None else int(cfg.capacity_gb * GiB)
        self._lru: OrderedDict[str, int] = OrderedDict()  # digest hex -> object bytes
        self._folders: set[str] = set()  # fan-out folders the last probe found
        self._used = 0
        self._reserved = 0  # bytes of writes under way (`_reserve`)
        # Evicted from the index, file not unlinked yet: a read of one meanwhile must not
        # record it again (its entry would outlive the file, counting bytes on no disk).
        self._evicting: set[str] = set()
        # Writes under way (digest -> writers), stored but maybe not yet recorded: the
        # start's walk may find their file and must not count it beside their reservation.
        self._writing: dict[str, int] = {}
        # While the start's walk runs: objects removed, forgotten or evicted meanwhile. The
        # walk may have found them before they went; its merge must not bring them back.
        self._gone_in_walk: set[str] | None = None
        # Counts removals from the store and the index (deletes, evictions picked and
        # done, entries forgotten): a read or put records a use it saw on disk only after
        # making sure, under the lock, that no removal since took the file (else the
        # index would count an object no disk holds, and evict a real one for it).
        self._removals = 0
        self._writes = 0  # writes recorded (a read's miss forgets nothing written since)
        # Entries a write under way took out of the index (`_reserve`): put back when it
        # fails and their file is still there (a torn object stays counted, and evictable).
        self._replaced: dict[str, int] = {}
        # Indexed objects whose key is a page's (`count_pages_of`), among those written or
        # read since the start (the walk learns no keys): their evictions count as pages.
        self._pages: set[str] = set()
        self._lock = threading.Lock()
        # Notified when evictions' unlinks and writes are done: a put of an object whose
        # eviction or write is under way waits for it (the unlink, outside the lock, would
        # remove what the put found present or wrote; another writer's object is its own).
        self._quiet = threading.Condition(self._lock)
        self._host = _host_tag()
        self._indexer: threading.Thread | None = None
        self._index_error: BaseException | None = None
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        try:
            make_dirs(self.root, GROUP_DIR_MODE)
            st = os.stat(self.root)
        except OSError as e:
            raise _unavailable(self.root, e) from None
        mode = stat.S_IMODE(st.st_mode)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            # Anyone could replace the objects there with KV every tenant's engine would
            # load (an object's checksum is no signature).
            raise BackendUnavailable(
                f"file: {self.root} is writable by every local user (mode {mode:o}): "
                "refusing to keep KV there; `chmod o-w` it or choose another "
                "storage.file.path")
        if st.st_mode & stat.S_IWOTH:  # sticky (a tmpfs mount's root): ours stay ours
            log.warning("file: %s is writable by every local user (mode %o): anyone can make "
                        "its fan-out folders before the daemon does, and then replace the "
                        "objects in them; `chmod o-w` it", self.root, mode)
        if st.st_uid not in (0, os.geteuid()):
            log.warning("file: %s belongs to uid %d, not this daemon's %d: its owner can "
                        "replace the KV it holds", self.root, st.st_uid, os.geteuid())
        fstype = fs_type_of(self.root)
        shared = is_shared_fs(fstype)
        self.threads = FileThreads.resolve(self._configured_threads, shared)
        if shared:
            log.info("L3 file backend at %s (%s, shared mount)", self.root, fstype)
        else:
            log.warning(
                "L3 file backend at %s is on a %s filesystem, which is NOT shared between "
                "nodes: other nodes will not see these objects (mount NFS/Lustre/CephFS/... "
                "there for a cluster-wide L3)",
                self.root,
                fstype,
            )
        # The walk takes ~50 us an object (a stat each; far more on a shared mount): a
        # store of millions would hold the daemon's start for minutes. Waited for a
        # moment with a capacity (its evictions need the index), not at all without
        # (the index then only counts `used_bytes`); the rest goes on in the background.
        self._indexer = threading.Thread(target=self._index_in_background,
                                         name="hicache-file-index", daemon=True)
        self._indexer.start()
        self._indexer.join(INDEX_WAIT_S if self.capacity_bytes is not None else 0.0)
        if self._indexer.is_alive():
            log.info("L3 file backend at %s: indexing the store in the background "
                     "(serving meanwhile)", self.root)
        elif self._index_error is not None:
            raise self._index_error
        log.info("L3 file backend: capacity %s, fsync %s, threads %s",
                 self.capacity_bytes, self.fsync, self.threads)

    def close(self, wait_s: float = 0.0) -> bool:
        # (Not under the lock, which a call on a hung mount may hold: the walk stops at its
        # next folder, and its merge checks again under the lock.)
        self._closing = True
        deadline = time.monotonic() + wait_s
        calls_done = self._caller.close(wait_s)
        indexer = self._indexer
        if indexer is None or indexer is threading.current_thread():
            return calls_done
        indexer.join(max(0.0, deadline - time.monotonic()))  # (it stops at its next folder)
        return calls_done  # (the walk holds no caller's buffer)

    def wait_indexed(self, timeout_s: float) -> bool:
        """Whether the start's walk of the store (index, stale temp files) is done,
        waiting up to `timeout_s` for it."""
        indexer = self._indexer
        if indexer is None:
            return False
        indexer.join(timeout_s)
        return not indexer.is_alive()

    def _index_in_background(self) -> None:
        try:
            self._rebuild_index()
        except BaseException as e:  # (raised by `start` when it is still waiting)
            self._index_error = e
            log.warning("L3 file backend: indexing %s failed (%s); objects it did not reach "
                        "are not counted against the capacity", self.root, e)
            return
        with self._lock:
            objects, used = len(self._lru), self._used
        log.info("L3 file backend at %s: %d objects, %d bytes", self.root, objects, used)

    def _rebuild_index(self) -> None:
        with self._lock:
            self._gone_in_walk = set()
        try:
            self._walk_and_merge()
        finally:
            with self._lock:
                self._gone_in_walk = None

    def _walk_and_merge(self) -> None:
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for folder, _, names in os.walk(self.root):
            if self._closing:
                return
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                    if name.endswith(TEMP_SUFFIX):
                        if not self._temp_of_ours(folder, name, st):
                            continue  # (removed only where this code writes, as it names it)
                        if now - st.st_mtime > STALE_TEMP_S or self._dead_writers_temp(name, st.st_mtime):
                            self._remove_temp(path)  # left by a writer that died
                    elif name.endswith(SUFFIX):
                        h = name[: -len(SUFFIX)]
                        # Only objects this code names, where it puts them: another file
                        # would be counted against the capacity and never found to evict.
                        if _DIGEST.fullmatch(h) and path == self._path(h) and stat.S_ISREG(st.st_mode):
                            found.append((st.st_mtime, h, st.st_size))
                except OSError as e:
                    if e.errno not in _SKIPPED_AT_START_ERRNOS:
                        raise _unavailable(path, e) from None
                    continue  # gone meanwhile, a link loop, ...: not an object of ours
        found.sort()
        try:  # (folders removed while it walked, or the whole store: their objects went)
            present = {name for name in os.listdir(self.root) if len(name) == 2}
        except OSError:
            present = set()
        found = [entry for entry in found if entry[1][:2] in present]
        with self._lock:
            if self._closing:
                return  # (closed while it walked: a backend built anew counts the store)
            # Objects used since the start (the walk ran in the background) stay the most
            # recent, in their order; those only the walk found go before them, oldest
            # first. The index knows better than the walk about objects it recorded, any
            # being written (their reservation counts them), and any removed, forgotten
            # or evicted since the walk began (it may have found them before they went).
            gone = self._gone_in_walk or set()
            index = OrderedDict((h, size) for _, h, size in found
                                if h not in self._lru and h not in self._evicting
                                and h not in self._writing and h not in gone)
            self._folders |= {h[:2] for h in index}
            index.update(self._lru)
            self._lru = index
            self._used = sum(index.values())
            victims = self._evict_locked(0)
        self._unlink(victims)

    def _remove_temp(self, path: str) -> None:
        """Remove a dead writer's temp file; a store that refuses (read-only, no write
        permission) keeps it: cleaning up is no reason to give up serving it."""
        try:
            os.unlink(path)
        except OSError as e:
            if e.errno not in _WRITE_REFUSED_ERRNOS:
                raise
            _bad_path.warning(self.root, "file: cannot remove the stale temp file %s (%s)",
                              path, e.strerror)

    def _temp_of_ours(self, folder: str, name: str, st: os.stat_result) -> bool:
        """Whether `name` in `folder` is a temp file as this code writes them: a plain file
        named `<object>.<host>.<pid>.<thread>.tmp` beside where its object goes. Any other
        `*.tmp` (a store on a shared folder, a link) is not the daemon's to remove."""
        parts = name[: -len(TEMP_SUFFIX)].rsplit(".", 3)
        if len(parts) != 4 or not stat.S_ISREG(st.st_mode) or not parts[0].endswith(SUFFIX):
            return False
        h = parts[0][: -len(SUFFIX)]
        return (_DIGEST.fullmatch(h) is not None and _HOST.fullmatch(parts[1]) is not None
                and _PID.fullmatch(parts[2]) is not None and _PID.fullmatch(parts[3]) is not None
                and os.path.join(folder, parts[0]) == self._path(h))

    def _dead_writers_temp(self, name: str, mtime: float) -> bool:
        """Whether temp file `name` (written at `mtime`) is this host's and its writer
        process is gone."""
        parts = name[: -len(TEMP_SUFFIX)].rsplit(".", 3)  # <object>.<host>.<pid>.<thread>
        if len(parts) != 4 or parts[1] != self._host or not _PID.fullmatch(parts[2]):
            return False  # (not a name this code writes; removed once stale)
        return _writer_gone(int(parts[2]), mtime)

    # ------------------------------------------------------------------ paths and index

    def path_of(self, key: str) -> str:
        """Where `key`'s object lives (tests use it to corrupt objects)."""
        return self._path(key_digest(key).hex())

    def _path(self, h: str) -> str:
        return f"{self.root}/{h[0:2]}/{h[2:4]}/{h}{SUFFIX}"

    def _touch(self, h: str, size: int, reserved: int = 0, *, wrote: bool = False,
               key: str = "", seen: int | None = None) -> list[tuple[str, int]]:
        """Record a use of object `h` (`wrote`: a write's; the `reserved` bytes it made room
        for become its own; `key`: its key, when the store is bounded); returns digests to
        evict to stay within capacity. A read of an object whose eviction is under way
        records nothing; nor does a use seen on disk (`seen`: `_removals` before it looked)
        whose file a removal since took."""
        with self._lock:
            self._reserved -= reserved
            if wrote:
                self._evicting.discard(h)  # (a write finds no file: that unlink is done)
                self._written(h)
                self._replaced.pop(h, None)
                self._writes += 1
            elif h in self._evicting or h in self._writing:
                return []  # (a write of it records it: counted once, by its reservation)
            if not self._still_there(h, seen):
                return []
            return self._record_locked(h, size, key)

    def _still_there(self, h: str, seen: int | None) -> bool:
        """Caller holds the lock: whether object `h`, seen on disk when `_removals` was
        `seen`, may be recorded: no removal since, or its file is there still."""
        return seen is None or seen == self._removals or os.path.exists(self._path(h))

    def _record_locked(self, h: str, size: int, key: str) -> list[tuple[str, int]]:
        """Caller holds the lock: `_touch`'s record. A health check's canary is not
        indexed: puts meanwhile must not evict it before its read-back (it goes at once)."""
        if key.startswith(CANARY_PREFIX):
            return []
        old = self._lru.pop(h, None)
        self._used += size - (old or 0)
        self._lru[h] = size
        if (self._page_key_tail is not None and self.capacity_bytes is not None
                and key.endswith(self._page_key_tail)):
            self._pages.add(h)
        return self._evict_locked(0)

    def _reserve(self, h: str, size: int) -> list[tuple[str, int]] | None:
        """Make room for a write of object `h` (`size` bytes) and hold it until the write
        is recorded (`_touch(..., reserved=size, wrote=True)`) or given up (`_unreserve`):
        writers in parallel each count the others' objects still being written. Returns
        digests to evict, or None (nothing reserved) while an eviction or another write
        of `h` is under way (`_await_quiet`, then look again). An index entry of `h` (its
        file found gone or torn) goes: the write replaces it, and no eviction may pick
        it, whose unlink would remove the new file."""
        with self._lock:
            if h in self._evicting or h in self._writing:
                return None
            old = self._lru.pop(h, None)
            if old is not None:
                self._used -= old
                self._replaced[h] = old
            victims = self._evict_locked(size)
            self._reserved += size
            self._writing[h] = 1
            return victims

    def _unreserve(self, h: str, size: int) -> None:
        with self._lock:
            self._reserved -= size
            self._written(h)
            old = self._replaced.pop(h, None)
            if old is not None and h not in self._lru and os.path.exists(self._path(h)):
                self._lru[h] = old
                self._lru.move_to_end(h, last=False)  # (a torn object: the first to go)
                self._used += old

    def _written(self, h: str) -> None:
        """Caller holds the lock: the write of `h` is recorded or given up."""
        if self._writing.pop(h, None) is not None:
            self._quiet.notify_all()

    def _present_or_busy(self, h: str, size: int, key: str, seen: int) -> list[tuple[str, int]] | None:
        """A put found object `h` whole (when `_removals` was `seen`): record the use (as
        `_touch`) and return digests to evict, or None while its eviction (whose unlink
        would remove it once PRESENT was answered) or a write of it is under way, or when
        a removal took it since (`_await_quiet`, then look again)."""
        with self._lock:
            if h in self._evicting or h in self._writing or not self._still_there(h, seen):
                return None
            return self._record_locked(h, size, key)

    def _await_quiet(self, h: str, timeout_s: float) -> bool:
        """Wait until no eviction or write of object `h` is under way; False when one
        still is after `timeout_s`."""
        if h not in self._evicting and h not in self._writing:  # (rechecked under the lock)
            return True
        with self._quiet:
            return self._quiet.wait_for(
                lambda: h not in self._evicting and h not in self._writing, timeout_s)

    def _evict_locked(self, incoming: int) -> list[tuple[str, int]]:
        if self.capacity_bytes is None:
            return []
        victims: list[tuple[str, int]] = []
        while self._lru and self._used + self._reserved + incoming > self.capacity_bytes:
            h, size = self._lru.popitem(last=False)
            self._used -= size
            victims.append((h, size))
            self._evicting.add(h)
            self._gone_locked(h)
        return victims

    def _gone_locked(self, h: str) -> None:
        """Caller holds the lock: object `h` leaves the store or the index (removed,
        evicted, forgotten), a removal: a read or put in flight records none of it
        (`_still_there`), a walk under way brings none of it back (`_gone_in_walk`)."""
        self._removals += 1
        if self._gone_in_walk is not None:
            self._gone_in_walk.add(h)

    def _drop_locked(self, h: str) -> None:
        """Caller holds the lock: object `h`'s entry goes (`_gone_locked`)."""
        self._used -= self._lru.pop(h, 0)
        self._pages.discard(h)
        self._gone_locked(h)

    def _forget(self, h: str, writes_seen: int) -> None:
        """A read found `h`'s file gone (another node removed it) when `_writes` was
        `writes_seen`: its entry goes too, unless a put is writing it or wrote it since."""
        with self._lock:
            if h in self._writing or (writes_seen != self._writes and os.path.exists(self._path(h))):
                return
            self._drop_locked(h)

    def _unlink(self, victims: Sequence[tuple[str, int]]) -> None:
        """Remove the objects an eviction chose (counted `evicted`). One whose file cannot
        be removed (its folder refuses, an I/O error) stays in the index, as the most
        recently used (the next evictions try others first): its file still takes room."""
        if not victims:
            return
        removed: list[str] = []
        kept: list[tuple[str, int]] = []
        for h, size in victims:
            path = self._path(h)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                kept.append((h, size))
                _bad_path.warning(path, "file: cannot evict %s (%s): it stays, counted "
                                  "against the capacity", path, e.strerror)
                continue
            removed.append(h)
        with self._lock:
            self._evicting.difference_update(h for h, _ in victims)
            self._removals += 1
            self._quiet.notify_all()
            for h, size in kept:
                if h not in self._lru:  # (not written again meanwhile)
                    self._lru[h] = size
                    self._used += size
            pages = sum(h in self._pages for h in removed)
            # Entries no longer indexed (not written again meanwhile) leave the page set.
            self._pages.difference_update(
                [h for h, _ in victims if h not in self._lru] if self._pages else ())
        with self._counter_lock:
            self._counters.evicted += len(removed)
            self._counters.evicted_pages += pages

    # ------------------------------------------------------------------ backend hooks

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        # Bounded calls (a hung mount must not hang the lookup), stopping at the first
        # miss. Locally in one thread: splitting the checks over two measured slower here
        # (512 keys: 1.2-1.4 ms in one, 1.4-1.8 ms in two): each check is a ~1.5 us syscall,
        # and the hand-offs cost more than the overlap saves.
        threads = self.threads.exists
        if threads == 1:
            return self._caller.call(self._exists_sync, keys)
        # Fanned out, in rounds (`exists_rounds`); a round with a miss is the last. The
        # rounds share one `storage.timeout_s`, like the one call they replace.
        out: list[bool] = []
        deadline = time.monotonic() + self.timeout_s
        for lo, size in exists_rounds(len(keys), threads):
            batch = keys[lo : lo + size]
            parts = self._caller.map(
                self._exists_sync, [(batch[a : a + n],) for a, n in runs(size, threads, 1)],
                timeout_s=deadline - time.monotonic(),
            )
            for part in parts:
                out += part
                if not all(part):
                    return out
        return out

    def _exists_sync(self, keys: Sequence[str]) -> list[bool]:
        # In chunks, each checked by one C-level map (a Python step per key cost ~15 % of
        # the whole), stopping after the chunk with the first miss; `os.access` is half
        # the cost of a stat.
        out: list[bool] = []
        root, access, flags = self.root, os.access, itertools.repeat(os.F_OK)
        for lo in range(0, len(keys), EXISTS_CHUNK):
            digests = [key_digest(key).hex() for key in keys[lo : lo + EXISTS_CHUNK]]
            # (`_path`, inlined: a call per key cost ~8 % of the check, 7 us per 64 keys)
            present = list(map(access, [f"{root}/{h[0:2]}/{h[2:4]}/{h}{SUFFIX}" for h in digests], flags))
            out += present
            if not all(present):
                break
        return out

    def _parts(
        self, keys: Sequence[str], buffers: Sequence[np.ndarray], threads: int
    ) -> list[tuple[Sequence[str], Sequence[np.ndarray]]]:
        """`keys`/`buffers` cut into at most `threads` runs (`FileThreads.min_part`)."""
        return [(keys[lo : lo + n], buffers[lo : lo + n])
                for lo, n in runs(len(keys), threads, self.threads.min_part)]

    def _read_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        parts = self._caller.map(self._read_sync, self._parts(keys, buffers, self.threads.read))
        return [size for part in parts for size in part]

    def _read_sync(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        # NOTE: the hot loop of a get; ~20 µs an object, so every Python call counts.
        out: list[int] = []
        # Recency only matters for eviction; without a capacity a hit only has to make
        # sure the object is indexed (it may come from another node).
        track_recency = self.capacity_bytes is not None
        lru = self._lru
        root = self.root
        extra = bytearray(1)
        for key, buf in zip(keys, buffers, strict=True):
            h = key_digest(key).hex()
            path = f"{root}/{h[0:2]}/{h[2:4]}/{h}{SUFFIX}"  # (`_path`, inlined)
            seen, writes_seen = self._removals, self._writes
            try:
                # Never follows a link, never blocks on a FIFO someone left there.
                fd = os.open(path, _READ_FLAGS)
            except FileNotFoundError:
                self._forget(h, writes_seen)
                out.append(MISSING)
                continue
            except OSError as e:
                # ESTALE: removed by another node (NFS), gone like above; ENOTDIR: something
                # other than a folder where its fan-out folder belongs: nothing of ours.
                if e.errno in _ABSENT_ERRNOS:
                    self._forget(h, writes_seen)
                    out.append(MISSING)
                    continue
                if e.errno not in _NOT_AN_OBJECT_ERRNOS:
                    raise _unavailable(path, e) from None
                out.append(NOT_AN_OBJECT)
                continue
            try:
                size = _read_object(fd, buf.data, extra)
                if 0 <= size < HEADER_BYTES and not stat.S_ISREG(os.fstat(fd).st_mode):
                    size = NOT_AN_OBJECT  # a FIFO reads as empty: not a torn object of ours
            except OSError as e:
                if e.errno == errno.ESTALE:  # removed by another node while open (NFS)
                    self._forget(h, writes_seen)
                    size = MISSING
                elif e.errno not in _NOT_AN_OBJECT_ERRNOS:
                    raise _unavailable(path, e) from None
                else:
                    size = NOT_AN_OBJECT  # e.g. a directory at the object's path
            finally:
                os.close(fd)
            if size == buf.nbytes:
                if track_recency or h not in lru:
                    self._unlink(self._touch(h, size, key=key, seen=seen))
                try:
                    check_object(buf, key, size)
                    size = VERIFIED
                except ObjectCorrupt:
                    pass  # reported by size: the caller finds it corrupt, counts and zeroes it
            out.append(size)
        return out

    def _write_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        parts = self._caller.map(self._write_sync, self._parts(keys, buffers, self.threads.write))
        return [status for part in parts for status in part]

    def _write_sync(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        out: list[PutStatus] = []
        tmp_suffix = f".{self._host}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        for key, buf in zip(keys, buffers, strict=True):
            h = key_digest(key).hex()
            path = self._path(h)
            status = self._present_or_reserve(h, key, path, buf.nbytes)
            if status is not None:
                out.append(status)
                continue
            tmp = path + tmp_suffix
            reserved = buf.nbytes if self.capacity_bytes is not None else 0
            seen = self._removals
            try:
                self._write_file(tmp, path, buf.data)
            except BaseException as e:
                if reserved:
                    self._unreserve(h, reserved)
                _discard(tmp)
                if isinstance(e, OSError) and e.errno in _BAD_PATH_ERRNOS:
                    # Something else sits on this key's path (a file where its folder
                    # belongs, a directory or a link loop at it): this key fails, the
                    # batch's others go on (the whole store is not unavailable).
                    _bad_path.warning(path, "file: cannot store %s there (%s)", path, e.strerror)
                    out.append(PutStatus.FAILED)
                    continue
                if (isinstance(e, OSError) and e.errno in _WRITE_REFUSED_ERRNOS
                        and e.errno != errno.EROFS and os.access(self.root, os.W_OK)):
                    # This key's folder refuses writes (its permissions, an immutable
                    # flag) while the store takes them: its keys fail, the others go on.
                    _bad_path.warning(path, "file: cannot store %s there (%s)", path, e.strerror)
                    out.append(PutStatus.FAILED)
                    continue
                if isinstance(e, OSError) and e.errno in _FULL_ERRNOS | _WRITE_REFUSED_ERRNOS:
                    # A full disk (or quota), or a store that refuses writes (read-only,
                    # no write permission), refuses writes, not reads: this key and the
                    # batch's rest fail as a full Redis or Mooncake refuses keys, and only
                    # the write breaker opens; what the directory holds is still served.
                    why = "full" if e.errno in _FULL_ERRNOS else "not writable"
                    _bad_path.warning(self.root, "file: %s is %s (%s): backups fail until "
                                      "it takes writes again", self.root, why, e.strerror)
                    out.extend([PutStatus.FAILED] * (len(keys) - len(out)))
                    return out
                if isinstance(e, OSError):
                    raise _unavailable(path, e) from None
                raise
            self._unlink(self._touch(h, buf.nbytes, reserved, wrote=True, key=key, seen=seen))
            out.append(PutStatus.STORED)
        return out

    def _present_or_reserve(self, h: str, key: str, path: str, size: int) -> PutStatus | None:
        """A put of object `h`: PRESENT when the store holds it whole (recorded as a use),
        None when it is to be written (with a capacity: its room reserved, victims
        evicted), FAILED when an eviction or another write of it under way did not end
        within `storage.timeout_s`. Either one under way ends first: the eviction's
        unlink would remove what this put found or wrote, and another writer's object is
        this one's (a second write would reserve its room twice)."""
        if self.capacity_bytes is None:
            return PutStatus.PRESENT if _holds_whole(path, key, size) else None
        for _ in range(PUT_ROUNDS):
            if not self._await_quiet(h, self.timeout_s):
                return PutStatus.FAILED
            seen = self._removals
            if _holds_whole(path, key, size):
                victims = self._present_or_busy(h, size, key, seen)
                if victims is None:
                    continue  # (an eviction or a write of it began meanwhile)
                self._unlink(victims)  # used: recent again (and its key known)
                return PutStatus.PRESENT
            victims = self._reserve(h, size)
            if victims is None:
                continue
            self._unlink(victims)
            return None
        return PutStatus.FAILED

    def _write_file(self, tmp: str, path: str, data: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        for attempt in range(FOLDER_ATTEMPTS):
            try:
                fd = os.open(tmp, flags, GROUP_FILE_MODE)
                break
            except FileNotFoundError:
                if attempt == FOLDER_ATTEMPTS - 1:
                    raise
            # The fan-out folder does not exist yet: made on first use, so a put into an
            # existing folder costs no extra system call. Recorded for the probe, which
            # notices folders that go (`_forget_removed_folders`). Made again when it went
            # meanwhile (a canary's removal takes its folders when they are empty).
            folder = os.path.dirname(tmp)
            make_dirs(folder, GROUP_DIR_MODE, GROUP_DIR_MODE)
            with self._lock:
                self._folders.add(os.path.basename(os.path.dirname(folder)))
        try:
            os.fchmod(fd, GROUP_FILE_MODE)  # (open's mode lost what the umask takes)
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _remove(self, keys: Sequence[str]) -> int:
        return self._caller.call(self._remove_sync, keys)

    def _remove_sync(self, keys: Sequence[str]) -> int:
        # The unlink and the index entry go together under the lock: a writer storing the
        # key meanwhile records its new file after both (never before the pop, which would
        # leave its file untracked), and an entry whose file is gone already (a reader
        # recorded it after another remover) is dropped too.
        removed = 0
        for key in keys:
            path = self.path_of(key)
            with self._lock:
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno not in _BAD_PATH_ERRNOS:
                        raise _unavailable(path, e) from None
                    # Not an object of ours there (a directory, a file where its folder
                    # belongs): nothing to remove; the other keys still go.
                self._drop_locked(os.path.basename(path)[: -len(SUFFIX)])
            if key.startswith(CANARY_PREFIX):
                # A health check's canary has a fresh key each time: its fan-out folders,
                # made for it, go with it (a probe every 10 s would leave thousands).
                _remove_empty_folders(path, self.root)
        return removed

    def _probe(self) -> tuple[str, int | None, int | None]:
        def probe() -> tuple[str, int | None, int | None]:
            if not os.path.lexists(self.root):
                # Removed under the daemon (by hand, a cleanup job): what it held is gone.
                # Made again here, as `start` did: an idle daemon gets no write that would
                # (and with the breaker open, none would reach the backend).
                make_dirs(self.root, GROUP_DIR_MODE)
                with self._lock:
                    for h in list(self._lru):  # (their files went with the store)
                        self._drop_locked(h)
                    self._pages.clear()
                self._folders = set()
                self.resets += 1
                log.warning("L3 file backend: %s was removed; created it again (the objects "
                            "it held are gone)", self.root)
            else:
                self._forget_removed_folders()
            st = os.statvfs(self.root)
            if not os.path.isdir(self.root):
                raise BackendUnavailable(f"file: {self.root} is not a directory")
            free = st.f_bavail * st.f_frsize
            capacity = self.capacity_bytes or st.f_blocks * st.f_frsize
            # A store that takes no writes still serves what it holds: reads go on (the
            # deep check's canary finds the writes refused: the write breaker's part).
            writes = "" if os.access(self.root, os.W_OK) else "; not writable: backups fail"
            indexing = "; indexing the store" if not self.wait_indexed(0) else ""
            detail = f"{self.root} ({fs_type_of(self.root)}, {free} bytes free{writes}{indexing})"
            return detail, capacity, self._used

        try:
            return self._caller.call(probe)
        except OSError as e:
            raise _unavailable(self.root, e) from None

    def _forget_removed_folders(self) -> None:
        """Objects whose fan-out folder is gone since the last probe (the store's contents
        removed under the daemon, the root kept) leave the index: its size and the
        capacity it holds say what the store holds. (One listing of the root a probe.)"""
        present = {name for name in os.listdir(self.root) if len(name) == 2}
        with self._lock:  # (writers add the folders they make)
            gone, self._folders = self._folders - present, self._folders | present
        # One a writer made after the listing is not gone.
        gone = {name for name in gone if not os.path.isdir(os.path.join(self.root, name))}
        if not gone:
            return
        with self._lock:
            self._folders -= gone
            dropped = [h for h in self._lru if h[:2] in gone]
            for h in dropped:  # (their files went with their folders)
                self._drop_locked(h)
        if dropped:
            self.resets += 1
            log.warning("L3 file backend: %d fan-out folders of %s were removed (the %d "
                        "objects they held are gone)", len(gone), self.root, len(dropped))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
# Errors that say the path holds something other than an object (a link, a directory, a
# FIFO or device): that key is corrupt, the backend is fine.
_NOT_AN_OBJECT_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EAGAIN, errno.EINVAL})
# Errors of a file met at start that say it is no object of ours (skipped).
_SKIPPED_AT_START_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENAMETOOLONG})
# Errors of a read that say no object of ours is at the path.
_ABSENT_ERRNOS = frozenset({errno.ESTALE, errno.ENOTDIR})
# Errors of a write or an unlink that say something other than our object or folder sits
# on the key's path (ENOENT: a dangling link where its folder belongs): that key only.
_BAD_PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENOENT, errno.EEXIST})
# A write refused for room: the store is full, not down.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# A write refused by the filesystem (read-only) or by permissions: of the whole store when
# the root refuses, else of the folder that does.
_WRITE_REFUSED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# Tries of a write's temp file whose fan-out folder is missing (made again each time).
FOLDER_ATTEMPTS = 3
# How long `start` waits for the index of a store with a capacity (then: the background).
INDEX_WAIT_S = 5.0


def _remove_empty_folders(path: str, root: str) -> None:
    """Remove the object's two fan-out folders if they are empty (best effort: another
    writer may be filling them)."""
    folder = os.path.dirname(path)
    for _ in range(2):
        if folder == root:
            return
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)


def _read_object(fd: int, view: memoryview, extra: bytearray) -> int:
    """Read the file into `view`; returns the file size (one syscall in the common case).

    The `extra` byte (scratch) detects a file larger than the buffer without an fstat. NOTE: a read
    that fills `view` exactly is taken as the whole file: a regular file only reads short
    at its end, and even a file that went on would only have been served after its header
    and checksum (which cover exactly `view`) verified.
    """
    size = len(view)
    got = os.readv(fd, [view, extra])
    while 0 < got < size:  # short read (signal, network file system): go on
        n = os.readv(fd, [view[got:], extra])
        if n == 0:
            return got
        got += n
    if got > size:
        return os.fstat(fd).st_size
    return got


def _holds_whole(path: str, key: str, nbytes: int) -> bool:
    """Whether a put of `key`'s `nbytes`-byte object at `path` is done already: something
    is there and it is not our object of this key cut short (shorter than a header, or
    our header for this key and length with fewer bytes: a writer that died without
    fsync). A torn one is written again, where answering PRESENT would leave the caller
    recording a page in L3 that no node can read; anything else is left alone, as reads
    leave it."""
    try:
        st = os.stat(path)
    except OSError:  # nothing there (or no way to tell: the write says which)
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size >= nbytes:
        return True
    if st.st_size < HEADER_BYTES:
        return False
    head = np.zeros(nbytes, dtype=np.uint8)
    try:
        with open(path, "rb") as f:
            f.readinto(head[:HEADER_BYTES].data)
    except OSError:
        return True  # (unreadable: not ours to judge)
    return not truncated_of_ours(head, key, st.st_size)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        return


def _unavailable(path: str, e: OSError) -> BackendUnavailable:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return BackendUnavailable(f"file: {code} on {path}: {e.strerror}")
