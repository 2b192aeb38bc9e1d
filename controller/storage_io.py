"""The controller's view of L3: family keys, guarded lookups, reads and writes of host pages.

Every call goes through the circuit breaker: while it is open, lookups answer "nothing"
at once and writes are refused (the caller counts a dropped backup), so a dead backend
costs the serving path nothing. A page is present only when the objects of EVERY member
of its family are: a missing sidecar object makes the whole page a miss.

Writes queued and not landed yet are known (`begin_write`/`end_write`): a lookup counts
their pages as present, and a read of them first waits for them to land, so a page that L2
let go of while its write was still queued is not lost to the requests in between.

Every call that reaches the backend is timed by operation and outcome (`L3OpRecorder`);
`stats()` reports those latencies with the bytes the backend moved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from hicache.config import MemberSpec
from hicache.controller.base import L3Op, L3Outcome, L3Stats
from hicache.controller.l3_latency import L3OpRecorder
from hicache.controller.workers import BreakerOpen, CircuitBreaker, ExistenceCache
from hicache.errors import BackendUnavailable
from hicache.keys import key_tail, storage_keys
from hicache.logthrottle import ThrottledLog
from hicache.tiers.base import HostPools
from hicache.tiers.storage.base import BackendHealth, GetStatus, PutStatus, StorageBackend

log = logging.getLogger("hicache.controller.l3")
# How long a page whose object read back corrupt counts as absent in L3 for this node.
CORRUPT_ABSENT_S = 60.0
# A page of a write in flight, as `begin_write` records it: (namespace, first member of
# its family, page hash).
Writing = tuple[str, str, bytes]
_S = TypeVar("_S", GetStatus, PutStatus)


def _writing(namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec]) -> list[Writing]:
    return [(namespace, members[0].name, h) for h in hashes]


class L3Written(NamedTuple):
    """What one `L3Store.write` did, in pages (a page: every member's object)."""

    landed: tuple[int, ...]  # which pages (indices into the write's) L3 now holds
    found: tuple[int, ...]  # which of those were there already (this write stored none)

    @property
    def in_l3(self) -> int:
        """Pages L3 now holds: stored by this write, or there already."""
        return len(self.landed)

    @property
    def stored(self) -> int:
        """Of those, pages this write stored (an object of theirs was new)."""
        return len(self.landed) - len(self.found)


class L3Store:
    def __init__(self, backend: StorageBackend, host: HostPools, model_id: str,
                 tp_rank: int = 0, tp_size: int = 1, breaker: CircuitBreaker | None = None,
                 cache: ExistenceCache | None = None, object_ttl_s: float | None = None,
                 object_bytes: int = 0, page_member: str = "") -> None:
        """`object_ttl_s`: the store expires objects this long after their last read or
        write (Redis's `ttl_s`): what is known present is asked again after half of it.
        `object_bytes`: the largest page object to write (header included; writes raise
        it), the size of the canary that proves a store takes writes again
        (`probe_writes`). `page_member`: the member every stored page has an object of
        (the FULL family's first): the store's evictions of those count its pages."""
        self.backend = backend
        if page_member:
            backend.count_pages_of(key_tail(page_member, tp_rank, tp_size))
        self.object_ttl_s = object_ttl_s
        self.object_bytes = object_bytes
        self.host = host
        self.model_id = model_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.breaker = breaker or CircuitBreaker(name=f"L3 {backend.name} circuit breaker")
        self.cache = cache or ExistenceCache(
            present_ttl_s=None if object_ttl_s is None else object_ttl_s / 2)
        # A store that went down may come back without what it held (a restarted Redis
        # without persistence, a Mooncake master): what was known present is asked again.
        self.breaker.on_trip.append(self.cache.clear)
        self._resets = backend.resets  # (a probe that finds it grew clears the cache too)
        self.errors = 0
        # Writes the store answered but refused (full, no eviction; a restarted master not
        # ready yet) trip this breaker only: backups stop, reads and lookups go on (a full
        # store still serves all it holds). The prober's canary write closes it.
        self.write_breaker = CircuitBreaker(
            name=f"L3 {backend.name} write breaker",
            failures="refused writes (the store answers but takes no writes: backups are "
                     "dropped, reads go on)")
        self.last_health: BackendHealth | None = None
        self.latency = L3OpRecorder(backend.name)
        self._warn = ThrottledLog(log)  # every failed call of a flapping store
        # Pages of writes queued or running, counted (two writes may share a page).
        self._writing: Counter[Writing] = Counter()
        self._landed = threading.Condition()

    @property
    def name(self) -> str:
        return self.backend.name

    def keys(self, namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec]) -> list[str]:
        """Keys page-major: page 0's members, then page 1's, ..."""
        return storage_keys(namespace, self.model_id, hashes, [m.name for m in members],
                            self.tp_rank, self.tp_size)

    def begin_write(self, namespace: str, hashes: Sequence[bytes],
                    members: Sequence[MemberSpec]) -> list[Writing]:
        """Record a write of these pages' families as in flight (when it is queued); pass
        what this returns to `end_write` once it landed, failed or was dropped."""
        pages = _writing(namespace, hashes, members)
        with self._landed:
            self._writing.update(pages)
        return pages

    def end_write(self, pages: list[Writing]) -> None:
        if not pages:
            return
        with self._landed:
            self._writing.subtract(pages)
            for page in pages:
                if self._writing[page] <= 0:
                    del self._writing[page]
            self._landed.notify_all()

    def _writing_run(self, namespace: str, hashes: Sequence[bytes], member: str, start: int) -> int:
        """The first page at or after `start` that no write in flight covers."""
        writing = self._writing
        with self._landed:
            while start < len(hashes) and (namespace, member, hashes[start]) in writing:
                start += 1
        return start

    def writing_any(self) -> bool:
        """Whether any write is in flight (a read then may have something to wait for)."""
        return bool(self._writing)

    def wait_written(self, namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec],
                     timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no write in flight covers these pages; False
        when some still does."""
        pages = _writing(namespace, hashes, members)
        deadline = time.monotonic() + timeout_s
        with self._landed:
            while any(p in self._writing for p in pages):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._landed.wait(left)
        return True

    def present_run(self, namespace: str, hashes: Sequence[bytes],
                    members: Sequence[MemberSpec]) -> int:
        """Leading pages whose whole family is in L3, or is being written there (0 while
        the breaker is open)."""
        if not hashes or self.breaker.is_open:  # (nothing L3 serves now: no prefetch either)
            return 0
        if not self._writing:  # (the common case: one pass over the keys)
            return self._stored_run(namespace, hashes, members)
        page, member = 0, members[0].name
        while page < len(hashes):
            page = self._writing_run(namespace, hashes, member, page)
            if page == len(hashes):
                break
            # (a page the store lacks is then known absent: asking again costs nothing)
            stored = self._stored_run(namespace, hashes[page:], members)
            if stored == 0:
                break
            page += stored
        return page

    def _stored_run(self, namespace: str, hashes: Sequence[bytes],
                    members: Sequence[MemberSpec]) -> int:
        """Leading pages whose whole family the store holds (the existence cache first)."""
        keys = self.keys(namespace, hashes, members)
        known, stop = self.cache.known_run(keys)
        if stop or known == len(keys):
            return known // len(members)
        if not self.breaker.allow():
            return known // len(members)
        found = self._exists_prefix(keys[known:])
        if found is None:
            return known // len(members)
        run = known + found
        self.cache.add_present(keys[:run])
        if run < len(keys):
            self.cache.add_absent(keys[run])
        return run // len(members)

    def has(self, namespace: str, page_hash: bytes, members: Sequence[MemberSpec]) -> bool:
        return self.present_run(namespace, [page_hash], members) == 1

    def read(self, namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec],
             host_ids: np.ndarray) -> int:
        """Read pages (whole families) into the host slots `host_ids` (one per page);
        returns how many leading pages arrived intact (a caller that counted writes in
        flight as present waits for them first: `wait_written`). Raises
        BackendUnavailable."""
        keys, statuses = self._transfer(L3Op.GET, self.backend.get_into, namespace, hashes,
                                        members, host_ids)
        per = len(members)
        for i, status in enumerate(statuses):
            if status is not GetStatus.HIT:  # the first page with a member missing ends the run
                page = i // per
                self.cache.forget(keys[page * per : (page + 1) * per])
                if status is GetStatus.CORRUPT and self._still_stored(keys[i]):
                    # Possibly left in the store (another geometry or format version is not
                    # ours to remove): the store would call it present at every lookup, and
                    # every match would promise and re-read it. Known absent for a while (a
                    # good copy this node writes clears that at once).
                    self.cache.add_absent(keys[page * per], CORRUPT_ABSENT_S)
                return page
        return len(hashes)

    def _still_stored(self, key: str) -> bool:
        """Whether a key read back corrupt is still in the store (not ours to remove);
        one it removed needs no mark (a good copy another node writes is seen at once)."""
        found = self._exists_prefix([key])
        return found is None or found == 1  # (unknown: not removed, so kept marked)

    def _exists_prefix(self, keys: Sequence[str]) -> int | None:
        """The backend's run of leading keys it holds, timed; None when it did not
        answer (counted, and fed to the breaker, as every L3 call is)."""
        try:
            with self.latency.timed(L3Op.EXISTS):
                found = self.backend.exists_prefix(keys)
        except BackendUnavailable as e:
            self._failed(e)
            return None
        self.breaker.success()
        return found

    def write(self, namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec],
              host_ids: np.ndarray) -> L3Written:
        """Store pages from their host slots; returns pages now in L3 and how many of them
        this write stored (the others were there: another daemon wrote them). Raises
        BackendUnavailable (breaker open or the store did not answer)."""
        keys, statuses = self._transfer(L3Op.PUT, self.backend.put_from, namespace, hashes,
                                        members, host_ids)
        per = len(members)
        present: list[str] = []
        found: set[str] = set()  # answered PRESENT: something is there, maybe not ours
        landed: list[int] = []
        there: list[int] = []
        for page in range(len(hashes)):
            page_keys = keys[page * per : (page + 1) * per]
            page_statuses = statuses[page * per : (page + 1) * per]
            if all(s in (PutStatus.STORED, PutStatus.PRESENT) for s in page_statuses):
                landed.append(page)
                present += page_keys
                was_there = {k for k, s in zip(page_keys, page_statuses, strict=True)
                             if s is PutStatus.PRESENT}
                found |= was_there
                if len(was_there) == per:
                    there.append(page)
        # One call for the batch: the cache then keeps the batch's first page most recent
        # (a path written node by node keeps that order within each node only).
        self.cache.add_present(present, found)
        return L3Written(tuple(landed), tuple(there))

    def _transfer(self, op: L3Op, call: Callable[[list[str], list[np.ndarray]], list[_S]],
                  namespace: str, hashes: Sequence[bytes], members: Sequence[MemberSpec],
                  host_ids: np.ndarray) -> tuple[list[str], list[_S]]:
        """One backend batch over the page objects of `host_ids`, through the breaker."""
        # A breaker hands out its half-open probe to the call it lets through: a write the
        # read breaker then refuses gives the write breaker's probe back.
        write_probe = None
        if op is L3Op.PUT:
            write_probe = self.write_breaker.take()
            if write_probe is None:
                raise BreakerOpen(f"{self.name}: refusing writes (write breaker open)")
        if not self.breaker.allow():
            if write_probe is not None:
                self.write_breaker.give_back(write_probe)
            raise BreakerOpen(f"{self.name}: circuit breaker open")
        keys = self.keys(namespace, hashes, members)
        views = [self.host.object_views(m.name, host_ids) for m in members]
        buffers = views[0] if len(views) == 1 else [v for page in zip(*views, strict=True) for v in page]
        if op is L3Op.PUT and buffers:  # (a page's objects: the canary's size to come)
            self.object_bytes = max(self.object_bytes, *(b.nbytes for b in buffers[: len(members)]))
        try:
            with self.latency.timed(op):
                statuses = call(keys, buffers)
        except BackendUnavailable as e:
            self._failed(e)
            raise
        self.breaker.success()  # (it answered)
        if op is L3Op.PUT:
            if PutStatus.FAILED in statuses:
                self.write_breaker.failure()
            else:
                self.write_breaker.success()
        return keys, statuses

    @property
    def takes_writes(self) -> bool:
        """False while the write breaker is open (backups are dropped, not queued)."""
        return not self.breaker.is_open and not self.write_breaker.is_open

    def probe_writes(self) -> bool:
        """A canary write/read/delete now (`health(deep=True)`) of an object the size of
        the largest page object (a store may still take a small one: a full Mooncake
        segment's leftover room); closes the write breaker when it succeeds. Leaves the
        read breaker alone: a full store still serves."""
        health = self._timed_health(True, self.object_bytes)
        if health.healthy:
            self.write_breaker.success()
        return health.healthy

    def probe(self, deep: bool = False) -> BackendHealth:
        """Ask the backend's health now (timed; an unhealthy answer counts as UNAVAILABLE).
        A deep probe whose canary alone failed (the store answers, but takes no writes: a
        full Redis, a full Mooncake segment) counts against the write breaker only: a
        full L3 still serves, and any tenant may ask for a deep check."""
        health = self._timed_health(deep)
        serving = health
        if health.healthy:
            if deep:
                self.write_breaker.success()
            self.breaker.success()
        elif deep and (serving := self._timed_health(False)).healthy:
            self.write_breaker.failure()
            self.breaker.success()
        else:
            self.breaker.failure()
        self.last_health = serving  # (readiness: whether it serves, which a full store does)
        return health

    def _timed_health(self, deep: bool, canary_bytes: int = 0) -> BackendHealth:
        t0 = time.perf_counter()
        health = self.backend.health(deep, canary_bytes)
        self.latency.record(L3Op.PROBE_DEEP if deep else L3Op.PROBE,
                            L3Outcome.OK if health.healthy else L3Outcome.UNAVAILABLE,
                            time.perf_counter() - t0)
        if self.backend.resets != self._resets:  # the store lost what it held
            self._resets = self.backend.resets
            self.cache.clear()
        return health

    def stats(self) -> L3Stats:
        """Latency of every call so far, the bytes the backend read and stored, and the
        corrupt objects it found (and removed)."""
        counted = self.backend.stats()
        return self.latency.snapshot(counted.bytes_read, counted.bytes_written, counted.corrupt,
                                     counted.corrupt_removed, counted.evicted,
                                     counted.evicted_pages)

    def _failed(self, e: Exception) -> None:
        self.errors += 1
        self.breaker.failure()
        self._warn.warning(f"failed:{type(e).__name__}", "L3 %s: %s", self.name, e)
