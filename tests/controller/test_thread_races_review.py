"""Races between threads inside one controller (review): engine threads running request
lives against a chaos thread (lease lapses, flushes, stats, evictions), on tiny tiers so
that eviction, write-back, backups and prefetches run all the time. After the threads
stop and the copies drained: tree and ownership audit, no leaked page, every verified
hit had the right bytes, nobody stuck."""

from __future__ import annotations

import contextlib
import random
import threading
import time
import traceback

import numpy as np
import pytest
from engine_sim import Engine, seq

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest, PrefetchState
from hicache.errors import NotFound, ResourceExhausted
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
STUCK_S = 30.0


class _Clock:
    """The engine registry's clock, advanced by the chaos thread (leases lapse)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class _Lapsed(Exception):
    """The chaos thread let this engine's lease lapse: it is dead, and a dead engine
    neither writes nor reads its (former) pages."""


def _expected(e: BaseException) -> bool:
    """Errors an engine must be ready for under pressure and lease lapses."""
    return isinstance(e, (ResourceExhausted, NotFound, _Lapsed))


class _Worker:
    """One engine thread: random request lives."""

    def __init__(self, ctl, name: str, rng: random.Random, prompts: list[bytes], stop: threading.Event,
                 errors: list[str]) -> None:
        self.ctl = ctl
        self.eng = Engine(ctl, name)
        self.rng = rng
        self.prompts = prompts
        self.stop = stop
        self.errors = errors
        self.ps = ctl.cfg.model.page_size
        self.lives = 0
        # Held while the engine touches L1 pages: a lapse (chaos) waits, then marks it dead.
        self.mu = threading.Lock()
        self.dead = False
        self.mamba = {mb.name for mb in ctl.cfg.model.family(MAMBA)}

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.one_life()
        except BaseException:
            self.errors.append(f"{self.eng.id}: {traceback.format_exc()}")

    def _reattach(self) -> None:
        self.ctl.attach(self.eng.id, 0, 1)

    def one_life(self) -> None:
        ctl, rng, eng = self.ctl, self.rng, self.eng
        base = rng.choice(self.prompts)
        n = rng.randint(1, len(base) // 16)
        tokens = base[: n * 16]
        if rng.random() < 0.4:  # a private tail
            tokens += seq(rng.randint(1, 3), 100_000 + rng.randrange(10**6))
        session = rng.choice(["", "", "s1", "s2", f"{eng.id}-s"])
        handles = {"lock": 0, "alloc": 0}
        try:
            self._life(tokens, session, handles)
        except BaseException as e:
            if not _expected(e):
                raise
            for kind in ("lock", "alloc"):
                if handles[kind]:
                    with contextlib.suppress(NotFound):
                        ctl.release(eng.id, handles["lock"] if kind == "lock" else None,
                                    handles["alloc"] if kind == "alloc" else None)
            with self.mu:
                if self.dead:
                    self.dead = False
                    self._reattach()
        self.lives += 1
        r = rng.random()
        if r < 0.05:
            with contextlib.suppress(NotFound):
                ctl.heartbeat(eng.id)
        elif r < 0.08:
            with contextlib.suppress(NotFound):  # (not open)
                ctl.close_session(rng.choice(["s1", "s2", f"{eng.id}-s"]))

    @contextlib.contextmanager
    def touching(self):
        """Reading or writing L1 pages the engine holds: only while its lease is alive."""
        with self.mu:
            if self.dead:
                raise _Lapsed()
            yield

    def _life(self, tokens: bytes, session: str, h: dict) -> None:
        ctl, rng, eng, ps = self.ctl, self.rng, self.eng, self.ps
        total = len(tokens) // (ps * 4)
        prefetch = rng.random() < 0.3
        m = ctl.match(eng.id, MatchRequest("", tokens, lock=True, prefetch=prefetch,
                                          allocate_tokens=len(tokens) // 4, session_id=session))
        h["lock"], h["alloc"] = m.lock_id, m.allocation_id
        with self.touching():
            eng.verify(m.device_pages, tokens, m.device_tokens // ps)
        if m.prefetch_id:
            if rng.random() < 0.3:
                with contextlib.suppress(NotFound):
                    ctl.cancel_prefetch(m.prefetch_id, eng.id)
            else:
                deadline = time.monotonic() + 2
                while (time.monotonic() < deadline and not self.stop.is_set()
                       and ctl.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING):
                    time.sleep(0.002)
        if rng.random() < 0.1:
            ctl.release(eng.id, m.lock_id, m.allocation_id)
            h["lock"] = h["alloc"] = 0
            return
        reused = m.device_tokens
        if m.host_tokens and rng.random() < 0.8:
            *_, last = list(ctl.load(eng.id, m.lock_id))
            reused = last.device_tokens
            with self.touching():
                eng.verify(last.device_pages, tokens, reused // ps)
        start = reused // ps
        skip = max(0, start - m.device_tokens // ps)
        alloc = {name: ids if name in self.mamba else ids[skip:] for name, ids in m.pages.items()}
        with self.touching():
            eng.write(alloc, tokens, start)
        lo_k = max(start + 1, (m.device_tokens + m.host_tokens) // ps)  # (the lock's prefix)
        keep = lo_k <= total - 1 and rng.random() < 0.4
        if keep:
            # Part of the prompt first (keep_lock), then decode growth, then the rest.
            k = rng.randint(lo_k, total - 1)
            with self.touching():
                eng.write(alloc, tokens[: k * ps * 4], start)  # (the checkpoint of page k)
            ctl.insert(eng.id, InsertRequest("", tokens[: k * ps * 4], lock_id=m.lock_id,
                                             allocation_id=m.allocation_id, keep_lock=True,
                                             mamba_checkpoint=rng.random() < 0.7))
            extra = rng.randint(1, 2)
            grown = ctl.allocate(eng.id, AllocateRequest("", extra * ps, allocation_id=m.allocation_id))
            more = seq(extra, 200_000 + rng.randrange(10**6))
            full = tokens + more
            with self.touching():
                eng.write(grown.pages, full, k)
            out = ctl.insert(eng.id, InsertRequest("", full, lock_id=m.lock_id,
                                                   allocation_id=m.allocation_id,
                                                   mamba_checkpoint=rng.random() < 0.7))
            assert out.inserted_tokens + out.reused_tokens == len(full) // 4
        else:
            out = ctl.insert(eng.id, InsertRequest("", tokens, lock_id=m.lock_id,
                                                   allocation_id=m.allocation_id,
                                                   mamba_checkpoint=rng.random() < 0.8))
            assert out.inserted_tokens + out.reused_tokens == total * ps
        h["lock"] = h["alloc"] = 0


def _lapse(ctl, w: _Worker) -> None:
    """`w`'s engine dies now (between its page accesses): its lease lapses."""
    with w.mu:
        w.dead = True
        with ctl._mu:
            rec = ctl._engines._engines.get(w.eng.id)
            if rec is not None:
                rec.expires_at = -1.0
            ctl.expire_leases()


