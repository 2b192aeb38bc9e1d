"""The L3 storage protocol: one small contract that every backend (file, Mooncake, Redis) keeps.

An L3 object is ONE buffer: `HEADER_BYTES` of header (integrity.py) followed by the payload.
Buffers are `numpy.ndarray` views (uint8, 1-D, C-contiguous) into the L2 host pool, which
reserves the header area in every slot. `StorageBackend` implements the public methods once
(validation, duplicate keys, header writing and checking, counters) and asks each backend for
four raw operations (`_exists`, `_read_into`, `_write_from`, `_remove`) plus its probes.

Failure model:
- A whole call that cannot reach the store (service down, timeout, permission) raises
  `BackendUnavailable`; nothing is retried here (the controller owns backoff). A full
  store refuses writes per key (`PutStatus.FAILED`): it still serves what it holds.
- Per-key outcomes are enums (`GetStatus`, `PutStatus`), never bare bools.
- A corrupt or wrong-sized object is `GetStatus.CORRUPT`: counted, and the WHOLE buffer
  (header and payload) is zeroed, so no byte of it can be served by mistake.
- A corrupt object of the right size is also removed from the store (`corrupt_removed`):
  left there, every lookup would count it present, every read would stop at it and no
  write would replace it (puts skip keys already present), so that prefix would never be
  served from L3 again. Objects of another size (another model geometry under the same
  key, a misconfiguration) and objects in another header format version of ours (another
  daemon version) are left alone: this daemon cannot tell they are broken, and removing
  them would have two daemons undo each other's writes. A reader racing a writer that
  replaces the object may remove the fresh copy: then the key is a miss, never wrong bytes.
- NOTE: after a *timed-out* `get_into` the store may still write into the buffers later (the
  transfer runs on in the client library). Callers must treat those buffers as owned by the
  backend until `stats().stuck_calls` drops back to zero; `close(wait_s)` waits for such
  calls (bounded) and says whether one still runs, in which case registered memory must
  not be freed. Successful calls never touch the buffers afterwards.
- Buffers of one batch share no memory (the same buffer may come again for the same key).

Thread safety: every public method may be called from several threads at once.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import ctypes
import dataclasses
import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import numpy as np

from hicache.arrays import any_of
from hicache.errors import BackendUnavailable, InvalidArgument, ObjectCorrupt
from hicache.keys import CANARY_PREFIX
from hicache.logthrottle import ThrottledLog
from hicache.tiers.storage.bounded import BoundedCaller
from hicache.tiers.storage.integrity import (
    HEADER_BYTES,
    check_object,
    other_format,
    truncated_of_ours,
    verified_objects,
    write_header,
    write_headers,
)

log = logging.getLogger("hicache.l3")

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Batches are cut into chunks of this many objects, so that the header work of one chunk
# (checksums: ~7 µs per 64 KiB object here) overlaps the I/O of the next. Shared by all
# backends: the hooks release the GIL while they wait (sockets, files, Mooncake calls).
PIPELINE_CHUNK = 64
_PIPELINE = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="l3-pipeline")

MISSING = -1  # `_read_into` result for a key that is not in the store
# `_read_into` result for an object that the hook has read AND verified with `check_object`
# itself, right after reading it, while its bytes were still in the CPU cache (hashing a
# 64 KiB page costs ~1.5 µs then, ~5 µs once other pages pushed it out).
VERIFIED = -2
# `_read_into` result for a key whose stored thing is no object of ours (a Redis value of
# another type, a directory or FIFO at a file's path): the caller counts that key corrupt
# and zeroes its buffer, leaves the thing in place, and the rest of the batch goes on.
# (Not 0: an EMPTY stored object is ours, torn, and is removed.)
NOT_AN_OBJECT = -3
CANARY_PAYLOAD = 4096
CANARY_KEYS = 3  # fresh keys a deep check writes before it calls a refusing store unhealthy


class GetStatus(enum.Enum):
    HIT = "hit"  # the buffer holds the verified object
    MISS = "miss"  # no such key; the buffer content is unspecified
    CORRUPT = "corrupt"  # header/checksum/size mismatch; the buffer was zeroed


class PutStatus(enum.Enum):
    STORED = "stored"  # written by this call
    PRESENT = "present"  # already in the store (or earlier in the same batch); not rewritten
    FAILED = "failed"  # the store refused this key (e.g. out of space); others may be stored


@dataclass(frozen=True)
class BackendHealth:
    name: str
    healthy: bool
    latency_ms: float
    detail: str
    capacity_bytes: int | None = None
    used_bytes: int | None = None


@dataclass(frozen=True)
class BackendStats:
    name: str
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    stored: int = 0
    present: int = 0
    put_failed: int = 0
    deleted: int = 0
    corrupt_removed: int = 0  # corrupt objects removed from the store after a read
    # Objects the backend removed to stay within its capacity (the file backend's
    # `capacity_gb`; Redis and Mooncake evict on their own, uncounted here).
    evicted: int = 0
    # Of those, pages: objects whose key ends as `count_pages_of` said (one per page),
    # among those this process wrote or read (the file index keeps no key per object).
    evicted_pages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unavailable: int = 0  # calls that raised BackendUnavailable
    stuck_calls: int = 0  # timed-out calls still running in the client library


@dataclass
class _Counters:
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    stored: int = 0
    present: int = 0
    put_failed: int = 0
    deleted: int = 0
    corrupt_removed: int = 0
    evicted: int = 0
    evicted_pages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unavailable: int = 0


class StorageBackend(abc.ABC):
    """An L3 store. Build with the registry, then `start()`; `close()` when done."""

    name: str = "abstract"
    pipeline_chunk: int = PIPELINE_CHUNK
    #: An object that fails its check is read once more before it is called corrupt (and
    #: removed): for stores where a read racing a delete can return torn bytes.
    reread_failed_checks: bool = False

    def __init__(self, timeout_s: float, workers: int = 4) -> None:
        self.timeout_s = timeout_s
        # Every call into the client library runs here, bounded by `timeout_s` (the
        # libraries' own timeouts do not bound a whole call); its stuck calls are counted.
        self._caller = BoundedCaller(self.name, timeout_s, workers)
        self._counters = _Counters()
        self._counter_lock = threading.Lock()
        # Two canary objects for deep health checks; backends that need registered memory
        # (Mooncake) register this array in `start()`.
        self._canary_area = np.zeros(2 * (HEADER_BYTES + CANARY_PAYLOAD), dtype=np.uint8)
        self._canary_lock = threading.Lock()
        self._page_canary: np.ndarray | None = None  # (`_canary_round_trip`)
        self._kept_canaries: list[np.ndarray] = []  # (a stuck call may still use them)
        # Per-object warnings (a store full of junk would log one per page read).
        self._warn = ThrottledLog(logging.getLogger(type(self).__module__))
        # Times a probe found the store had lost what it held (its caller then forgets
        # what it knew present).
        self.resets = 0
        self._page_key_tail: str | None = None  # (`count_pages_of`)

    # ------------------------------------------------------------------ public contract

    @abc.abstractmethod
    def start(self) -> None:
        """Connect / prepare the store. Raises `BackendUnavailable` within `timeout_s` when
        the store cannot be reached. Call once, before anything else."""

    def count_pages_of(self, key_tail: str) -> None:
        """Count the evictions of objects whose key ends with `key_tail` as pages too
        (`BackendStats.evicted_pages`): one member's objects, one per page. Call before
        the first write; a backend that does not evict on its own ignores it."""
        self._page_key_tail = key_tail

    def register_host_buffer(self, address: int, size: int) -> None:
        """Announce a host memory region (the L2 pool) that buffers will live in. Backends
        that transfer zero-copy (Mooncake) register it with their client; the others ignore
        it. Idempotent for the same region. Raises `BackendUnavailable` if the client refuses."""
        return None

    def unregister_host_buffer(self, address: int) -> None:
        """Withdraw a region given to `register_host_buffer` before its memory is freed.
        Unknown addresses are ignored. Never raises for a dead store."""
        return None

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Length of the run of keys present in the store, counted from `keys[0]`.

        A gap ends the run: for present/absent/present the answer is 1. Presence is not
        verified content (a corrupt object counts as present; `get_into` will miss it).
        Empty `keys` → 0. Duplicates are checked like any key. Mutates nothing.
        """
        _check_keys(keys)
        if not keys:
            return 0
        present = self._guarded(self._exists, keys)
        run = 0
        for hit in present:
            if not hit:
                break
            run += 1
        return run

    def get_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[GetStatus]:
        """Read each key's object into its buffer and verify it; one status per key.

        Writes into every buffer (HIT: the object; CORRUPT: zeros; MISS: unspecified).
        Duplicate keys are each read into their own buffer. Empty batch → [].
        Raises `InvalidArgument` (mismatched lengths, bad buffers, non-ASCII keys) or
        `BackendUnavailable` (then no status is known and buffers are unspecified).
        """
        _check_batch(keys, buffers)
        if not keys:
            return []
        sizes = self._fetch(keys, buffers)
        if self.reread_failed_checks:
            failed: list[int] = []
            for i, (key, buf, size) in enumerate(zip(keys, buffers, sizes, strict=True)):
                if size in (MISSING, NOT_AN_OBJECT, VERIFIED):
                    continue
                try:
                    check_object(buf, key, size)
                    sizes[i] = VERIFIED
                except ObjectCorrupt:
                    failed.append(i)
            if failed:  # read once more: judged (and maybe removed) on that read
                again = self._fetch([keys[i] for i in failed], [buffers[i] for i in failed])
                for i, size in zip(failed, again, strict=True):
                    sizes[i] = size
        out: list[GetStatus] = []
        hits = corrupt = nbytes = 0
        broken: list[str] = []  # corrupt objects of ours: removed below
        for key, buf, size in zip(keys, buffers, sizes, strict=True):
            if size == MISSING:
                out.append(GetStatus.MISS)
                continue
            if size == NOT_AN_OBJECT:  # someone else's thing at our key: not ours to remove
                log.debug("%s: %s holds no object; a miss", self.name, key)
                buf[:] = 0
                corrupt += 1
                out.append(GetStatus.CORRUPT)
                continue
            if size != VERIFIED:
                try:
                    check_object(buf, key, size)
                except ObjectCorrupt as e:
                    # Ours and broken: the right size with our format, cut short with our
                    # header, or shorter than any header (a crash left it empty): nothing
                    # another geometry or daemon version could have written.
                    if ((size == buf.nbytes and not other_format(buf))
                            or truncated_of_ours(buf, key, size) or 0 <= size < HEADER_BYTES):
                        broken.append(key)
                        self._warn.warning("corrupt", "%s: %s; a miss, removing it from the store",
                                           self.name, e)
                    else:  # not ours to judge (and possibly many): counted, not logged loudly
                        log.debug("%s: %s; a miss", self.name, e)
                    buf[:] = 0
                    corrupt += 1
                    out.append(GetStatus.CORRUPT)
                    continue
            hits += 1
            nbytes += buf.nbytes
            out.append(GetStatus.HIT)
        removed = self._remove_broken(broken) if broken else 0
        with self._counter_lock:
            c = self._counters
            c.gets += len(keys)
            c.hits += hits
            c.corrupt += corrupt
            c.corrupt_removed += removed
            c.misses += len(keys) - hits - corrupt
            c.bytes_read += nbytes
        return out

    def _fetch(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        if len(set(keys)) == len(keys):
            return list(self._fetch_objects(keys, buffers))
        return self._fetch_repeated(keys, buffers)

    def _fetch_repeated(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        """`_fetch_objects` for a batch that repeats keys. Each (key, buffer size) is read
        once, into its first buffer, and copied into the others: a client may fill only
        one buffer of a key given twice in a call (Mooncake does), so a key wanted at two
        sizes is read in two calls."""
        first: dict[tuple[str, int], int] = {}
        for i, key in enumerate(keys):
            first.setdefault((key, buffers[i].nbytes), i)
        calls: list[list[int]] = []  # call n reads each key's n-th size
        seen: dict[str, int] = {}
        for (key, _), i in first.items():
            n = seen.get(key, 0)
            seen[key] = n + 1
            if n == len(calls):
                calls.append([])
            calls[n].append(i)
        got: dict[int, int] = {}
        for call in calls:
            got.update(zip(call, self._fetch_objects([keys[i] for i in call],
                                                     [buffers[i] for i in call]), strict=True))
        sizes = []
        for i, key in enumerate(keys):
            j = first[(key, buffers[i].nbytes)]
            if j != i and got[j] != MISSING:
                buffers[i][:] = buffers[j]
            sizes.append(got[j])
        return sizes

    def _remove_broken(self, keys: list[str]) -> int:
        """Best effort: the read's statuses stand whether or not this works (a key left
        behind is found corrupt, and removed, at its next read)."""
        try:
            return self._guarded(self._remove, list(dict.fromkeys(keys)))
        except BackendUnavailable as e:
            log.warning("%s: could not remove %d corrupt object(s): %s", self.name, len(keys), e)
            return 0

    def put_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        """Store each buffer under its key; one status per key.

        Writes the header into `buf[:HEADER_BYTES]` of each buffer (the payload is only
        read), then stores header + payload as one object. Keys already present are not
        rewritten (objects are content addressed, so the stored bytes are the same).
        A key repeated in the batch is stored once; later copies report PRESENT.
        Empty batch → []. Raises `InvalidArgument` or `BackendUnavailable` (then some keys
        may have been stored; `exists_prefix` tells which).
        """
        _check_batch(keys, buffers)
        if not keys:
            return []
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = list(first.values())
        if len(unique) == len(keys):
            results = self._store_objects(keys, buffers)
        else:
            unique_keys = [keys[i] for i in unique]
            results = self._store_objects(unique_keys, [buffers[i] for i in unique])
        by_index = dict(zip(unique, results, strict=True))
        # A repeated key is PRESENT once its first copy is in the store, and shares that
        # copy's FAILED otherwise.
        out = [
            by_index.get(i, PutStatus.FAILED if by_index[first[key]] is PutStatus.FAILED
                          else PutStatus.PRESENT)
            for i, key in enumerate(keys)
        ]
        with self._counter_lock:
            c = self._counters
            c.puts += len(keys)
            for i, status in by_index.items():
                if status is PutStatus.STORED:
                    c.stored += 1
                    c.bytes_written += buffers[i].nbytes
            # Per key given, like `puts` (a repeated key shares its first copy's outcome).
            c.put_failed += sum(1 for s in out if s is PutStatus.FAILED)
            c.present += sum(1 for s in out if s is PutStatus.PRESENT)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        """Remove keys; returns how many were present and removed. Absent keys are fine.
        Empty `keys` → 0. Raises `BackendUnavailable`."""
        _check_keys(keys)
        if not keys:
            return 0
        removed = self._guarded(self._remove, list(dict.fromkeys(keys)))
        with self._counter_lock:
            self._counters.deleted += removed
        return removed

    def health(self, deep: bool = False, canary_bytes: int = 0) -> BackendHealth:
        """Probe the store; never raises for an unreachable store (reports it instead).

        Shallow: the client's own liveness check. Deep: also a canary object written, read
        back, verified and deleted (under a key unique to this process), of
        `canary_bytes` (at least a small one's): a store that refuses objects the size of
        the daemon's pages is not taking its writes, whatever a small object shows.
        """
        t0 = time.perf_counter()
        probed = ""
        try:
            detail, capacity, used = self._probe()
            probed = detail
            if deep:
                self._canary_round_trip(max(CANARY_PAYLOAD, canary_bytes - HEADER_BYTES))
                detail += "; canary write/read/verify/delete ok"
            healthy = True
        except (BackendUnavailable, ObjectCorrupt) as e:
            # A canary's failure says what the probe saw too (a store not writable, full).
            healthy, detail, capacity, used = False, str(e), None, None
            if probed:
                detail += f" ({probed})"
        except Exception as e:  # (a backend's unexpected error: reported, never raised)
            healthy, detail, capacity, used = False, f"{type(e).__name__}: {e}", None, None
        latency_ms = (time.perf_counter() - t0) * 1e3
        return BackendHealth(self.name, healthy, latency_ms, detail, capacity, used)

    def stats(self) -> BackendStats:
        """A snapshot of the counters since `start()`."""
        with self._counter_lock:
            fields = dataclasses.asdict(self._counters)
        return BackendStats(name=self.name, stuck_calls=self._stuck_calls(), **fields)

    @abc.abstractmethod
    def close(self, wait_s: float = 0.0) -> bool:
        """Release connections and threads. Calls given up on after `storage.timeout_s`
        may still run in the client library, writing into buffers they were given: they
        are waited for, at most `wait_s`. Returns whether none still runs (False: the
        memory of buffers given to this backend must not be freed or reused yet).
        Idempotent; never raises for a dead store."""
        return True

    # ------------------------------------------------------------------ backend hooks

    def _fetch_objects(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        """Read the objects into the buffers; per key VERIFIED, MISSING or the stored size
        of an object still to verify (the caller checks those, and counts and zeroes the
        corrupt ones).

        The default pipelines chunks through `_read_into`: chunk k is verified while
        chunk k+1 is in flight. A backend may override it with its own schedule."""
        sizes: list[int] = []
        previous: tuple[int, list[int]] | None = None
        chunks = self._chunks(len(keys))
        for lo, hi in chunks:
            future = self._submit(len(chunks) == 1, self._read_into, keys[lo:hi], buffers[lo:hi])
            if previous is not None:
                sizes.extend(verified(keys[previous[0] :], buffers[previous[0] :], previous[1]))
            previous = (lo, self._result(future))
        if previous is not None:
            sizes.extend(verified(keys[previous[0] :], buffers[previous[0] :], previous[1]))
        return sizes

    def _store_objects(
        self, keys: Sequence[str], buffers: Sequence[np.ndarray]
    ) -> list[PutStatus]:
        """Write each header (`write_header`), then store the objects; unique keys.

        The default pipelines chunks through `_write_from`: headers of chunk k+1 are
        written while chunk k is in flight. A backend may override it to overlap its own
        round trips with the header work instead (Mooncake's existence check)."""
        results: list[PutStatus] = []
        future: cf.Future[list[PutStatus]] | None = None
        chunks = self._chunks(len(keys))
        for lo, hi in chunks:
            write_headers(buffers[lo:hi], keys[lo:hi])
            if future is not None:
                done: list[PutStatus] = self._result(future)
                results += done
            future = self._submit(len(chunks) == 1, self._write_from, keys[lo:hi], buffers[lo:hi])
        if future is not None:
            last: list[PutStatus] = self._result(future)
            results += last
        return results

    @abc.abstractmethod
    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key (may stop early after the first absent one and return a
        shorter list). Raises `BackendUnavailable`."""

    @abc.abstractmethod
    def _read_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        """Copy each stored object into its buffer; per key the stored object's size in
        bytes, or MISSING. A stored object of another size than the buffer must not be
        written past the buffer (report its size; the caller calls it corrupt). A hook may
        verify an object itself (`check_object`, nothing less) and report VERIFIED; objects
        that fail its check are reported by size, and the caller finds them corrupt."""

    @abc.abstractmethod
    def _write_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        """Store each whole buffer (header already filled) under its key, unique keys."""

    @abc.abstractmethod
    def _remove(self, keys: Sequence[str]) -> int:
        """Remove unique keys; how many existed."""

    @abc.abstractmethod
    def _probe(self) -> tuple[str, int | None, int | None]:
        """Liveness: (detail, capacity_bytes, used_bytes). Raises `BackendUnavailable`."""

    def _stuck_calls(self) -> int:
        return self._caller.stuck

    # ------------------------------------------------------------------ helpers

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = self.pipeline_chunk
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _submit(
        self, inline: bool, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> cf.Future[_R]:
        """Run a hook on the pipeline pool, or here when there is nothing to overlap. The
        hooks bound their own time (storage.timeout_s), so waiting on the future is bounded."""
        if not inline:
            return _PIPELINE.submit(lambda: self._guarded(fn, *args, **kwargs))
        done: cf.Future[_R] = cf.Future()
        try:
            done.set_result(self._guarded(fn, *args, **kwargs))
        except Exception as e:
            done.set_exception(e)
        return done

    def _result(self, future: cf.Future[_R]) -> _R:
        """A pipelined hook's result. The hook bounds its own time once it runs; the time it
        waits for a free pipeline thread (a pool the whole process shares) is bounded here:
        one still queued after `timeout_s` is cancelled, so it never runs (nor writes into
        buffers the caller has let go of)."""
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            if future.cancel():
                with self._counter_lock:  # (counted as `_guarded` counts a hook's)
                    self._counters.unavailable += 1
                raise BackendUnavailable(
                    f"{self.name}: no pipeline thread free within {self.timeout_s:g} s "
                    "(storage.timeout_s)"
                ) from None
            return future.result()  # running: bounded by the hook

    def _guarded(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except BackendUnavailable:
            with self._counter_lock:
                self._counters.unavailable += 1
            raise

    def _canary_round_trip(self, payload: int = CANARY_PAYLOAD) -> None:
        need = 2 * (HEADER_BYTES + payload)
        with self._canary_lock:
            area = self._canary_area
            if area.nbytes < need:
                # A page-sized canary (`health(canary_bytes=...)`, every probe interval
                # while writes are refused): an area of its own, registered where the
                # store needs that, kept for the next probe.
                kept = self._page_canary
                if kept is not None and kept.nbytes >= need:
                    area = kept
                else:
                    area = np.zeros(need, dtype=np.uint8)
                    self.register_host_buffer(area.ctypes.data, area.nbytes)
                    if kept is not None:
                        self._retire_canary(kept)
                    self._page_canary = area
            self._canary_in(area, payload)

    def _retire_canary(self, area: np.ndarray) -> None:
        """An area no canary uses any more: unregistered, or kept for good while a call
        given up on may still write into it."""
        if self._stuck_calls():
            self._kept_canaries.append(area)
        else:
            self.unregister_host_buffer(area.ctypes.data)

    def _canary_in(self, area: np.ndarray, payload: int) -> None:
        # Under the prefix of every key the daemon writes: a store account limited to it
        # (a Redis ACL `~hc2/*`) must pass the check it passes in service.
        # A write refused for one key is that key's failure (a stray file where the file
        # store's fan-out folder belongs, say), not the store's: fresh keys are tried, and
        # only a store that refuses each is unhealthy.
        size = HEADER_BYTES + payload
        src, dst = area[:size], area[size : 2 * size]
        refused: list[str] = []
        for _ in range(CANARY_KEYS):
            key = f"{CANARY_PREFIX}{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex}"
            _fill_random(src[HEADER_BYTES:])
            dst[:] = 0
            write_header(src, key)
            try:
                (status,) = self._write_from([key], [src])
                if status is not PutStatus.STORED:
                    refused.append(status.value)
                    continue
                (got,) = self._read_into([key], [dst])
                if got == MISSING:
                    raise BackendUnavailable(f"{self.name}: canary written but not found")
                check_object(dst, key, dst.nbytes if got == VERIFIED else got)
                return
            finally:
                self._remove([key])
        raise BackendUnavailable(f"{self.name}: canary write refused for {len(refused)} "
                                 f"keys ({', '.join(refused)})")


def _fill_random(body: np.ndarray) -> None:
    """`body` filled with CANARY_PAYLOAD random bytes, repeated (a page-sized canary would
    cost a random byte each: ~0.1 s for 20 MiB here, every probe interval)."""
    n = min(len(body), CANARY_PAYLOAD)
    body[:n] = np.frombuffer(os.urandom(n), dtype=np.uint8)
    while n < len(body):
        step = min(n, len(body) - n)
        body[n : n + step] = body[:step]
        n += step


def verified(keys: Sequence[str], buffers: Sequence[np.ndarray], sizes: list[int]) -> list[int]:
    """`sizes` (of objects read into `buffers`) with VERIFIED for each object that passes
    `check_object`; the others keep their size (for the caller to count as corrupt).
    Only the first ``len(sizes)`` keys and buffers are used."""
    n = len(sizes)
    ok = verified_objects(buffers[:n], keys[:n], sizes)
    return [VERIFIED if good else size for good, size in zip(ok, sizes, strict=True)]


def _check_keys(keys: Sequence[str]) -> None:
    # The common case in C: join() takes strings only, all() finds an empty one.
    try:
        if "".join(keys).isascii() and all(keys):
            return
    except TypeError:
        pass
    for key in keys:
        if not isinstance(key, str) or not key or not key.isascii():
            raise InvalidArgument(f"L3 keys must be non-empty ASCII strings, got {key!r}")


def _check_batch(keys: Sequence[str], buffers: Sequence[np.ndarray]) -> None:
    if len(keys) != len(buffers):
        raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
    _check_keys(keys)
    for buf in buffers:
        if not (
            isinstance(buf, np.ndarray)
            and buf.dtype == np.uint8
            and buf.ndim == 1
            and buf.flags.c_contiguous
            and buf.nbytes > HEADER_BYTES
        ):
            raise InvalidArgument(
                "L3 buffers must be 1-D C-contiguous uint8 arrays larger than "
                f"{HEADER_BYTES} header bytes"
            )
        if not buf.flags.writeable:  # (a get fills it; a put writes its header into it)
            raise InvalidArgument("L3 buffers must be writable (got a read-only array)")
    if len(buffers) > 1:
        _check_disjoint(keys, buffers)


def _check_disjoint(keys: Sequence[str], buffers: Sequence[np.ndarray]) -> None:
    """Buffers of one batch share no memory: a get would fill one with two keys' objects
    (and judge the first corrupt, removing a good object), a put would store one key's
    payload under the other's header. The same buffer may come again for the same key.
    ~0.6 us a buffer (its address; `ctypes` is the cheapest way to it, numpy's attributes
    cost twice that); the rare batch with a shared span is sorted out in Python."""
    n = len(buffers)
    address, char = ctypes.addressof, ctypes.c_char.from_buffer  # (buffers are writable)
    # (numpy arrays export the buffer protocol; its stubs do not say so)
    starts = np.fromiter((address(char(b)) for b in buffers), dtype=np.uint64, count=n)  # type: ignore[arg-type]
    ends = starts + np.fromiter((b.nbytes for b in buffers), dtype=np.uint64, count=n)
    order = np.argsort(starts, kind="stable")
    if not any_of(np.maximum.accumulate(ends[order])[:-1] > starts[order][1:]):
        return
    spans: dict[tuple[int, int], str] = {}
    for key, start, end in zip(keys, starts.tolist(), ends.tolist(), strict=True):
        if spans.setdefault((start, end), key) != key:
            raise InvalidArgument(f"L3 buffers of one batch share memory: keys ...{spans[(start, end)][-16:]} "
                                  f"and ...{key[-16:]} were given the same buffer")
    reach = 0
    for start, end in sorted(spans):
        if start < reach:
            raise InvalidArgument("L3 buffers of one batch share memory: two of them overlap "
                                  "(each key needs a buffer of its own)")
        reach = max(reach, end)
