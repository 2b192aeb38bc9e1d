"""HybridCacheController: the tree and the tiers behaving as one large cache (DESIGN §3).

Concurrency: one mutex guards the tree, the allocators and the handle registry; it is
held for bookkeeping and L1<->L2 copies of a request's own pages, never across an L3 call.
L3 work (backups, prefetches) runs on worker threads and comes back under the mutex.
Every transfer moves a whole family (a component and its sidecars share page ids).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from hicache.auth import tenant_of_config
from hicache.config import HicacheConfig
from hicache.controller.base import (
    NO_PAGES,
    AllocateRequest,
    AllocationInfo,
    AttachInfo,
    CacheService,
    HeartbeatInfo,
    InsertOutcome,
    InsertRequest,
    LoadProgress,
    MatchOutcome,
    MatchRequest,
    PagesByMember,
    PoolUsage,
    PrefetchInfo,
    StatsSnapshot,
)
from hicache.controller.engines import AllocationRecord, Engine, EngineRegistry, LockRecord
from hicache.controller.loads import Loads
from hicache.controller.prefetch import Prefetcher, PrefetchOp
from hicache.controller.storage_io import L3Store
from hicache.controller.transfers import Transfers
from hicache.controller.workers import CLOSE_WAIT_S, Job
from hicache.errors import BackendUnavailable, ConfigError, InvalidArgument, NotFound
from hicache.keys import PAGE_HASH_BYTES, chain_hashes
from hicache.tiers.base import CopyEngine, DevicePools, HostPools
from hicache.tiers.copy import build_copy_engine
from hicache.tiers.device import build_device_pools
from hicache.tiers.host import build_host_pools
from hicache.tiers.storage.base import HEADER_BYTES, BackendHealth
from hicache.tiers.storage.registry import build_backend
from hicache.tree import HiRadixTree
from hicache.types import (
    ComponentKind,
    HostLayout,
    PrefetchPolicy,
    StorageBackendName,
    Tier,
)

log = logging.getLogger("hicache.controller")
MAMBA = ComponentKind.MAMBA
HEALTH_PROBE_S = 5.0  # a healthy-looking L3 is asked this often (shallow probe)
L3_CONNECT_RETRY_S = 5.0  # a configured L3 that could not be reached at start is retried this often


def _nothing() -> None:
    """The release of a hold that was not granted."""


class _InsertPlan(NamedTuple):
    """What an Insert commits, as checked against its handles (`_insert_plan`)."""

    lock: LockRecord | None
    alloc: AllocationRecord | None
    begin: int  # token page the inserted span starts at
    need: int  # pages of it the allocation provides
    pages: dict[ComponentKind, np.ndarray]
    slot: int | None  # the MAMBA checkpoint handed over
    session: str | None
    since: int | None  # when the request began, on the tree's session clock (None: now)


# What `HybridCacheController.counters` counts (the prefetcher counts into it too).
COUNTED = ("engine_restarts", "hit_tokens_device", "hit_tokens_host", "hit_tokens_storage",
           "lease_released_allocations", "lease_released_locks", "leases_expired", "lookups",
           "prefetch_deferred_room", "prefetch_pages_to_l1", "prefetch_refused_budget",
           "prefetch_refused_room", "prefetch_to_l1_failed", "prefetch_to_l1_no_room",
           "prefetches_started", "restart_released_allocations", "restart_released_locks")


class HybridCacheController(CacheService):
    def __init__(self, cfg: HicacheConfig, tree: HiRadixTree, device: DevicePools,
                 host: HostPools, copier: CopyEngine, l3: L3Store | None) -> None:
        self.cfg = cfg
        self.tree = tree
        self.device = device
        self.host = host
        self.l3 = l3
        # Why the configured (not required) L3 backend is not connected, while it is not:
        # reported unhealthy by `health` and retried in the background.
        self.l3_down: str | None = None
        # Exported from the start (at 0): an alert on one reads 0, not "no data".
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTED, 0))
        self._mu = threading.RLock()
        self._ps = cfg.model.page_size
        self._pb = self._ps * 4
        self._kinds = cfg.model.component_kinds
        self._paged = [k for k in self._kinds if k is not MAMBA]
        self._engines = EngineRegistry(cfg.server.lease_ms / 1000)
        self._prefetch_of_lock: dict[int, int] = {}
        self.transfers = Transfers(self, copier)
        self.loads = Loads(self, self.transfers)
        self.prefetcher = Prefetcher(self)
        self.probe_interval_s = 0.5
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="hicache-l3-probe", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.transfers.start()
        self.prefetcher.start()
        if self.l3 is not None or self.l3_down is not None:
            self._prober.start()

    def _probe_loop(self) -> None:
        """While the breaker is open, ask the backend every `probe_interval_s`; a healthy
        answer closes the breaker and backups resume (while the write breaker is open, a
        canary write every `probe_interval_s` closes it). Otherwise ask every
        `HEALTH_PROBE_S`: an idle daemon makes no L3 calls, and readiness must still see
        a required backend go down. A backend not connected at start is connected here
        every `L3_CONNECT_RETRY_S`."""
        last = time.monotonic()
        while not self._stop.wait(self.probe_interval_s):
            if self.l3 is None:
                if time.monotonic() - last >= L3_CONNECT_RETRY_S:
                    last = time.monotonic()
                    try:
                        self._connect_l3()
                    except Exception:  # the thread must live on: it is the only retry
                        log.exception("L3 connect failed")
                continue
            due = time.monotonic() - last >= HEALTH_PROBE_S
            if self.l3.breaker.is_open or due:
                last = time.monotonic()
                try:
                    self.l3.probe(deep=False)
                except Exception:
                    log.exception("L3 probe failed")
            if self.l3.write_breaker.is_open and not self.l3.breaker.is_open:
                try:  # a store that refused writes proves it takes them again by a canary
                    self.l3.probe_writes()
                except Exception:
                    log.exception("L3 write probe failed")

    def _connect_l3(self) -> None:
        if self._stop.is_set():  # closing: the pools may be gone
            return
        try:
            store = open_l3(self.cfg, self.host)
        except Exception as e:  # unreachable, or refusing the registration: retried later
            if str(e) != self.l3_down:  # (retried every few seconds: news only)
                log.warning("L3 %s: not connected: %s (retrying every %g s)",
                            self.cfg.storage.backend.value, e, L3_CONNECT_RETRY_S)
            self.l3_down = str(e)
            return
        if self._stop.is_set():  # closed meanwhile
            store.backend.close()
            return
        with self._mu:
            self.l3 = store
            self.l3_down = None
        log.info("L3 %s connected; backups and prefetches start", self.cfg.storage.backend.value)

    def close(self) -> None:
        # One deadline for every thread's last call: each may be an L3 call of up to
        # `storage.timeout_s` (they used to wait 5 s each, one after another).
        deadline = time.monotonic() + close_wait_s(self.cfg)
        self._stop.set()
        if self._prober.is_alive():
            self._prober.join(timeout=max(0.0, deadline - time.monotonic()))
        self.prefetcher.close(deadline)
        self.transfers.close(deadline)
        self.loads.close()
        self.transfers.copier.close()  # it holds views of both pools: before they close
        host_free = True
        if self.l3 is not None:
            self.l3.backend.unregister_host_buffer(self.host.buffer_address)
            host_free = self.l3.backend.close(max(0.0, deadline - time.monotonic()))
        self.device.close()
        if not host_free:
            # A call into the store given up on still runs and may move data into L2:
            # unmapped under it, that could crash the process. The mapping goes with it.
            log.warning("L3 %s: a call still runs at close; L2 stays mapped until the process "
                        "ends", self.cfg.storage.backend.value)
        self.host.close(keep_memory=not host_free)

    # ------------------------------------------------------------------ engines

    def attach(self, engine_id: str, tp_rank: int, tp_size: int, instance_id: str = "") -> AttachInfo:
        """Register (or renew) an engine. An `instance_id` other than the one this rank
        attached with before means the engine restarted under the same id: what its
        predecessor held is released first (it is dead; nothing would ever release it)."""
        if tp_size != self.cfg.model.tp_size:
            raise InvalidArgument(
                f"tp_size {tp_size} does not match model.tp_size {self.cfg.model.tp_size}"
            )
        with self._mu:
            _, gone = self._engines.attach(engine_id, tp_rank, tp_size, instance_id)
            if gone is not None:
                locks, allocs = self._release_engine(gone)
                self.counters["engine_restarts"] += 1
                self.counters["restart_released_locks"] += locks
                self.counters["restart_released_allocations"] += allocs
                log.warning("engine %s: attached again by another process (rank %d); released "
                            "its predecessor's %d locks, %d allocations", engine_id, tp_rank,
                            locks, allocs)
        return AttachInfo(
            page_size=self._ps,
            members=self.cfg.model.rank_members,
            pools=self.device.descriptors(tp_rank),
            lease_ms=self.cfg.server.lease_ms,
        )

    def heartbeat(self, engine_id: str, tp_rank: int = 0, instance_id: str = "") -> HeartbeatInfo:
        with self._mu:
            engine = self._engines.engine(engine_id)
            self._engines.heard_from(engine, tp_rank, instance_id)  # (a replaced process: no renewal)
            self._engines.renew(engine_id)
            return HeartbeatInfo(self.cfg.server.lease_ms, len(engine.locks), len(engine.allocations))

    def expire_leases(self, stalled_s: float = 0.0) -> int:
        with self._mu:
            if stalled_s > 0:
                self._engines.extend_leases(stalled_s)
                log.warning("the daemon did not run for %.1f s (stopped, paused, swapped "
                            "out?): every lease is extended by that", stalled_s)
            gone = self._engines.lapsed()
            for engine in gone:
                locks, allocs = self._release_engine(engine)
                self.counters["leases_expired"] += 1
                self.counters["lease_released_locks"] += locks
                self.counters["lease_released_allocations"] += allocs
                # A client that closes stops heartbeating (the API has no detach): a lapse
                # holding nothing is that, not an engine that died mid-request.
                log.log(logging.WARNING if locks or allocs else logging.INFO,
                        "engine %s: lease lapsed; released %d locks, %d allocations",
                        engine.engine_id, locks, allocs)
            return len(gone)

    def _release_engine(self, engine: Engine) -> tuple[int, int]:
        """Caller holds the mutex. Release every handle of an engine record that left the
        registry (lease lapsed, or a new process attached in its place); returns the
        (locks, allocations) released."""
        for lock_id in engine.locks:
            self._request_moves_on(lock_id)
        locks, allocs = self._engines.take_handles(engine)
        for rec in locks:
            if rec.tree_lock.active:
                self.tree.unlock(rec.tree_lock)
        for alloc in allocs:
            self._free_allocation(alloc)
        return len(locks), len(allocs)

    # ------------------------------------------------------------------ match

    def _check_tokens(self, tokens: bytes) -> None:
        if len(tokens) % 4:
            raise InvalidArgument(
                f"tokens: {len(tokens)} bytes is not a multiple of 4 (little-endian uint32 ids)"
            )
        limit = self.cfg.server.max_tokens_per_request
        if len(tokens) // 4 > limit:
            raise InvalidArgument(
                f"tokens: {len(tokens) // 4} tokens exceed server.max_tokens_per_request ({limit})"
            )

    def _check_count(self, name: str, n: int, lo: int) -> None:
        limit = self.cfg.server.max_tokens_per_request
        if not lo <= n <= limit:
            raise InvalidArgument(
                f"{name}: {n} must be in [{lo}, {limit}] (server.max_tokens_per_request)"
            )

    def match(self, engine_id: str, req: MatchRequest) -> MatchOutcome:
        self._check_tokens(req.tokens)
        wants_lock = req.lock or req.allocate_tokens is not None
        # A prefetch without a lock holds the path only until the prefetch has started
        # (its own pin then keeps what it continues): the caller gets no lock_id.
        hold = wants_lock or req.prefetch
        if req.allocate_tokens is not None:
            self._check_count("allocate_tokens", req.allocate_tokens, 0)
        with self._mu:
            if hold:
                self._engines.renew(engine_id)
            m = self.tree.match(req.namespace, req.tokens, lock=hold,
                                session_id=req.session_id or None)
            self.transfers.after_match(m)
            # L3 continues from the deepest boundary the tree can serve; the tree may hold
            # nodes past it (a hybrid model's SWA window or MAMBA checkpoint missing there)
            # that L3 can complete.
            base = m.path[-1] if m.path else None
            known = m.device_tokens + m.host_tokens + m.storage_tokens
            in_tree = 0
            if req.prefetch and m.storage_tokens and m.lock is not None:
                # The tree's own storage part (a hybrid boundary whose window or checkpoint
                # only L3 holds) is fetched too: L3 is asked, and read, from the lock's end
                # (the host boundary). The commit keeps the pages the tree holds and adopts
                # the slots it lacks. NOTE: it reads that part's FULL pages again though L2
                # may hold them (an op reads whole pages; recomputing would cost more).
                base, in_tree = m.lock.end, m.storage_tokens
                known -= in_tree
            beyond_l3 = self.l3 is not None and len(req.tokens) // self._pb * self._ps > known
            prev = self.tree.chain_prev(req.namespace, base) if beyond_l3 else b""
            storage_base = m.path[-1] if m.path else None
            # Past the storage boundary L3 may go on where it cannot serve the tree's own
            # storage part from the host boundary: only if that part's FULL pages are here.
            storage_prev = (self.tree.chain_prev(req.namespace, storage_base)
                            if beyond_l3 and in_tree and storage_base is not None
                            and self.tree.full_in_host(storage_base) else None)
            lock_id = 0
            lock_record = None
            if m.lock is not None and wants_lock:
                lock_record = LockRecord(engine_id, req.namespace, m.lock, req.session_id,
                                         self.tree.session_clock)
                lock_id = self._engines.add_lock(lock_record)
        storage_tokens = m.storage_tokens
        beyond: bytes = b""
        lead = 0  # the tree's storage part, when the prefetch must start past it
        if beyond_l3:
            try:
                beyond = chain_hashes(prev, req.tokens[known * 4 :], self._pb)
                run = self.prefetcher.l3_run(req.namespace, beyond)
                if in_tree and run * self._ps < in_tree and storage_prev is not None:
                    # L3 cannot serve the tree's own storage part from the host boundary
                    # (it lost FULL pages L2 holds): continue from the storage boundary if
                    # L3 can. The window before that boundary is only in L3, so a boundary
                    # past it must bring its whole window.
                    after = chain_hashes(storage_prev, req.tokens[(known + in_tree) * 4 :], self._pb)
                    if past := self.prefetcher.l3_run(req.namespace, after, window_inside=True):
                        base, known, lead, in_tree = storage_base, known + in_tree, in_tree, 0
                        beyond, run = after, past
                fetch = run
                budget = self.prefetcher.budget_left(engine_id)
                if req.prefetch and len(self.tree.components) > 1 and 0 < budget < run:
                    # Over the prefetch budget: stop at the deepest boundary a hybrid model
                    # can reuse (an earlier checkpoint), not at a page it could not use.
                    fetch = self.prefetcher.l3_run(req.namespace, beyond, limit=budget,
                                                   window_inside=bool(lead))
            except BaseException:  # (a backend's unexpected error): the caller gets no lock
                with self._mu:
                    if lock_id:
                        with contextlib.suppress(NotFound):
                            self.release(engine_id, lock_id, None)
                    elif m.lock is not None and m.lock.active:
                        self.tree.unlock(m.lock)
                raise
            # From the host boundary (the tree's storage part included), what L3 serves;
            # past a fallback, the tree's part and what L3 holds after it.
            storage_tokens += run * self._ps - in_tree
            beyond = beyond[: fetch * PAGE_HASH_BYTES]
        prefetch_id = 0
        alloc_id = 0
        alloc_pages: PagesByMember = NO_PAGES  # (the outcome's own empty default)
        with self._mu:
            def lock_alive() -> None:
                # The mutex was free during the L3 lookup (and may be while allocating):
                # an engine whose lease lapsed meanwhile gets no handles.
                if lock_id and m.lock is not None and not m.lock.active:
                    raise NotFound(f"engine {engine_id!r}: its lease expired during the match; "
                                   "call Attach again")

            def start() -> tuple[int, np.ndarray | None]:
                lock_alive()
                return m.device_tokens // self._ps, m.device_pages.get(MAMBA)

            try:
                lock_alive()
                if req.allocate_tokens is not None:
                    assert m.lock is not None
                    alloc_id, alloc_pages = self._new_allocation(
                        engine_id, req.namespace, max(0, req.allocate_tokens - m.device_tokens),
                        start,
                    )
                    if lock_record is not None:  # (a Load of it lands in the allocation's first pages)
                        lock_record.allocation_id = alloc_id
                # `base` (the storage boundary) lies beyond the lock when a hybrid model's
                # window or checkpoint is only in L3: an eviction while the mutex was free
                # may have deleted it, and then there is nothing to continue from.
                if (req.prefetch and beyond and m.lock is not None
                        and storage_tokens >= self.cfg.prefetch.threshold_tokens
                        and (base is None or self.tree.is_live(base))):
                    in_l1 = m.device_tokens == self.tree.depth_tokens(base)
                    prefetch_id = self.prefetcher.start_op(req.namespace, req.tokens, base,
                                                           beyond, to_l1=in_l1, owner=engine_id,
                                                           lead_tokens=lead)
                    if prefetch_id and lock_id:
                        self._prefetch_of_lock[lock_id] = prefetch_id
                lock_alive()
            except BaseException:
                # The caller gets an error, never these handles: nothing may stay held (a
                # prefetch started is cancelled; what arrives still lands, for later).
                op = self.prefetcher.get(prefetch_id) if prefetch_id else None
                if op is not None:
                    self.prefetcher.cancel(op)
                self._prefetch_of_lock.pop(lock_id, None)
                if lock_id or alloc_id:
                    with contextlib.suppress(NotFound):  # lease lapsed: released with it
                        self.release(engine_id, lock_id or None, alloc_id or None)
                raise
            finally:
                if m.lock is not None and not wants_lock and m.lock.active:
                    self.tree.unlock(m.lock)  # the prefetch-only hold
            device_pages = self._by_member(m.device_pages)
            # Counted once answered: a match that fails (no room to allocate, a lapsed
            # lease) and is retried is one lookup, its hits counted once.
            counters = self.counters
            counters["lookups"] += 1
            counters["hit_tokens_device"] += m.device_tokens
            counters["hit_tokens_host"] += m.host_tokens
            counters["hit_tokens_storage"] += storage_tokens
        return MatchOutcome(
            device_tokens=m.device_tokens,
            host_tokens=m.host_tokens,
            storage_tokens=storage_tokens,
            device_pages=device_pages,
            lock_id=lock_id,
            prefetch_id=prefetch_id,
            allocation_id=alloc_id,
            pages=alloc_pages,
        )

    def _by_member(self, pages: Mapping[ComponentKind, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for kind in self._kinds:
            ids = pages.get(kind)
            if ids is None:
                continue
            for member in self.cfg.model.family(kind):
                out[member.name] = ids
        return out

    # ------------------------------------------------------------------ allocation

    def _allocate_family(self, n: int, with_slot: bool) -> tuple[dict[ComponentKind, np.ndarray], int | None]:
        """`n` L1 pages of every paged kind (and a MAMBA slot): all of them or, raising,
        none (pages taken for earlier kinds are freed)."""
        need = dict.fromkeys(self._paged, n)
        if with_slot:
            need[MAMBA] = 1
        got = self.transfers.allocate_l1_all(need)  # (every kind, those of 0 pages too)
        slot = int(got.pop(MAMBA)[0]) if with_slot else None
        return got, slot

    def _new_allocation(self, engine_id: str, namespace: str, tokens: int,
                        start: Callable[[], tuple[int, np.ndarray | None]],
                        made_for: Engine | None = None) -> tuple[int, PagesByMember]:
        """A new allocation of `tokens`. Allocating may wait for queued copies with the
        mutex released, so what it continues is read only afterwards: `start()` gives the
        token page it starts at and the checkpoint to copy (or raises NotFound, the lock
        it extends being gone meanwhile; the pages are then freed). `made_for`: the engine
        record the call renewed; a process attached in its place meanwhile gets nothing."""
        n = -(-tokens // self._ps)
        pages, slot = self._allocate_family(n, MAMBA in self._kinds)
        try:
            start_page, checkpoint = start()
        except BaseException:
            self._free_allocation(AllocationRecord(engine_id, namespace, 0, pages, slot))
            raise
        if slot is not None and checkpoint is not None and len(checkpoint):
            try:
                self.transfers.copy_l1_slot(MAMBA, int(checkpoint[0]), slot)  # copy-on-write
            except BaseException:  # (the copy engine's error): nobody would free them
                self._free_allocation(AllocationRecord(engine_id, namespace, 0, pages, slot))
                raise
        record = AllocationRecord(engine_id, namespace, start_page, pages, slot, self.tree.session_clock)
        try:
            alloc_id = self._engines.add_allocation(record, made_for)
        except BaseException:  # the engine's lease lapsed meanwhile: nobody would free them
            self._free_allocation(record)
            raise
        return alloc_id, self._allocation_pages(record)

    def _allocation_pages(self, record: AllocationRecord) -> dict[str, np.ndarray]:
        pages: dict[ComponentKind, np.ndarray] = dict(record.pages)
        if record.mamba_slot is not None:
            pages[MAMBA] = np.array([record.mamba_slot], dtype=np.int64)
        return self._by_member(pages)

    def allocate(self, engine_id: str, req: AllocateRequest) -> AllocationInfo:
        self._check_count("num_tokens", req.num_tokens, 1)
        with self._mu:
            engine = self._engines.renew(engine_id)
            # A handle sent as 0 is looked up (and refused): 0 is never a handle. The lock
            # a call names is checked whether it makes an allocation or grows one.
            if req.lock_id is not None:
                self._engines.lock(engine_id, req.lock_id, req.namespace)
            if req.allocation_id is not None:
                held = self._engines.allocation(engine_id, req.allocation_id, req.namespace)  # (fail before waiting)
                self._check_growth(req.allocation_id, held, req.num_tokens)
                grown, _ = self._allocate_family(-(-req.num_tokens // self._ps), False)
                # Allocating may have waited with the mutex released: the allocation must
                # still be there (a Release or a lapse meanwhile would orphan the pages).
                try:
                    record = self._engines.allocation(engine_id, req.allocation_id, req.namespace)
                    self._check_growth(req.allocation_id, record, req.num_tokens)  # (grown meanwhile?)
                except (NotFound, InvalidArgument):
                    for kind, ids in grown.items():
                        self.transfers.free_l1(kind, ids)
                    raise
                for kind, ids in grown.items():
                    record.pages[kind] = np.concatenate([record.pages[kind], ids])
                return AllocationInfo(req.allocation_id, self._allocation_pages(record))

            def start() -> tuple[int, np.ndarray | None]:
                if req.lock_id is None:
                    return 0, None
                lock = self._engines.lock(engine_id, req.lock_id).tree_lock  # (still held?)
                checkpoint = None
                if lock.device_end is not None and MAMBA in self._kinds:
                    checkpoint = self.tree.pages_of(lock.device_end, MAMBA, Tier.DEVICE)
                return self.tree.depth_tokens(lock.device_end) // self._ps, checkpoint

            alloc_id, pages = self._new_allocation(
                engine_id, req.namespace, req.num_tokens, start, engine
            )
            return AllocationInfo(alloc_id, pages)

    def _check_growth(self, allocation_id: int, record: AllocationRecord, num_tokens: int) -> None:
        """An allocation holds at most the pages of one request's tokens at once, however
        many calls grew it (each call alone is checked by `_check_count`): its pages, those
        a Load in flight borrowed, and those it keeps retired."""
        limit = self.cfg.server.max_tokens_per_request
        most = -(-limit // self._ps)
        kind = self._paged[0]
        held = (len(record.pages[kind]) + self.loads.lent_from(record)
                + sum(len(ids) for ids in record.retired.get(kind, ())))
        more = -(-num_tokens // self._ps)
        if held + more > most:
            raise InvalidArgument(
                f"num_tokens: growing allocation {allocation_id} by {more} pages would hold "
                f"{held + more} pages; at most {most} ({limit} tokens, "
                f"server.max_tokens_per_request)"
            )

    def _free_allocation(self, record: AllocationRecord) -> None:
        for kind, ids in record.pages.items():
            self.transfers.free_l1(kind, ids)
        for kind, parts in record.retired.items():
            for ids in parts:
                self.transfers.free_l1(kind, ids)
        record.retired.clear()
        if record.mamba_slot is not None:
            self.transfers.free_l1(MAMBA, np.array([record.mamba_slot], dtype=np.int64))

    # ------------------------------------------------------------------ insert / release

    def _insert_plan(self, engine_id: str, req: InsertRequest) -> _InsertPlan:
        """Check an Insert against its handles (caller holds the mutex) and work out what
        it commits; raises for every error of the request's own, changing nothing."""
        self._engines.renew(engine_id)
        lock_rec = (self._engines.lock(engine_id, req.lock_id, req.namespace)
                    if req.lock_id is not None else None)
        alloc = (self._engines.allocation(engine_id, req.allocation_id, req.namespace)
                 if req.allocation_id is not None else None)
        tree_lock = lock_rec.tree_lock if lock_rec else None
        if tree_lock is not None and not req.tokens.startswith(tree_lock.prefix):
            raise InvalidArgument("tokens do not start with the prefix the lock was matched on")
        begin = self.tree.depth_tokens(tree_lock.device_end if tree_lock else None) // self._ps
        total = len(req.tokens) // self._pb
        need = total - begin
        pages: dict[ComponentKind, np.ndarray] = {}
        if alloc is not None:
            # Checked whether or not the insert takes pages from it: committing consumes the
            # allocation up to `begin`, and a lock ending before the allocation's first page
            # (another request's) would move it backwards: its owner's next Insert would
            # then commit each page at the wrong position. (A later, deeper match of the
            # same request may commit it: the pages before its end go as loaded instead.)
            lo = begin - alloc.start_page
            have = len(alloc.pages[self._paged[0]])
            if lo < 0 or (need > 0 and lo + need > have):
                raise InvalidArgument(
                    f"allocation {req.allocation_id} covers token pages [{alloc.start_page}, "
                    f"{alloc.start_page + have}); insert needs [{begin}, {total})"
                )
        if need > 0:
            if alloc is None:
                raise InvalidArgument(f"{need} new pages of tokens but no allocation_id")
            pages = {kind: alloc.pages[kind][lo : lo + need] for kind in self._paged}
        slot = alloc.mamba_slot if (alloc is not None and req.mamba_checkpoint) else None
        session = req.session_id or (lock_rec.session_id if lock_rec else "") or None
        since = lock_rec.since if lock_rec else alloc.since if alloc else None
        return _InsertPlan(lock_rec, alloc, begin, need, pages, slot, session, since)

    def insert(self, engine_id: str, req: InsertRequest) -> InsertOutcome:
        self._check_tokens(req.tokens)
        if req.keep_lock and req.lock_id is None:
            # The lock carries where the request's device pages start; without one the
            # next Insert could not tell which pages of the allocation it continues from.
            raise InvalidArgument("keep_lock needs the lock_id of the match the request extends")
        with self._mu:
            plan = self._insert_plan(engine_id, req)
            # A continuing request hands the tree a copy of its state (copy-on-write) and
            # goes on writing its own slot: the engine keeps the slot it was given (a
            # reply that handed it another would need a field the API does not have, and
            # an engine writing on in a slot the tree took would change the checkpoint).
            # The copy's slot is taken before anything is committed: no room fails the
            # call with nothing changed. Taking it may wait for queued copies with the
            # mutex released, so the request is checked before (every error of its own
            # first) and planned again after (its handles must still be there).
            fresh = None
            if req.keep_lock and plan.slot is not None:
                fresh = int(self.transfers.allocate_l1(MAMBA, 1)[0])
                try:
                    plan = self._insert_plan(engine_id, req)
                except BaseException:
                    self.transfers.free_l1(MAMBA, np.array([fresh], dtype=np.int64))
                    raise
                if plan.slot is None:
                    self.transfers.free_l1(MAMBA, np.array([fresh], dtype=np.int64))
                    fresh = None
            lock_rec, alloc, slot, begin, need = plan.lock, plan.alloc, plan.slot, plan.begin, plan.need
            try:
                if fresh is not None:
                    assert slot is not None
                    # Complete on return (on CUDA too): the engine writes on in `slot`
                    # as soon as the reply reaches it.
                    self.transfers.copy_l1_slot(MAMBA, slot, fresh)
                result = self.tree.insert(
                    req.namespace, req.tokens, plan.pages, lock=lock_rec.tree_lock if lock_rec else None,
                    keep_lock=req.keep_lock, mamba_slot=slot if fresh is None else fresh,
                    session_id=plan.session, session_since=plan.since,
                )
            except BaseException:  # (the copy engine's error too): nothing committed
                if fresh is not None:
                    self.transfers.free_l1(MAMBA, np.array([fresh], dtype=np.int64))
                raise
            for kind, ids in result.released.items():
                if req.keep_lock and alloc is not None and kind in alloc.pages:
                    # The request goes on reading these (its block table points at them):
                    # they leave with the allocation (final Insert, Release, lapse).
                    if len(ids):
                        alloc.retired.setdefault(kind, []).append(ids)
                else:
                    self.transfers.free_l1(kind, ids)
            if result.dropped:  # a shorter L2 copy of an SWA tail this insert grew
                for kind, ids in result.dropped.items():
                    self.transfers.free_l2(kind, ids)
                self.transfers.refill_host(result.end)
            if lock_rec is not None and not req.keep_lock:
                self._engines.pop_lock(engine_id, req.lock_id or 0)
                self._request_moves_on(req.lock_id)
            if alloc is not None:
                self._consume_allocation(engine_id, req, alloc, begin, need, slot if fresh is None else None)
            if result.end is not None:
                self.transfers.after_insert(result.end)
            return InsertOutcome(result.inserted_tokens, result.reused_tokens)

    def _consume_allocation(self, engine_id: str, req: InsertRequest, alloc: AllocationRecord,
                            begin: int, used: int, handed: int | None) -> None:
        """Pages the tree now owns (or handed back) leave the allocation, and so does the
        MAMBA slot it took (`handed`); the rest stays for decode growth, or is freed by
        the final insert."""
        lo = max(0, begin - alloc.start_page)
        skipped = {kind: alloc.pages[kind][:lo] for kind in self._paged}  # loaded instead
        for kind, ids in skipped.items():
            self.transfers.free_l1(kind, ids)
        for kind in self._paged:
            alloc.pages[kind] = alloc.pages[kind][lo + max(0, used) :]
        alloc.start_page = begin + max(0, used)
        if handed is not None:  # the tree owns (or freed) it now
            alloc.mamba_slot = None
        if not req.keep_lock:
            self._engines.pop_allocation(engine_id, req.allocation_id or 0)
            self._free_allocation(alloc)

    def release(self, engine_id: str, lock_id: int | None, allocation_id: int | None) -> None:
        if lock_id is None and allocation_id is None:
            raise InvalidArgument("release needs a lock_id or an allocation_id")
        with self._mu:
            if lock_id is not None and allocation_id is not None:
                # Both looked up first: an unknown one changes nothing (the wire sends one
                # handle a Release; an in-process caller may send both).
                self._engines.lock(engine_id, lock_id)
                self._engines.allocation(engine_id, allocation_id)
            if lock_id is not None:
                record = self._engines.pop_lock(engine_id, lock_id)
                self._request_moves_on(lock_id)
                if record.tree_lock.active:
                    self.tree.unlock(record.tree_lock)
            if allocation_id is not None:
                self._free_allocation(self._engines.pop_allocation(engine_id, allocation_id))

    def hold_background(self) -> Callable[[], None]:
        with self._mu:
            if not self.transfers.hold_flushes():  # another RPC holds them: its end sends
                return _nothing
        held = [True]

        def release_locked() -> None:
            if held:
                held.clear()
                self.transfers.release_flushes()

        def release_on_worker() -> None:
            with self._mu:
                release_locked()

        def release() -> None:
            # Runs on gRPC's poller thread, which must not wait for the mutex (every
            # RPC's dispatch would wait with it): when the mutex is busy, the copy
            # worker releases the hold (and then runs the flush it schedules).
            if self._mu.acquire(blocking=False):
                try:
                    release_locked()
                finally:
                    self._mu.release()
                return
            job = Job("release-held-copies", release_on_worker, lambda _e: None)
            if not self.transfers.copy_worker.submit(job):  # closed or full: wait here
                release_on_worker()

        return release

    def close_session(self, session_id: str) -> int:
        if not session_id:
            raise InvalidArgument("session_id: must be a non-empty string")
        with self._mu:
            return self.tree.close_session(session_id)

    # ------------------------------------------------------------------ load

    def load(self, engine_id: str, lock_id: int) -> Iterator[LoadProgress]:
        with self._mu:
            self._engines.renew(engine_id)
            record = self._engines.lock(engine_id, lock_id)
            self._request_moves_on(lock_id)
            op = self.loads.plan_load(record.tree_lock, self._lendable_allocation(record))
        yield from self.loads.run_load(op, record.tree_lock)

    def _lendable_allocation(self, record: LockRecord) -> AllocationRecord | None:
        """The allocation the lock's match made, while it still starts at the lock's
        device boundary (caller holds the mutex): its first pages stand for the L2 part
        a Load brings (`Loads.plan_load`)."""
        if not record.allocation_id:
            return None
        try:
            alloc = self._engines.allocation(record.engine_id, record.allocation_id, record.namespace)
        except (NotFound, InvalidArgument):
            return None
        device = self.tree.depth_tokens(record.tree_lock.device_end) // self._ps
        return alloc if alloc.start_page == device else None

    # ------------------------------------------------------------------ prefetch

    def prefetch_status(self, prefetch_id: int, engine_id: str | None = None) -> PrefetchInfo:
        op = self._prefetch_op(prefetch_id, engine_id)
        return op.info()

    def cancel_prefetch(self, prefetch_id: int, engine_id: str | None = None) -> int:
        op = self._prefetch_op(prefetch_id, engine_id)
        self.prefetcher.cancel(op)
        return op.info().tokens_ready

    def _request_moves_on(self, lock_id: int | None) -> None:
        """The engine scheduled the request (Load, Insert or Release of its lock): a
        best_effort prefetch stops there; what arrived stays usable."""
        prefetch_id = self._prefetch_of_lock.pop(lock_id or 0, 0)
        if prefetch_id and self.cfg.prefetch.policy is PrefetchPolicy.BEST_EFFORT:
            op = self.prefetcher.get(prefetch_id)
            if op is not None:
                self.prefetcher.cancel(op)

    def _prefetch_op(self, prefetch_id: int, engine_id: str | None) -> PrefetchOp:
        """The op, if `engine_id` (None: any caller in this process) started it; another
        engine (another tenant's, with tokens) learns nothing about it."""
        op = self.prefetcher.get(prefetch_id)
        if op is None or (engine_id is not None and op.owner != engine_id):
            raise NotFound(f"prefetch {prefetch_id} is unknown or expired")
        return op

    # ------------------------------------------------------------------ reports

    def stats(self) -> StatsSnapshot:
        pools: list[PoolUsage] = []
        with self._mu:
            # In L1, pages held by allocations and by running loads are not evictable:
            # counted as locked.
            held = self._engines.held_pages()
            loading = {kind: sum(len(ids) for ids in self.loads.loading_pages(kind))
                       for kind in self._kinds}
            for tier, pools_obj in ((Tier.DEVICE, self.device), (Tier.HOST, self.host)):
                for member in self.cfg.model.members:
                    kind = member.component
                    alloc = pools_obj.allocator(kind)
                    pools.append(PoolUsage(
                        tier=tier.name.lower(), member=member.name, capacity_pages=alloc.total,
                        used_pages=alloc.total - alloc.free_count,
                        locked_pages=self.tree.locked_pages(tier, kind)
                        + (held[kind] + loading[kind] if tier is Tier.DEVICE else 0),
                    ))
            counters = dict(self.counters)
            counters.update(self.transfers.counters())
            counters["prefetches_running"] = self.prefetcher.running
            counters["active_locks"] = self._engines.lock_count
            counters["active_allocations"] = self._engines.allocation_count
            counters["sessions_closed_for_room"] = self.tree.sessions_closed_for_room
            # (exported from the start: 0 while no L3 is connected, down at start too)
            counters["l3_breaker_trips"] = self.l3.breaker.trips if self.l3 is not None else 0
            counters["l3_write_breaker_trips"] = (
                self.l3.write_breaker.trips if self.l3 is not None else 0)
            if self.l3 is not None:
                counters["l3_errors"] = self.l3.errors
        l3 = (self.l3.stats(),) if self.l3 is not None else ()
        if l3:  # the store's own evictions, in pages (objects of the pages' first member)
            counters["evictions_storage"] = l3[0].evicted_pages
        return StatsSnapshot(tuple(pools), counters, l3)

    def health(self, deep: bool) -> tuple[BackendHealth, ...]:
        if self.l3 is None:
            if self.l3_down is None:
                return ()  # no L3 configured
            return (BackendHealth(
                self.cfg.storage.backend.value, False, 0.0,
                f"not connected since start ({self.l3_down}); retried every "
                f"{L3_CONNECT_RETRY_S:g} s",
            ),)
        if deep or self.l3.last_health is None:
            return (self.l3.probe(deep=deep),)
        return (self.l3.last_health,)

    def serving(self) -> bool:
        if self.l3 is None or not self.cfg.storage.required:
            return True
        last = self.l3.last_health
        return not self.l3.breaker.is_open and (last is None or last.healthy)

    def flush(self, timeout_s: float) -> int:
        return self.transfers.flush(timeout_s)

    def unflushed_pages(self) -> int:
        return self.transfers.unflushed_pages()

    # ------------------------------------------------------------------ audits

    def check_integrity(self) -> None:
        """Tree invariants, allocator invariants, and that every L1/L2 page is owned
        exactly once (by the tree, an allocation, or an in-flight transfer)."""
        with self._mu:
            self.tree.check_integrity()
            self.device.check_integrity()
            self.host.check_integrity()
            self.transfers.check_ownership(self._engines)