def _chaos(ctl, workers: list, rng: random.Random, stop: threading.Event, errors: list[str]) -> None:
    try:
        while not stop.is_set():
            r = rng.random()
            if r < 0.15:
                _lapse(ctl, rng.choice(workers))
            elif r < 0.25:
                ctl.flush(1.0)
            elif r < 0.55:
                ctl.stats()
            else:
                tier = rng.choice([Tier.DEVICE, Tier.HOST])
                with ctl._mu:
                    kind = rng.choice(ctl._kinds)
                    ctl.transfers._evict(tier, kind, rng.randint(1, 8))
            time.sleep(rng.uniform(0.002, 0.03))
    except BaseException:
        errors.append(f"chaos: {traceback.format_exc()}")


def _prompts(rng: random.Random) -> list[bytes]:
    """Shared prefixes (so that engines hit each other's pages)."""
    out = []
    for i in range(4):
        out.append(seq(rng.randint(4, 8), 1000 * (i + 1)))
    out.append(out[0] + seq(4, 9000))
    return out


def _stress(make, seed: int, engines: int, run_s: float, **cfg) -> dict:
    ctl = make(**cfg)
    clock = _Clock()
    ctl._engines._clock = clock
    rng = random.Random(seed)
    prompts = _prompts(rng)
    stop = threading.Event()
    errors: list[str] = []
    workers = [_Worker(ctl, f"e{i}", random.Random(seed * 100 + i), prompts, stop, errors)
               for i in range(engines)]
    threads = [threading.Thread(target=w.run, name=f"eng-{i}", daemon=True) for i, w in enumerate(workers)]
    threads.append(threading.Thread(target=_chaos, args=(ctl, workers, random.Random(seed + 7), stop, errors),
                                    name="chaos", daemon=True))
    for t in threads:
        t.start()
    time.sleep(run_s)
    stop.set()
    deadline = time.monotonic() + STUCK_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        import sys
        frames = sys._current_frames()
        dump = "".join(f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                       for t in threads if t.is_alive() and t.ident in frames)
        pytest.fail(f"threads stuck > {STUCK_S} s: {stuck}\n{dump}")
    assert not errors, "\n".join(errors[:3])
    assert ctl.transfers.drain(15)
    # every engine's handles go: then every page the tree does not own is free
    clock.offset += ctl.cfg.server.lease_ms / 1000 + 1
    ctl.expire_leases()
    assert ctl.prefetcher.worker.drain(10) and ctl.prefetcher.l1_worker.drain(10)
    assert ctl.transfers.drain(15)
    ctl.check_integrity()
    with ctl._mu:
        for tier, pools in ((Tier.DEVICE, ctl.device), (Tier.HOST, ctl.host)):
            for kind in ctl._kinds:
                alloc = pools.allocator(kind)
                owned = sum(len(ids) for node in ctl.tree.iter_nodes()
                            if (ids := ctl.tree.pages_of(node, kind, tier)) is not None)
                parked = len(ctl.transfers._parked_l2.get(kind, [])) if tier is Tier.HOST else 0
                assert alloc.free_count + owned + parked == alloc.total, (tier, kind)
        assert ctl.prefetcher.running == 0
        assert not ctl.loads._loads
    checked = sum(w.eng.checked for w in workers)
    lives = sum(w.lives for w in workers)
    assert lives > engines * 5, lives
    return {"checked": checked, "lives": lives, "stats": ctl.stats().counters}


