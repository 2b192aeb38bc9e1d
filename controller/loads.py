"""Loads: the L2 part of a locked match copied up into L1, its layers streamed as they
land (the `Load` RPC), and the moves into free L1 pages a prefetch makes.

A load reserves L1 pages for every slot of the lock's path that only L2 holds (or borrows
them from the request's own allocation: `plan_load`), copies outside the controller's
mutex on a load thread (the locked pages cannot move), then lands the copied slots in the
tree. Room comes from `Transfers` (allocation and eviction); this module owns only the
loads in flight. Called by the controller under its mutex, except the copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.controller.base import LoadProgress
from hicache.controller.transfers import per_family
from hicache.errors import NotFound
from hicache.tree import TreeLock
from hicache.types import ComponentKind, Tier

if TYPE_CHECKING:
    from hicache.controller.controller import HybridCacheController
    from hicache.controller.engines import AllocationRecord
    from hicache.controller.transfers import Transfers
    from hicache.tiers.base import LayerCallback

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
LOAD_WAIT_S = 2.0  # longest a load waits for another load copying the same slots
LOAD_THREADS = 4  # loads copying at once (more wait for a thread, streaming nothing yet)
L1Move = tuple[object, ComponentKind, np.ndarray, np.ndarray]  # node, kind, L2 pages, L1 pages


@dataclass(eq=False)  # (held in a set: by identity)
class LoadOp:
    """Host -> device copies of one lock's path, with per-layer progress."""

    moves: list[L1Move]
    layers_total: int
    layers_ready: int = 0
    done: bool = False
    error: BaseException | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    # Pages the request's own allocation lent as the copy's L1 pages (see `plan_load`).
    lent: LentPages | None = None

    def layer_done(self, layer: int) -> None:
        with self.cond:
            self.layers_ready = max(self.layers_ready, layer + 1)
            self.cond.notify_all()


@dataclass(eq=False)
class LentPages:
    """The first `pages` (per paged kind) of a request's allocation, taken by its Load as
    the L1 pages the loaded part lands in: the allocation already stood for those token
    pages, and the engine was to write them there. Those no move uses (SWA outside its
    window) are `unused`. A load that fails gives them all back (`give_back`)."""

    allocation: AllocationRecord
    start_page: int  # where the allocation started when they were taken
    pages: dict[ComponentKind, np.ndarray]
    unused: dict[ComponentKind, np.ndarray]

    def backs(self, kind: ComponentKind) -> bool:
        """Whether the moves of `kind` copy into these pages: every paged kind's do
        (`Loads._lendable`), a MAMBA checkpoint's never."""
        return kind in self.pages


