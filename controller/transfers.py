"""Page families moving between tiers: room-making, write policies, L3 backups. (Loads
up into L1 are `loads.Loads`'s, in the room made here.)

Called by the controller under its mutex, except the L1->L2 write-through flushes (on
the copy worker: the copy runs outside the mutex, the pinned pages cannot move) and the
L3 backup jobs (on the backup worker).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.arrays import any_of
from hicache.controller.workers import Job, Worker
from hicache.errors import BackendUnavailable, InvalidArgument, ResourceExhausted
from hicache.keys import PAGE_HASH_BYTES, split_hashes
from hicache.logthrottle import ThrottledLog
from hicache.tree import KEEP_THE_REST, MatchResult, TreeLock, Victim
from hicache.types import ComponentKind, PageHash, Tier, WritePolicy

if TYPE_CHECKING:
    from hicache.config import MemberSpec
    from hicache.controller.controller import HybridCacheController
    from hicache.controller.engines import EngineRegistry
    from hicache.controller.storage_io import Writing
    from hicache.tiers.base import CopyEngine

log = logging.getLogger("hicache.controller")
_failed = ThrottledLog(log)  # a broken copy engine fails every backup: one record a key


FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
MAX_UNCOPIED = 4096  # write-through nodes remembered as not copied for lack of room
BACKPRESSURE_S = 5.0  # longest an allocation waits for queued copies to free room
L1_VICTIM_WAIT_S = 0.1  # longest an L1 allocation waits for room in L2 for its victims' copies
# A pool short of room evicts this share of its pages beyond what the allocation needs
# (16 of the default 1,024): one tree eviction and one free per that many pages rather
# than per request. Pools of under 64 pages evict exactly what they need.
EVICT_AHEAD_DIVISOR = 64
# Most pages one L1->L2 flush copies: more wait for the next flush (which starts at once).
# NOTE: the CPU copy engine copies up to 64 pages inline; larger copies go to its helper
# threads, which contend for the GIL with the serving threads.
FLUSH_PAGES = 64
# Pending L1->L2 copies are flushed when an RPC ends after they became due; with no RPC
# ending, a timer flushes them this many batch times (`write.l1_to_l2_batch_ms`) after
# the first was queued.
IDLE_FLUSH_FACTOR = 2


@dataclass
class L3Write:
    """An L3 write queued or running: how many pages it writes of each kind (the last
    ones of the path to its node: a FULL slot, an SWA window or tail; 1 for a MAMBA
    checkpoint, its node's end) and the nodes it covers (its node, then the heads tree
    splits made of it meanwhile: their share of its pages). Objects are named by their
    content, so what it covers is a matter of token positions, not of L2 page ids."""

    pages: dict[ComponentKind, int]
    nodes: list[object]


@dataclass
class HostCopy:
    """One node's queued L1->L2 write-through: the L1 pages of each family slot that L2
    lacks (FULL first), the pin that keeps them in place until the copy landed, and, once
    its flush reserved them, (kind, L1 pages, L2 pages) per slot that found room."""

    node: object
    slots: list[tuple[ComponentKind, np.ndarray]]
    pin: TreeLock
    moves: list[tuple[ComponentKind, np.ndarray, np.ndarray]] = field(default_factory=list)
    heads: list[object] = field(default_factory=list)  # split off `node` while queued

    @property
    def pages(self) -> int:
        """Its pages (its first slot's: FULL's), what a flush and a batch count."""
        return len(self.slots[0][1])


def per_family(moves: list[tuple[ComponentKind, np.ndarray, np.ndarray]]
               ) -> list[tuple[ComponentKind, np.ndarray, np.ndarray]]:
    """(kind, source ids, destination ids) joined per family, first-seen order: one copy
    engine call per family."""
    by_kind: dict[ComponentKind, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for kind, src, dst in moves:
        srcs, dsts = by_kind.setdefault(kind, ([], []))
        srcs.append(src)
        dsts.append(dst)
    return [(kind, _cat(srcs), _cat(dsts)) for kind, (srcs, dsts) in by_kind.items()]


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# What `Transfers.stats` counts (evictions, per tier and kind, come as they happen).
COUNTED = ("allocation_waits", "backups_dropped", "backups_l2", "backups_l2_failed",
           "backups_l2_skipped", "backups_l3", "backups_l3_failed", "backups_l3_present",
           "l1_evictions_deferred", "l2_flushes", "l2_landings_refused", "loaded_pages")


class Transfers:
    def __init__(self, ctl: HybridCacheController, copier: CopyEngine) -> None:
        self.ctl = ctl
        self.tree = ctl.tree
        self.copier = copier
        self.cfg = ctl.cfg
        # Exported from the start (at 0), so that alerts on them read 0, not "no data".
        self.stats: Counter[str] = Counter(dict.fromkeys(COUNTED, 0))
        # L3 writes retry over ~6 s: long enough for a restarted store to come back
        # (Mooncake remounts its segment about a second after its master restarts).
        self.backup_worker = Worker("backup", capacity=4096, retries=5, backoff_s=0.2)
        # L1->L2 copies are local and fast: their own worker, never behind slow L3 writes.
        self.copy_worker = Worker("l1-to-l2", capacity=4096, retries=0)
        # Host pages an L3 write is reading: freeing one parks it until the write is done.
        self._held_l2: dict[ComponentKind, Counter[int]] = {}
        self._parked_l2: dict[ComponentKind, list[int]] = {}
        self._in_flight: dict[ComponentKind, list[np.ndarray]] = {}  # host pages owned by jobs
        # Nodes with a copy queued (by id: the copy), so a second request over the same
        # path does not queue (and write) it again.
        self._queued_l2: dict[int, HostCopy] = {}
        # Set while an L1 allocation that may wait for copies evicts: a victim that ranks
        # after a node whose copy is queued is kept (`_l1_victim_after_copies`), and the
        # allocation waits for the copy, then takes that node first (its pin held it).
        self._copies_first = False
        self._kept_for_copies = False
        self._flushing = threading.Lock()  # (`flush`: one at a time)
        # Nodes with an L3 write queued or running, by id: that write (see `L3Write`).
        self._queued_l3: dict[int, L3Write] = {}
        # write_through: nodes whose L1->L2 copy found no room (L2's pages held by L3
        # writes in flight), copied as they leave L1 (`_l1_victim_uncopied`); while there
        # are none, L1 evictions take no callback (it cost ~5 us an evicted node).
        self._uncopied: OrderedDict[int, object] = OrderedDict()
        self.tree.on_split = self._on_split
        # L1->L2 write-through copies waiting for the copy worker's next flush, in order;
        # their pages (FULL's), and when the oldest was queued.
        self._pending_l2: list[HostCopy] = []
        self._pending_pages = 0
        self._pending_since = 0.0
        self._flush_queued = False
        # Batching (`write.l1_to_l2_batch_*`): a queued flush waits on `_flush_wake` until
        # its copies are due (`_batch_due`), which is checked where nothing is being sent:
        # when the RPC holding them ends, or when a copy is queued without a hold. Its own
        # timeout (`IDLE_FLUSH_FACTOR` x the batch time) only serves when no RPC comes:
        # a timer firing under traffic would take the GIL and the mutex from a request
        # in the middle of its handler. `_flush_waiting`: one waits. `_flush_now`:
        # someone needs them (an allocation, drain, close), due at once.
        self._batch_pages = self.cfg.write.l1_to_l2_batch_pages
        self._batch_s = self.cfg.write.l1_to_l2_batch_ms / 1e3
        self._flush_wake = threading.Condition(ctl._mu)
        self._flush_waiting = False
        self._flush_now = False
        # An Insert or Batch RPC under way whose copies wait for its response to be sent
        # (at most one at a time: see `hold_flushes`).
        self._flush_holds = 0
        # Allocators and evict-ahead counts by tier and kind, looked up once.
        self._allocators = {
            Tier.DEVICE: {k: ctl.device.allocator(k) for k in ctl._kinds},
            Tier.HOST: {k: ctl.host.allocator(k) for k in ctl._kinds},
        }
        self._ahead = {
            tier: {k: a.total // EVICT_AHEAD_DIVISOR for k, a in by_kind.items()}
            for tier, by_kind in self._allocators.items()
        }
        # Notified whenever a copy lands or held host pages are released: an allocation
        # short of room waits on it (releasing the mutex) rather than failing at once.
        self.landed = threading.Condition(ctl._mu)
        self._evicting = 0  # inside a tree eviction callback: never wait there
        self._defer_l1_victims = True  # see `_l1_victim`

    def start(self) -> None:
        self.backup_worker.start()
        self.copy_worker.start()

    def close(self, deadline: float | None = None) -> None:
        with self.ctl._mu:  # a flush waiting for its batch goes now (or finds nothing)
            self._flush_now = True
            self._flush_wake.notify_all()
        self.copy_worker.close(deadline)
        self.backup_worker.close(deadline)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued copy (L1->L2, then L2->L3) has landed, held ones
        included (copies queued meanwhile too, until the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.ctl._mu:
                self._schedule_l2_flush(urgent=True)
            ok = self.copy_worker.drain(max(0.0, deadline - time.monotonic()))
            with self.ctl._mu:
                left = bool(self._pending_l2)
            if not left or not ok or time.monotonic() >= deadline:
                break
        ok = ok and not left
        return self.backup_worker.drain(max(0.0, deadline - time.monotonic())) and ok

    def counters(self) -> dict[str, int]:
        out = dict(self.stats)
        out["backup_worker_failures"] = self.backup_worker.failures + self.copy_worker.failures
        return out

    # ------------------------------------------------------------------ room

    def allocate_l1(self, kind: ComponentKind, n: int) -> np.ndarray:
        """`n` L1 pages of `kind`, evicting (with the L1->L2 write policy) to make room.
        Pages pinned by queued L1->L2 copies become evictable once they land, so a short
        allocation waits for that (back-pressure, bounded). ResourceExhausted when locked
        pages leave no room."""
        return self._allocate(Tier.DEVICE, kind, n)

    def allocate_l1_all(self, need: Mapping[ComponentKind, int]) -> dict[ComponentKind, np.ndarray]:
        """`need[kind]` L1 pages of each kind: all of them, or ResourceExhausted with none
        taken and, when some kind cannot fit whatever is evicted, nothing evicted either
        (evicting for one kind first, then failing on another, would empty the cache for
        nothing). A kind short only of pages pinned by queued copies waits for them."""
        free = self.allocate_free_l1(need)
        if free is not None:
            return free
        allocators = self._allocators[Tier.DEVICE]
        deadline = time.monotonic() + BACKPRESSURE_S
        while True:
            short = [(kind, n) for kind, n in need.items() if n > self._reachable(Tier.DEVICE, kind)]
            if not short:
                break
            left = deadline - time.monotonic()
            kind, n = short[0]
            # (past the pool's size no eviction and no copy can make room)
            if n > allocators[kind].total or not self._queued_l2 or self._evicting or left <= 0:
                raise self._no_room(Tier.DEVICE, kind, n)
            self._wait_for_copies(left)
        got: dict[ComponentKind, np.ndarray] = {}
        try:
            for kind, n in need.items():  # (the kinds share the one bound on waiting)
                got[kind] = self._allocate(Tier.DEVICE, kind, n,
                                           wait_s=max(0.0, deadline - time.monotonic()))
        except BaseException:
            for kind, ids in got.items():
                self.free_l1(kind, ids)
            raise
        return got

    def allocate_free_l1(self, need: Mapping[ComponentKind, int]) -> dict[ComponentKind, np.ndarray] | None:
        """`need[kind]` L1 pages of each kind from the free pages alone, never evicting
        or waiting; None (nothing taken) when they do not all fit."""
        allocators = self._allocators[Tier.DEVICE]
        for kind, n in need.items():  # (a loop, not any(...): every L1 allocation's first try)
            if allocators[kind].free_count < n:
                return None
        return {kind: allocators[kind].allocate(n) for kind, n in need.items()}

    def allocate_l2(self, kind: ComponentKind, n: int, wait: bool = True) -> np.ndarray:
        """`n` L2 pages of `kind`, evicting to make room; with `wait=False` never waiting
        (with the mutex released) for queued copies or held pages to free some."""
        if wait:
            return self._allocate(Tier.HOST, kind, n)
        return self._allocate(Tier.HOST, kind, n, wait_for_copies=False, wait_s=0.0)

    def _allocate(self, tier: Tier, kind: ComponentKind, n: int, *,
                  wait_for_copies: bool = True, wait_s: float | None = None) -> np.ndarray:
        """`wait_s`: how long it may wait for queued copies (None: `BACKPRESSURE_S`)."""
        alloc = self._allocators[tier][kind]
        if alloc.free_count >= n:
            return alloc.allocate(n)
        if n > alloc.total:  # no eviction can make room: do not empty the pool trying
            raise self._no_room(tier, kind, n)
        if wait_s is None:
            wait_s = BACKPRESSURE_S
        deadline = time.monotonic() + wait_s
        kept_until: float | None = None
        copies_first = tier is Tier.DEVICE and wait_for_copies and wait_s > 0
        while True:
            # Evicting only when it can make room: a request that cannot fit (the rest is
            # locked, pinned or held by allocations) must not empty the pool trying.
            if alloc.free_count < n <= self._reachable(tier, kind):
                kept = self.stats["l1_evictions_deferred"]
                # (saved and restored: an L2 allocation may run inside an L1 eviction)
                outer = self._copies_first, self._kept_for_copies
                self._copies_first, self._kept_for_copies = copies_first, False
                try:
                    self._evict(tier, kind, n - alloc.free_count + self._ahead[tier][kind])
                finally:
                    kept_for_copies = self._kept_for_copies
                    self._copies_first, self._kept_for_copies = outer
                if alloc.free_count < n and kept_for_copies:
                    # Victims that rank after a node whose copy is queued: that node goes
                    # first once its copy landed (waited for at most `wait_s`; then they go).
                    left = deadline - time.monotonic()
                    if left > 0 and self._queued_l2 and not self._evicting:
                        self._wait_for_copies(left)
                    else:
                        copies_first = False
                    continue
                if alloc.free_count < n and self.stats["l1_evictions_deferred"] > kept:
                    # Victims kept in L1 until L2 has room for their copy (`_l1_victim`):
                    # it comes as L3 writes land. Waited for a moment only (nothing on the
                    # serving path waits on a slow L3), then they go (counted dropped).
                    now = time.monotonic()
                    kept_until = now + L1_VICTIM_WAIT_S if kept_until is None else kept_until
                    if now < kept_until and not self._evicting:
                        self.landed.wait(kept_until - now)
                        continue
                    self._defer_l1_victims = False
                    try:
                        self._evict(tier, kind, n - alloc.free_count)
                    finally:
                        self._defer_l1_victims = True
            if alloc.free_count >= n:
                return alloc.allocate(n)
            pending = ((wait_for_copies and self._queued_l2)
                       or (tier is Tier.HOST and any(self._parked_l2.values())))
            left = deadline - time.monotonic()
            if not pending or self._evicting or left <= 0:
                raise self._no_room(tier, kind, n)
            self._wait_for_copies(left)

    def _no_room(self, tier: Tier, kind: ComponentKind, n: int) -> ResourceExhausted:
        """Caller holds the mutex. What an allocation of `n` pages that cannot be made says."""
        alloc = self._allocators[tier][kind]
        where = f"L{1 if tier is Tier.DEVICE else 2} {kind.value}: {n} pages needed"
        if n > alloc.total:
            return ResourceExhausted(f"{where}, the pool has {alloc.total}")
        # What holds the rest, so that an operator can tell a leak from a busy cache.
        cached = self.tree.resident_pages(tier, kind)
        locked = self.tree.locked_pages(tier, kind)
        parked = len(self._parked_l2.get(kind, ())) if tier is Tier.HOST else 0
        held = max(0, alloc.total - alloc.free_count - cached - parked)
        holders = ("engine allocations and loads" if tier is Tier.DEVICE
                   else "copies under way and L3 writes in flight")
        return ResourceExhausted(
            f"{where}, {alloc.free_count} of {alloc.total} free: {locked} cached and locked, "
            f"{cached - locked} cached and unlocked (too few, or copies queued or waiting for "
            f"room below pin them), {held + parked} held by {holders}")

    def _wait_for_copies(self, left: float) -> None:
        """Caller holds the mutex (released meanwhile). An allocation short of room waits a
        moment for queued copies to land (a held flush goes now: never waited for)."""
        self.stats["allocation_waits"] += 1
        self._schedule_l2_flush(urgent=True)
        self.landed.wait(min(left, 0.05))

    def _reachable(self, tier: Tier, kind: ComponentKind) -> int:
        """Caller holds the mutex. At most how many pages of the pool could be free after
        evicting everything evictable: the free ones, the tree's unlocked ones (a page
        pinned by a queued copy counts as locked until it lands) and, in L2, the parked
        ones (freed while a write in flight still reads them)."""
        alloc = self._allocators[tier][kind]
        n = alloc.free_count + self.tree.resident_pages(tier, kind) - self.tree.locked_pages(tier, kind)
        if tier is Tier.HOST:
            n += len(self._parked_l2.get(kind, ()))
        return n

    def free_l1(self, kind: ComponentKind, ids: np.ndarray) -> None:
        if len(ids):
            self._allocators[Tier.DEVICE][kind].free(ids)

    def free_l2(self, kind: ComponentKind, ids: np.ndarray) -> None:
        if not len(ids):
            return
        held = self._held_l2.get(kind)
        if held:
            busy = np.fromiter((held[int(i)] > 0 for i in ids), dtype=bool, count=len(ids))
            if any_of(busy):
                self._parked_l2.setdefault(kind, []).extend(int(i) for i in ids[busy])
                ids = ids[~busy]
        if len(ids):
            self._allocators[Tier.HOST][kind].free(ids)

    def host_room_coming(self) -> bool:
        """Caller holds the mutex. Whether L2 pages are held by writes in flight (to L3,
        or late reads): they free once those land (a parked page is a held one)."""
        return any(self._held_l2.values())

    def _hold_l2(self, kind: ComponentKind, ids: np.ndarray) -> None:
        self._held_l2.setdefault(kind, Counter()).update(int(i) for i in ids)

    def _unhold_l2(self, kind: ComponentKind, ids: np.ndarray) -> None:
        """Caller holds the mutex. Pages parked while held are freed now."""
        held = self._held_l2[kind]
        held.subtract(int(i) for i in ids)
        parked = self._parked_l2.get(kind)
        if parked:
            ready = [i for i in parked if held[i] <= 0]
            if ready:
                self._parked_l2[kind] = [i for i in parked if held[i] > 0]
                self.ctl.host.allocator(kind).free(np.array(ready, dtype=np.int64))
        for i in ids:
            if held[int(i)] <= 0:
                del held[int(i)]
        self.landed.notify_all()

    def _evict(self, tier: Tier, kind: ComponentKind, n: int) -> None:
        """A component's own eviction first (SWA windows, MAMBA checkpoints), then whole
        leaves, which free every slot of their family. Re-entrant: an L1 write-back may
        evict from L2 while an L1 eviction is under way."""
        alloc = self._allocators[tier][kind]
        target = alloc.free_count + n
        for victim_kind in dict.fromkeys((kind, FULL)):
            for _ in range(2):  # a second pass where nodes it kept can go now
                short = target - alloc.free_count
                if short <= 0:
                    break
                callback = self._victim_callback(tier)
                self._evicting += 1
                try:
                    result = self.tree.evict(tier, victim_kind, short, before_drop=callback)
                finally:
                    self._evicting -= 1
                free = self.free_l1 if tier is Tier.DEVICE else self.free_l2
                for k, ids in result.freed.items():
                    free(k, ids)  # host pages a write-back job holds are parked, not freed
                # FULL pages are the tier's pages (`evictions_<tier>`); other components'
                # slots leaving alone are counted apart.
                suffix = "" if victim_kind is FULL else f"_{victim_kind.value}"
                self.stats[f"evictions_{tier.name.lower()}{suffix}"] += result.evicted_pages
                if not result.stranded or not self._copy_stranded(tier, result.stranded):
                    break

    def _copy_stranded(self, tier: Tier, nodes: tuple[object, ...]) -> bool:
        """Caller holds the mutex. `nodes` were kept by an eviction of `tier`: each is the
        last copy of a node with children. Under write-through its copy to L2 was never
        made (a match split a node whose copy found no room, a selective copy not due):
        it is copied as it leaves L1, as `_uncopied` nodes are (True: evict again), or
        it would stay forever. Under write-back the eviction's callback tried already."""
        if tier is not Tier.DEVICE or self.cfg.write.l1_to_l2 is WritePolicy.WRITE_BACK:
            return False
        fresh = [node for node in nodes if self._uncopied.get(id(node)) is not node]
        for node in fresh:
            self._note_uncopied(node)
        return bool(fresh)

    # ------------------------------------------------------------------ write policies

    def _victim_callback(self, tier: Tier) -> Callable[[Victim], bool | int | None] | None:
        """What must happen before a slot leaves `tier` (a write-back), or None: then the
        tree builds no victim descriptions at all."""
        if tier is Tier.DEVICE:
            policy = self.cfg.write.l1_to_l2
            if policy is WritePolicy.WRITE_BACK:
                return self._l1_victim
            keeping = self._l1_victim_after_copies() if self._copies_first and self._queued_l2 else None
            if keeping is not None:
                return keeping
            return self._l1_victim_uncopied if self._uncopied else None
        # (an L3 that has not connected yet, `l3_down`, loses what leaves: counted there)
        if self.cfg.write.l2_to_l3 is WritePolicy.WRITE_BACK and (
                self.ctl.l3 is not None or self.ctl.l3_down is not None):
            return self._l2_victim
        return None

    def _l1_victim(self, victim: Victim) -> bool:
        """A slot leaving L1 under write_back goes to L2 first (only what L2 lacks), and
        from there on to L3 as the L2 -> L3 policy says (as a write-through copy landing
        in L2 does: it used to wait for a later match of the node). A failed copy does
        not stop the eviction of a leaf: the slot then leaves the cache (`tree.evict`
        keeps a node with children, whose last copy it would be)."""
        node = victim.node
        self._backup_to_host_or_count(node, "write-back")
        full = victim.pages.get(FULL)
        if (full is not None and not self.tree.is_resident(node, FULL, Tier.HOST)
                and not self.tree.is_resident(node, FULL, Tier.STORAGE)):
            if self._defer_l1_victims and self._parked_l2.get(FULL):
                # L2 is short only of pages L3 write-backs hold (the L2 slot this eviction
                # took to make room among them): room comes once they land. The slot stays
                # in L1 meanwhile while other victims can go; an allocation that needs it
                # gone waits a moment, then takes it (`_allocate`): nothing on the serving
                # path waits on L3. (A node with children too: it could not go at all.)
                self.stats["l1_evictions_deferred"] += 1
                return True
            if self.tree.is_leaf(node):
                # No room in L2 (or a failed copy): a leaf's last copy leaves the cache (a
                # node with children stays, `tree.evict`). Counted in FULL pages, as
                # L2 -> L3 does.
                self.stats["backups_dropped"] += len(full)
        self._maybe_l3([node])  # (nothing without an L3, or where L2 got nothing)
        return False

    def _note_uncopied(self, node: object) -> None:
        """Caller holds the mutex. `node`'s write-through copy found no room in L2."""
        # (selective too: a node whose copy was tried had its hits; a cold one never is)
        if self.cfg.write.l1_to_l2 is not WritePolicy.WRITE_BACK:
            self._uncopied[id(node)] = node
            if len(self._uncopied) > MAX_UNCOPIED:  # (the oldest most likely left L1)
                self._uncopied.popitem(last=False)

    def _on_split(self, tail: object, head: object) -> None:
        """Caller holds the mutex (the tree splits under it). A split node whose copy
        is owed: its new head owes one too. One whose copy is queued: that copy covers
        the head too (it lands over `span`), which must not queue a second one; the same
        for a queued L3 write."""
        if self._uncopied and self._uncopied.get(id(tail)) is tail:
            self._note_uncopied(head)
        copy = self._queued_l2.get(id(tail))
        if copy is not None:
            copy.heads.append(head)
            self._queued_l2[id(head)] = copy
        write = self._queued_l3.get(id(tail))
        if write is not None:  # (the same for a queued L3 write)
            write.nodes.append(head)
            self._queued_l3[id(head)] = write

    def _l1_victim_after_copies(self) -> Callable[[Victim], bool | int] | None:
        """write_through, an allocation that may wait for copies evicting: a FULL victim
        that ranks after a node whose L1->L2 copy is queued (a session-referenced path, a
        hotter one), held by nothing but its copy's pin, is kept, since that node goes
        first once its copy landed; else as `_l1_victim_uncopied`. None when no queued
        node could go (then the eviction builds no victim descriptions for it)."""
        ranks = [self.tree.eviction_rank(Tier.DEVICE, FULL, copy.node, locks=1)
                 for key, copy in self._queued_l2.items() if key == id(copy.node)]
        first = min((r for r in ranks if r is not None), default=None)
        if first is None:
            return None

        def before_drop(victim: Victim) -> bool | int:
            if FULL in victim.pages:
                rank = self.tree.eviction_rank(Tier.DEVICE, FULL, victim.node)
                if rank is not None and rank > first:
                    self._kept_for_copies = True
                    return KEEP_THE_REST  # (the later victims rank after this one)
            return self._l1_victim_uncopied(victim) if self._uncopied else False

        return before_drop

    def _l1_victim_uncopied(self, victim: Victim) -> bool:
        """write_through (and a selective node whose copy was due): a slot whose copy found
        no room in L2 (its pages held by L3 writes in flight, or by locks) leaves L1 as
        under write_back (`_l1_victim`), or its data would leave every tier. Any other slot
        is in L2 already (or, selective, was never due): nothing to do."""
        node = victim.node
        if self._uncopied.get(id(node)) is not node:
            return False
        if self._l1_victim(victim):
            return True  # kept (still uncopied): tried again at the next eviction
        # Forgotten once its FULL slot leaves L1 or has its copy: a checkpoint or window
        # leaving alone (whose copy may have found no room either) leaves the debt owed.
        if FULL in victim.pages or self.tree.is_resident(node, FULL, Tier.HOST):
            del self._uncopied[id(node)]
        return False

    def _l2_victim(self, victim: Victim) -> None:
        """A slot leaving L2 under write_back (with an L3) goes to L3 first. Its host pages
        are held, so the eviction's free parks them until the write finished: nothing on
        the serving path waits on L3."""
        # What L3 holds already stays out: a checkpoint or window leaving L2 is written
        # even where the node's FULL pages are in L3 (it used to be dropped then).
        stale_before = self._stale_before()
        stale = stale_before is not None and self.tree.storage_stale(victim.node, stale_before)
        queued = self._queued_l3.get(id(victim.node))
        pages = {kind: ids for kind, ids in victim.pages.items()
                 if (stale or not self.tree.is_resident(victim.node, kind, Tier.STORAGE))
                 and not (queued is not None  # (a queued write of the node writes those)
                          and self._write_covers(queued, victim.node, kind, len(ids)))}
        if not pages:
            return
        namespace = self.tree.namespace_of(victim.node)
        hashes = victim.hashes()
        # The backup counters count FULL pages (as write-through does): a slot alone adds none.
        full_pages = len(hashes) // PAGE_HASH_BYTES if FULL in pages else 0
        l3 = self.ctl.l3
        if l3 is None or not l3.takes_writes:
            self.stats["backups_dropped"] += full_pages
            return
        writing = self._hold_for_l3(namespace, hashes, pages)

        def release() -> None:
            with self.ctl._mu:
                self._release_for_l3(pages, writing)

        landed: dict[ComponentKind, set[int]] = {}  # (across the job's attempts)

        def run() -> None:
            self._write_l3(namespace, hashes, pages, landed)  # raises to be retried; give-up releases
            with self.ctl._mu:
                self._release_for_l3(pages, writing)
                # A node still in the tree (in L1, or with other slots) records its L3 copy,
                # so its next eviction from L2 does not write (and count) it again. FULL
                # and a checkpoint are whole slots; an SWA slot written may be a tail, so
                # it is not recorded (a later write of it finds the objects present).
                node = victim.node
                if self.tree.is_live(node):
                    if FULL in pages:  # (a checkpoint or window leaving alone renews nothing)
                        self.tree.storage_renewed(node)
                    for kind in (FULL, MAMBA):
                        if kind in pages and not self.tree.is_resident(node, kind, Tier.STORAGE):
                            self.tree.set_resident(node, kind, Tier.STORAGE)

        if not self.backup_worker.submit(Job("write-back", run, lambda _e: release())):
            self.stats["backups_dropped"] += full_pages
            self._release_for_l3(pages, writing)  # not parked yet: the eviction frees them now

    def _unqueue(self, copy: HostCopy) -> None:
        """Caller holds the mutex. A queued copy ended: the nodes it covers (its node and
        the heads splits made of it) may queue copies again."""
        for node in (copy.node, *copy.heads):
            if self._queued_l2.get(id(node)) is copy:
                del self._queued_l2[id(node)]

    def span(self, end: object, pages: int) -> list[tuple[object, int, int]]:
        """The nodes that now hold the last `pages` pages of the path to `end`, root
        first, each with its slice [lo, hi) of those pages: `end` alone unless a match
        split it while a copy ran (the object is the tail, new parents hold the head)."""
        out: list[tuple[object, int, int]] = []
        hi = pages
        node: object | None = end
        while hi > 0 and node is not None:
            n = self._pages_in(node)
            out.append((node, max(0, hi - n), hi))
            hi -= n
            node = self.tree.parent_of(node)
        out.reverse()
        return out

    def _pages_in(self, node: object) -> int:
        tree = self.tree
        return (tree.depth_tokens(node) - tree.depth_tokens(tree.parent_of(node))) // self.ctl._ps

    def _drop_in_flight(self, kind: ComponentKind, ids: np.ndarray) -> None:
        held = self._in_flight.get(kind, [])
        for i, arr in enumerate(held):
            if arr is ids:
                del held[i]
                return

    def _missing_in_host(self, node: object) -> list[tuple[ComponentKind, np.ndarray]]:
        """(kind, L1 pages) of each family slot of `node` that L1 holds and L2 lacks,
        FULL first."""
        out = []
        for kind in self.ctl._kinds:
            dev = self.tree.pages_of(node, kind, Tier.DEVICE)
            if dev is not None and not self.tree.is_resident(node, kind, Tier.HOST):
                out.append((kind, dev))
        return out

    def _host_copies(self, node: object) -> list[tuple[ComponentKind, np.ndarray, np.ndarray]]:
        """(kind, L1 pages, fresh L2 pages) for each family slot of `node` that L2 lacks,
        FULL first; stops (counted) when L2 has no room."""
        moves: list[tuple[ComponentKind, np.ndarray, np.ndarray]] = []
        for kind, dev in self._missing_in_host(node):
            try:
                # Never waits: a wait releases the mutex, and the node (not locked by
                # the callers) could leave L1 meanwhile and `dev` go to another request.
                moves.append((kind, dev, self._allocate(Tier.HOST, kind, len(dev), wait_s=0.0)))
            except ResourceExhausted:
                self.stats["backups_l2_skipped"] += 1
                break
        return moves

    def backup_to_host(self, node: object) -> bool:
        """Copy `node`'s family slots that L2 lacks from L1 (synchronous: a local copy).
        A failing copy frees the L2 pages of the slots not landed yet, then raises."""
        moves = self._host_copies(node)
        for i, (kind, dev, host_ids) in enumerate(moves):
            try:
                self.copier.device_to_host(kind, dev, host_ids)
            except BaseException:
                for k, _dev, ids in moves[i:]:
                    self.free_l2(k, ids)
                raise
            if kind is FULL or self.tree.is_resident(node, FULL, Tier.HOST):
                self.tree.set_resident(node, kind, Tier.HOST, host_ids)
                if kind is FULL:  # (the backup counters count FULL pages, as evictions do)
                    self.stats["backups_l2"] += len(dev)
            else:  # FULL could not go: a slot alone in L2 is of no use
                self.free_l2(kind, host_ids)
        return bool(moves)

    def _backup_to_host_or_count(self, node: object, why: str) -> None:
        """`backup_to_host` where a failure must not fail the caller (a match, an
        eviction): the backup is dropped (counted `backups_l2_failed`, logged)."""
        try:
            self.backup_to_host(node)
        except Exception as e:  # the copy engine's error: its pages are freed already
            self.stats["backups_l2_failed"] += 1
            _failed.error(f"{why}:{type(e).__name__}", "L1->L2 copy (%s) failed; not backed up",
                          why, exc_info=e)

    def after_insert(self, end: object) -> None:
        """Write-through at insert: L1 -> L2 for the path's new pages (on the copy
        worker, off the request path), then L3."""
        policy = self.cfg.write.l1_to_l2
        threshold = self.cfg.write.selective_threshold
        if policy is not WritePolicy.WRITE_BACK:
            lacking = self.tree.nodes_lacking(end, FULL, Tier.HOST)
            if len(self.ctl._kinds) > 1 and end not in lacking:
                # A slot committed after the node's FULL pages went down (a checkpoint, a
                # whole SWA window): `backup_to_host_async` copies what L2 lacks.
                lacking.append(end)
            for node in lacking:
                if policy is WritePolicy.WRITE_THROUGH or self.tree.hits(node) >= threshold:
                    self.backup_to_host_async(node)
        if self.ctl.l3 is not None:
            self._maybe_l3(self.tree.path_to(end))

    def refill_host(self, end: object | None) -> None:
        """An insert let L2 copies on the path to `end` go (a longer SWA tail replaced
        them in L1): under a write-through policy the new slots go down again (write-back
        copies them when they leave L1)."""
        if end is None or self.cfg.write.l1_to_l2 is WritePolicy.WRITE_BACK:
            return
        for node in self.tree.path_to(end):
            if self.tree.is_resident(node, FULL, Tier.HOST) and self._missing_in_host(node):
                self.backup_to_host_async(node)

    def backup_to_host_async(self, node: object) -> None:
        """Like `backup_to_host`, but on the copy worker: the node is pinned now (its L1
        pages cannot move) until the copy landed; the worker takes the host pages.

        Copies queued while the worker is busy share its next flush: one L2 allocation
        per family, one engine call per family and one landing under the mutex, in the
        order they were queued (up to `FLUSH_PAGES` pages; the rest take the next)."""
        if id(node) in self._queued_l2:
            return
        slots = self._missing_in_host(node)
        if not slots:
            return
        if not self._pending_l2:
            self._pending_since = time.monotonic()
        copy = HostCopy(node, slots, self.tree.pin(node))
        self._queued_l2[id(node)] = copy
        self._pending_l2.append(copy)
        self._pending_pages += copy.pages
        self._schedule_l2_flush()

    def hold_flushes(self) -> bool:
        """Caller holds the mutex. Copies queued from now on wait for `release_flushes`
        (one flush for a whole Batch call, and none competing with sending the reply).
        One hold at a time: with RPCs overlapping, the others take none (False), so that
        copies wait for one RPC at most; holds taken back to back would hold them off
        for as long as the traffic lasts."""
        if self._flush_holds:
            return False
        self._flush_holds = 1
        return True

    def release_flushes(self) -> None:
        """Caller holds the mutex; ends a hold `hold_flushes` granted."""
        self._flush_holds = 0
        self._schedule_l2_flush()

    def _schedule_l2_flush(self, urgent: bool = False) -> None:
        """Caller holds the mutex. At most one flush job is queued on the copy worker: it
        waits until the pending copies are due (`_batch_due`), then takes whatever is
        pending, so later copies ride along. Held by an RPC under way unless `urgent`
        (someone waits for the copies, or they were due before)."""
        if not self._pending_l2:
            return
        if urgent:
            self._flush_now = True
        if self._flush_holds and not urgent:
            return
        if self._flush_waiting:
            if self._batch_due():
                self._flush_wake.notify()
            return
        if self._flush_queued:
            return
        self._flush_queued = True
        if not self.copy_worker.submit(Job("l1-to-l2", self._flush_l2, lambda _e: None)):
            self._flush_queued = False
            if not self.copy_worker.closed:  # closed: shutting down, the pools go next
                self._flush_now = True  # (not waiting for a batch here)
                self._flush_l2()  # queue full: copy here rather than lose the backups

    def _flush_l2(self) -> None:
        """Reserve host pages for the oldest pending L1->L2 backups, copy them (one engine
        call per family) outside the mutex, then land them and schedule the next flush.
        Two critical sections, not more: each is a hand-off with the serving threads. A
        failure lands them as not copied (their host pages are freed) and raises, so the
        worker counts and logs it."""
        with self.ctl._mu:
            if not self._wait_for_batch():
                self._flush_queued = False  # held: the RPC's end schedules the flush
                return
            batch = self._take_pending()
            if not batch:
                return
            try:
                self._reserve_host(batch)
            except BaseException:
                try:
                    self._land_l2(batch, copied=False)
                finally:
                    self._schedule_l2_flush(urgent=True)
                raise
        copied = False
        try:
            moves = [(kind, dev, host_ids) for copy in batch for kind, dev, host_ids in copy.moves]
            for kind, dev, host_ids in per_family(moves):
                self.copier.device_to_host(kind, dev, host_ids)
            copied = True
        finally:
            with self.ctl._mu:
                try:
                    self._land_l2(batch, copied)
                finally:
                    # What did not fit in this flush was due already: not held.
                    self._schedule_l2_flush(urgent=True)

    def _batch_due(self) -> bool:
        """Caller holds the mutex. Whether the pending copies stop waiting for others to
        share their flush: `write.l1_to_l2_batch_pages` pages wait, the first waited
        `l1_to_l2_batch_ms`, or someone needs them."""
        return (self._flush_now or self._pending_pages >= self._batch_pages
                or time.monotonic() - self._pending_since >= self._batch_s)

    def _wait_for_batch(self) -> bool:
        """Caller holds the mutex (released while waiting): until the pending copies are
        due (True), or held by an RPC under way (False: its end schedules the flush; the
        copy worker does not wait for it, since that end may be a job queued behind this
        one). Woken by `_schedule_l2_flush` once they are due; on its own only after
        `IDLE_FLUSH_FACTOR` batch times (no RPC came to end). Pages pinned meanwhile stay
        in L1; an allocation short of room, `drain` and `close` make them due at once."""
        while self._pending_l2:
            if self._flush_holds and not self._flush_now:
                return False
            if self._batch_due():
                break
            idle = self._pending_since + IDLE_FLUSH_FACTOR * self._batch_s - time.monotonic()
            if idle <= 0:
                break
            self._flush_waiting = True
            try:
                self._flush_wake.wait(idle)
            finally:
                self._flush_waiting = False
        return True

    def _take_pending(self) -> list[HostCopy]:
        """Caller holds the mutex. The oldest pending copies, up to `FLUSH_PAGES` pages
        (at least one copy); copies queued from now on schedule the next flush."""
        pending, pages, n = self._pending_l2, 0, 0
        while n < len(pending) and (n == 0 or pages + pending[n].pages <= FLUSH_PAGES):
            pages += pending[n].pages
            n += 1
        batch, self._pending_l2 = pending[:n], pending[n:]
        self._pending_pages -= pages
        self._flush_queued = False
        self._flush_now = False  # (what is left was due: the flush schedules it urgently)
        return batch

    def _reserve_host(self, batch: list[HostCopy]) -> None:
        """Caller holds the mutex. Host pages for each queued slot, one allocation per
        family for the whole batch (evicting from L2 as needed). Never waiting: not for
        queued copies (those are this batch), and not for host pages an L3 write holds,
        since L1 allocations wait for this flush and the serving path must not wait on
        L3 (a store slower than the write stream would throttle requests). Short of room,
        node by node: a node whose FULL slot finds none is skipped (counted, its L1 pages
        unpinned); a later slot without room stops its node's copies there."""
        want: dict[ComponentKind, int] = {}
        for copy in batch:
            for kind, dev in copy.slots:
                want[kind] = want.get(kind, 0) + len(dev)
        got: dict[ComponentKind, np.ndarray] = {}
        for kind, n in want.items():
            with contextlib.suppress(ResourceExhausted):  # else node by node below
                got[kind] = self._allocate(Tier.HOST, kind, n, wait_for_copies=False, wait_s=0.0)
        used = dict.fromkeys(got, 0)
        try:
            for copy in batch:
                for kind, dev in copy.slots:
                    if kind in got:
                        host_ids = got[kind][used[kind] : used[kind] + len(dev)]
                        used[kind] += len(dev)
                    else:
                        try:
                            host_ids = self._allocate(Tier.HOST, kind, len(dev), wait_s=0.0)
                        except ResourceExhausted:
                            self.stats["backups_l2_skipped"] += 1
                            break
                    self._in_flight.setdefault(kind, []).append(host_ids)
                    copy.moves.append((kind, dev, host_ids))
        finally:
            for kind, ids in got.items():  # what skipped slots would have taken
                self.free_l2(kind, ids[used[kind] :])

    def _land_l2(self, batch: list[HostCopy], copied: bool) -> None:
        """Caller holds the mutex. Ends one flush, copied or not: `l2_flushes` counts it
        here, so a flush counted has landed (counted when it started, a reader could see
        it before its pages were in L2)."""
        self.stats["l2_flushes"] += 1
        landed: dict[int, object] = {}
        l3 = self.ctl.l3 is not None  # (else `_maybe_l3` has nothing to do: no list to build)
        for copy in batch:
            node, moves = copy.node, copy.moves
            if not moves:  # no room in L2: nothing was reserved
                self._unqueue(copy)
                self.tree.unlock(copy.pin)
                self._note_uncopied(node)
                continue
            span = self.span(node, len(moves[0][1]) if moves[0][0] is not MAMBA else 1)
            if not copied:  # the copy failed: made when the slot leaves L1, as without room
                self.stats["backups_l2_failed"] += 1
                for part, _, _ in span:
                    if self.tree.is_live(part) and not self.tree.is_resident(part, FULL, Tier.HOST):
                        self._note_uncopied(part)
            for kind, _dev, host_ids in moves:
                self._drop_in_flight(kind, host_ids)
                if kind is MAMBA:
                    parts = [(node, 0, 1)]
                else:  # an SWA slot may be its node's tail: the last pages of the span
                    parts = span if len(host_ids) == len(moves[0][1]) else self.span(node, len(host_ids))
                for part, lo, hi in parts:
                    full_there = kind is FULL or self.tree.is_resident(part, FULL, Tier.HOST)
                    if (copied and full_there and self.tree.is_live(part)
                            and not self.tree.is_resident(part, kind, Tier.HOST)):
                        try:
                            self.tree.set_resident(part, kind, Tier.HOST, host_ids[lo:hi])
                        except InvalidArgument as e:  # a bug: the rest of the batch still lands
                            log.error("L1->L2 copy of a %s slot not landed: %s", kind.value, e)
                            self.stats["l2_landings_refused"] += 1
                            self.free_l2(kind, host_ids[lo:hi])
                            continue
                        if kind is FULL:
                            self.stats["backups_l2"] += hi - lo
                    else:
                        self.free_l2(kind, host_ids[lo:hi])
            self._unqueue(copy)
            self.tree.unlock(copy.pin)
            if l3:
                landed.update((id(part), part) for part, _, _ in span)
        self.landed.notify_all()
        if l3:
            self._maybe_l3(list(landed.values()))

    def after_match(self, m: MatchResult) -> None:
        """Selective write-through: nodes that just got hot go down a tier."""
        threshold = self.cfg.write.selective_threshold
        if self.cfg.write.l1_to_l2 is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in m.path:
                if (self.tree.hits(node) >= threshold and self.tree.is_resident(node, FULL, Tier.DEVICE)
                        and not self.tree.is_resident(node, FULL, Tier.HOST)):
                    self._backup_to_host_or_count(node, "selective write-through")
                    if not self.tree.is_resident(node, FULL, Tier.HOST):
                        self._note_uncopied(node)  # (no room: copied when it leaves L1)
        self._maybe_l3(m.path)

    def _maybe_l3(self, nodes: tuple[object, ...] | list[object]) -> None:
        policy = self.cfg.write.l2_to_l3
        if self.ctl.l3 is None or policy is WritePolicy.WRITE_BACK:
            return
        threshold = self.cfg.write.selective_threshold
        stale_before = self._stale_before()
        selective = policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        for node in nodes:  # (every match's path: the cheap mask tests first)
            if (stale_before is not None and self.tree.storage_stale(node, stale_before)
                    and not self.tree.is_resident(node, FULL, Tier.HOST)
                    and self.tree.is_resident(node, FULL, Tier.DEVICE)
                    and id(node) not in self._queued_l2
                    and not (selective and self.tree.hits(node) < threshold)):
                # An expiring record of a slot L2 let go (`l1_to_l2: write_back`): written
                # again from a copy in L2, like any L3 write. (A copy queued already lands
                # and is written then.)
                self._backup_to_host_or_count(node, "L3 record renewal")
            # (A checkpoint or window committed after FULL went down goes on its own.)
            kinds = self.tree.slots_for_storage(node, stale_before)
            if not kinds or (selective and self.tree.hits(node) < threshold):
                continue
            self.backup_to_storage(node, kinds)

    def _stale_before(self) -> float | None:
        """With a store whose objects expire (`storage.redis.ttl_s`), records of L3
        residency made before this (half a TTL ago, the existence cache's bound too) may
        name expired objects: they are written again where they go through a write path,
        which renews the objects (else a longer prompt's write stored only its new tail,
        whose head had expired: unreachable). None: objects do not expire."""
        ttl = None if self.ctl.l3 is None else self.ctl.l3.object_ttl_s
        return None if ttl is None else time.monotonic() - ttl / 2

    def backup_to_storage(self, node: object, kinds: list[ComponentKind]) -> None:
        """Queue an L3 write of `node`'s L2 slots of `kinds` (`slots_for_storage`). Its host
        pages are held (a free while the write runs is parked until it finished) rather
        than the node pinned, so a slow store never locks L1 or L2 pages. Dropped (counted)
        while the breaker is open or the queue is full. `backups_l3` counts FULL pages."""
        l3 = self.ctl.l3
        assert l3 is not None
        if id(node) in self._queued_l3:
            return
        hashes = self.tree.page_hashes(node)
        full_pages = len(hashes) // PAGE_HASH_BYTES if FULL in kinds else 0
        if not l3.takes_writes:
            self.stats["backups_dropped"] += full_pages
            return
        namespace = self.tree.namespace_of(node)
        pages = {
            kind: ids for kind in kinds
            if (ids := self.tree.pages_of(node, kind, Tier.HOST)) is not None
        }
        writing = self._hold_for_l3(namespace, hashes, pages)
        write = L3Write({kind: len(ids) for kind, ids in pages.items()}, [node])
        self._queued_l3[id(node)] = write

        def finish(stored: bool, failed: bool = True) -> None:
            with self.ctl._mu:
                self._release_for_l3(pages, writing)
                for part in write.nodes:
                    if self._queued_l3.get(id(part)) is write:
                        del self._queued_l3[id(part)]
                if not stored:
                    self.stats["backups_l3_failed"] += int(failed)
                    return
                self._landed_l3(write, pages)

        landed: dict[ComponentKind, set[int]] = {}  # (across the job's attempts)

        def run() -> None:
            self._write_l3(namespace, hashes, pages, landed)
            finish(True)

        if not self.backup_worker.submit(Job("write-through", run, lambda _e: finish(False))):
            self.stats["backups_dropped"] += full_pages
            finish(False, failed=False)

    def _landed_l3(self, write: L3Write, pages: dict[ComponentKind, np.ndarray]) -> None:
        """Caller holds the mutex. An L3 write stored `pages` (of its node, and of the
        heads split off it meanwhile): record each slot it covers (`_write_covers`) that
        L2 or L1 still holds, then offer what it did not write: slots committed or grown
        since it was queued (a checkpoint, a window), whose L2 landing found it queued."""
        end = write.nodes[0]
        if FULL in pages and self.tree.is_live(end):
            self.tree.storage_renewed(end)  # (a record of FULL, written again)
        for part in write.nodes:
            if not self.tree.is_live(part):
                continue
            for kind in pages:
                held = self.tree.pages_of(part, kind, Tier.HOST)
                if held is None:
                    held = self.tree.pages_of(part, kind, Tier.DEVICE)
                if held is None or not self._write_covers(write, part, kind, len(held)):
                    continue
                if not self.tree.is_resident(part, kind, Tier.STORAGE):
                    self.tree.set_resident(part, kind, Tier.STORAGE)  # (a partial slot: not recorded)
                if kind is FULL:
                    self.tree.storage_renewed(part)  # (a head's record too, written again)
        if self.cfg.write.l2_to_l3 is WritePolicy.WRITE_BACK:
            return  # (written when it leaves L2)
        stale_before = self._stale_before()
        for part in write.nodes:
            if self.tree.is_live(part):
                missed = self.tree.slots_for_storage(part, stale_before)
                if missed:
                    self.backup_to_storage(part, missed)

    def _write_covers(self, write: L3Write, part: object, kind: ComponentKind, slot_pages: int) -> bool:
        """Caller holds the mutex. Whether `write` stores `part`'s `kind` slot of
        `slot_pages` pages (its last pages, up to `part`'s end): those token pages lie
        among the last `write.pages[kind]` of the path to the write's node. A MAMBA
        checkpoint: the write's node's own. (`part` is that node or a head split off it;
        the node may have left the tree since: its depth still says where the pages were.)"""
        n = write.pages.get(kind)
        if n is None:
            return False
        end = write.nodes[0]
        if kind is MAMBA:
            return part is end
        if not self.tree.is_live(part):
            return False
        end_at = self.tree.depth_tokens(end)
        part_end = self.tree.depth_tokens(part)
        ps = self.cfg.model.page_size
        return part_end <= end_at and part_end - slot_pages * ps >= end_at - n * ps

    def _hold_for_l3(self, namespace: str, hashes: bytes,
                     pages: dict[ComponentKind, np.ndarray]) -> list[Writing]:
        """Caller holds the mutex. An L3 write of `pages` is queued: hold them (a free
        while it runs parks them) and record the pages `_write_l3` will store as in flight
        (lookups count them as present and reads wait for them: L2 may let go of them
        before they land). Pass what this returns to `_release_for_l3`, exactly once."""
        l3 = self.ctl.l3
        assert l3 is not None
        for kind, ids in pages.items():
            self._hold_l2(kind, ids)
        writing: list[Writing] = []
        for _kind, _ids, targets, members in self._l3_targets(hashes, pages):
            writing += l3.begin_write(namespace, targets, members)
        return writing

    def _release_for_l3(self, pages: dict[ComponentKind, np.ndarray], writing: list[Writing]) -> None:
        """Caller holds the mutex. The write `_hold_for_l3` recorded landed, was given up
        or dropped: it is no longer in flight, and its pages are no longer held."""
        l3 = self.ctl.l3
        assert l3 is not None
        l3.end_write(writing)
        for kind, ids in pages.items():
            self._unhold_l2(kind, ids)

    def _l3_targets(self, hashes: bytes, pages: dict[ComponentKind, np.ndarray]
                    ) -> Iterator[tuple[ComponentKind, np.ndarray, list[PageHash], tuple[MemberSpec, ...]]]:
        """(kind, host pages, their page hashes, family) of each slot an L3 write stores:
        a MAMBA checkpoint is at the node's end; an SWA slot may be its node's tail."""
        page_hashes = split_hashes(hashes)
        for kind, ids in pages.items():
            yield kind, ids, page_hashes[len(page_hashes) - len(ids) :], self.cfg.model.family(kind)

    def _write_l3(self, namespace: str, hashes: bytes, pages: dict[ComponentKind, np.ndarray],
                  landed: dict[ComponentKind, set[int]]) -> None:
        """Store `pages`; raises unless L3 holds them all. Every attempt writes every page
        (a store that evicts to make room, Mooncake, then keeps the pages an earlier
        attempt stored rather than push them out for the rest: a chain's head must stay
        for its tail to be of use). `landed`: the pages (indices, by kind) earlier attempts
        of this job got into L3, added to. Counts FULL pages: stored (`backups_l3`) or
        found there already (`backups_l3_present`: another daemon, or an earlier job of
        the same pages, stored them), each once per job: a retry finds the pages its
        earlier attempt stored, which are not another's."""
        l3 = self.ctl.l3
        assert l3 is not None
        for kind, ids, targets, members in self._l3_targets(hashes, pages):
            done = l3.write(namespace, targets, members, ids)
            seen = landed.setdefault(kind, set())
            if kind is FULL:
                with self.ctl._mu:
                    self.stats["backups_l3"] += done.stored
                    self.stats["backups_l3_present"] += len(set(done.found) - seen)
            seen.update(done.landed)
            if done.in_l3 < len(targets):  # retried; refusals count against the write breaker
                raise BackendUnavailable(f"L3 stored {done.in_l3} of {len(targets)} {kind.value} pages")

    # ------------------------------------------------------------------ copy-on-write

    def copy_l1_slot(self, kind: ComponentKind, src: int, dst: int) -> None:
        """Copy one L1 slot of a family to another (MAMBA copy-on-write), complete when
        this returns (on CUDA too: the engine uses `dst` right after the RPC)."""
        self.copier.copy_within_device(kind, src, dst)

    # ------------------------------------------------------------------ flush

    def flush(self, timeout_s: float) -> int:
        """Everything L3 lacks goes down (L1-only slots via L2 first); waits up to
        `timeout_s`; returns pages written. One flush at a time: a second waits (within
        its timeout) for the one under way, then writes what is left, so that two never
        both count the pages written meanwhile."""
        deadline = time.monotonic() + timeout_s
        if self.ctl.l3 is None:
            return 0
        if not self._flushing.acquire(timeout=max(0.0, timeout_s)):
            return 0
        try:
            return self._flush(deadline)
        finally:
            self._flushing.release()

    def _flush(self, deadline: float) -> int:
        before = self.stats["backups_l3"]
        # NOTE: jobs already queued land first. A node whose L3 write is still queued is
        # not L3-resident yet, so scanning now would queue (and write, and count) it twice.
        self.drain(max(0.0, deadline - time.monotonic()))
        # What L2 holds goes down first: staging an L1-only slot into L2 may evict L2
        # slots, which (unless L2 -> L3 is write-back) leave unwritten. Once written they
        # leave safely (and a staged slot whose write is queued is held until it landed).
        # The drain between: an evicted page a queued write holds frees only once it
        # landed, and staging takes free L2 pages only (it never waits).
        with self.ctl._mu:
            stale_before = self._stale_before()
            for node in self.tree.iter_nodes():
                if kinds := self.tree.slots_for_storage(node, stale_before):
                    self.backup_to_storage(node, kinds)
        self.drain(max(0.0, deadline - time.monotonic()))
        # Staging passes until one writes nothing more: staging a slot may evict one staged
        # just before it, whose L2 pages stay parked until its write lands (no room comes
        # from it meanwhile): the slot that found no room goes in the next pass.
        left = self.unflushed_pages()
        while True:  # (once at least: checkpoints and windows are no FULL pages)
            with self.ctl._mu:
                for node in self.tree.iter_nodes():
                    if not self.tree.is_live(node):
                        continue  # evicted by an earlier node's staging
                    self.backup_to_host(node)  # (any slot L1 holds and L2 lacks; else nothing)
                    if kinds := self.tree.slots_for_storage(node, stale_before):
                        self.backup_to_storage(node, kinds)
            self.drain(max(0.0, deadline - time.monotonic()))
            left, was = self.unflushed_pages(), left
            if not left or left >= was or time.monotonic() >= deadline:
                break  # (what is left cannot go: L3 refused it, or L2 has no room at all)
        return self.stats["backups_l3"] - before

    def unflushed_pages(self) -> int:
        """FULL pages L1/L2 hold that L3 lacks (after a flush: those it could not write);
        0 without an L3 configured (one configured that never connected lacks them all)."""
        if self.ctl.l3 is None and self.ctl.l3_down is None:
            return 0
        with self.ctl._mu:
            return self.tree.full_pages_only_above(Tier.STORAGE)

    # ------------------------------------------------------------------ audit

    def check_ownership(self, engines: EngineRegistry) -> None:
        """Every allocated L1/L2 page is held by exactly one owner, and every owned page
        is allocated (counts alone would let a leak hide a page freed while still owned)."""
        for tier, pools in ((Tier.DEVICE, self.ctl.device), (Tier.HOST, self.ctl.host)):
            for kind in self.ctl._kinds:
                owned: list[np.ndarray] = []
                for node in self.tree.iter_nodes():
                    ids = self.tree.pages_of(node, kind, tier)
                    if ids is not None:
                        owned.append(ids)
                if tier is Tier.DEVICE:
                    for rec in engines._allocations.values():
                        if kind in rec.pages:
                            owned.append(rec.pages[kind])
                        owned.extend(rec.retired.get(kind, []))
                        if kind is MAMBA and rec.mamba_slot is not None:
                            owned.append(np.array([rec.mamba_slot]))
                    owned.extend(self.ctl.prefetcher.reserved_l1(kind))
                    owned.extend(self.ctl.loads.loading_pages(kind))
                else:
                    owned.extend(self._in_flight.get(kind, []))
                    owned.append(np.array(self._parked_l2.get(kind, []), dtype=np.int64))
                    owned.extend(self.ctl.prefetcher.reserved(kind))
                ids = np.concatenate(owned) if owned else np.empty(0, dtype=np.int64)
                alloc = pools.allocator(kind)
                assert len(np.unique(ids)) == len(ids), f"{tier.name} {kind.value}: a page owned twice"
                free_owned = ids[~alloc.is_allocated(ids)]
                assert not free_owned.size, (
                    f"{tier.name} {kind.value}: pages {free_owned[:8].tolist()} owned but free "
                    f"(freed while still owned, or owned and never allocated)"
                )
                used = alloc.total - alloc.free_count
                assert len(ids) == used, (
                    f"{tier.name} {kind.value}: {used} pages allocated, {len(ids)} owned (leak)"
                )
