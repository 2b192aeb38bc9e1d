"""Page families moving between tiers: room-making, write policies, loads, L3 backups.

Called by the controller under its mutex, except `run_load`'s copy (outside it: the
locked pages cannot move) and the L3 backup jobs (on the backup worker).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.controller.base import LoadProgress
from hicache.controller.workers import Job, Worker
from hicache.errors import BackendUnavailable, ResourceExhausted
from hicache.keys import split_hashes
from hicache.tree import MatchResult, TreeLock, Victim
from hicache.types import ComponentKind, Tier, WritePolicy

if TYPE_CHECKING:
    from hicache.controller.controller import HybridCacheController
    from hicache.controller.engines import EngineRegistry
    from hicache.tiers.base import CopyEngine

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
BACKPRESSURE_S = 5.0  # longest an allocation waits for queued copies to free room


@dataclass
class LoadOp:
    """Host -> device copies of one lock's path, with per-layer progress."""

    moves: list[tuple[object, ComponentKind, np.ndarray, np.ndarray]]  # node, kind, host, dev
    layers_total: int
    layers_ready: int = 0
    done: bool = False
    error: BaseException | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)

    def layer_done(self, layer: int) -> None:
        with self.cond:
            self.layers_ready = max(self.layers_ready, layer + 1)
            self.cond.notify_all()


