"""Engines, their leases, and the handles they hold (locks and allocations).

Owned by the controller and mutated only under its mutex. A handle belongs to the engine
that made it; an engine whose lease lapsed loses every handle at the next sweep.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hicache.controller.base import MAX_ENGINE_ID, MAX_SCOPED_ENGINE_ID
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound
from hicache.tree import TreeLock
from hicache.types import ComponentKind

# Said with a NOT_FOUND for handle 0: no handle is 0 (a response's 0 means "none was
# created"); a request that has none leaves the field unset.
_ZERO = " (0 is never a handle: leave the field unset for none)"


@dataclass
class LockRecord:
    engine_id: str
    namespace: str
    tree_lock: TreeLock
    session_id: str
    since: int = 0  # the tree's session clock at the match (`HiRadixTree.session_clock`)
    allocation_id: int = 0  # the allocation the same match made (a Load may use its pages)


@dataclass
class AllocationRecord:
    engine_id: str
    namespace: str
    start_page: int  # token page the first page id stands for
    pages: dict[ComponentKind, np.ndarray]  # per-page components, in token order
    mamba_slot: int | None  # the request's working state (copy-on-write target)
    since: int = 0  # the tree's session clock when it was made (`HiRadixTree.session_clock`)
    # Pages a keep_lock Insert did not commit (the tree held those tokens already) that
    # the running request still reads its KV from: freed with the allocation, not before.
    retired: dict[ComponentKind, list[np.ndarray]] = field(default_factory=dict)
    handle: int = 0  # its allocation_id, once registered


@dataclass
class Engine:
    engine_id: str
    tp_rank: int
    tp_size: int
    expires_at: float
    locks: set[int] = field(default_factory=set)
    allocations: set[int] = field(default_factory=set)
    instances: dict[int, str] = field(default_factory=dict)  # tp_rank -> its process's instance id
    # After a rank's restart: the other ranks' processes of the record before, not yet
    # heard of since (a whole group restarting rank by rank: they are dead, and a new
    # process of such a rank joins; one that lives on confirms itself by its heartbeat).
    inherited: dict[int, str] = field(default_factory=dict)


class EngineRegistry:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._engines: dict[str, Engine] = {}
        self._locks: dict[int, LockRecord] = {}
        self._allocations: dict[int, AllocationRecord] = {}
        # Handle ids are drawn at random, not counted from 1: an id an engine kept from
        # before a daemon restart must not name another request's lock or allocation here.
        self._rng = random.Random(int.from_bytes(os.urandom(16), "little"))
        self._lapsed: OrderedDict[str, None] = OrderedDict()  # recently expired engine ids

    def attach(self, engine_id: str, tp_rank: int, tp_size: int,
               instance_id: str = "") -> tuple[Engine, Engine | None]:
        """(the engine, its dead predecessor or None). The predecessor is the record of a
        process that attached this rank under another `instance_id`: it is out of the
        registry, its handles the caller's to release (as for a lapsed lease)."""
        if not engine_id:
            raise InvalidArgument("engine_id: must be a non-empty string")
        if len(engine_id) > MAX_SCOPED_ENGINE_ID:  # (the servicer holds ids sent to MAX_ENGINE_ID)
            raise InvalidArgument(f"engine_id: {len(engine_id)} characters, at most "
                                  f"{MAX_SCOPED_ENGINE_ID} (with a token's label)")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise InvalidArgument(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        if len(instance_id) > MAX_ENGINE_ID:
            raise InvalidArgument(f"instance_id: {len(instance_id)} characters, at most {MAX_ENGINE_ID}")
        engine = self._engines.get(engine_id)
        gone = None
        if engine is not None and instance_id:
            before = engine.instances.get(tp_rank)
            if before is not None and before != instance_id:
                gone = self._engines.pop(engine_id)
                engine = None
        if engine is None:
            engine = self._engines[engine_id] = Engine(engine_id, tp_rank, tp_size, 0.0)
            self._lapsed.pop(engine_id, None)
            if gone is not None:  # (what it inherited and has not heard from yet, too)
                known = {**gone.inherited, **gone.instances}
                engine.inherited = {r: i for r, i in known.items() if r != tp_rank}
        if instance_id:
            engine.instances[tp_rank] = instance_id
            engine.inherited.pop(tp_rank, None)
        engine.expires_at = self._clock() + self.lease_s
        return engine, gone

    def engine(self, engine_id: str) -> Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            if not engine_id:
                raise FailedPrecondition(
                    "no engine id in the x-hicache-engine metadata header: call Attach first "
                    "(the client sends the header after Attach)"
                )
            if engine_id in self._lapsed:
                raise NotFound(f"engine {engine_id!r}: its lease expired; call Attach again")
            raise FailedPrecondition(f"engine {engine_id!r} is not attached: call Attach first")
        return engine

    def renew(self, engine_id: str) -> Engine:
        engine = self.engine(engine_id)
        engine.expires_at = self._clock() + self.lease_s
        return engine

    def heard_from(self, engine: Engine, tp_rank: int, instance_id: str) -> None:
        """A heartbeat of `tp_rank`'s process `instance_id`: a process the record inherited
        lives on, and its restart later counts as one. Raises NotFound for a process that
        another one replaced (it attached this rank since, e.g. a forked child): its
        handles were released then, and it must learn so rather than renew another's."""
        if not instance_id:
            return
        if engine.inherited.get(tp_rank) == instance_id:
            del engine.inherited[tp_rank]
            engine.instances[tp_rank] = instance_id
            return
        current = engine.instances.get(tp_rank)
        if tp_rank in engine.inherited:
            return
        if current is None:
            # The record is a newer one (the daemon restarted, or the lease lapsed, and
            # another rank attached again): this process's pools and handles are gone.
            raise FailedPrecondition(
                f"engine {engine.engine_id!r} rank {tp_rank} is not attached (the daemon "
                "restarted or the engine's lease lapsed since, and another rank attached "
                "again): call Attach again")
        if current != instance_id:
            raise NotFound(f"engine {engine.engine_id!r} rank {tp_rank}: another process attached "
                           "it since; this one's locks and allocations were released: call "
                           "Attach again (or use an engine id of its own)")

    def new_id(self) -> int:
        while True:
            handle = self._rng.getrandbits(63)
            if handle and handle not in self._locks and handle not in self._allocations:
                return handle

    # locks ---------------------------------------------------------------------------

    def add_lock(self, record: LockRecord) -> int:
        """Raises (and records nothing) when the engine is not attached."""
        engine = self.engine(record.engine_id)
        lock_id = self.new_id()
        self._locks[lock_id] = record
        engine.locks.add(lock_id)
        return lock_id

    def lock(self, engine_id: str, lock_id: int, namespace: str | None = None) -> LockRecord:
        """The engine's lock; with `namespace`, InvalidArgument when it was matched in
        another one."""
        record = self._locks.get(lock_id)
        if record is None or record.engine_id != engine_id:
            raise NotFound(f"lock {lock_id} is unknown or already released{_ZERO if not lock_id else ''}")
        if namespace is not None and record.namespace != namespace:
            raise InvalidArgument(f"namespace {namespace!r} does not match lock {lock_id}'s namespace")
        return record

    def pop_lock(self, engine_id: str, lock_id: int) -> LockRecord:
        record = self.lock(engine_id, lock_id)
        del self._locks[lock_id]
        self._engines[engine_id].locks.discard(lock_id)
        return record

    # allocations ---------------------------------------------------------------------

    def add_allocation(self, record: AllocationRecord, made_for: Engine | None = None) -> int:
        """Raises (and records nothing) when the engine is not attached, or (`made_for`:
        the record the call renewed) when another process attached under its id since:
        the handle would land with a process that never asked for it."""
        engine = self.engine(record.engine_id)
        if made_for is not None and engine is not made_for:
            raise NotFound(f"engine {record.engine_id!r} was attached anew while this call "
                           "waited (another process under its id, or after its lease lapsed); "
                           "the handles of the process that asked are gone")
        alloc_id = self.new_id()
        self._allocations[alloc_id] = record
        record.handle = alloc_id
        engine.allocations.add(alloc_id)
        return alloc_id

    def holds(self, record: AllocationRecord) -> bool:
        """Whether `record` is still a live allocation (not released, consumed or lapsed)."""
        return self._allocations.get(record.handle) is record

    def allocation(self, engine_id: str, alloc_id: int, namespace: str | None = None) -> AllocationRecord:
        """The engine's allocation; with `namespace`, InvalidArgument when it was made in
        another one."""
        record = self._allocations.get(alloc_id)
        if record is None or record.engine_id != engine_id:
            raise NotFound(f"allocation {alloc_id} is unknown or already released{_ZERO if not alloc_id else ''}")
        if namespace is not None and record.namespace != namespace:
            raise InvalidArgument(f"namespace {namespace!r} does not match allocation {alloc_id}'s")
        return record

    def pop_allocation(self, engine_id: str, alloc_id: int) -> AllocationRecord:
        record = self.allocation(engine_id, alloc_id)
        del self._allocations[alloc_id]
        self._engines[engine_id].allocations.discard(alloc_id)
        return record

    # leases --------------------------------------------------------------------------

    def extend_leases(self, seconds: float) -> None:
        """Every lease runs `seconds` longer (time in which no engine could renew), but
        never past a full lease from now: one renewed since the stall lost nothing to it."""
        cap = self._clock() + self.lease_s
        for engine in self._engines.values():
            engine.expires_at = min(engine.expires_at + seconds, cap)

    def lapsed(self) -> list[Engine]:
        """Engines whose lease ran out, removed from the registry (their handles are the
        caller's to release)."""
        now = self._clock()
        gone = [e for e in self._engines.values() if e.expires_at < now]
        for engine in gone:
            del self._engines[engine.engine_id]
            self._lapsed[engine.engine_id] = None
        while len(self._lapsed) > 4096:
            self._lapsed.popitem(last=False)
        return gone

    def take_handles(self, engine: Engine) -> tuple[list[LockRecord], list[AllocationRecord]]:
        locks = [self._locks.pop(i) for i in sorted(engine.locks) if i in self._locks]
        allocs = [self._allocations.pop(i) for i in sorted(engine.allocations) if i in self._allocations]
        engine.locks.clear()
        engine.allocations.clear()
        return locks, allocs

    @property
    def lock_count(self) -> int:
        return len(self._locks)

    def held_pages(self) -> Counter[ComponentKind]:
        """L1 pages (and MAMBA slots) the open allocations hold, per component: the engines'
        and not evictable (O(allocations), for stats)."""
        held: Counter[ComponentKind] = Counter()
        for rec in self._allocations.values():
            for kind, ids in rec.pages.items():
                held[kind] += len(ids)
            for kind, parts in rec.retired.items():
                held[kind] += sum(len(p) for p in parts)
            if rec.mamba_slot is not None:
                held[ComponentKind.MAMBA] += 1
        return held

    @property
    def allocation_count(self) -> int:
        return len(self._allocations)