CONFIGS = [
    pytest.param(dict(hybrid=False, write__l1_to_l2="write_through", write__l2_to_l3="write_through"), id="plain-wt-wt"),
    pytest.param(dict(hybrid=False, write__l1_to_l2="write_back", write__l2_to_l3="write_back",
                      prefetch__policy="best_effort"), id="plain-wb-wb"),
    pytest.param(dict(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_back"), id="hybrid-wt-wb"),
    pytest.param(dict(hybrid=True, write__l1_to_l2="write_back", write__l2_to_l3="write_through"), id="hybrid-wb-wt"),
    pytest.param(dict(hybrid=True, write__l1_to_l2="write_through_selective",
                      write__l2_to_l3="write_through_selective", write__selective_threshold=2,
                      prefetch__policy="best_effort"), id="hybrid-sel-sel"),
    pytest.param(dict(swa_only=True, write__l1_to_l2="write_back", write__l2_to_l3="write_back"), id="swa-wb-wb"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_engine_threads_and_chaos_keep_the_cache_whole(make, cfg) -> None:
    import os
    seed = int(os.environ.get("RACES_SEED", "1234"))
    run_s = float(os.environ.get("RACES_RUN_S", "2.5"))
    engines = int(os.environ.get("RACES_ENGINES", "5"))
    out = _stress(make, seed=seed, engines=engines, run_s=run_s, l1_tokens=48 * 4, **cfg)
    assert out["checked"] > 0
    if os.environ.get("RACES_DEBUG"):
        c = out["stats"]
        print({k: c.get(k) for k in ("lookups", "hit_tokens_device", "hit_tokens_host", "hit_tokens_storage",
                                     "loaded_pages", "allocation_waits", "prefetches_started", "prefetches_done",
                                     "prefetch_pages_to_l1", "evictions_device", "evictions_host", "backups_l2",
                                     "backups_l3", "leases_expired", "l2_flushes")}, out["lives"], out["checked"])


# ---------------------------------------------------------------- targeted interleavings


def _during_wait(ctl, monkeypatch, name: str, hook, *, times: int = 1):
    """Make `ctl.transfers.<name>` (an allocation that may wait for queued copies with the
    mutex released) first wait, as the back-pressure wait does (`landed.wait`), while
    another thread runs `hook()` under the mutex. Deterministic: the wait ends only once
    the hook ran. Returns the list of hook errors."""
    transfers = ctl.transfers
    real = getattr(transfers, name)
    left = [times]
    errors: list[BaseException] = []

    def waiting(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            done = threading.Event()

            def run() -> None:
                try:
                    with ctl._mu:
                        hook()
                except BaseException as e:
                    errors.append(e)
                finally:
                    done.set()

            threading.Thread(target=run, daemon=True).start()
            deadline = time.monotonic() + 10
            while not done.is_set() and time.monotonic() < deadline:
                transfers.landed.wait(0.02)  # (releases the mutex, however deep it is held)
        return real(*args, **kwargs)

    monkeypatch.setattr(transfers, name, waiting)
    return errors


def _in_l2_only(ctl, eng: Engine, tokens: bytes) -> None:
    eng.request(tokens)
    assert ctl.transfers.drain(10)
    with ctl._mu:
        for kind in ctl._kinds:
            ctl.transfers._evict(Tier.DEVICE, kind, ctl.device.allocator(kind).total)


def _leak_free(ctl) -> None:
    assert ctl.transfers.drain(10)
    ctl.check_integrity()


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_load_whose_lease_lapses_while_it_waits_for_room_is_not_found(make, monkeypatch, hybrid) -> None:
    ctl = make(hybrid=hybrid, storage__backend="none")
    eng = Engine(ctl, "e1")
    tokens = seq(4)
    _in_l2_only(ctl, eng, tokens)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True))
    assert m.host_tokens == 16

    def lapse() -> None:
        ctl._engines._engines["e1"].expires_at = -1.0
        ctl.expire_leases()

    errors = _during_wait(ctl, monkeypatch, "allocate_l1_all", lapse)
    with pytest.raises(NotFound):
        list(ctl.load("e1", m.lock_id))
    assert not errors
    _leak_free(ctl)
    assert not ctl.loads._loads


@pytest.mark.parametrize("hybrid", [False, True])
def test_two_loads_of_one_path_while_the_first_waits_for_room_both_serve_right_bytes(make, monkeypatch, hybrid) -> None:
    ctl = make(hybrid=hybrid, storage__backend="none")
    a, b = Engine(ctl, "a"), Engine(ctl, "b")
    tokens = seq(4)
    _in_l2_only(ctl, a, tokens)
    ma = ctl.match("a", MatchRequest("", tokens, lock=True))
    mb = ctl.match("b", MatchRequest("", tokens, lock=True))
    got = {}

    def other_load() -> None:
        # (the mutex is held here: the other load runs on its own thread, and is waited for)
        t = threading.Thread(target=lambda: got.setdefault("b", list(ctl.load("b", mb.lock_id))))
        t.start()
        deadline = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < deadline:
            ctl.transfers.landed.wait(0.02)
        t.join(1)

    errors = _during_wait(ctl, monkeypatch, "allocate_l1_all", other_load)
    last_a = list(ctl.load("a", ma.lock_id))[-1]
    assert not errors
    last_b = got["b"][-1]
    a.verify(last_a.device_pages, tokens, last_a.device_tokens // 4)
    b.verify(last_b.device_pages, tokens, last_b.device_tokens // 4)
    assert last_a.device_tokens == last_b.device_tokens == 16
    ctl.release("a", ma.lock_id, None)
    ctl.release("b", mb.lock_id, None)
    _leak_free(ctl)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_match_allocation_waiting_while_another_engine_loads_the_path_commits_right(make, monkeypatch, hybrid) -> None:
    ctl = make(hybrid=hybrid, storage__backend="none")
    a = Engine(ctl, "a")
    Engine(ctl, "b")
    tokens = seq(4)
    _in_l2_only(ctl, a, tokens)
    mb = ctl.match("b", MatchRequest("", tokens, lock=True))

    def load_b() -> None:
        list(ctl.load("b", mb.lock_id))

    errors = _during_wait(ctl, monkeypatch, "allocate_l1_all", load_b)
    full = tokens + seq(2, 7000)
    m = a.request(full)
    assert not errors
    assert m.host_tokens == 16
    ctl.release("b", mb.lock_id, None)
    assert ctl.transfers.drain(10)
    again = ctl.match("a", MatchRequest("", full, lock=True))
    assert again.device_tokens + again.host_tokens == len(full) // 4
    if again.host_tokens:
        last = list(ctl.load("a", again.lock_id))[-1]
        a.verify(last.device_pages, full, last.device_tokens // 4)
    else:
        a.verify(again.device_pages, full, again.device_tokens // 4)
    ctl.release("a", again.lock_id, None)
    _leak_free(ctl)


def test_a_keep_lock_insert_waiting_for_a_slot_while_another_inserts_the_path(make, monkeypatch) -> None:
    """Hybrid: A's keep_lock Insert takes a fresh MAMBA slot (may wait, mutex released);
    meanwhile B inserts the same prompt with keep_lock. A then reuses B's pages and keeps
    its own as retired; both finish; every page owned once, the bytes right."""
    ctl = make(hybrid=True, storage__backend="none")
    a, b = Engine(ctl, "a"), Engine(ctl, "b")
    prompt = seq(3, 300)
    ma = ctl.match("a", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    mb = ctl.match("b", MatchRequest("", prompt, lock=True, allocate_tokens=12))
    a.write(ma.pages, prompt, 0)
    b.write(mb.pages, prompt, 0)

    def insert_b() -> None:
        ctl.insert("b", InsertRequest("", prompt, lock_id=mb.lock_id, allocation_id=mb.allocation_id,
                                      keep_lock=True, mamba_checkpoint=True))

    errors = _during_wait(ctl, monkeypatch, "allocate_l1", insert_b)
    out = ctl.insert("a", InsertRequest("", prompt, lock_id=ma.lock_id, allocation_id=ma.allocation_id,
                                        keep_lock=True, mamba_checkpoint=True))
    assert not errors
    assert out.reused_tokens == 12
    ctl.check_integrity()
    for eng, m in ((a, ma), (b, mb)):
        more = prompt + seq(1, 900 if eng is a else 901)
        g = ctl.allocate(eng.id, AllocateRequest("", 4, allocation_id=m.allocation_id))
        eng.write(g.pages, more, 3)
        ctl.insert(eng.id, InsertRequest("", more, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    for tail in (900, 901):
        more = prompt + seq(1, tail)
        m = ctl.match("a", MatchRequest("", more, lock=True))
        assert m.device_tokens == 16
        a.verify(m.device_pages, more, 4)
        ctl.release("a", m.lock_id, None)
    _leak_free(ctl)


def test_growth_waiting_while_a_keep_lock_insert_consumes_the_allocation(make, monkeypatch) -> None:
    """Pipelined calls of one request: a growth waits (mutex released) while the request's
    keep_lock Insert commits part of the allocation; the grown pages come after the rest."""
    ctl = make(storage__backend="none")
    a = Engine(ctl, "a")
    prompt = seq(4, 400)
    m = ctl.match("a", MatchRequest("", prompt, lock=True, allocate_tokens=16))
    a.write(m.pages, prompt, 0)

    def insert_part() -> None:
        ctl.insert("a", InsertRequest("", prompt[: 2 * 16], lock_id=m.lock_id,
                                      allocation_id=m.allocation_id, keep_lock=True))

    errors = _during_wait(ctl, monkeypatch, "allocate_l1_all", insert_part)
    g = ctl.allocate("a", AllocateRequest("", 4, allocation_id=m.allocation_id))
    assert not errors
    assert len(g.pages["full"]) == 3  # two prompt pages left, one grown
    assert np.array_equal(g.pages["full"][:2], m.pages["full"][2:4])
    full = prompt + seq(1, 401)
    a.write(g.pages, full, 2)
    ctl.insert("a", InsertRequest("", full, lock_id=m.lock_id, allocation_id=m.allocation_id))
    again = ctl.match("a", MatchRequest("", full, lock=True))
    assert again.device_tokens == 20
    a.verify(again.device_pages, full, 5)
    ctl.release("a", again.lock_id, None)
    _leak_free(ctl)


@pytest.mark.parametrize("hybrid", [False, True])
def test_evicting_everything_during_a_loads_copy_keeps_the_load_whole(make, monkeypatch, hybrid) -> None:
    ctl = make(hybrid=hybrid, write__l1_to_l2="write_back", write__l2_to_l3="write_back")
    a = Engine(ctl, "a")
    tokens = seq(5, 600)
    _in_l2_only(ctl, a, tokens)
    m = ctl.match("a", MatchRequest("", tokens, lock=True))
    assert m.host_tokens == 20
    copier = ctl.transfers.copier
    real = copier.host_to_device
    started, go = threading.Event(), threading.Event()

    def gated(*args, **kwargs):
        started.set()
        assert go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(copier, "host_to_device", gated)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("p", list(ctl.load("a", m.lock_id))))
    t.start()
    assert started.wait(10)
    other = Engine(ctl, "b")
    with ctl._mu:
        for tier in (Tier.DEVICE, Tier.HOST):
            pools = ctl.device if tier is Tier.DEVICE else ctl.host
            for kind in ctl._kinds:
                ctl.transfers._evict(tier, kind, pools.allocator(kind).total)
    with contextlib.suppress(ResourceExhausted):  # take (and write) every free L1 page
        for i in range(64):
            other.request(seq(1, 50_000 + i * 10))
    go.set()
    t.join(10)
    last = out["p"][-1]
    assert last.device_tokens == 20
    a.verify(last.device_pages, tokens, 5)
    ctl.release("a", m.lock_id, None)
    _leak_free(ctl)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_prefetch_committing_while_an_insert_of_the_path_lands(make, monkeypatch, hybrid) -> None:
    from engine_sim import hold_nth_read, wait_prefetch

    ctl = make(hybrid=hybrid, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    a, b = Engine(ctl, "a"), Engine(ctl, "b")
    tokens = seq(6, 800)
    a.request_then_only_in_l3(tokens)
    gate, reached = hold_nth_read(ctl, monkeypatch, 1)
    m = ctl.match("a", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id
    assert reached.wait(10)
    b.request(tokens)  # B computes and inserts the same prompt (in L1) meanwhile
    gate.set()
    wait_prefetch(ctl, m.prefetch_id)
    ctl.release("a", m.lock_id, None)
    assert ctl.transfers.drain(10)
    ctl.check_integrity()
    again = ctl.match("a", MatchRequest("", tokens, lock=True))
    assert again.device_tokens + again.host_tokens == 24
    last = list(ctl.load("a", again.lock_id))[-1] if again.host_tokens else again
    a.verify(last.device_pages, tokens, last.device_tokens // 4)
    ctl.release("a", again.lock_id, None)
    with ctl._mu:  # and from L2 alone
        for kind in ctl._kinds:
            ctl.transfers._evict(Tier.DEVICE, kind, ctl.device.allocator(kind).total)
    again = ctl.match("a", MatchRequest("", tokens, lock=True))
    if again.host_tokens:
        last = list(ctl.load("a", again.lock_id))[-1]
        a.verify(last.device_pages, tokens, last.device_tokens // 4)
    ctl.release("a", again.lock_id, None)
    _leak_free(ctl)


def test_a_load_waiting_for_room_does_not_copy_a_path_another_load_brought_meanwhile(make, monkeypatch) -> None:
    ctl = make(storage__backend="none")
    a = Engine(ctl, "a")
    Engine(ctl, "b")
    tokens = seq(4)
    _in_l2_only(ctl, a, tokens)
    ma = ctl.match("a", MatchRequest("", tokens, lock=True))
    mb = ctl.match("b", MatchRequest("", tokens, lock=True))

    def other_load() -> None:
        t = threading.Thread(target=lambda: list(ctl.load("b", mb.lock_id)))
        t.start()
        deadline = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < deadline:
            ctl.transfers.landed.wait(0.02)
        t.join(1)

    _during_wait(ctl, monkeypatch, "allocate_l1_all", other_load)
    copied = []
    real = ctl.transfers.copier.host_to_device

    def counting(kind, host, dev, *args, **kwargs):
        copied.append(len(dev))
        return real(kind, host, dev, *args, **kwargs)

    monkeypatch.setattr(ctl.transfers.copier, "host_to_device", counting)
    last = list(ctl.load("a", ma.lock_id))[-1]
    assert last.device_tokens == 16
    ctl.release("a", ma.lock_id, None)
    ctl.release("b", mb.lock_id, None)
    # B's load (run while A waited) copied the 4 pages; A must not copy them again.
    assert sum(copied) == 4, copied