class Transfers:
    def __init__(self, ctl: HybridCacheController, copier: CopyEngine) -> None:
        self.ctl = ctl
        self.tree = ctl.tree
        self.copier = copier
        self.cfg = ctl.cfg
        self.stats: Counter[str] = Counter()
        # L3 writes retry over ~6 s: long enough for a restarted store to come back
        # (Mooncake remounts its segment about a second after its master restarts).
        self.backup_worker = Worker("backup", capacity=4096, retries=5, backoff_s=0.2)
        # L1->L2 copies are local and fast: their own worker, never behind slow L3 writes.
        self.copy_worker = Worker("l1-to-l2", capacity=4096, retries=0)
        # Host pages an L3 write is reading: freeing one parks it until the write is done.
        self._held_l2: dict[ComponentKind, Counter[int]] = {}
        self._parked_l2: dict[ComponentKind, list[int]] = {}
        self._in_flight: dict[ComponentKind, list[np.ndarray]] = {}  # host pages owned by jobs
        # Nodes with a copy queued, so a second request over the same path does not queue
        # (and write) it again.
        self._queued_l2: set[int] = set()
        self._queued_l3: set[int] = set()
        # Notified whenever a copy lands or held host pages are released: an allocation
        # short of room waits on it (releasing the mutex) rather than failing at once.
        self.landed = threading.Condition(ctl._mu)
        self._evicting = 0  # inside a tree eviction callback: never wait there

    def start(self) -> None:
        self.backup_worker.start()
        self.copy_worker.start()

    def close(self) -> None:
        self.copy_worker.close()
        self.backup_worker.close()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued copy (L1->L2, then L2->L3) has landed."""
        deadline = time.monotonic() + timeout_s
        ok = self.copy_worker.drain(timeout_s)
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

    def allocate_l2(self, kind: ComponentKind, n: int) -> np.ndarray:
        return self._allocate(Tier.HOST, kind, n)

    def _allocate(self, tier: Tier, kind: ComponentKind, n: int) -> np.ndarray:
        pools = self.ctl.device if tier is Tier.DEVICE else self.ctl.host
        alloc = pools.allocator(kind)
        deadline = time.monotonic() + BACKPRESSURE_S
        while True:
            if alloc.free_count < n:
                self._evict(tier, kind, n - alloc.free_count)
            if alloc.free_count >= n:
                return alloc.allocate(n)
            pending = self._queued_l2 or (tier is Tier.HOST and any(self._parked_l2.values()))
            left = deadline - time.monotonic()
            if not pending or self._evicting or left <= 0:
                raise ResourceExhausted(
                    f"L{1 if tier is Tier.DEVICE else 2} {kind.value}: {n} pages needed, "
                    f"{alloc.free_count} free and the rest locked"
                )
            self.stats["allocation_waits"] += 1
            self.landed.wait(min(left, 0.05))

    def free_l1(self, kind: ComponentKind, ids: np.ndarray) -> None:
        if len(ids):
            self.ctl.device.allocator(kind).free(ids)

    def free_l2(self, kind: ComponentKind, ids: np.ndarray) -> None:
        if not len(ids):
            return
        held = self._held_l2.get(kind)
        if held:
            busy = np.fromiter((held[int(i)] > 0 for i in ids), dtype=bool, count=len(ids))
            if busy.any():
                self._parked_l2.setdefault(kind, []).extend(int(i) for i in ids[busy])
                ids = ids[~busy]
        if len(ids):
            self.ctl.host.allocator(kind).free(ids)

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
        pools = self.ctl.device if tier is Tier.DEVICE else self.ctl.host
        alloc = pools.allocator(kind)
        target = alloc.free_count + n
        for victim_kind in dict.fromkeys((kind, FULL)):
            short = target - alloc.free_count
            if short <= 0:
                break
            callback = self._l1_victim if tier is Tier.DEVICE else self._l2_victim
            self._evicting += 1
            try:
                result = self.tree.evict(tier, victim_kind, short, before_drop=callback)
            finally:
                self._evicting -= 1
            free = self.free_l1 if tier is Tier.DEVICE else self.free_l2
            for k, ids in result.freed.items():
                free(k, ids)  # host pages a write-back job holds are parked, not freed
            self.stats[f"evicted_{tier.name.lower()}_{victim_kind.value}"] += result.evicted_pages

    # ------------------------------------------------------------------ write policies

    def _l1_victim(self, victim: Victim) -> None:
        """A slot leaving L1: under write_back it goes to L2 first (only what L2 lacks)."""
        if self.cfg.write.l1_to_l2 is not WritePolicy.WRITE_BACK:
            return
        self.backup_to_host(victim.node)

    def _l2_victim(self, victim: Victim) -> None:
        """A slot leaving L2: under write_back it goes to L3 first. Its host pages are
        held, so the eviction's free parks them until the write finished: nothing on the
        serving path waits on L3."""
        if (self.cfg.write.l2_to_l3 is not WritePolicy.WRITE_BACK or self.ctl.l3 is None
                or self.tree.is_resident(victim.node, FULL, Tier.STORAGE)):
            return
        namespace = self.tree.namespace_of(victim.node)
        hashes = victim.hashes()
        pages = dict(victim.pages)
        for kind, ids in pages.items():
            self._hold_l2(kind, ids)

        def release(_e: BaseException | None = None) -> None:
            with self.ctl._mu:
                for kind, ids in pages.items():
                    self._unhold_l2(kind, ids)

        def run() -> None:
            self._write_l3(namespace, hashes, pages)  # raises to be retried; give-up releases
            self.stats["backups_l3"] += len(hashes) // 16
            release()

        if self.ctl.l3.breaker.is_open or not self.backup_worker.submit(Job("write-back", run, release)):
            self.stats["backups_dropped"] += len(hashes) // 16
            for kind, ids in pages.items():  # not parked yet: the eviction frees them now
                self._unhold_l2(kind, ids)

    def _span(self, end: object, pages: int) -> list[tuple[object, int, int]]:
        """The nodes that now hold the last `pages` pages of the path to `end`, root
        first, each with its slice [lo, hi) of those pages."""
        path = self.tree.path_to(end)
        out: list[tuple[object, int, int]] = []
        hi = pages
        for node in reversed(path):
            if hi <= 0:
                break
            n = (self.tree.depth_tokens(node) - self.tree.depth_tokens(self.tree.parent_of(node))) // self.ctl._ps
            out.append((node, max(0, hi - n), hi))
            hi -= n
        return list(reversed(out))

    def _drop_in_flight(self, kind: ComponentKind, ids: np.ndarray) -> None:
        held = self._in_flight.get(kind, [])
        for i, arr in enumerate(held):
            if arr is ids:
                del held[i]
                return

    def _host_copies(self, node: object) -> list[tuple[ComponentKind, np.ndarray, np.ndarray]]:
        """(kind, L1 pages, fresh L2 pages) for each family slot of `node` that L2 lacks,
        FULL first; stops (counted) when L2 has no room."""
        moves: list[tuple[ComponentKind, np.ndarray, np.ndarray]] = []
        for kind in self.ctl._kinds:
            dev = self.tree.pages_of(node, kind, Tier.DEVICE)
            if dev is None or self.tree.is_resident(node, kind, Tier.HOST):
                continue
            try:
                moves.append((kind, dev, self.allocate_l2(kind, len(dev))))
            except ResourceExhausted:
                self.stats["backups_l2_skipped"] += 1
                break
        return moves

    def backup_to_host(self, node: object) -> bool:
        """Copy `node`'s family slots that L2 lacks from L1 (synchronous: a local copy)."""
        moves = self._host_copies(node)
        for kind, dev, host_ids in moves:
            self.copier.device_to_host(kind, dev, host_ids)
            if kind is FULL or self.tree.is_resident(node, FULL, Tier.HOST):
                self.tree.set_resident(node, kind, Tier.HOST, host_ids)
                self.stats["backups_l2"] += len(dev)
            else:  # FULL could not go: a slot alone in L2 is of no use
                self.free_l2(kind, host_ids)
        return bool(moves)

    def after_insert(self, end: object) -> None:
        """Write-through at insert: L1 -> L2 for the path's new pages (on the backup
        worker, off the request path), then L3."""
        policy = self.cfg.write.l1_to_l2
        threshold = self.cfg.write.selective_threshold
        for node in self.tree.path_to(end):
            if self.tree.is_resident(node, FULL, Tier.HOST):
                continue
            if policy is WritePolicy.WRITE_THROUGH or (
                policy is WritePolicy.WRITE_THROUGH_SELECTIVE and self.tree.hits(node) >= threshold
            ):
                self.backup_to_host_async(node)
        self._maybe_l3(self.tree.path_to(end))

    def backup_to_host_async(self, node: object) -> None:
        """Like `backup_to_host`, but the copy runs on the backup worker: host pages are
        taken now, the node is pinned (its L1 pages cannot move) until the copy landed."""
        if id(node) in self._queued_l2:
            return
        moves = self._host_copies(node)
        if not moves:
            return
        for kind, _dev, host_ids in moves:
            self._in_flight.setdefault(kind, []).append(host_ids)
        pin = self.tree.pin(node)
        self._queued_l2.add(id(node))

        def land(copied: bool) -> None:
            with self.ctl._mu:
                # NOTE: a match may have split the node meanwhile; the pinned object is the
                # tail, its new parents hold the head of the copied span.
                span = self._span(node, len(moves[0][1]) if moves[0][0] is not MAMBA else 1)
                for kind, _dev, host_ids in moves:
                    self._drop_in_flight(kind, host_ids)
                    parts = [(node, 0, 1)] if kind is MAMBA else span
                    for part, lo, hi in parts:
                        full_there = kind is FULL or self.tree.is_resident(part, FULL, Tier.HOST)
                        if (copied and full_there and self.tree.is_live(part)
                                and not self.tree.is_resident(part, kind, Tier.HOST)):
                            self.tree.set_resident(part, kind, Tier.HOST, host_ids[lo:hi])
                            self.stats["backups_l2"] += hi - lo
                        else:
                            self.free_l2(kind, host_ids[lo:hi])
                self._queued_l2.discard(id(node))
                self.tree.unlock(pin)
                self.landed.notify_all()
                self._maybe_l3([part for part, _, _ in span])

        def run() -> None:
            for kind, dev, host_ids in moves:
                self.copier.device_to_host(kind, dev, host_ids)
            land(True)

        if not self.copy_worker.submit(Job("l1-to-l2", run, lambda _e: land(False))):
            # Queue full: copy here rather than lose the backup.
            for kind, dev, host_ids in moves:
                self.copier.device_to_host(kind, dev, host_ids)
            land(True)

    def after_match(self, m: MatchResult) -> None:
        """Selective write-through: nodes that just got hot go down a tier."""
        threshold = self.cfg.write.selective_threshold
        if self.cfg.write.l1_to_l2 is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in m.path:
                if (self.tree.hits(node) >= threshold and self.tree.is_resident(node, FULL, Tier.DEVICE)
                        and not self.tree.is_resident(node, FULL, Tier.HOST)):
                    self.backup_to_host(node)
        self._maybe_l3(m.path)

    def _maybe_l3(self, nodes: tuple[object, ...] | list[object]) -> None:
        policy = self.cfg.write.l2_to_l3
        if self.ctl.l3 is None or policy is WritePolicy.WRITE_BACK:
            return
        threshold = self.cfg.write.selective_threshold
        for node in nodes:
            if not self.tree.is_resident(node, FULL, Tier.HOST) or self.tree.is_resident(
                node, FULL, Tier.STORAGE
            ):
                continue
            if policy is WritePolicy.WRITE_THROUGH_SELECTIVE and self.tree.hits(node) < threshold:
                continue
            self.backup_to_storage(node)

    def backup_to_storage(self, node: object) -> None:
        """Queue an L3 write of `node`'s L2 family slots. Its host pages are held (a free
        while the write runs is parked until it finished) rather than the node pinned, so
        a slow store never locks L1 or L2 pages. Dropped (counted) while the breaker is
        open or the queue is full."""
        l3 = self.ctl.l3
        assert l3 is not None
        if id(node) in self._queued_l3:
            return
        if l3.breaker.is_open:
            self.stats["backups_dropped"] += 1
            return
        namespace = self.tree.namespace_of(node)
        hashes = self.tree.page_hashes(node)
        pages = {
            kind: ids for kind in self.ctl._kinds
            if (ids := self.tree.pages_of(node, kind, Tier.HOST)) is not None
        }
        for kind, ids in pages.items():
            self._hold_l2(kind, ids)
        self._queued_l3.add(id(node))

        def finish(stored: bool) -> None:
            with self.ctl._mu:
                for kind, ids in pages.items():
                    self._unhold_l2(kind, ids)
                self._queued_l3.discard(id(node))
                if not stored:
                    self.stats["backups_l3_failed"] += 1
                    return
                self.stats["backups_l3"] += len(hashes) // 16
                # NOTE: a split meanwhile leaves the pinned-by-identity node as the tail;
                # the head was written too and will only be skipped as present next time.
                if self.tree.is_live(node):
                    for kind in pages:
                        if (self.tree.is_resident(node, kind, Tier.HOST)
                                and not self.tree.is_resident(node, kind, Tier.STORAGE)):
                            self.tree.set_resident(node, kind, Tier.STORAGE)

        def run() -> None:
            self._write_l3(namespace, hashes, pages)
            finish(True)

        if not self.backup_worker.submit(Job("write-through", run, lambda _e: finish(False))):
            self.stats["backups_dropped"] += 1
            finish(False)
            self.stats["backups_l3_failed"] -= 1

    def _write_l3(self, namespace: str, hashes: bytes, pages: dict[ComponentKind, np.ndarray]) -> None:
        l3 = self.ctl.l3
        assert l3 is not None
        page_hashes = split_hashes(hashes)
        for kind, ids in pages.items():
            members = self.cfg.model.family(kind)
            targets = page_hashes[-1:] if kind is MAMBA else page_hashes
            stored = l3.write(namespace, targets, members, ids)
            if stored < len(targets):
                raise BackendUnavailable(f"L3 stored {stored} of {len(targets)} {kind.value} pages")

    # ------------------------------------------------------------------ load

    def plan_load(self, lock: TreeLock) -> LoadOp:
        """Reserve L1 pages for every slot of the lock's path that only L2 holds."""
        path = self.tree.lock_path(lock)
        moves: list[tuple[object, ComponentKind, np.ndarray, np.ndarray]] = []
        comps = {c.kind: c for c in self.tree.components}
        try:
            for kind in self.ctl._kinds:
                nodes = comps[kind].transfer_nodes(path, 0, len(path), Tier.HOST, Tier.DEVICE)  # type: ignore[arg-type]
                for node in nodes:
                    host_ids = self.tree.pages_of(node, kind, Tier.HOST)
                    assert host_ids is not None
                    moves.append((node, kind, host_ids, self.allocate_l1(kind, len(host_ids))))
        except ResourceExhausted:
            for _, kind, _, dev in moves:
                self.free_l1(kind, dev)
            raise
        layers = max((m.layers for m in self.cfg.model.family(FULL)), default=1)
        return LoadOp(moves, layers)

    def run_load(self, op: LoadOp, lock: TreeLock) -> Iterator[LoadProgress]:
        def work() -> None:
            try:
                by_kind: dict[ComponentKind, list[tuple[np.ndarray, np.ndarray]]] = {}
                for _, kind, host_ids, dev_ids in op.moves:
                    by_kind.setdefault(kind, []).append((host_ids, dev_ids))
                # Small families first; FULL last drives the per-layer progress.
                for kind in sorted(by_kind, key=lambda k: k is FULL):
                    host = np.concatenate([h for h, _ in by_kind[kind]])
                    dev = np.concatenate([d for _, d in by_kind[kind]])
                    self.copier.host_to_device(
                        kind, host, dev, on_layer=op.layer_done if kind is FULL else None
                    )
            except BaseException as e:
                op.error = e
            finally:
                with op.cond:
                    op.done = True
                    op.cond.notify_all()

        thread = threading.Thread(target=work, name="hicache-load", daemon=True)
        thread.start()
        sent = 0
        while True:
            with op.cond:
                while op.layers_ready == sent and not op.done:
                    op.cond.wait(1.0)
                ready, done = op.layers_ready, op.done
            if op.error is not None:
                break
            if done:
                break
            if ready > sent:
                sent = ready
                yield LoadProgress(layers_ready=ready, layers_total=op.layers_total)
        thread.join()
        with self.ctl._mu:
            if op.error is not None:
                for _, kind, _, dev in op.moves:
                    self.free_l1(kind, dev)
                raise op.error
            for node, kind, _, dev in op.moves:
                if self.tree.is_resident(node, kind, Tier.DEVICE):
                    self.free_l1(kind, dev)  # a concurrent insert got there first
                else:
                    self.tree.set_resident(node, kind, Tier.DEVICE, dev)
            self.stats["loaded_pages"] += sum(len(d) for _, k, _, d in op.moves if k is FULL)
            self.tree.mark_loaded(lock)
            pages = self._path_pages(lock)
            tokens = self.tree.depth_tokens(lock.end)
        yield LoadProgress(op.layers_total, op.layers_total, self.ctl._by_member(pages), tokens)

    def _path_pages(self, lock: TreeLock) -> dict[ComponentKind, np.ndarray]:
        path = self.tree.lock_path(lock)
        out: dict[ComponentKind, np.ndarray] = {}
        for kind in self.ctl._kinds:
            if kind is MAMBA:
                ids = self.tree.pages_of(path[-1], kind, Tier.DEVICE) if path else None
                out[kind] = ids if ids is not None else np.empty(0, dtype=np.int64)
                continue
            parts = []
            for node in path:
                ids = self.tree.pages_of(node, kind, Tier.DEVICE)
                if ids is None:
                    full = self.tree.pages_of(node, FULL, Tier.DEVICE)
                    ids = np.full(0 if full is None else len(full), -1, dtype=np.int64)
                parts.append(ids)
            out[kind] = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return out

    def copy_l1_slot(self, kind: ComponentKind, src: int, dst: int) -> None:
        """Copy one L1 slot of a family to another (MAMBA copy-on-write)."""
        for member in self.cfg.model.family(kind):
            for layer in range(member.layers):
                rows = self.ctl.device.layer(member.name, layer)
                rows[dst].copy_(rows[src])

    # ------------------------------------------------------------------ flush

    def flush(self, timeout_s: float) -> int:
        """Everything L3 lacks goes down (L1-only slots via L2 first); waits up to
        `timeout_s`; returns pages written."""
        deadline = time.monotonic() + timeout_s
        before = self.stats["backups_l3"]
        if self.ctl.l3 is None:
            return 0
        # NOTE: jobs already queued land first. A node whose L3 write is still queued is
        # not L3-resident yet, so scanning now would queue (and write, and count) it twice.
        self.copy_worker.drain(max(0.0, deadline - time.monotonic()))
        self.backup_worker.drain(max(0.0, deadline - time.monotonic()))
        with self.ctl._mu:
            for node in self.tree.iter_nodes():
                if not self.tree.is_resident(node, FULL, Tier.HOST):
                    self.backup_to_host(node)
                if self.tree.is_resident(node, FULL, Tier.HOST) and not self.tree.is_resident(
                    node, FULL, Tier.STORAGE
                ):
                    self.backup_to_storage(node)
        self.copy_worker.drain(max(0.0, deadline - time.monotonic()))
        self.backup_worker.drain(max(0.0, deadline - time.monotonic()))
        return self.stats["backups_l3"] - before

    # ------------------------------------------------------------------ audit

    def check_ownership(self, engines: EngineRegistry) -> None:
        """Every allocated L1/L2 page is held by exactly one owner."""
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
                        if kind is MAMBA and rec.mamba_slot is not None:
                            owned.append(np.array([rec.mamba_slot]))
                else:
                    owned.extend(self._in_flight.get(kind, []))
                    owned.append(np.array(self._parked_l2.get(kind, []), dtype=np.int64))
                    owned.extend(self.ctl.prefetcher.reserved(kind))
                ids = np.concatenate(owned) if owned else np.empty(0, dtype=np.int64)
                alloc = pools.allocator(kind)
                assert len(np.unique(ids)) == len(ids), f"{tier.name} {kind.value}: a page owned twice"
                used = alloc.total - alloc.free_count
                assert len(ids) == used, (
                    f"{tier.name} {kind.value}: {used} pages allocated, {len(ids)} owned (leak)"
                )