def close_wait_s(cfg: HicacheConfig) -> float:
    """The longest `close` waits for the controller's threads: an L3 call under way (at
    most `storage.timeout_s`) and a little more for the work around it."""
    return cfg.storage.timeout_s + CLOSE_WAIT_S


def open_l3(cfg: HicacheConfig, host: HostPools) -> L3Store:
    """Connect the configured L3 backend and register the L2 pool with it (objects move
    straight between the store and L2 pages). Raises BackendUnavailable when it cannot be
    reached; a failed registration closes the backend and raises."""
    backend = build_backend(cfg.storage)
    try:
        backend.register_host_buffer(host.buffer_address, host.buffer_size)
        ttl = cfg.storage.redis.ttl_s if cfg.storage.backend is StorageBackendName.REDIS else None
        largest = max(HEADER_BYTES + m.bytes_per_page for m in cfg.model.members)
        return L3Store(backend, host, cfg.model.id, 0, cfg.model.tp_size, object_ttl_s=ttl,
                       object_bytes=largest, page_member=cfg.model.family(ComponentKind.FULL)[0].name)
    except BaseException:
        with contextlib.suppress(Exception):
            backend.close()
        raise


def build_controller(cfg: HicacheConfig, instance: str, *, use_cuda: bool | None = None,
                     start: bool = True) -> HybridCacheController:
    """Pools, tree, copy engine and L3 backend from `cfg`; started unless `start=False`.

    Raises ConfigError (sizes, layouts), FailedPrecondition (another live daemon owns
    `instance`), BackendUnavailable (a required L3 backend cannot be reached)."""
    kinds = {
        k: (cfg.model.components[k].window_tokens if k is ComponentKind.SWA else 0)
        for k in cfg.model.component_kinds
    }
    tree = HiRadixTree(cfg.model.page_size, kinds, cfg.eviction.policy, cfg.model.id,
                       cfg.model.kv_dtype, cfg.eviction.closed_session_tombstones,
                       cfg.model.geometry,
                       # An L1 slot can always be copied to L2 as it leaves: under
                       # write-back each is; under write-through the last copy of a node
                       # with children, whose copy was never made (`_copy_stranded`).
                       (Tier.DEVICE,),
                       cfg.eviction.max_open_sessions, tenant_of_config(cfg))
    device = build_device_pools(cfg, instance, use_cuda)
    host: HostPools | None = None
    copier: CopyEngine | None = None
    try:
        host = build_host_pools(cfg)
        copier = build_copy_engine(device, host)
        l3 = None
        down = None
        if cfg.storage.backend is not StorageBackendName.NONE:
            if host.layout is not HostLayout.PAGE_FIRST:
                raise ConfigError(
                    "tiers.l2.layout: layer_first cannot serve an L3 backend (objects need "
                    "page_first; use auto or page_first)"
                )
            try:
                l3 = open_l3(cfg, host)
            except BackendUnavailable as e:
                if cfg.storage.required:
                    raise
                log.error("L3 %s unavailable, serving from L1/L2 only (retried every %g s): %s",
                          cfg.storage.backend.value, L3_CONNECT_RETRY_S, e)
                down = str(e)
        ctl = HybridCacheController(cfg, tree, device, host, copier, l3)
        ctl.l3_down = down
    except BaseException:
        if copier is not None:  # (first: it holds views of both pools, and helper threads)
            copier.close()
        if host is not None:
            host.close()
        device.close()
        raise
    if start:
        ctl.start()
    return ctl