class Loads:
    def __init__(self, ctl: HybridCacheController, transfers: Transfers) -> None:
        self.ctl = ctl
        self.tree = ctl.tree
        self.cfg = ctl.cfg
        self.transfers = transfers  # (room in L1: allocation, eviction, freeing; the copy engine)
        # Loads copy on long-lived threads: a fresh thread per load cost ~0.7 ms (torch's
        # per-thread set-up). Each load's caller streams its layers as they land.
        self._load_threads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="hicache-load")
        self._loads: set[LoadOp] = set()  # running loads (`plan_load` to `run_load`'s end)
        self._load_events = 0  # loads registered or ended so far (`plan_load`)

    def close(self) -> None:
        """Wait for the loads copying (a load started after this fails: the daemon stops)."""
        self._load_threads.shutdown(wait=True)

    def plan_load(self, lock: TreeLock, lend: AllocationRecord | None = None) -> LoadOp:
        """Caller holds the mutex. Reserve L1 pages for every slot of the lock's path that
        only L2 holds. Slots another load is copying are waited for (with the mutex
        released, at most LOAD_WAIT_S), not copied twice: two engines loading one path
        evict for one copy. The op stays registered until `run_load` lands or frees it.

        `lend`: the request's allocation, from its match (MatchPrefix with allocate_tokens
        allocates from the device boundary on: the L2 part too). Where its first pages
        stand for exactly the token pages the load brings, those are the copy's L1 pages
        (`_lendable`): before, the load took as many again, and a request that fit L1
        could not load its L2 part (RESOURCE_EXHAUSTED), or evicted for it."""
        deadline = time.monotonic() + LOAD_WAIT_S
        while True:
            wanted = self._wanted_in_l1(self.tree.lock_path(lock))
            copying = {(id(node), kind) for op in self._loads for node, kind, _, _ in op.moves}
            copying |= self.ctl.prefetcher.copying_to_l1()  # (a prefetch bringing them)
            left = deadline - time.monotonic()
            if left > 0 and any((id(node), kind) in copying for node, kind, _ in wanted):
                self.transfers.landed.wait(min(left, 0.05))
            else:
                lendable = self._lendable(wanted, lend) if lend is not None else None
                rest = [w for w in wanted if lendable is None or (id(w[0]), w[1]) not in lendable]
                # One allocation for the whole load: a load that cannot fit fails before
                # evicting anything (node by node, each part fitted and evicted first).
                seen = self._load_events
                got = self.transfers.allocate_l1_all(_pages_needed(rest))
                if self._load_events == seen or left <= 0:
                    break
                # The allocation waited (mutex released) and another load planned or
                # landed meanwhile: it may copy these slots, or have copied them.
                for kind, ids in got.items():
                    self.transfers.free_l1(kind, ids)
            if not lock.active:
                raise NotFound("the lock was released while its load waited for another "
                               "load of the same pages")
        if not lock.active:  # (released while the allocation waited)
            for kind, ids in got.items():
                self.transfers.free_l1(kind, ids)
            raise NotFound("the lock was released while its load waited for room")
        layers = max((m.layers for m in self.cfg.model.family(FULL)), default=1)
        lent = None
        if lendable is not None and lend is not None and self._still_lendable(lend, lendable):
            lent = self._borrow(lend, lendable)
            moves = _moves_into(rest, got) + [
                (node, kind, host_ids, lendable[(id(node), kind)][1])
                for node, kind, host_ids in wanted if (id(node), kind) in lendable]
        elif lendable is not None:
            # The allocation was released or used while the room for the rest was found
            # (the mutex released): the engine moved on from this request.
            for kind, ids in got.items():
                self.transfers.free_l1(kind, ids)
            raise NotFound("the request's allocation was released or used while its load "
                           "waited for room")
        else:
            moves = _moves_into(wanted, got)
        op = LoadOp(moves, layers, lent=lent)
        if op.moves:  # (always, when pages were lent: they back a FULL slot at least)
            self._loads.add(op)
            self._load_events += 1
        return op

    def _lendable(self, wanted: _Wanted, lend: AllocationRecord,
                  ) -> dict[tuple[int, ComponentKind], tuple[int, np.ndarray]] | None:
        """Caller holds the mutex. For each paged slot of `wanted`, (its first token page
        counted from the allocation's start, the allocation's pages that stand for it),
        when the FULL slots are one run of the allocation's pages, in order, and every
        other paged slot lies among the allocation's pages up to that run's end; None
        otherwise (the load takes pages of its own). Every paged slot is then lent (only
        a MAMBA checkpoint takes a slot of its own). The run may start past the
        allocation's start: the FULL pages before it are in L1 already (the match's
        boundary lies above them, e.g. at a hybrid model's checkpoint), and the
        allocation's pages for them go with the load, unused."""
        ps = self.cfg.model.page_size
        out: dict[tuple[int, ComponentKind], tuple[int, np.ndarray]] = {}
        at = -1  # where the next FULL slot begins (`_wanted_in_l1` lists FULL slots first)
        for node, kind, ids in wanted:
            if kind not in lend.pages:  # (MAMBA: a checkpoint slot, not a page)
                continue
            lo = self.tree.depth_tokens(node) // ps - len(ids) - lend.start_page
            if kind is FULL:
                if lo < 0 or (at >= 0 and lo != at) or lo + len(ids) > len(lend.pages[FULL]):
                    return None
                at = lo + len(ids)
            elif lo < 0 or lo + len(ids) > at:
                return None
            out[(id(node), kind)] = (lo, lend.pages[kind][lo : lo + len(ids)])
        return out if at > 0 else None

    def _still_lendable(self, lend: AllocationRecord,
                        lendable: dict[tuple[int, ComponentKind], tuple[int, np.ndarray]]) -> bool:
        """After a wait with the mutex released: the allocation still holds those pages."""
        return self.ctl._engines.holds(lend) and all(
            lo + len(ids) <= len(lend.pages[kind])
            and np.array_equal(lend.pages[kind][lo : lo + len(ids)], ids)
            for (_, kind), (lo, ids) in lendable.items())

    def _borrow(self, lend: AllocationRecord,
                lendable: dict[tuple[int, ComponentKind], tuple[int, np.ndarray]]) -> LentPages:
        """Take the allocation's first pages, up to the end of the FULL slots it loads,
        for the op."""
        n = max(lo + len(ids) for (_, kind), (lo, ids) in lendable.items() if kind is FULL)
        taken = {kind: lend.pages[kind][:n] for kind in lend.pages}
        used: dict[ComponentKind, np.ndarray] = {}
        for (_, kind), (lo, ids) in lendable.items():
            mark = used.setdefault(kind, np.zeros(n, dtype=bool))
            mark[lo : lo + len(ids)] = True
        unused = {kind: ids[~used[kind]] if kind in used else ids for kind, ids in taken.items()}
        lent = LentPages(lend, lend.start_page, taken, unused)
        for kind in lend.pages:
            lend.pages[kind] = lend.pages[kind][n:]
        lend.start_page += n
        return lent

    def lent_from(self, allocation: AllocationRecord) -> int:
        """Caller holds the mutex. Pages (per paged kind) the loads in flight borrowed
        from `allocation` (`_borrow`): out of its `pages` while they copy, still the
        request's (they come back if a load fails)."""
        return sum(len(op.lent.pages[FULL]) for op in self._loads
                   if op.lent is not None and op.lent.allocation is allocation)

    def _unlanded(self, lent: LentPages | None) -> Callable[[ComponentKind, np.ndarray], None]:
        """Where L1 pages of a load that did not land (or that no move used) go: freed,
        but the allocation's own (lent) pages stay with it while it lives, retired (freed
        with it): the engine holds their ids, and until the allocation ends no other
        request may get them."""
        if lent is None:
            return self.transfers.free_l1
        alloc = lent.allocation

        def unlanded(kind: ComponentKind, ids: np.ndarray) -> None:
            if lent.backs(kind) and self.ctl._engines.holds(alloc):
                alloc.retired.setdefault(kind, []).append(ids)
            else:
                self.transfers.free_l1(kind, ids)

        return unlanded

    def give_back(self, lent: LentPages) -> None:
        """Caller holds the mutex. A load that lands nothing returns the pages it took:
        to the allocation if it is still the engine's and has not moved on since (the
        engine may then compute those tokens there, as it would have), else freed."""
        alloc = lent.allocation
        n = len(lent.pages[FULL])
        if self.ctl._engines.holds(alloc) and alloc.start_page == lent.start_page + n:
            for kind, ids in lent.pages.items():
                alloc.pages[kind] = np.concatenate([ids, alloc.pages[kind]])
            alloc.start_page = lent.start_page
        else:
            for kind, ids in lent.pages.items():
                self.transfers.free_l1(kind, ids)

    def loading_pages(self, kind: ComponentKind) -> list[np.ndarray]:
        """Caller holds the mutex. The L1 pages of `kind` running loads copy into (not
        evictable, owned by the load until it lands)."""
        return ([dev for op in self._loads for _, k, _, dev in op.moves if k is kind]
                + [op.lent.unused[kind] for op in self._loads
                   if op.lent is not None and kind in op.lent.unused])

    def _end_load(self, op: LoadOp) -> None:
        """Caller holds the mutex. The op landed or freed its pages."""
        self._loads.discard(op)
        self._load_events += 1
        self.transfers.landed.notify_all()

    def plan_to_free_l1(self, nodes: list[object]) -> list[L1Move] | None:
        """Caller holds the mutex. Like `plan_load` for `nodes` (root first), but only
        from free L1 pages, never evicting: None when they do not all fit."""
        wanted = self._wanted_in_l1(nodes)
        got = self.transfers.allocate_free_l1(_pages_needed(wanted))
        return None if got is None else _moves_into(wanted, got)

    def _wanted_in_l1(self, nodes: tuple[object, ...] | list[object]) -> _Wanted:
        """(node, kind, L2 pages) of each slot that must move up so that the boundary at
        the end of `nodes` is valid in L1, by component (FULL first)."""
        comps = {c.kind: c for c in self.tree.components}
        out: list[tuple[object, ComponentKind, np.ndarray]] = []
        for kind in self.ctl._kinds:
            for node in comps[kind].transfer_nodes(nodes, 0, len(nodes), Tier.HOST, Tier.DEVICE):  # type: ignore[arg-type]
                host_ids = self.tree.pages_of(node, kind, Tier.HOST)
                assert host_ids is not None
                out.append((node, kind, host_ids))
        return out

    def copy_to_l1(self, moves: list[L1Move], on_layer: LayerCallback | None = None) -> None:
        """Copy the moves (no mutex: their nodes are locked, their L1 pages reserved), one
        engine call per family; small families first, FULL last reports `on_layer`."""
        families = per_family([(kind, host_ids, dev) for _, kind, host_ids, dev in moves])
        for kind, host, dev in sorted(families, key=lambda f: f[0] is FULL):
            self.transfers.copier.host_to_device(kind, host, dev, on_layer=on_layer if kind is FULL else None)

    def land_in_l1(self, moves: list[L1Move],
                   unlanded: Callable[[ComponentKind, np.ndarray], None] | None = None) -> int:
        """Caller holds the mutex. Copied moves become L1-resident; returns the FULL
        pages that did. A slot that L1 holds already (a concurrent load or insert got
        there first), whose L2 pages are no longer the ones copied, or (FULL) whose parent
        is not in L1 (L1 holds prefixes), frees its L1 pages (or hands them to
        `unlanded`). Moves land root first.
        NOTE: a match may have split a node meanwhile; the object is the tail, its new
        parents hold the head of the copied span (`Transfers.span`)."""
        free = unlanded or self.transfers.free_l1
        landed = 0
        for node, kind, host_ids, dev in sorted(moves, key=lambda m: m[1] is not FULL):
            parts = [(node, 0, len(dev))] if kind is MAMBA else self.transfers.span(node, len(dev))
            for part, lo, hi in parts:
                there = self.tree.pages_of(part, kind, Tier.HOST) if self.tree.is_live(part) else None
                above = self.tree.parent_of(part) if kind is FULL else None
                if (there is not None and np.array_equal(there, host_ids[lo:hi])
                        and not self.tree.is_resident(part, kind, Tier.DEVICE)
                        and (kind is FULL or self.tree.is_resident(part, FULL, Tier.DEVICE))
                        and (above is None or self.tree.is_resident(above, FULL, Tier.DEVICE))):
                    self.tree.set_resident(part, kind, Tier.DEVICE, dev[lo:hi])
                    landed += (hi - lo) if kind is FULL else 0
                else:
                    free(kind, dev[lo:hi])
        return landed

    def run_load(self, op: LoadOp, lock: TreeLock) -> Iterator[LoadProgress]:
        """Copy, streaming the layers, then land. A caller that stops listening (the
        engine cancelled the stream) does not stop the copy into the reserved L1 pages:
        it finishes and lands (or its pages are freed), so nothing leaks."""
        abandoned = False
        if op.moves:  # a path in L1 already (e.g. a prefetch brought it) copies nothing
            try:
                yield from self._copy_reporting_layers(op)
            except GeneratorExit:
                abandoned = True
                with op.cond:
                    while not op.done:
                        op.cond.wait()
        with self.ctl._mu:
            if op.error is not None:
                lent = op.lent
                for _, kind, _, dev in op.moves:
                    if lent is None or not lent.backs(kind):
                        self.transfers.free_l1(kind, dev)
                if lent is not None:
                    self.give_back(lent)
                self._end_load(op)
                if abandoned:
                    return
                raise op.error
            moves = op.moves
            lent = op.lent
            if lent is not None:
                if (abandoned or not lock.active) and self.ctl._engines.holds(lent.allocation):
                    # The engine will not learn where the part landed (it stopped
                    # listening; its lock went): its allocation keeps the pages it had for
                    # those tokens, to compute them there. (Landed, the tree would own
                    # pages the engine writes to.) The rest lands as ever.
                    moves = [m for m in moves if not lent.backs(m[1])]
                    self.give_back(lent)
                else:  # (SWA's pages outside its window: the engine holds their ids too)
                    keep = self._unlanded(lent)
                    for kind, ids in lent.unused.items():
                        keep(kind, ids)
            self.transfers.stats["loaded_pages"] += self.land_in_l1(moves, self._unlanded(lent))
            self._end_load(op)
            if abandoned:
                return  # the copy is kept; the lock (maybe released by now) is not touched
            if not lock.active:  # released (or its engine's lease lapsed) during the copy
                raise NotFound("the lock was released while its load was copying (what "
                               "arrived stays cached)")
            pages = self.tree.mark_loaded(lock)
            tokens = self.tree.depth_tokens(lock.end)
        yield LoadProgress(op.layers_total, op.layers_total, self.ctl._by_member(pages), tokens)

    def _copy_reporting_layers(self, op: LoadOp) -> Iterator[LoadProgress]:
        """Copy on a load thread; yield each layer as it lands (not the last)."""

        def work() -> None:
            try:
                self.copy_to_l1(op.moves, op.layer_done)
            except BaseException as e:
                op.error = e
            finally:
                with op.cond:
                    op.done = True
                    op.cond.notify_all()

        try:
            running = self._load_threads.submit(work)
        except RuntimeError as e:  # shut down: the daemon is stopping
            op.error = e
            op.done = True
            return
        sent = 0
        # The last layer is reported by the final message, with the pages: a progress
        # message of all layers (the last landed, the copy not yet done) would read as
        # the final one, without pages, to the engine.
        last = op.layers_total - 1
        while True:
            with op.cond:
                while min(op.layers_ready, last) == sent and not op.done:
                    op.cond.wait(1.0)
                ready, done = min(op.layers_ready, last), op.done
            if op.error is not None:
                break
            if done:
                break
            if ready > sent:
                sent = ready
                yield LoadProgress(layers_ready=ready, layers_total=op.layers_total)
        running.result()  # work() keeps its exception in op.error: this only waits


_Wanted = list[tuple[object, ComponentKind, np.ndarray]]  # (node, kind, its L2 pages)


def _pages_needed(wanted: _Wanted) -> dict[ComponentKind, int]:
    need: dict[ComponentKind, int] = {}
    for _, kind, host_ids in wanted:
        need[kind] = need.get(kind, 0) + len(host_ids)
    return need


def _moves_into(wanted: _Wanted, got: Mapping[ComponentKind, np.ndarray]) -> list[L1Move]:
    """The L1 pages `got` per component (as many as `_pages_needed`), handed out to the
    slots of `wanted` in order."""
    used = dict.fromkeys(got, 0)
    moves: list[L1Move] = []
    for node, kind, host_ids in wanted:
        lo = used[kind]
        used[kind] = lo + len(host_ids)
        moves.append((node, kind, host_ids, got[kind][lo : used[kind]]))
    return moves
