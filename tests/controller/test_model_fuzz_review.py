"""Review: a seeded, model-based fuzz of the in-process controller.

Several engines (two in one namespace, one in another; with `model.tp_size` 2 each engine
attaches both ranks under a process id) drive a `HybridCacheController` built with tiny
pools (FULL-only and hybrid FULL+SWA+MAMBA, several L1->L2 x L2->L3 write-policy pairs, a
file L3) through random interleavings of: whole requests, open requests (match with lock /
allocate_tokens / prefetch / session ids, allocate, grow, load, insert, release), probes,
prefetches (status, cancel), CloseSession, flushes, engine restarts (attach under a new
instance id), lease lapses (`expire_leases`), heartbeats and evictions forced in L1/L2
(`evict_all` and partial `transfers._evict`).

A model keeps every handle each engine holds. After every step: the tree's invariants and
page ownership (`check_integrity`), the pages each open request's lock pins still hold the
bytes written, Stats (used + free == capacity, locked <= used, the active_* gauges equal
the model's handles, counters never decrease, restart/lease counters count exactly what
the model held), heartbeats report the model's handles. At the end: nothing locked once
every handle is gone, a lossless policy pair loses no prompt (unless a backup was counted
dropped), every prompt still cached anywhere reads back exact, and once every engine is
gone L1 can be allocated whole. After each flush (L3 up, nothing dropped or failed):
`unflushed_pages()` is 0, and (FULL-only) every FULL page this daemon counted stored
(`backups_l3`) is one object a member in the file L3.

What a failing run showed is minimised into the tests at the end (strict xfails until fixed)."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from engine_sim import Engine, evict_all, toks, wait_prefetch

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest, PrefetchState
from hicache.errors import FailedPrecondition, HicacheError, NotFound, ResourceExhausted
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
PS = 4
PB = PS * 4
LIMIT = 128  # server.max_tokens_per_request
GAUGES = {"prefetches_running", "active_locks", "active_allocations"}
_fresh = itertools.count()


class SimEngine(Engine):
    """engine_sim's Engine, attached on every rank of `model.tp_size` under a process id
    (`instance`); it writes and checks whole rows (every rank's shard)."""

    def __init__(self, ctl, engine_id: str, namespace: str = "") -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.id = engine_id
        self.ns = namespace
        self.cfg = ctl.cfg
        self.ps = self.cfg.model.page_size
        self.checked = 0
        self.tp = self.cfg.model.tp_size
        self.generation = 0
        self.attach_all()

    @property
    def instance(self) -> str:
        return f"{self.id}-p{self.generation}"

    def attach_all(self) -> None:
        for rank in range(self.tp):
            self.ctl.attach(self.id, rank, self.tp, instance_id=self.instance)


@dataclass
class Req:
    eng: SimEngine
    tokens: bytes
    lock_id: int | None
    alloc_id: int | None
    dev: int  # the lock's device boundary (pages)
    held: dict[str, np.ndarray] = field(default_factory=dict)  # paged L1 ids before `dev`
    pages: dict[str, np.ndarray] | None = None  # the allocation's pages
    alloc_start: int = 0
    alloc_len: int = 0
    session: str = ""

    @property
    def total(self) -> int:
        return len(self.tokens) // PB


def tokens_from(rng: random.Random, bases: list[int]) -> bytes:
    """Shared prefixes (matches split nodes) with fresh tails now and then."""
    b = rng.choice(bases)
    ids = list(range(b, b + PS * rng.randint(1, 5)))
    if rng.random() < 0.4:
        ids += [900_000 + 64 * next(_fresh) + i for i in range(PS * rng.randint(1, 2))]
    return toks(ids)


class Model:
    def __init__(self, ctl, seed: int, *, lossless: bool) -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.rng = random.Random(seed)
        self.lossless = lossless
        self.hybrid = MAMBA in ctl.cfg.model.component_kinds
        self.mamba = {m.name for m in ctl.cfg.model.family(MAMBA)} if self.hybrid else set()
        kinds = ctl.cfg.model.component_kinds
        self.swa = {m.name for m in ctl.cfg.model.family(SWA)} if SWA in kinds else set()
        self.window = ctl.cfg.model.components[SWA].window_tokens // PS if self.swa else 0
        self.layers = {m.name: m.layers for m in ctl.cfg.model.members}
        self.engines = [SimEngine(ctl, "e1"), SimEngine(ctl, "e2"), SimEngine(ctl, "e3", "ns-b")]
        self.reqs: list[Req] = []
        self.prompts: dict[tuple[str, bytes], SimEngine] = {}  # (ns, tokens) inserted whole
        self.sessions: set[str] = set()
        self.running: list[tuple[SimEngine, int]] = []  # prefetches left running
        self.lossless = lossless and not self.hybrid
        self.bases = [self.rng.randrange(1, 1000) * 100 for _ in range(5)]
        self.last = Counter(ctl.stats().counters)
        self.log: list[str] = []

    # ------------------------------------------------------------------ helpers

    def attempt(self, fn, *args, allowed=(ResourceExhausted,), **kw):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, **kw), None
        except HicacheError as e:
            assert str(e).strip()
            if not isinstance(e, allowed):
                raise
            return None, e

    def mine(self, eng: SimEngine) -> list[Req]:
        return [r for r in self.reqs if r.eng is eng]

    def paged(self, pages) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
        return {n: np.array(ids) for n, ids in pages.items() if n not in self.mamba}

    def verify(self, eng: SimEngine, pages, tokens: bytes, device_tokens: int) -> None:  # type: ignore[no-untyped-def]
        eng.verify(pages, tokens, device_tokens // PS)

    def note_prompt(self, eng: SimEngine, tokens: bytes) -> None:
        whole = tokens[: len(tokens) // PB * PB]
        if whole:
            self.prompts.setdefault((eng.ns, whole), eng)

    # ------------------------------------------------------------------ ops

    def op_whole(self) -> None:
        eng = self.rng.choice(self.engines)
        tokens = tokens_from(self.rng, self.bases)
        session = self.rng.choice(["", "", "s1", "s2"])
        prefetch = self.rng.random() < 0.3
        self.whole(eng, tokens, session, prefetch)

    def whole(self, eng: SimEngine, tokens: bytes, session: str = "", prefetch: bool = False) -> bool:
        ctl = self.ctl
        m, err = self.attempt(ctl.match, eng.id, MatchRequest(
            eng.ns, tokens, session_id=session, lock=True, prefetch=prefetch,
            allocate_tokens=len(tokens) // 4))
        if err is not None:
            return False
        if session:
            self.sessions.add(session)
        try:
            self.verify(eng, m.device_pages, tokens, m.device_tokens)
            start = m.device_tokens // PS
            skip = 0
            if m.host_tokens:
                out, err = self.attempt(lambda: list(ctl.load(eng.id, m.lock_id)),
                                        allowed=(ResourceExhausted, FailedPrecondition))
                if err is None:
                    last = out[-1]
                    self.verify(eng, last.device_pages, tokens, last.device_tokens)
                    skip = last.device_tokens // PS - start
                    start += skip
            eng.write({k: v if k in self.mamba else v[skip:] for k, v in m.pages.items()}, tokens, start)
            out, err = self.attempt(ctl.insert, eng.id, InsertRequest(
                eng.ns, tokens, lock_id=m.lock_id, allocation_id=m.allocation_id,
                session_id=session, mamba_checkpoint=True))
        except BaseException:
            with contextlib.suppress(NotFound):
                ctl.release(eng.id, m.lock_id, m.allocation_id)
            raise
        if err is not None:
            ctl.release(eng.id, m.lock_id, m.allocation_id)
            return False
        assert out.inserted_tokens + out.reused_tokens == len(tokens) // PB * PS
        self.note_prompt(eng, tokens)
        return True

    def op_open(self) -> None:
        if len(self.reqs) >= 3:
            return
        eng = self.rng.choice(self.engines)
        tokens = tokens_from(self.rng, self.bases)
        session = self.rng.choice(["", "s1", "s3"])
        how = self.rng.choice(["alloc", "lock", "lock_then_alloc"])
        alloc_tokens = len(tokens) // 4 + PS * self.rng.randint(0, 2) if how == "alloc" else None
        m, err = self.attempt(self.ctl.match, eng.id, MatchRequest(
            eng.ns, tokens, session_id=session, lock=True, allocate_tokens=alloc_tokens))
        if err is not None:
            return
        if session:
            self.sessions.add(session)
        self.verify(eng, m.device_pages, tokens, m.device_tokens)
        r = Req(eng, tokens, m.lock_id, m.allocation_id or None, dev=m.device_tokens // PS,
                held=self.paged(m.device_pages), session=session)
        if alloc_tokens is not None:
            r.pages, r.alloc_start = dict(m.pages), r.dev
            r.alloc_len = len(m.pages["full"])
            assert r.alloc_len == -(-max(0, alloc_tokens - m.device_tokens) // PS)
        self.reqs.append(r)
        if how == "lock_then_alloc":
            self.allocate_for(r)

    def allocate_for(self, r: Req) -> None:
        want = max(1, (r.total - r.dev) * PS + PS * self.rng.randint(0, 1))
        info, err = self.attempt(self.ctl.allocate, r.eng.id,
                                 AllocateRequest(r.eng.ns, want, lock_id=r.lock_id))
        if err is not None:
            return
        r.alloc_id, r.pages, r.alloc_start = info.allocation_id, dict(info.pages), r.dev
        r.alloc_len = len(info.pages["full"])
        assert r.alloc_len == -(-want // PS)

    def op_allocate(self) -> None:
        cands = [r for r in self.reqs if r.alloc_id is None and r.lock_id is not None]
        if cands:
            self.allocate_for(self.rng.choice(cands))

    def op_grow(self) -> None:
        cands = [r for r in self.reqs if r.alloc_id is not None and r.lock_id is not None]
        if not cands:
            return
        r = self.rng.choice(cands)
        more = self.rng.randint(0, 2)
        tokens = r.tokens[: r.total * PB] + toks(
            [910_000 + 64 * next(_fresh) + i for i in range(PS * more)])
        if len(tokens) // 4 > LIMIT // 2:
            return
        n_pages = self.rng.randint(1, 3)
        info, err = self.attempt(self.ctl.allocate, r.eng.id,
                                 AllocateRequest(r.eng.ns, n_pages * PS, allocation_id=r.alloc_id))
        if err is not None:
            return
        assert info.allocation_id == r.alloc_id
        assert len(info.pages["full"]) == r.alloc_len + n_pages
        r.pages, r.alloc_len = dict(info.pages), r.alloc_len + n_pages
        if r.alloc_start + r.alloc_len >= len(tokens) // PB:
            r.tokens = tokens

    def op_load(self) -> None:
        cands = [r for r in self.reqs if r.lock_id is not None]
        if not cands:
            return
        r = self.rng.choice(cands)
        out, err = self.attempt(lambda: list(self.ctl.load(r.eng.id, r.lock_id)),
                                allowed=(ResourceExhausted, FailedPrecondition))
        if err is not None:
            return
        last = out[-1]
        assert last.layers_ready == last.layers_total
        assert last.device_tokens // PS >= r.dev
        self.verify(r.eng, last.device_pages, r.tokens, last.device_tokens)
        r.dev = last.device_tokens // PS
        r.held = self.paged(last.device_pages)

    def insertable(self, r: Req) -> bool:
        need = r.total - r.dev
        if need <= 0:
            return True
        if r.alloc_id is None or r.pages is None:
            return False
        lo = r.dev - r.alloc_start
        return lo >= 0 and lo + need <= r.alloc_len

    def op_insert(self) -> None:
        cands = [r for r in self.reqs if self.insertable(r)]
        if not cands:
            return
        r = self.rng.choice(cands)
        if r.pages is not None:
            lo = r.dev - r.alloc_start
            r.eng.write({n: ids if n in self.mamba else ids[lo:] for n, ids in r.pages.items()},
                        r.tokens, r.dev)
        checkpoint = self.rng.random() < 0.7
        keep = r.lock_id is not None and self.rng.random() < 0.4
        out, err = self.attempt(self.ctl.insert, r.eng.id, InsertRequest(
            r.eng.ns, r.tokens, lock_id=r.lock_id, allocation_id=r.alloc_id,
            session_id=r.session, mamba_checkpoint=checkpoint, keep_lock=keep))
        if err is not None:
            return
        assert out.inserted_tokens + out.reused_tokens == r.total * PS
        if checkpoint or not self.hybrid:
            self.note_prompt(r.eng, r.tokens)
        if not keep:
            self.reqs.remove(r)
            return
        # The request goes on (decode): its lock ends at its tokens now, the allocation
        # keeps the pages past them; it reads its KV from the pages it wrote.
        used = r.total - r.dev
        if r.pages is not None:
            lo = r.dev - r.alloc_start
            if used > 0:
                r.held = {n: np.concatenate([ids, np.asarray(r.pages[n][lo : lo + used])])
                          for n, ids in r.held.items()}
            r.alloc_len -= lo + max(0, used)
            r.pages = {n: ids if n in self.mamba else ids[lo + max(0, used):] for n, ids in r.pages.items()}
            r.alloc_start = r.total
        r.dev = r.total
        r.tokens = r.tokens[: r.total * PB]

    def op_release(self) -> None:
        if not self.reqs:
            return
        r = self.rng.choice(self.reqs)
        if r.lock_id is not None and r.alloc_id is not None and self.rng.random() < 0.5:
            self.ctl.release(r.eng.id, r.lock_id, None)
            self.ctl.release(r.eng.id, None, r.alloc_id)
        else:
            self.ctl.release(r.eng.id, r.lock_id, r.alloc_id)
        self.reqs.remove(r)

    def op_probe(self) -> None:
        eng = self.rng.choice(self.engines)
        if self.prompts and self.rng.random() < 0.6:
            (ns, tokens), owner = self.rng.choice(list(self.prompts.items()))
            eng = owner if ns != "" else self.rng.choice([e for e in self.engines if e.ns == ""])
        else:
            tokens = tokens_from(self.rng, self.bases)
        self.probe(eng, tokens, load=self.rng.random() < 0.7)

    def probe(self, eng: SimEngine, tokens: bytes, load: bool) -> int:
        m, err = self.attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=True))
        if err is not None:
            return -1
        reached = m.device_tokens
        try:
            self.verify(eng, m.device_pages, tokens, m.device_tokens)
            if load and m.host_tokens:
                out, err = self.attempt(lambda: list(self.ctl.load(eng.id, m.lock_id)),
                                        allowed=(ResourceExhausted, FailedPrecondition))
                if err is None:
                    last = out[-1]
                    assert last.device_tokens >= m.device_tokens
                    self.verify(eng, last.device_pages, tokens, last.device_tokens)
                    reached = last.device_tokens
        finally:
            self.ctl.release(eng.id, m.lock_id, None)
        return reached

    def op_prefetch(self) -> None:
        if self.prompts and self.rng.random() < 0.8:
            (_ns, tokens), eng = self.rng.choice(list(self.prompts.items()))
        else:
            eng, tokens = self.rng.choice(self.engines), tokens_from(self.rng, self.bases)
        self.prefetch(eng, tokens, lock=self.rng.random() < 0.5, cancel=self.rng.random() < 0.3)

    def prefetch(self, eng: SimEngine, tokens: bytes, lock: bool, cancel: bool) -> None:
        m, err = self.attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=lock, prefetch=True))
        if err is not None:
            return
        assert bool(m.lock_id) == lock
        try:
            if m.prefetch_id:
                info = self.ctl.prefetch_status(m.prefetch_id, eng.id)
                assert 0 <= info.tokens_ready <= info.tokens_total
                if cancel:
                    assert self.ctl.cancel_prefetch(m.prefetch_id, eng.id) >= 0
                state = wait_prefetch(self.ctl, m.prefetch_id)
                info = self.ctl.prefetch_status(m.prefetch_id, eng.id)
                assert 0 <= info.tokens_ready <= info.tokens_total
                if state is PrefetchState.DONE:
                    assert info.tokens_ready == info.tokens_total, info
        finally:
            if m.lock_id:
                self.ctl.release(eng.id, m.lock_id, None)
        self.probe(eng, tokens, load=True)

    def op_prefetch_background(self) -> None:
        """A prefetch left running while other ops go on (with a lock: an open request)."""
        if self.prompts and self.rng.random() < 0.8:
            (_ns, tokens), eng = self.rng.choice(list(self.prompts.items()))
        else:
            eng, tokens = self.rng.choice(self.engines), tokens_from(self.rng, self.bases)
        lock = len(self.reqs) < 3 and self.rng.random() < 0.5
        m, err = self.attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=lock, prefetch=True))
        if err is not None:
            return
        self.verify(eng, m.device_pages, tokens, m.device_tokens)
        if m.prefetch_id:
            self.running.append((eng, m.prefetch_id))
        if lock:
            self.reqs.append(Req(eng, tokens, m.lock_id, None, dev=m.device_tokens // PS,
                                 held=self.paged(m.device_pages)))

    def op_prefetch_poll(self) -> None:
        if not self.running:
            return
        eng, pid = self.rng.choice(self.running)
        what = self.rng.random()
        try:
            if what < 0.3:
                ready = self.ctl.cancel_prefetch(pid, eng.id)
                assert ready >= 0
            info = self.ctl.prefetch_status(pid, eng.id)
        except NotFound:  # (expired from the controller's memory)
            self.running.remove((eng, pid))
            return
        assert 0 <= info.tokens_ready <= info.tokens_total, info
        if info.state is PrefetchState.DONE:
            assert info.tokens_ready == info.tokens_total, info
        if info.state is not PrefetchState.RUNNING:
            self.running.remove((eng, pid))

    def op_close_session(self) -> None:
        sid = self.rng.choice(["s1", "s2", "s3"])
        n, _ = self.attempt(self.ctl.close_session, sid, allowed=(NotFound,))
        assert n is None or n >= 0
        self.sessions.discard(sid)

    def op_flush(self) -> None:
        assert self.ctl.flush(10) >= 0
        self.after_flush()

    def after_flush(self) -> None:
        """Nothing left unwritten (L3 is up); a lossless policy pair lost no prompt."""
        ctl = self.ctl
        c = ctl.stats().counters
        failed = sum(c[k] for k in ("backups_dropped", "backups_l2_failed", "backups_l3_failed"))
        if failed:
            return
        assert ctl.unflushed_pages() == 0, ctl.unflushed_pages()
        if not self.hybrid and ctl.l3 is not None:
            # Each FULL page this daemon stored is one object a member (counted once).
            objects = sum(f.endswith(".kv") for _, _, fs in os.walk(ctl.l3.backend.root) for f in fs)
            evicted = ctl.stats().l3[0].evicted
            stored = c["backups_l3"] * len(ctl.cfg.model.members)
            assert objects + evicted == stored, (objects, evicted, stored)
        if self.lossless:
            for (ns, tokens), eng in self.prompts.items():
                m = ctl.match(eng.id, MatchRequest(ns, tokens))
                found = m.device_tokens + m.host_tokens + m.storage_tokens
                assert found == len(tokens) // 4, ("prompt lost", len(tokens) // 4, m[:3])

    def op_fill(self) -> None:
        eng = self.rng.choice(self.engines)
        for _ in range(self.rng.randint(1, 4)):
            self.whole(eng, toks(np.arange(PS * 6) + 2_000_000 + 64 * next(_fresh)))

    def op_evict(self) -> None:
        how = self.rng.random()
        if how < 0.5:
            tiers = self.rng.choice([(Tier.DEVICE,), (Tier.HOST,), (Tier.DEVICE, Tier.HOST)])
            evict_all(self.ctl, *tiers)
        else:  # partial, as an allocation short of room makes it (no drain first)
            tier = self.rng.choice([Tier.DEVICE, Tier.HOST])
            kind = self.rng.choice(list(self.ctl._kinds))
            with self.ctl._mu:
                self.ctl.transfers._evict(tier, kind, self.rng.randint(1, 6))

    def op_restart(self) -> None:
        eng = self.rng.choice(self.engines)
        mine = self.mine(eng)
        locks = sum(r.lock_id is not None for r in mine)
        allocs = sum(r.alloc_id is not None for r in mine)
        before = Counter(self.ctl.stats().counters)
        eng.generation += 1
        eng.attach_all()
        after = Counter(self.ctl.stats().counters)
        assert after["engine_restarts"] - before["engine_restarts"] == 1
        assert after["restart_released_locks"] - before["restart_released_locks"] == locks
        assert after["restart_released_allocations"] - before["restart_released_allocations"] == allocs
        for r in mine:
            self.reqs.remove(r)
            if r.lock_id is not None:
                with pytest.raises(NotFound):
                    self.ctl.release(eng.id, r.lock_id, None)

    def op_lapse(self) -> None:
        eng = self.rng.choice(self.engines)
        mine = self.mine(eng)
        locks = sum(r.lock_id is not None for r in mine)
        allocs = sum(r.alloc_id is not None for r in mine)
        before = Counter(self.ctl.stats().counters)
        with self.ctl._mu:
            self.ctl._engines._engines[eng.id].expires_at = 0.0
        assert self.ctl.expire_leases() == 1
        after = Counter(self.ctl.stats().counters)
        assert after["leases_expired"] - before["leases_expired"] == 1
        assert after["lease_released_locks"] - before["lease_released_locks"] == locks
        assert after["lease_released_allocations"] - before["lease_released_allocations"] == allocs
        for r in mine:
            self.reqs.remove(r)
        with pytest.raises(NotFound):
            self.ctl.heartbeat(eng.id)
        eng.generation += 1
        eng.attach_all()

    def op_heartbeat(self) -> None:
        eng = self.rng.choice(self.engines)
        for rank in range(eng.tp):
            hb = self.ctl.heartbeat(eng.id, rank, eng.instance)
            mine = self.mine(eng)
            assert hb.locks == sum(r.lock_id is not None for r in mine)
            assert hb.allocations == sum(r.alloc_id is not None for r in mine)

    OPS = {"whole": 6, "open": 3, "allocate": 1, "grow": 2, "load": 2, "insert": 3, "release": 2,
           "probe": 3, "prefetch": 2, "close_session": 1, "flush": 1, "fill": 1, "evict": 3,
           "restart": 1, "lapse": 1, "heartbeat": 1, "prefetch_background": 2, "prefetch_poll": 2}

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        ctl = self.ctl
        ctl.check_integrity()
        for r in self.reqs:  # what a lock pins keeps its bytes
            if r.lock_id is None:
                continue
            hs = r.eng.hashes(r.tokens)
            for name, ids in r.held.items():
                base = 0
                if name in self.swa:  # (SWA: only the window before the boundary is kept)
                    base = max(0, r.dev - self.window)
                    ids = ids[base:]
                for layer in range(self.layers[name]):
                    rows = r.eng._rows(name, layer)
                    for i, pid in enumerate(ids):
                        if pid < 0:
                            continue
                        want = r.eng.pattern(hs[base + i], name, layer, rows.shape[1])
                        assert np.array_equal(rows[int(pid)], want), (
                            f"{name} page {base + i} (L1 {pid}) changed under a lock")
        # The snapshot and the allocators read under the mutex: a prefetch following into
        # free L1 allocates on its own thread (4 SWA pages between the two reads, once).
        with ctl._mu:
            s = ctl.stats()
            free = {(tier, kind): (pools.allocator(kind).free_count, pools.allocator(kind).total)
                    for tier, pools in ((Tier.DEVICE, ctl.device), (Tier.HOST, ctl.host))
                    for kind in ctl._kinds}
        for p in s.pools:
            assert 0 <= p.locked_pages <= p.used_pages <= p.capacity_pages, p
        for (tier, kind), (free_count, total) in free.items():
            usage = [p for p in s.pools if p.tier == tier.name.lower()
                     and p.member in {m.name for m in ctl.cfg.model.family(kind)}]
            for p in usage:
                assert p.used_pages + free_count == p.capacity_pages == total, p
        c = Counter(s.counters)
        assert c["active_locks"] == sum(r.lock_id is not None for r in self.reqs)
        assert c["active_allocations"] == sum(r.alloc_id is not None for r in self.reqs)
        for k, v in self.last.items():
            if k not in GAUGES:
                assert c[k] >= v, f"counter {k} went down: {v} -> {c[k]}"
        self.last = c

    # ------------------------------------------------------------------ run

    def run(self, steps: int) -> None:
        names = list(self.OPS)
        weights = [self.OPS[n] for n in names]
        for _ in range(steps):
            name = self.rng.choices(names, weights)[0]
            self.log.append(name)
            getattr(self, f"op_{name}")()
            self.check()
        self.finish()

    def finish(self) -> None:
        ctl = self.ctl
        for r in list(self.reqs):
            ctl.release(r.eng.id, r.lock_id, r.alloc_id)
            self.reqs.remove(r)
        for _eng, pid in self.running:
            with contextlib.suppress(NotFound):
                wait_prefetch(ctl, pid)
        for sid in ("s1", "s2", "s3"):
            with contextlib.suppress(NotFound):
                ctl.close_session(sid)
        deadline = time.monotonic() + 10
        while ctl.stats().counters["prefetches_running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ctl.transfers.drain(10)
        self.check()
        s = ctl.stats()
        assert all(p.locked_pages == 0 for p in s.pools), [p for p in s.pools if p.locked_pages]
        assert s.counters["active_locks"] == s.counters["active_allocations"] == 0
        ctl.flush(10)
        self.after_flush()
        # Every prompt still cached anywhere reads back exact (through L3 by a prefetch).
        for (_ns, tokens), eng in self.prompts.items():
            self.prefetch(eng, tokens, lock=True, cancel=False)
        self.check()
        # Every engine gone: L1 can be allocated whole.
        for eng in self.engines:
            with ctl._mu:
                ctl._engines._engines[eng.id].expires_at = 0.0
        assert ctl.expire_leases() == len(self.engines)
        assert ctl.transfers.drain(10)
        for rank in range(ctl.cfg.model.tp_size):
            ctl.attach("last", rank, ctl.cfg.model.tp_size, instance_id="x")
        pages = min(ctl.device.allocator(k).total for k in ctl._paged)
        info = ctl.allocate("last", AllocateRequest("", pages * PS))
        assert len(info.pages["full"]) == pages
        ctl.release("last", None, info.allocation_id)
        self.check()


CONFIGS = {
    "full-wt-wt": dict(write__l1_to_l2="write_through", write__l2_to_l3="write_through"),
    "full-wb-wb": dict(write__l1_to_l2="write_back", write__l2_to_l3="write_back"),
    "full-wts-wb-tp2": dict(write__l1_to_l2="write_through_selective", write__l2_to_l3="write_back",
                            model__tp_size=2, prefetch__policy="best_effort"),
    "full-wb-wt": dict(write__l1_to_l2="write_back", write__l2_to_l3="write_through", sidecar=True,
                       eviction__policy="lfu", eviction__max_open_sessions=1,
                       eviction__closed_session_tombstones=1),
    "full-wt-wt-small": dict(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
                             tiers__l2__ratio=1.5, write__l1_to_l2_batch_pages=1,
                             tiers__l2__prefetch_fraction=0.5, storage__file__capacity_gb=2e-6),
    "hybrid-wt-wt": dict(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through"),
    "hybrid-wb-wts-tp2": dict(hybrid=True, write__l1_to_l2="write_back",
                              write__l2_to_l3="write_through_selective", model__tp_size=2),
    "hybrid-wt-wb": dict(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_back",
                         prefetch__policy="best_effort", eviction__max_open_sessions=1,
                         eviction__policy="lfu"),
}
SEEDS = [1, 2, 3]


def model_of(make, config: str, seed: int) -> Model:  # type: ignore[no-untyped-def]
    kw = CONFIGS[config]
    ctl = make(l1_tokens=64, server__max_tokens_per_request=LIMIT, **kw)
    lossless = "storage__file__capacity_gb" not in kw and all(
        kw.get(k) in ("write_through", "write_back") for k in ("write__l1_to_l2", "write__l2_to_l3"))
    return Model(ctl, seed * 1000 + list(CONFIGS).index(config), lossless=lossless)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_seeded_model_fuzz(make, config: str, seed: int) -> None:
    """100 steps a seed; seed 1 150 steps (at 150, full-wb-wt seed 1 ended with a flush
    that left pages unwritten: minimised below, fixed)."""
    model = model_of(make, config, seed)
    try:
        model.run(150 if seed == 1 else 100)
    except BaseException as e:
        e.add_note(f"ops: {model.log}")
        raise


# ---------------------------------------------------------------- minimised from the fuzz


def _l2_nearly_full_of_l3_backed(ctl, eng: Engine) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Seven 4-page prompts written down to L2 and L3 and gone from L1: L2 (32 FULL pages)
    has 4 free, every used page evictable (L3 holds it)."""
    old = [toks(np.arange(1000 * (k + 1), 1000 * (k + 1) + 16)) for k in range(7)]
    for tokens in old:
        eng.request(tokens)
    ctl.flush(10)
    evict_all(ctl, Tier.DEVICE)
    assert ctl.host.allocator(FULL).free_count == 4
    assert ctl.unflushed_pages() == 0
    return old


def test_flush_writes_every_l1_only_prompt_when_l2_is_nearly_full(make) -> None:
    """Minimised from `test_seeded_model_fuzz` (full-wb-wt, seed 1, 150 steps)."""
    kw = dict(l1_tokens=64, write__l1_to_l2="write_back", write__l2_to_l3="write_through")
    ctl = make(**kw)
    eng = Engine(ctl)
    old = _l2_nearly_full_of_l3_backed(ctl, eng)
    a, b = toks(np.arange(50_000, 50_016)), toks(np.arange(60_000, 60_016))
    eng.request(a)  # write_back: both in L1 only; the flush must stage them through L2
    eng.request(b)
    for tokens in old:  # (the old prompts used since: the fresh L2 slots are the LRU ones)
        ctl.match("e1", MatchRequest("", tokens))
    ctl.flush(10)
    ctl.flush(10)  # (a second flush does not help either)
    # Another daemon on the same L3 (this one's successor after a shutdown) finds both.
    other = make(**kw)
    Engine(other)
    for tokens in (a, b):
        assert other.match("e1", MatchRequest("", tokens)).storage_tokens == 16, "prompt not in L3"


def test_an_l3_write_landing_after_its_l2_slot_left_is_recorded(make) -> None:
    """Minimised from `test_seeded_model_fuzz` (full-wb-wt, seed 1, 150 steps): the first
    prompt the flush staged there."""
    ctl = make(l1_tokens=64, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    gate, reached = threading.Event(), threading.Event()
    real = ctl.l3.write

    def held_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        reached.set()
        assert gate.wait(10)
        return real(*args, **kwargs)

    ctl.l3.write = held_write
    try:
        tokens = toks(np.arange(70_000, 70_016))
        eng.request(tokens)
        assert ctl.transfers.copy_worker.drain(10)
        assert reached.wait(10), "no L3 write started"
        with ctl._mu:  # L2 pressure takes the slot while its write is in flight
            ctl.transfers._evict(Tier.HOST, FULL, 4)
        assert ctl.host.allocator(FULL).total - ctl.host.allocator(FULL).free_count == 4  # (parked)
    finally:
        gate.set()
        ctl.l3.write = real
    assert ctl.transfers.drain(10)
    assert ctl.stats().counters["backups_l3"] == 4  # L3 holds the prompt now
    assert ctl.unflushed_pages() == 0, f"{ctl.unflushed_pages()} pages reported unflushed"
