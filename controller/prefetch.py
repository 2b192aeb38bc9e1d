"""Prefetch: L3 -> L2 ahead of the request (DESIGN §3).

A `PrefetchOp` reserves host pages (bounded by `tiers.l2.prefetch_fraction` of L2), reads
page families in batches on the prefetch worker, and commits each batch to the tree as
host-resident right away, so what arrived is usable even if the op then times out or is
cancelled. `tokens_ready` only grows, page-aligned, always a prefix. Unused reserved
pages always go back, whatever the outcome.

When the request's matched prefix is in L1 and L1 has free pages, each committed batch
is also copied on to L1 (on the `prefetch-to-l1` worker, while the next batch is read),
so the request's load finds its pages there. Only free L1 pages are taken, never by
evicting; the first batch that does not fit stops it, so L1 holds a prefix. The op
finishes (and releases its pin) only after those copies landed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.auth import tenant_of_config
from hicache.controller.base import PrefetchInfo, PrefetchState
from hicache.controller.loads import L1Move
from hicache.controller.workers import Job, Worker
from hicache.errors import BackendTimedOut, BackendUnavailable, ResourceExhausted
from hicache.keys import PAGE_HASH_BYTES, split_hashes
from hicache.tree import TreeLock
from hicache.types import ComponentKind, PrefetchPolicy, Tier

if TYPE_CHECKING:
    from hicache.config import MemberSpec
    from hicache.controller.controller import HybridCacheController
    from hicache.controller.storage_io import L3Store
    from hicache.controller.transfers import Transfers

log = logging.getLogger("hicache.controller.prefetch")
FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA
BATCH_PAGES = 256  # pages per L3 read: fewer, larger calls are what the backends are fast at
MAX_WALK_BACK = 64  # boundaries tried below the FULL run for a hybrid model's L3 lookup
# Longest a prefetch waits for writes in flight, all its waits together (or until its
# deadline): for the L2 pages they hold, when L2 had no other room, and, before reading
# pages, for their writes.
WRITES_WAIT_S = 5.0
# For this long after an engine was refused a prefetch for want of budget, the engines
# share the budget (`budget_left`).
FAIR_SHARE_WINDOW_S = 5.0


@dataclass(eq=False)
class PrefetchOp:
    op_id: int
    namespace: str
    tokens: bytes  # the request's tokens up to the last page to fetch
    start_page: int  # token page of the first fetched page
    hashes: list[bytes]
    # Reserved host pages, one per page (MAMBA: 1). Empty until the worker reserves them
    # when L2 had no room at the start but what writes in flight held.
    host: dict[ComponentKind, np.ndarray]
    deadline: float | None
    state: PrefetchState = PrefetchState.RUNNING
    pages_ready: int = 0
    reported: int | None = None  # tokens_ready frozen at the deadline
    cancelled: bool = False
    mu: threading.Lock = field(default_factory=threading.Lock)
    page_size: int = 1
    pin: TreeLock | None = None  # holds the path the next batch continues
    to_l1: bool = False  # also copy committed batches into free L1 pages
    # Copies to L1 not landed yet, oldest batch first (mutex; `Prefetcher.l1_landed`).
    l1_moves: list[list[L1Move]] = field(default_factory=list)
    # A batch that did not land whole in L1: later batches must not land below the gap
    # (L1 holds a prefix), so they are freed instead (mutex).
    l1_broken: bool = False
    owner: str = ""  # the engine whose match started it (the one that may ask about it)
    # Its worker is done with it (`_finish_locked`): a cancel or a timeout ends `state`
    # first, while the worker still holds its pages (mutex).
    finished: bool = False
    started: bool = False  # its worker took it up (mutex): a queued one has read nothing
    waited_s: float = 0.0  # spent waiting for writes in flight so far (`_wait_left`)
    # Tokens between the match's host boundary and `start_page`: the tree's own storage
    # part, when L3 could not serve it and the op fetches past it (its FULL pages are in
    # L2; it becomes usable with the first boundary the op makes reusable). Counted in
    # tokens_ready and tokens_total, which are both measured from the host boundary, like
    # the match's storage_tokens.
    lead_tokens: int = 0
    pages_total: int = 0  # len(hashes), kept once the finished op drops them

    def __post_init__(self) -> None:
        self.pages_total = len(self.hashes)

    def _ready_tokens(self) -> int:
        return self.pages_ready * self.page_size + self.lead_tokens if self.pages_ready else 0

    def expire_locked(self) -> None:
        """Caller holds `mu`. A RUNNING op past its deadline is TIMED_OUT, whoever comes
        first (a status, a cancel, its worker's end): the same history gives the same
        answer whether the engine polled or not. tokens_ready is frozen from then."""
        if (self.state is PrefetchState.RUNNING and self.deadline is not None
                and time.monotonic() >= self.deadline):
            self.state = PrefetchState.TIMED_OUT
            self.reported = self._ready_tokens()

    def info(self) -> PrefetchInfo:
        with self.mu:
            total = self.pages_total * self.page_size + self.lead_tokens
            self.expire_locked()
            ready = self._ready_tokens() if self.reported is None else self.reported
            return PrefetchInfo(self.state, ready, total)

    def cancel(self) -> None:
        """Stop at the next batch (`Prefetcher.cancel` also gives a queued op's pages back)."""
        with self.mu:
            self.cancelled = True
            self.expire_locked()  # (a timeout that came first decides)
            if self.state is PrefetchState.RUNNING:
                self.state = PrefetchState.CANCELLED
                self.reported = self._ready_tokens()


def _timed_out(op: PrefetchOp) -> bool:
    with op.mu:
        op.expire_locked()
        return op.state is PrefetchState.TIMED_OUT


class Prefetcher:
    def __init__(self, ctl: HybridCacheController, keep_finished: int = 4096) -> None:
        self.ctl = ctl
        self.tree = ctl.tree
        self.worker = Worker("prefetch", capacity=256, retries=0)  # not idempotent: no retry
        self.l1_worker = Worker("prefetch-to-l1", capacity=256, retries=0)
        # Notified (mutex held) whenever a copy to L1 lands or is given up.
        self.l1_landed = threading.Condition(ctl._mu)
        self._ops: dict[int, PrefetchOp] = {}
        # Per tenant (see `tenant_of_config`), the ids of its ops, oldest first: each keeps
        # at most `keep_finished`, so one tenant's prefetches never push out another's
        # records (its PrefetchStatus would be lost early).
        self._tenant_of = tenant_of_config(ctl.cfg)
        self._of_tenant: dict[str, OrderedDict[int, None]] = {}
        self._to_l1: set[PrefetchOp] = set()  # ops with copies to L1 in flight (mutex)
        # Prefetch ids are random, so that one tenant cannot guess another's (they are
        # checked against the engine that started them as well: `_prefetch_op`).
        self._rng = random.SystemRandom()
        self._keep = keep_finished
        self._reserved_pages = 0
        self._held: dict[str, int] = {}  # pages reserved by each engine's running ops
        # Engines refused a prefetch for want of budget lately (the last time), oldest first.
        self._refused: OrderedDict[str, float] = OrderedDict()
        self.running = 0  # ops started and not finished (caller holds the mutex to read)

    def start(self) -> None:
        self.worker.start()
        self.l1_worker.start()

    def close(self, deadline: float | None = None) -> None:
        self.worker.close(deadline)
        self.l1_worker.close(deadline)

    def get(self, op_id: int) -> PrefetchOp | None:
        with self.ctl._mu:
            return self._ops.get(op_id)

    def budget_left(self, owner: str | None = None) -> int:
        """Host pages a new prefetch (of engine `owner`) may still reserve (read without
        the mutex: a hint). While another engine was refused one for want of budget in
        the last `FAIR_SHARE_WINDOW_S`, the engines waiting or holding reservations share
        it, each an equal part: one engine's stream of prefetches no longer keeps every
        other's from starting (it had all of it, taken again as each of its prefetches
        ended). With no other engine waiting, an engine may take all of it."""
        total = self.ctl.host.allocator(FULL).total
        budget = int(self.ctl.cfg.tiers.l2.prefetch_fraction * total)
        left = budget - self._reserved_pages
        if owner is None:
            return left
        since = time.monotonic() - FAIR_SHARE_WINDOW_S
        waiting = [o for o, at in list(self._refused.items()) if o != owner and at >= since]
        if not waiting:
            return left
        sharing = len({owner, *waiting, *self._held})
        return min(left, budget // sharing - self._held.get(owner, 0))

    def _note_refused(self, owner: str) -> None:
        """`owner` was refused a prefetch for want of budget (caller holds the mutex)."""
        now = time.monotonic()
        self._refused[owner] = now
        self._refused.move_to_end(owner)
        while self._refused:
            oldest, at = next(iter(self._refused.items()))
            if now - at <= FAIR_SHARE_WINDOW_S:
                break
            del self._refused[oldest]

    def reserved(self, kind: ComponentKind) -> list[np.ndarray]:
        out = []
        for op in self._ops.values():
            ids = op.host.get(kind)
            if ids is not None and len(ids):
                out.append(ids[ids >= 0])
        return out

    def reserved_l1(self, kind: ComponentKind) -> list[np.ndarray]:
        """L1 pages of copies to L1 in flight (caller holds the mutex)."""
        return [dev for op in self._to_l1 for moves in op.l1_moves
                for _, k, _, dev in moves if k is kind]

    def copying_to_l1(self) -> set[tuple[int, ComponentKind]]:
        """(id(node), kind) of every slot a copy to L1 is bringing (caller holds the
        mutex): a Load of the same path waits for it rather than copy it again."""
        return {(id(node), kind) for op in self._to_l1 for moves in op.l1_moves
                for node, kind, _, _ in moves}

    def l3_run(self, namespace: str, hashes: bytes, limit: int | None = None,
               window_inside: bool = False) -> int:
        """The deepest page boundary beyond the tree (at most `limit` pages) that L3 can
        serve: every page before it has its FULL family, windowed components (SWA) have
        the `window` pages before it, point components (MAMBA) a checkpoint exactly there.
        The window pages before `hashes` are taken to be in L2 (they are at a host
        boundary); `window_inside`: they are not (a storage boundary), so a boundary's
        window must lie among `hashes`."""
        l3 = self.ctl.l3
        assert l3 is not None
        page_hashes = split_hashes(hashes)
        if limit is not None:
            page_hashes = page_hashes[:limit]
        fam = self.ctl.cfg.model.family
        run = l3.present_run(namespace, page_hashes, fam(FULL))
        others = [c for c in self.tree.components if c.kind is not FULL]
        if not others:
            return run
        for b in range(run, max(0, run - MAX_WALK_BACK), -1):
            ok = True
            for comp in others:
                members = fam(comp.kind)
                if comp.per_page:
                    lo = b - comp.window_pages if comp.window_pages else 0
                    if lo < 0 and window_inside:
                        return 0  # (and so would every shallower boundary)
                    lo = max(0, lo)
                    ok = l3.present_run(namespace, page_hashes[lo:b], members) == b - lo
                else:
                    ok = l3.has(namespace, page_hashes[b - 1], members)
                if not ok:
                    break
            if ok:
                return b
        return 0

    def _new_id(self) -> int:
        while True:
            op_id = self._rng.getrandbits(63)
            if op_id and op_id not in self._ops:
                return op_id

    def start_op(self, namespace: str, tokens: bytes, tail: object | None, hashes: bytes,
                 to_l1: bool = False, owner: str = "", lead_tokens: int = 0) -> int:
        """Reserve host pages and queue the reads (caller holds the mutex); `to_l1`: the
        path down to `tail` is in L1, so arriving batches may follow it there;
        `lead_tokens`: see `PrefetchOp`. Returns 0 when nothing could be reserved."""
        cfg = self.ctl.cfg
        ps = cfg.model.page_size
        want = len(hashes) // PAGE_HASH_BYTES
        n = min(want, self.budget_left(owner))
        if n <= 0 or (n < want and len(self.tree.components) > 1):
            # A hybrid model's `hashes` end at a boundary L3 can resume from (the caller
            # chose it under the budget it read without the mutex); cut shorter (another
            # prefetch reserved meanwhile), they would end where no checkpoint or window
            # is: every read wasted, the op FAILED with nothing reusable.
            self.ctl.counters["prefetch_refused_budget"] += 1
            self._note_refused(owner)
            return 0
        # Pinned before reserving: the reservation evicts L2, and `tail` may lie past the
        # caller's lock (a hybrid boundary whose checkpoint or window only L3 holds).
        pin = self.tree.pin(tail) if tail is not None else None
        # Never waiting here for room: the caller's MatchPrefix would wait with it. When
        # L2 is short only of pages that writes in flight hold (a store slower than the
        # inserts), the worker reserves them once those landed (`_reserve_deferred`).
        host = self._try_reserve(n)
        # (The reservations of ops already queued come back before this one runs.)
        if host is None and not (self.ctl.transfers.host_room_coming() or self.running):
            if pin is not None:
                self.tree.unlock(pin)
            self.ctl.counters["prefetch_refused_room"] += 1
            return 0
        start_page = self.tree.depth_tokens(tail) // ps
        policy = cfg.prefetch.policy
        deadline = None
        if policy is PrefetchPolicy.TIMEOUT:
            deadline = time.monotonic() + cfg.prefetch.timeout_for(n * ps)
        op = PrefetchOp(
            op_id=self._new_id(),
            namespace=namespace,
            tokens=tokens[: (start_page + n) * ps * 4],
            start_page=start_page,
            hashes=[hashes[i * PAGE_HASH_BYTES : (i + 1) * PAGE_HASH_BYTES] for i in range(n)],
            host=host or {},
            deadline=deadline,
            page_size=ps,
            to_l1=to_l1,
            owner=owner,
            lead_tokens=lead_tokens,
        )
        op.pin = pin
        self._reserved_pages += n
        self._held[owner] = self._held.get(owner, 0) + n
        self.running += 1
        self._ops[op.op_id] = op
        self._forget_finished(self._tenant_of(owner), op.op_id)
        if host is None:
            self.ctl.counters["prefetch_deferred_room"] += 1
        if not self.worker.submit(Job(f"prefetch-{op.op_id}", lambda: self._run(op),
                                      lambda e: self._finish(op, PrefetchState.FAILED))):
            self._finish_locked(op, PrefetchState.FAILED)
        self.ctl.counters["prefetches_started"] += 1
        return op.op_id

    def _try_reserve(self, n: int) -> dict[ComponentKind, np.ndarray] | None:
        """Caller holds the mutex. Host pages for `n` pages' families (MAMBA: one slot),
        evicting L2 as needed but never waiting; None (and nothing held) without room."""
        host: dict[ComponentKind, np.ndarray] = {}
        try:
            for kind in self.ctl._kinds:
                host[kind] = self.ctl.transfers.allocate_l2(kind, 1 if kind is MAMBA else n,
                                                            wait=False)
        except ResourceExhausted:
            for kind, ids in host.items():
                self.ctl.transfers.free_l2(kind, ids)
            return None
        return host

    def _reserve_deferred(self, op: PrefetchOp) -> bool:
        """On the worker: reserve the host pages of an op that found no room at its start,
        waiting (mutex released) while writes in flight hold L2 pages, at most
        `_wait_left`. False: gave up (or cancelled)."""
        transfers = self.ctl.transfers
        start = time.monotonic()
        give_up = start + self._wait_left(op)
        try:
            return self._reserve_until(op, transfers, give_up)
        finally:
            op.waited_s += time.monotonic() - start

    def _reserve_until(self, op: PrefetchOp, transfers: Transfers, give_up: float) -> bool:
        with self.ctl._mu:
            while True:
                if op.cancelled:
                    return False
                host = self._try_reserve(len(op.hashes))
                if host is not None:
                    op.host = host
                    return True
                left = give_up - time.monotonic()
                # (Ops queued before this one have finished: the worker runs them in order.)
                if left <= 0 or not transfers.host_room_coming():
                    self.ctl.counters["prefetch_refused_room"] += 1
                    return False
                transfers.landed.wait(min(left, 0.05))

    def cancel(self, op: PrefetchOp) -> None:
        """Stop `op`: its worker stops before its next batch; one still queued (behind
        another op's reads) gives its L2 pages and its share of the budget back now."""
        op.cancel()
        with self.ctl._mu:
            if not op.started and not op.finished:
                self._finish_locked(op, PrefetchState.CANCELLED)

    def _run(self, op: PrefetchOp) -> None:
        with self.ctl._mu:
            if op.finished:  # cancelled while queued (`cancel`): it reads nothing
                return
            op.started = True
            end = (op.start_page + len(op.hashes)) * op.page_size
            if op.hashes and self.tree.served_tokens(op.namespace, op.tokens) >= end:
                # Another prefetch of the prefix (ops run one after another), or inserts,
                # brought it all while this one was queued: nothing to read again.
                op.pages_ready = len(op.hashes)
                self._finish_locked(op, PrefetchState.DONE)
                return
        l3 = self.ctl.l3
        assert l3 is not None
        cfg = self.ctl.cfg
        paged = [k for k in self.ctl._kinds if k is not MAMBA]
        windows = {c.kind: c.window_pages for c in self.tree.components}
        total = len(op.hashes)
        done = 0
        outcome = PrefetchState.DONE
        if self._gives_way(op):  # past its deadline while queued: it reads nothing
            self._finish(op, PrefetchState.TIMED_OUT)
            return
        if not op.host and not self._reserve_deferred(op):
            self._finish(op, PrefetchState.FAILED)  # (a cancel that came first decides)
            return
        try:
            while done < total:
                if op.cancelled:
                    outcome = PrefetchState.CANCELLED
                    break
                if self._gives_way(op):
                    outcome = PrefetchState.TIMED_OUT
                    break
                hi = min(total, done + BATCH_PAGES)
                got = hi - done  # leading pages of this batch whose whole family arrived
                for kind in paged:
                    members = cfg.model.family(kind)
                    window = windows.get(kind, 0)
                    lo = max(done, total - window) if window else done
                    if lo > done:  # outside the final window: not needed, never fetched
                        skip = op.host[kind][done : min(lo, hi)]
                        with self.ctl._mu:
                            self.ctl.transfers.free_l2(kind, skip[skip >= 0])
                        skip[:] = -1
                    if lo >= hi:
                        continue
                    n = self._read(l3, op, op.hashes[lo:hi], members, op.host[kind][lo:hi])
                    if kind is FULL:
                        got = min(got, n)
                    elif n < hi - lo:
                        got = min(got, lo - done + n)
                    if got == 0:
                        break
                last = done + got == total
                if got and last and MAMBA in op.host:
                    mamba = cfg.model.family(MAMBA)
                    if not self._read(l3, op, op.hashes[total - 1 : total], mamba, op.host[MAMBA]):
                        got -= 1  # no checkpoint at the end: the boundary stops a page earlier
                        last = False
                if got > 0:
                    moves = self._commit(op, done, done + got, with_checkpoint=last)
                    if moves:
                        final = done + got == total or done + got < hi
                        self._copy_to_l1(op, moves, inline=final)
                if done + got < hi or got <= 0:
                    outcome = PrefetchState.FAILED if done + got < total else PrefetchState.DONE
                    done += max(0, got)
                    break
                done += got
        except BackendUnavailable as e:
            outcome = PrefetchState.FAILED
            if isinstance(e, BackendTimedOut) and e.pending:
                self._hold_until_returned(op, e.pending)
        self._finish(op, outcome)

    def _gives_way(self, op: PrefetchOp) -> bool:
        """Whether a timed-out op stops before its next batch. Its engine computes what
        had not arrived; pages that arrive late are still inserted for later requests
        (DESIGN §3), but only while no other prefetch waits for the one worker: reading
        on for nobody would hold up prefetches whose engines still wait, until they too
        time out, one after another."""
        return _timed_out(op) and self.worker.queued() > 0

    def _read(self, l3: L3Store, op: PrefetchOp, hashes: list[bytes],
              members: tuple[MemberSpec, ...], host_ids: np.ndarray) -> int:
        """`l3.read` of pages of the op, after waiting for their writes in flight (at most
        `_wait_left`; the time spent is the op's)."""
        left = self._wait_left(op)
        if left > 0 and l3.writing_any():
            start = time.monotonic()
            try:
                l3.wait_written(op.namespace, hashes, members, left)
            finally:
                op.waited_s += time.monotonic() - start
        return l3.read(op.namespace, hashes, members, host_ids)

    @staticmethod
    def _wait_left(op: PrefetchOp) -> float:
        """How long the op may still wait for writes in flight (the lookup that started it
        counted their pages as present): what is left of `WRITES_WAIT_S` for the whole op,
        counting only time spent waiting (each read got 5 s of its own: 15 s for one
        hybrid batch, which reads FULL, SWA and a checkpoint apart, the one prefetch worker
        held up meanwhile); less after its deadline; none once cancelled."""
        if op.cancelled:
            return 0.0
        left = WRITES_WAIT_S - op.waited_s
        if op.deadline is not None:
            left = min(left, op.deadline - time.monotonic())
        return max(0.0, left)

    def _hold_until_returned(self, op: PrefetchOp, pending: list[Any]) -> None:
        """A read given up on runs on and may still write into the op's host pages: they
        stay held (freeing parks them) until every `pending` call has returned; L2 pages
        carry no checksum, so pages reused before would serve that late write."""
        transfers = self.ctl.transfers
        with self.ctl._mu:
            held = {kind: ids[ids >= 0].copy() for kind, ids in op.host.items()}
            for kind, ids in held.items():
                transfers._hold_l2(kind, ids)
        left = [len(pending)]

        def returned(_future: object) -> None:
            with self.ctl._mu:
                left[0] -= 1
                if left[0] == 0:
                    for kind, ids in held.items():
                        transfers._unhold_l2(kind, ids)

        for future in pending:
            future.add_done_callback(returned)

    def _commit(self, op: PrefetchOp, lo: int, hi: int, with_checkpoint: bool) -> list[L1Move]:
        """Pages [lo, hi) arrived: make them host-resident in the tree, then visible.
        Returns the copies to L1 this batch takes (registered with the op), if any."""
        ps4 = op.page_size * 4
        with self.ctl._mu:
            tokens = op.tokens[: (op.start_page + hi) * ps4]
            pages = {k: op.host[k][lo:hi] for k in op.host if k is not MAMBA}
            slot = int(op.host[MAMBA][0]) if (with_checkpoint and MAMBA in op.host) else None
            if op.pin is None:
                result = self.tree.insert(op.namespace, tokens, pages, mamba_slot=slot, tier=Tier.HOST)
                if result.end is not None:
                    op.pin = self.tree.pin(result.end)
            else:
                result = self.tree.insert(op.namespace, tokens, pages, lock=op.pin, keep_lock=True,
                                          mamba_slot=slot, tier=Tier.HOST)
            for kind, ids in result.released.items():
                self.ctl.transfers.free_l2(kind, ids)
            for kind, ids in result.dropped.items():  # a shorter L1 copy of a grown SWA tail
                self.ctl.transfers.free_l1(kind, ids)
            # Owned by the tree (or freed) now: marked at once, so that nothing raising
            # below makes `_finish_locked` free pages the tree holds.
            for kind in op.host:
                if kind is MAMBA:
                    if slot is not None:
                        op.host[kind] = op.host[kind][1:]
                else:
                    op.host[kind][lo:hi] = -1
            end = result.end if result.end is not None else (op.pin.end if op.pin else None)
            self._mark_in_storage(op, end, lo, hi, slot is not None)
            # tokens_ready is a usable prefix: a hybrid model's batch end is one only
            # with its window and checkpoint, i.e. the op's last page with the checkpoint;
            # and only if the path down to it is reusable from L1 and L2 (an op that
            # starts past the host boundary needs the tree's part before it there too).
            hybrid = len(self.tree.components) > 1
            if ((not hybrid or (hi == len(op.hashes) and (slot is not None or MAMBA not in op.host)))
                    and end is not None and self.tree.reusable_from_host(end)):
                with op.mu:
                    op.pages_ready = hi
            if op.to_l1 and end is not None:
                return self._plan_to_l1(op, end, (op.start_page + lo) * op.page_size)
            return []

    def _plan_to_l1(self, op: PrefetchOp, end: object, first_token: int) -> list[L1Move]:
        """Caller holds the mutex. Reserve free L1 pages for the nodes just committed
        (those below `first_token` on the path to `end`); the first batch without room
        stops it for the rest of the op."""
        tree = self.tree
        nodes: list[object] = []
        node: object | None = end
        while node is not None and tree.depth_tokens(tree.parent_of(node)) >= first_token:
            nodes.append(node)
            node = tree.parent_of(node)
        moves = self.ctl.loads.plan_to_free_l1(nodes[::-1])
        if moves is None:
            op.to_l1 = False
            self.ctl.counters["prefetch_to_l1_no_room"] += 1
            return []
        if moves:
            op.l1_moves.append(moves)
            self._to_l1.add(op)
        return moves

    def _copy_to_l1(self, op: PrefetchOp, moves: list[L1Move], inline: bool) -> None:
        """Copy and land `moves`: on the L1 worker while the next batch is read, or here
        (the last batch: nothing left to overlap with). Batches land in order: the worker
        runs them first in, first out, and the inline one waits for those before it."""
        if inline:
            try:
                self.ctl.loads.copy_to_l1(moves)
            except Exception:
                log.exception("prefetch %d: copy to L1 failed", op.op_id)
                self._l1_done(op, moves, copied=False)
                return
            with self.ctl._mu:
                while op.l1_moves and op.l1_moves[0] is not moves:  # earlier ones on the worker
                    self.l1_landed.wait()
            self._l1_done(op, moves, copied=True)
            return

        def run() -> None:
            self.ctl.loads.copy_to_l1(moves)  # raises: the worker gives up, nothing lands
            self._l1_done(op, moves, copied=True)

        job = Job(f"prefetch-{op.op_id}-to-l1", run, lambda _e: self._l1_done(op, moves, copied=False))
        if not self.l1_worker.submit(job):
            self._l1_done(op, moves, copied=False)

    def _l1_done(self, op: PrefetchOp, moves: list[L1Move], copied: bool) -> None:
        """Land (or, not copied, free) a copy to L1, exactly once. After a batch that did
        not land whole, later ones are freed: L1 must not hold pages below a gap."""
        with self.ctl._mu:
            if not any(m is moves for m in op.l1_moves):
                return
            op.l1_moves = [m for m in op.l1_moves if m is not moves]
            if not op.l1_moves:
                self._to_l1.discard(op)
            transfers = self.ctl.transfers
            try:
                if copied and not op.l1_broken:
                    want = sum(len(dev) for _, kind, _, dev in moves if kind is FULL)
                    landed = self.ctl.loads.land_in_l1(moves)
                    self.ctl.counters["prefetch_pages_to_l1"] += landed
                    if landed < want:
                        op.l1_broken = True
                else:
                    for _, kind, _, dev in moves:
                        transfers.free_l1(kind, dev)
                    if not copied:
                        self.ctl.counters["prefetch_to_l1_failed"] += 1
                    op.l1_broken = True
                if op.l1_broken:
                    op.to_l1 = False
            finally:
                self.l1_landed.notify_all()
                transfers.landed.notify_all()  # (a Load waiting for these slots)

    def _mark_in_storage(self, op: PrefetchOp, end: object | None, lo: int, hi: int,
                         checkpoint: bool) -> None:
        """Caller holds the mutex. The slots this commit read from L3 are in L3: record it,
        so that write-through does not write them back. Per kind only the pages it read
        (a windowed kind only its final window), whole nodes only."""
        if end is None:
            return
        ps = op.page_size
        total = len(op.hashes)
        first = {
            c.kind: op.start_page + (max(lo, total - c.window_pages) if c.window_pages else lo)
            for c in self.tree.components if c.per_page
        }
        last = op.start_page + hi
        tree = self.tree
        node: object | None = end
        while node is not None:
            parent = tree.parent_of(node)
            top, bottom = tree.depth_tokens(parent) // ps, tree.depth_tokens(node) // ps
            if bottom <= min(first.values()):
                break
            for kind, begin in first.items():
                if begin <= top and bottom <= last and kind in op.host:
                    self._mark(node, kind)
            if checkpoint and node is end and MAMBA in op.host:
                self._mark(node, MAMBA)
            node = parent

    def _mark(self, node: object, kind: ComponentKind) -> None:
        if self.tree.is_resident(node, kind, Tier.HOST) and not self.tree.is_resident(node, kind, Tier.STORAGE):
            self.tree.set_resident(node, kind, Tier.STORAGE)

    def _forget_finished(self, tenant: str, op_id: int) -> None:
        """Caller holds the mutex. Record `op_id` as the tenant's newest and keep at most
        `keep_finished` of the tenant's ops, dropping finished ones oldest first: one whose
        worker has not finished stays (its status is asked for, its pages audited),
        cancelled or timed out or not."""
        ids = self._of_tenant.setdefault(tenant, OrderedDict())
        ids[op_id] = None
        excess = len(ids) - self._keep
        if excess <= 0:
            return
        drop = []
        for old in ids:  # running ops (few: the budget bounds them) are skipped
            if self._ops[old].finished:  # (not `state`: a cancelled op's worker may still hold pages)
                drop.append(old)
                if len(drop) == excess:
                    break
        for old in drop:
            del ids[old]
            del self._ops[old]

    def _finish(self, op: PrefetchOp, outcome: PrefetchState) -> None:
        # Copies to L1 read host pages that the op's pin keeps in place: they land first.
        with self.ctl._mu:
            while op.l1_moves:
                self.l1_landed.wait()
            self._finish_locked(op, outcome)

    def _finish_locked(self, op: PrefetchOp, outcome: PrefetchState) -> None:
        for kind, ids in op.host.items():
            left = ids[ids >= 0]
            self.ctl.transfers.free_l2(kind, left)
            op.host[kind] = ids[:0]
        self._reserved_pages -= op.pages_total
        held = self._held.get(op.owner, 0) - op.pages_total
        if held > 0:
            self._held[op.owner] = held
        else:
            self._held.pop(op.owner, None)
        self.running -= 1
        op.finished = True
        # Kept (up to keep_finished) only to answer PrefetchStatus: not its prompt and
        # hashes (a 1M-token prompt is 4 MB).
        op.tokens, op.hashes = b"", []
        if op.pin is not None and op.pin.active:
            self.tree.unlock(op.pin)
        op.pin = None
        with op.mu:
            op.expire_locked()
            if op.state is PrefetchState.RUNNING:
                op.state = outcome
            final = op.state  # a cancel or timeout that came first decides
        self.ctl.counters[f"prefetches_{final.value.lower()}"] += 1
