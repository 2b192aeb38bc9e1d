"""A stateful fuzz of the controller's public API (`CacheService`, controller/base.py).

Hypothesis drives a `HybridCacheController` (built as the `make` fixture builds it, FULL
only or with SWA / sidecars, and hybrid FULL+SWA+MAMBA; several write and prefetch
policies) with a mix of valid calls (whole request lives, locks, allocations and their
growth, keep_lock inserts, loads, prefetches, sessions, evictions, flushes, engine
restarts and lapsed leases, requests on threads at once) and invalid ones (bad token
bytes, too many tokens, unknown / released / zero / foreign handles, wrong prefixes and
namespaces, allocations too small, bad counts, unknown engines, empty session ids).

Checked at every step: each error raised is a `HicacheError` with a message (a bare
KeyError / IndexError / AssertionError ... fails the test) and invalid input gets the
documented one; `check_integrity` passes (a refused call changed nothing); every page a
match reports on L1 (or a load brings there) holds the bytes the engine wrote
(`Engine.verify`), and so does every page an open request reads under its lock, and the
MAMBA state in its allocation's slot. With nothing held an allocation that fits L1 gets
its pages; a flush loses nothing the cache held; a finished prefetch's pages are in
L1/L2. At the end every handle is released and both pools drain empty (nothing leaked).

The bugs the fuzz found have their regression tests in test_write_through.py.
For a longer hunt: HICACHE_FUZZ_EXAMPLES=N HICACHE_FUZZ_RANDOM=1 (tests/fuzzing.py)."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from engine_sim import Engine, evict_all, seq, tiny_config, toks
from fuzzing import fuzz_examples, fuzz_settings
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.controller.base import AllocateRequest, InsertRequest, MatchRequest, PrefetchState
from hicache.controller.controller import build_controller
from hicache.errors import (
    FailedPrecondition,
    HicacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from hicache.types import ComponentKind, Tier

LIMIT = 64  # server.max_tokens_per_request of every fuzzed controller
PS = 4  # tokens a page (tiny_config)
PB = PS * 4  # bytes a page
MAX_PAGES = 12  # pages of a request at most (LIMIT is 16)
PICKS = 24  # choices among state (handles, engines, known sequences) drawn each step
MAX_OPEN = 3  # requests held open at once (each holds L1 pages and a MAMBA slot)

_instances = itertools.count()

# Page contents from a small alphabet: requests share prefixes, diverge, split nodes.
page = st.integers(0, 2)
token_lists = st.lists(page, min_size=1, max_size=8)


def tokens_of(pages: list[int], tail: int = 0) -> bytes:
    """Whole pages of the alphabet, then `tail` tokens of a partial page (ignored by the tree)."""
    body = b"".join(seq(1, 4 * p) for p in pages)
    return body + toks(np.arange(900, 900 + tail))


def fresh_tokens(n_pages: int) -> bytes:
    return seq(n_pages, 1_000_000 + 64 * next(_instances))


@dataclass
class Req:
    """A request in flight as the engine sees it: its handles and where its pages go."""

    eng: Engine
    tokens: bytes  # what it inserts next
    lock_id: int | None
    alloc_id: int | None
    pages: dict | None = None  # the allocation's pages from `alloc_start`; None: unknown (refresh by growing)
    alloc_start: int = 0  # token page of the allocation's first page
    alloc_len: int = 0  # pages the allocation holds (per paged member)
    dev: int = 0  # the lock's device boundary (pages): inserts take pages from there
    prefix: int = 0  # pages of the lock's prefix (tokens must start with it)
    session: str = ""
    # The L1 pages the request reads its KV from (the lock keeps them): per paged member,
    # one id per token page before `dev`; None: not tracked.
    held: dict | None = None
    state_at: int = 0  # pages whose MAMBA state the allocation's slot holds (0: none known)
    checkpoint: bool = False  # the match found a MAMBA checkpoint at its device boundary
    # A Load moved pages while `pages` was unknown: it may have landed them in the
    # allocation's own first pages, which then left it (known at the next growth).
    maybe_lent: bool = False

    @property
    def total(self) -> int:
        return len(self.tokens) // PB


def _check_error(e: BaseException) -> None:
    assert isinstance(e, HicacheError), f"untyped error {type(e).__name__}: {e!r}"
    assert str(e).strip(), f"{type(e).__name__} without a message"


def attempt(fn, *args, allowed: tuple = (ResourceExhausted,), **kw):  # type: ignore[no-untyped-def]
    """A valid call: (result, None), or (None, error) for an error in `allowed` (no room).
    Any other error fails the test (a HicacheError is re-raised as it is)."""
    try:
        return fn(*args, **kw), None
    except HicacheError as e:
        _check_error(e)
        if not isinstance(e, allowed):
            raise
        if threading.current_thread() is threading.main_thread():  # (hypothesis: the test's thread only)
            event(f"{getattr(fn, '__name__', fn)} refused: {type(e).__name__}")
        return None, e


def refused(expected: type[HicacheError], fn, *args, **kw) -> HicacheError:  # type: ignore[no-untyped-def]
    """An invalid call: it must raise `expected` (a HicacheError with a message)."""
    try:
        result = fn(*args, **kw)
    except HicacheError as e:
        _check_error(e)
        assert isinstance(e, expected), f"{fn.__name__}: {type(e).__name__} ({e}), expected {expected.__name__}"
        return e
    raise AssertionError(f"{fn.__name__}{args} was accepted (expected {expected.__name__}): {result!r}")


def op(weight: int = 1, **strategies):  # type: ignore[no-untyped-def]
    """An operation of the machine: `ControllerFuzz.step` picks one per step (weighted),
    drawing its arguments from `strategies`. One rule rather than
    a rule each: hypothesis's swarm testing would disable the request rules in many
    examples, leaving the others without handles to work on."""
    def deco(f):  # type: ignore[no-untyped-def]
        f.fuzz_op = (weight, strategies)
        return f
    return deco


def pre(predicate):  # type: ignore[no-untyped-def]
    """The op runs only in states where `predicate(machine)` holds."""
    def deco(f):  # type: ignore[no-untyped-def]
        f.fuzz_pre = predicate
        return f
    return deco


def load_all(ctl, engine_id: str, lock_id: int) -> list:  # type: ignore[no-untyped-def]
    return list(ctl.load(engine_id, lock_id))


class ControllerFuzz(RuleBasedStateMachine):
    CONFIGS: list[dict] = []

    def __init__(self) -> None:
        super().__init__()
        self.ctl = None
        self.dir: Path | None = None
        self.reqs: list[Req] = []
        self.dead_locks: list[tuple[str, int]] = []  # (engine id, id) released or consumed
        self.dead_allocs: list[tuple[str, int]] = []
        self.prefetches: list[tuple[str, int]] = []  # (owner, prefetch id)
        self.instances: dict[str, str] = {}
        self._picks = iter(())
        self.known: list[bytes] = []  # token sequences inserted so far (whole pages)

    # ------------------------------------------------------------------ setup

    @initialize(which=st.integers(0, 1 << 16))
    def build(self, which: int) -> None:
        kw = dict(self.CONFIGS[which % len(self.CONFIGS)])
        kw.setdefault("server__max_tokens_per_request", LIMIT)
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-fuzz-"))  # (L3 files; removed at teardown)
        cfg = tiny_config(self.dir, **kw)
        name = f"fz{os.getpid()}x{next(_instances)}x{int(time.time() * 1000) % 100000}"
        quiet = logging.getLogger("hicache.tiers.storage.file")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # (its "not shared between nodes" warning, every example)
        try:
            self.ctl = build_controller(cfg, name)
        finally:
            quiet.setLevel(level)
        self.engines = [Engine(self.ctl, "e1"), Engine(self.ctl, "e2"), Engine(self.ctl, "e1", "ns2")]
        kinds = cfg.model.component_kinds
        self.mamba = {m.name for m in cfg.model.family(ComponentKind.MAMBA)} if ComponentKind.MAMBA in kinds else set()
        self.swa = {m.name for m in cfg.model.family(ComponentKind.SWA)} if ComponentKind.SWA in kinds else set()
        self.window = cfg.model.components[ComponentKind.SWA].window_tokens // PS if self.swa else 0
        self.hybrid = bool(self.mamba)
        self._layers = {m.name: m.layers for m in cfg.model.members}

    def teardown(self) -> None:
        ctl = self.ctl
        if ctl is None:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            for r in list(self.reqs):
                self._release(r)
            deadline = time.monotonic() + 10
            while True:
                with ctl._mu:
                    running = ctl.prefetcher.running
                if not running or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            assert not running, "prefetches still running at the end"
            assert ctl.transfers.drain(10)
            ctl.check_integrity()
            assert ctl.stats().counters["active_locks"] == 0
            assert ctl.stats().counters["active_allocations"] == 0
            # Nothing held: every page of both pools can be evicted (no leak anywhere). One
            # pass evicts leaves only (a parent becomes one when its child has gone, and with
            # write-back a child goes once its copy has landed): a few passes.
            pools = ((Tier.DEVICE, ctl.device), (Tier.HOST, ctl.host))
            for _ in range(20):
                evict_all(ctl, Tier.DEVICE, Tier.HOST)
                assert ctl.transfers.drain(10)
                ctl.check_integrity()
                used = {(tier.name, kind.value): p.allocator(kind).total - p.allocator(kind).free_count
                        for tier, p in pools for kind in ctl._kinds}
                if not any(used.values()):
                    break
            assert not any(used.values()), f"pages left in use with nothing held: {used}"
        finally:
            ctl.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _other(self, eng: Engine) -> Engine:
        return next(e for e in self.engines if e.id != eng.id)

    def _pick(self, items):  # type: ignore[no-untyped-def]
        """One of `items` by the step's next pick (drawn up front: see `step`)."""
        return items[self._next() % len(items)]

    def _next(self) -> int:
        return next(self._picks, 0)

    def _tokens(self, pages: list[int], tail: int = 0) -> bytes:
        """`pages` of the alphabet, or (mostly, once some exist) a sequence inserted before,
        cut somewhere and continued with `pages`: hits in every tier, nodes split."""
        use, which, whole, cut, more = (self._next() for _ in range(5))  # (always five)
        if self.known and use % 4:
            base = self.known[which % len(self.known)]
            n = len(base) // PB
            keep = n if whole % 2 else 1 + cut % n  # (the whole: a checkpoint's boundary)
            tokens = base[: keep * PB] + tokens_of(pages[: more % 4])
            tokens = tokens[: MAX_PAGES * PB]
            return tokens + tokens_of([], tail)
        return tokens_of(pages, tail)

    def _inserted(self, tokens: bytes, checkpoint: bool = True) -> None:
        if self.hybrid and not checkpoint:
            return  # (no checkpoint at its end: a hybrid model cannot reuse it)
        whole = tokens[: len(tokens) // PB * PB]
        if whole and whole not in self.known:
            self.known.append(whole)

    def _verify(self, eng: Engine, pages, tokens: bytes, device_tokens: int) -> None:
        eng.verify(pages, tokens, device_tokens // PS)

    def _paged(self, pages: dict) -> int:
        return len(pages["full"])

    def _forget(self, r: Req) -> None:
        self.reqs.remove(r)
        if r.lock_id is not None:
            self.dead_locks.append((r.eng.id, r.lock_id))
        if r.alloc_id is not None:
            self.dead_allocs.append((r.eng.id, r.alloc_id))

    def _release(self, r: Req) -> None:
        if r.lock_id is None and r.alloc_id is None:
            self.reqs.remove(r)
            return
        self.ctl.release(r.eng.id, r.lock_id, r.alloc_id)
        self._forget(r)

    def _match_req(self, eng: Engine, tokens: bytes, alloc_tokens: int | None, session: str) -> Req | None:
        m, err = attempt(self.ctl.match, eng.id, MatchRequest(
            eng.ns, tokens, session_id=session, lock=True, allocate_tokens=alloc_tokens))
        if err is not None:
            return None
        assert m.lock_id > 0
        self._verify(eng, m.device_pages, tokens, m.device_tokens)
        r = Req(eng, tokens, m.lock_id, m.allocation_id or None, session=session,
                dev=m.device_tokens // PS, prefix=(m.device_tokens + m.host_tokens) // PS,
                alloc_start=m.device_tokens // PS, held=self._paged_only(m.device_pages),
                checkpoint=bool(self.mamba) and any(len(m.device_pages.get(n, ())) for n in self.mamba))
        if alloc_tokens is not None:
            assert m.allocation_id > 0
            r.pages = dict(m.pages)
            r.state_at = r.dev if r.checkpoint else 0
            r.alloc_len = self._paged(m.pages)
            assert r.alloc_len == -(-max(0, alloc_tokens - m.device_tokens) // PS)
        else:
            assert m.allocation_id == 0
        self.reqs.append(r)
        return r

    def _paged_only(self, pages) -> dict:  # type: ignore[no-untyped-def]
        return {name: np.array(ids) for name, ids in pages.items() if name not in self.mamba}

    def _check_held(self, r: Req) -> None:
        """What a request reads stays as it was while it holds its lock: every L1 page
        before its device boundary (SWA: those of the window before it, the rest may go),
        and the MAMBA state in its allocation's slot."""
        hs = r.eng.hashes(r.tokens)
        if r.held is not None and r.lock_id is not None:
            for name, ids in r.held.items():
                assert len(ids) == r.dev, (name, len(ids), r.dev)
                first = max(0, r.dev - self.window) if name in self.swa else 0
                for layer in range(self._layers[name]):
                    rows = r.eng._rows(name, layer)
                    for i in range(first, r.dev):
                        pid = int(ids[i])
                        assert pid >= 0, f"{name} page {i} of the window before the boundary missing"
                        want = r.eng.pattern(hs[i], name, layer, rows.shape[1])
                        assert np.array_equal(rows[pid], want), (
                            f"{name} page {i} (L1 {pid}) layer {layer} changed under the request's lock")
        if r.state_at and r.pages is not None:
            for name in self.mamba:
                for layer in range(self._layers[name]):
                    rows = r.eng._rows(name, layer)
                    want = r.eng.pattern(hs[r.state_at - 1] + b"state", name, layer, rows.shape[1])
                    assert np.array_equal(rows[int(r.pages[name][0])], want), (
                        f"{name} layer {layer}: the allocation's slot lost the state after page {r.state_at}")

    def _write(self, r: Req) -> None:
        """The request's KV for its pages past the lock's device boundary (and its MAMBA
        state at the end, into the allocation's slot)."""
        if r.pages is None:
            return
        lo = r.dev - r.alloc_start
        sub = {name: ids if name in self.mamba else ids[lo:] for name, ids in r.pages.items()}
        r.eng.write(sub, r.tokens, r.dev)
        r.state_at = r.total if self.mamba else 0

    def _insertable(self, r: Req) -> bool:
        need = r.total - r.dev
        if need <= 0:
            return r.lock_id is not None or r.alloc_id is not None
        if r.alloc_id is None or r.pages is None:
            return False
        lo = r.dev - r.alloc_start
        return lo >= 0 and lo + need <= r.alloc_len

    def _probe(self, eng: Engine, tokens: bytes, load: bool) -> None:
        """Match with a lock, check every L1 page reported, optionally load the L2 part
        and check it too, release."""
        m, err = attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=True))
        if err is not None:
            return
        event(f"probe hit device={m.device_tokens > 0} host={m.host_tokens > 0} storage={m.storage_tokens > 0}")
        try:
            self._verify(eng, m.device_pages, tokens, m.device_tokens)
            if load and m.host_tokens:
                out, err = attempt(load_all, self.ctl, eng.id, m.lock_id,
                                   allowed=(ResourceExhausted, FailedPrecondition))
                if err is None:
                    last = out[-1]
                    assert last.device_pages is not None and last.device_tokens is not None
                    assert last.layers_ready == last.layers_total
                    assert last.device_tokens >= m.device_tokens
                    self._verify(eng, last.device_pages, tokens, last.device_tokens)
        finally:
            self.ctl.release(eng.id, m.lock_id, None)

    # ------------------------------------------------------------------ valid: requests

    @pre(lambda self: len(self.reqs) < MAX_OPEN)
    @op(weight=4, pages=token_lists, tail=st.integers(0, 3), extra=st.integers(0, 3),
        how=st.sampled_from(["match_alloc", "lock_then_allocate", "lock_only"]),
        session=st.sampled_from(["", "", "s1", "s2"]))
    def begin_request(self, pages, tail, extra, how, session) -> None:
        eng = self._pick(self.engines)
        tokens = self._tokens(pages, tail)
        n = len(tokens) // 4
        if how == "match_alloc":
            self._match_req(eng, tokens, n + PS * extra, session)
            return
        r = self._match_req(eng, tokens, None, session)
        if r is None or how == "lock_only":
            return
        self._allocate_for(r, extra)

    def _allocate_for(self, r: Req, extra: int) -> None:
        want = max(1, (r.total - r.dev + extra) * PS)
        info, err = attempt(self.ctl.allocate, r.eng.id,
                            AllocateRequest(r.eng.ns, want, lock_id=r.lock_id))
        if err is not None:
            return
        assert info.allocation_id > 0
        r.alloc_id = info.allocation_id
        r.pages = dict(info.pages)
        r.alloc_start = r.dev
        # (a copy of the checkpoint at the lock's device boundary: copy-on-write)
        r.state_at = r.dev if r.checkpoint and r.dev else 0
        r.alloc_len = self._paged(info.pages)
        assert r.alloc_len == -(-want // PS)

    @pre(lambda self: any(r.alloc_id is None and r.lock_id is not None for r in self.reqs))
    @op(extra=st.integers(0, 3))
    def allocate_with_lock(self, extra) -> None:
        r = self._pick([r for r in self.reqs if r.alloc_id is None and r.lock_id is not None])
        self._allocate_for(r, extra)

    @pre(lambda self: len(self.reqs) < MAX_OPEN)
    @op(pages=token_lists, extra=st.integers(0, 2))
    def allocate_without_lock(self, pages, extra) -> None:
        """An allocation of its own: the request inserts from the root."""
        eng = self._pick(self.engines)
        tokens = tokens_of(pages)
        info, err = attempt(self.ctl.allocate, eng.id, AllocateRequest(eng.ns, len(tokens) // 4 + PS * extra))
        if err is not None:
            return
        r = Req(eng, tokens, None, info.allocation_id, pages=dict(info.pages),
                alloc_start=0, alloc_len=self._paged(info.pages))
        self.reqs.append(r)

    @pre(lambda self: any(r.lock_id is not None for r in self.reqs))
    @op(weight=2)
    def load(self) -> None:
        r = self._pick([r for r in self.reqs if r.lock_id is not None])
        out, err = attempt(load_all, self.ctl, r.eng.id, r.lock_id,
                           allowed=(ResourceExhausted, FailedPrecondition))
        if err is not None:
            return
        last = out[-1]
        assert last.device_pages is not None and last.device_tokens is not None
        assert last.device_tokens // PS >= r.dev
        self._verify(r.eng, last.device_pages, r.tokens, last.device_tokens)
        event(f"load ok moved={last.device_tokens // PS > r.dev}")
        new_dev = last.device_tokens // PS
        if r.alloc_id is not None and new_dev > r.dev:
            # A Load lands the L2 part in the request's own allocation where its pages
            # stand for it: those pages, and the allocation's before them, then leave the
            # allocation (its growth returns the pages it still holds). The loaded run's
            # last page tells (a load's own pages are never the allocation's).
            hi = new_dev - r.alloc_start
            if r.pages is None:
                r.maybe_lent = True
            elif 0 < hi <= r.alloc_len and r.pages["full"][hi - 1] == last.device_pages["full"][new_dev - 1]:
                event("load lent the allocation's pages")
                r.pages = {name: ids if name in self.mamba else ids[hi:] for name, ids in r.pages.items()}
                r.alloc_len -= hi
                r.alloc_start = new_dev
        r.dev = r.prefix = new_dev
        r.held = self._paged_only(last.device_pages)
        r.checkpoint = bool(self.mamba) and any(len(last.device_pages.get(n, ())) for n in self.mamba)

    @pre(lambda self: any(self._insertable(r) for r in self.reqs))
    @op(weight=4, keep_lock=st.booleans(), checkpoint=st.booleans(), held=st.booleans())
    def insert(self, keep_lock, checkpoint, held) -> None:
        r = self._pick([r for r in self.reqs if self._insertable(r)])
        keep_lock = keep_lock and r.lock_id is not None
        self._write(r)
        release = self.ctl.hold_background() if held else None
        try:
            out, err = attempt(self.ctl.insert, r.eng.id, InsertRequest(
                r.eng.ns, r.tokens, lock_id=r.lock_id, allocation_id=r.alloc_id,
                mamba_checkpoint=checkpoint, keep_lock=keep_lock))
        finally:
            if release is not None:
                release()
        if err is not None:
            return
        assert out.inserted_tokens + out.reused_tokens == r.total * PS, out
        self._inserted(r.tokens, checkpoint)
        event(f"insert ok keep_lock={keep_lock} lock={r.lock_id is not None} alloc={r.alloc_id is not None} "
              f"new={out.inserted_tokens > 0} reused={out.reused_tokens > 0}")
        if not keep_lock:
            self._forget(r)
            return
        used = r.total - r.dev
        if r.held is not None and used > 0:
            lo = r.dev - r.alloc_start
            r.held = {name: np.concatenate([ids, np.asarray(r.pages[name][lo : lo + used])])
                      for name, ids in r.held.items()}
        if r.alloc_id is not None:
            lo = r.dev - r.alloc_start
            r.alloc_len -= lo + used
            if r.pages is not None:
                r.pages = {name: ids if name in self.mamba else ids[lo + used:] for name, ids in r.pages.items()}
            if checkpoint and self.hybrid:
                r.pages = None  # (re-read from the next Allocate: the tree took a copy of the slot)
            r.alloc_start = r.total
        r.dev = r.prefix = r.total
        r.tokens = r.tokens[: r.total * PB]

    @pre(lambda self: any(r.lock_id is not None and r.alloc_id is not None for r in self.reqs))
    @op(weight=2, more=st.lists(page, min_size=0, max_size=3), slack=st.integers(0, 2))
    def grow(self, more, slack) -> None:
        """Decode growth: more tokens, the allocation grown to hold them."""
        r = self._pick([r for r in self.reqs if r.lock_id is not None and r.alloc_id is not None])
        tokens = r.tokens[: r.total * PB] + tokens_of(more) if more else r.tokens
        if len(tokens) // PB > MAX_PAGES:
            return
        need = len(tokens) // PB - r.dev
        have = r.alloc_len - (r.dev - r.alloc_start)
        n_pages = max(1, need - have) + slack
        info, err = attempt(self.ctl.allocate, r.eng.id,
                            AllocateRequest(r.eng.ns, n_pages * PS, allocation_id=r.alloc_id))
        if err is not None:
            return
        assert info.allocation_id == r.alloc_id
        got = self._paged(info.pages)
        if r.maybe_lent and got == r.alloc_len - (r.dev - r.alloc_start) + n_pages != r.alloc_len + n_pages:
            event("grow after a load that lent the allocation's pages")
            r.alloc_len -= r.dev - r.alloc_start
            r.alloc_start = r.dev
        r.maybe_lent = False
        assert got == r.alloc_len + n_pages, (got, r.alloc_len, n_pages)
        r.pages = dict(info.pages)
        r.alloc_len += n_pages
        r.tokens = tokens
        event("grow ok")

    @pre(lambda self: self.reqs)
    @op(weight=2, split=st.booleans())
    def release(self, split) -> None:
        r = self._pick(self.reqs)
        if split and r.lock_id is not None and r.alloc_id is not None:
            self.ctl.release(r.eng.id, r.lock_id, None)
            self.ctl.release(r.eng.id, None, r.alloc_id)
            self._forget(r)
            return
        self._release(r)

    @pre(lambda self: any(r.lock_id is not None and r.alloc_id is not None for r in self.reqs))
    @op()
    def drop_lock(self) -> None:
        """Release a request's lock and keep its allocation: it may still insert from the
        root with the allocation alone (if that starts at the first page)."""
        r = self._pick([r for r in self.reqs if r.lock_id is not None and r.alloc_id is not None])
        self.ctl.release(r.eng.id, r.lock_id, None)
        self.dead_locks.append((r.eng.id, r.lock_id))
        r.lock_id, r.dev, r.prefix, r.held, r.checkpoint = None, 0, 0, None, False

    @op(weight=3, pages=st.lists(page, min_size=1, max_size=6), checkpoint=st.booleans(),
        prefetch=st.booleans())
    def whole_request(self, pages, checkpoint, prefetch) -> None:
        """A request's whole life (match + allocate, load, write, insert) in one rule."""
        self._whole_request(self._pick(self.engines), self._tokens(pages), checkpoint, prefetch)

    def _whole_request(self, eng: Engine, tokens: bytes, checkpoint: bool, prefetch: bool) -> None:
        m, err = attempt(self.ctl.match, eng.id, MatchRequest(
            eng.ns, tokens, lock=True, prefetch=prefetch, allocate_tokens=len(tokens) // 4))
        if err is not None:
            return
        r = Req(eng, tokens, m.lock_id, m.allocation_id, pages=dict(m.pages),
                alloc_start=m.device_tokens // PS, alloc_len=self._paged(m.pages),
                dev=m.device_tokens // PS, prefix=(m.device_tokens + m.host_tokens) // PS)
        self.reqs.append(r)
        self._verify(eng, m.device_pages, tokens, m.device_tokens)
        if m.prefetch_id:
            self.prefetches.append((eng.id, m.prefetch_id))
        if m.host_tokens:
            out, err = attempt(load_all, self.ctl, eng.id, m.lock_id,
                               allowed=(ResourceExhausted, FailedPrecondition))
            if err is None:
                last = out[-1]
                self._verify(eng, last.device_pages, tokens, last.device_tokens)
                r.dev = r.prefix = last.device_tokens // PS
        self._write(r)
        out, err = attempt(self.ctl.insert, eng.id, InsertRequest(
            eng.ns, tokens, lock_id=r.lock_id, allocation_id=r.alloc_id, mamba_checkpoint=checkpoint))
        if err is not None:
            self._release(r)
            return
        assert out.inserted_tokens + out.reused_tokens == r.total * PS
        self._inserted(tokens, checkpoint)
        self._forget(r)

    # ------------------------------------------------------------------ valid: reads, tiers

    @op(weight=3, pages=token_lists, tail=st.integers(0, 3), load=st.booleans())
    def probe(self, pages, tail, load) -> None:
        self._probe(self._pick(self.engines), self._tokens(pages, tail), load)

    @op(weight=2, pages=token_lists, lock=st.booleans(), cancel=st.booleans())
    def prefetch(self, pages, lock, cancel) -> None:
        self._prefetch(self._pick(self.engines), self._tokens(pages), lock, cancel)

    def _prefetch(self, eng: Engine, tokens: bytes, lock: bool, cancel: bool) -> None:
        """Match with a prefetch, wait until it ends, check what came back (`_probe`)."""
        m, err = attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=lock, prefetch=True))
        if err is not None:
            return
        assert bool(m.lock_id) == lock
        try:
            if m.prefetch_id:
                self.prefetches.append((eng.id, m.prefetch_id))
                info = self.ctl.prefetch_status(m.prefetch_id, eng.id)
                assert 0 <= info.tokens_ready <= info.tokens_total
                if cancel:
                    assert self.ctl.cancel_prefetch(m.prefetch_id, eng.id) >= 0
                deadline = time.monotonic() + 10
                while (state := self.ctl.prefetch_status(m.prefetch_id).state) is PrefetchState.RUNNING:
                    assert time.monotonic() < deadline, "prefetch still running after 10 s"
                    time.sleep(0.002)
                event(f"prefetch ended {state.value}")
        finally:
            if m.lock_id:
                self.ctl.release(eng.id, m.lock_id, None)
        if m.prefetch_id and state is PrefetchState.DONE and not self.hybrid:
            # What it fetched is in L1/L2 now (nothing evicts it meanwhile: no pressure here).
            again = self.ctl.match(eng.id, MatchRequest(eng.ns, tokens))
            assert again.device_tokens + again.host_tokens >= (m.device_tokens + m.host_tokens
                                                               + m.storage_tokens), (m[:3], again[:3])
        self._probe(eng, tokens, load=True)

    @op(weight=2, n=st.integers(1, 8), held=st.booleans())
    def fill(self, n, held) -> None:
        """Fresh 10-page requests: L1 and in time L2 evict under pressure. With nothing
        else held (no request open, no prefetch running) there is always room: each one
        must get its pages, waiting for queued copies if need be, even while an RPC holds
        the background copies (`hold_background`: an allocation needing them releases it)."""
        eng = self._pick(self.engines)
        with self.ctl._mu:
            idle = not self.reqs and not self.ctl.prefetcher.running
        allowed = () if idle else (ResourceExhausted,)
        release = self.ctl.hold_background() if held else None
        try:
            self._fill(eng, n, allowed)
        finally:
            if release is not None:
                release()

    def _fill(self, eng: Engine, n: int, allowed: tuple) -> None:
        for _ in range(n):
            tokens = fresh_tokens(10)
            m, err = attempt(self.ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=True, allocate_tokens=40),
                             allowed=allowed)
            if err is not None:
                return
            assert m.device_tokens == 0
            eng.write(m.pages, tokens, 0)
            out, err = attempt(self.ctl.insert, eng.id, InsertRequest(
                eng.ns, tokens, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True),
                allowed=allowed)
            if err is not None:
                self.ctl.release(eng.id, m.lock_id, m.allocation_id)
                return
            assert out.inserted_tokens == 40

    @op(host=st.booleans())
    def evict(self, host) -> None:
        evict_all(self.ctl, *((Tier.DEVICE, Tier.HOST) if host else (Tier.DEVICE,)))

    @pre(lambda self: self.known)
    @op(weight=2, tiers=st.sampled_from(["l1", "l1+l2", "flush+l1+l2"]),
        then=st.sampled_from(["probe", "prefetch", "request", "request+prefetch"]))
    def come_back(self, tiers, then) -> None:
        """Evict a known sequence's tiers, then reuse it: loads from L2, prefetches from L3,
        every byte checked on the way back."""
        eng = self._pick(self.engines)
        tokens = self._pick(self.known)
        before = self.ctl.match(eng.id, MatchRequest(eng.ns, tokens))
        if tiers.startswith("flush"):
            self.ctl.flush(10)
        for _ in range(2):  # (write-back: a parent leaves after its child)
            evict_all(self.ctl, *((Tier.DEVICE,) if tiers == "l1" else (Tier.DEVICE, Tier.HOST)))
        after = self.ctl.match(eng.id, MatchRequest(eng.ns, tokens))
        if tiers.startswith("flush"):  # what the cache held is all in L3 now
            found = lambda m: m.device_tokens + m.host_tokens + m.storage_tokens  # noqa: E731
            assert found(after) >= found(before), (before[:3], after[:3])
        if then == "probe":
            self._probe(eng, tokens, load=True)
        elif then == "prefetch":
            self._prefetch(eng, tokens, lock=bool(self._next() % 2), cancel=False)
        else:
            self._whole_request(eng, tokens, checkpoint=True, prefetch=then.endswith("prefetch"))

    @op()
    def flush(self) -> None:
        assert self.ctl.flush(10) >= 0

    @op(session=st.sampled_from(["s1", "s2", "never-opened"]))
    def close_session(self, session) -> None:
        """A session never opened (or closed long ago) is NotFound; a recent one 0."""
        n, _ = attempt(self.ctl.close_session, session, allowed=(NotFound,))
        assert n is None or n >= 0

    @op(instance=st.sampled_from(["a", "b", ""]))
    def reattach(self, instance) -> None:
        """An engine attaches again; under another process id its handles are released."""
        eng_id = self._pick(["e1", "e2"])
        self.ctl.attach(eng_id, 0, 1, instance_id=instance)
        before = self.instances.get(eng_id)
        if instance:
            self.instances[eng_id] = instance
            if before is not None and before != instance:
                for r in [r for r in self.reqs if r.eng.id == eng_id]:
                    self._forget(r)
        hb = self.ctl.heartbeat(eng_id, 0, instance)
        mine = [r for r in self.reqs if r.eng.id == eng_id]
        assert hb.locks == sum(r.lock_id is not None for r in mine)
        assert hb.allocations == sum(r.alloc_id is not None for r in mine)

    @op(calls=st.lists(st.sampled_from(["heartbeat", "match", "allocate", "insert", "release"]),
                       max_size=3))
    def lease_lapses(self, calls) -> None:
        """An engine's lease runs out (its clock moved past it): the sweep releases what it
        held; until it attaches again its calls are NotFound ("lease expired")."""
        eng = self._pick(self.engines)
        mine = [r for r in self.reqs if r.eng.id == eng.id]
        with self.ctl._mu:
            self.ctl._engines._engines[eng.id].expires_at = 0.0  # (as if `lease_ms` had passed)
        assert self.ctl.expire_leases() == 1
        for r in mine:
            self._forget(r)
        self.instances.pop(eng.id, None)
        counters = self.ctl.stats().counters
        assert counters["leases_expired"] >= 1
        for call in calls:
            if call == "heartbeat":
                refused(NotFound, self.ctl.heartbeat, eng.id)
            elif call == "match":
                refused(NotFound, self.ctl.match, eng.id, MatchRequest(eng.ns, seq(2), lock=True))
            elif call == "allocate":
                refused(NotFound, self.ctl.allocate, eng.id, AllocateRequest(eng.ns, 4))
            elif call == "insert" and mine and mine[0].lock_id:
                refused(NotFound, self.ctl.insert, eng.id, InsertRequest(
                    eng.ns, mine[0].tokens, lock_id=mine[0].lock_id, allocation_id=mine[0].alloc_id))
            elif call == "release" and mine and mine[0].lock_id:
                refused(NotFound, self.ctl.release, eng.id, mine[0].lock_id, None)
        self.ctl.attach(eng.id, 0, 1)
        assert self.ctl.heartbeat(eng.id).locks == 0

    @op(n=st.integers(2, 3), pages=st.lists(token_lists, min_size=3, max_size=3))
    def concurrent_requests(self, n, pages) -> None:
        """Whole requests on threads at once (the gRPC server calls from many), each
        checking every page it reuses."""
        engines = [self._pick(self.engines) for _ in range(n)]
        seqs = [self._tokens(p) for p in pages[:n]]
        errors: list[BaseException] = []

        def one(eng: Engine, tokens: bytes) -> None:
            try:
                for _ in range(3):
                    self._solo_request(eng, tokens)
            except BaseException as e:  # (re-raised on the test's thread)
                errors.append(e)

        threads = [threading.Thread(target=one, args=(e, t)) for e, t in zip(engines, seqs, strict=False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a request hung"
        if errors:
            raise errors[0]
        # (what succeeded depends on the threads' timing: not added to `known`, whose
        # picks must not vary between runs of an example)

    def _solo_request(self, eng: Engine, tokens: bytes) -> bool:
        """One request's life that leaves nothing held whatever happens (no room: False)."""
        ctl = self.ctl
        m, err = attempt(ctl.match, eng.id, MatchRequest(eng.ns, tokens, lock=True,
                                                         allocate_tokens=len(tokens) // 4))
        if err is not None:
            return False
        try:
            eng.verify(m.device_pages, tokens, m.device_tokens // PS)
            pages, start = dict(m.pages), m.device_tokens // PS
            skip = 0
            if m.host_tokens:
                out, err = attempt(load_all, ctl, eng.id, m.lock_id, allowed=(ResourceExhausted, FailedPrecondition))
                if err is None:
                    eng.verify(out[-1].device_pages, tokens, out[-1].device_tokens // PS)
                    skip = out[-1].device_tokens // PS - start
                    start += skip
            eng.write({k: v if k in self.mamba else v[skip:] for k, v in pages.items()}, tokens, start)
            out, err = attempt(ctl.insert, eng.id, InsertRequest(
                eng.ns, tokens, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True))
        except BaseException:
            ctl.release(eng.id, m.lock_id, m.allocation_id)
            raise
        if err is not None:
            ctl.release(eng.id, m.lock_id, m.allocation_id)
            return False
        assert out.inserted_tokens + out.reused_tokens == len(tokens) // PB * PS
        return True

    @op()
    def request_at_the_limit(self) -> None:
        """Exactly `server.max_tokens_per_request` tokens: accepted."""
        eng = self._pick(self.engines)
        tokens = fresh_tokens(LIMIT // PS)
        assert len(tokens) // 4 == LIMIT
        if self._solo_request(eng, tokens):
            self._probe(eng, tokens, load=True)

    @op()
    def stats_and_health(self) -> None:
        s = self.ctl.stats()
        assert s.counters["active_locks"] == sum(r.lock_id is not None for r in self.reqs)
        assert s.counters["active_allocations"] == sum(r.alloc_id is not None for r in self.reqs)
        for p in s.pools:
            assert 0 <= p.locked_pages <= p.used_pages <= p.capacity_pages, p
        self.ctl.health(deep=False)
        assert self.ctl.expire_leases() == 0

    # ------------------------------------------------------------------ invalid input

    @op(pages=token_lists, cut=st.integers(1, 3),
        call=st.sampled_from(["match", "match_lock", "insert"]))
    def bad_token_bytes(self, pages, cut, call) -> None:
        eng = self._pick(self.engines)
        tokens = tokens_of(pages)[:-cut]
        if call == "insert":
            refused(InvalidArgument, self.ctl.insert, eng.id, InsertRequest(eng.ns, tokens))
        else:
            refused(InvalidArgument, self.ctl.match, eng.id,
                    MatchRequest(eng.ns, tokens, lock=call == "match_lock", allocate_tokens=8))

    @op(over=st.integers(1, 40), call=st.sampled_from(["match", "insert", "prefetch"]))
    def too_many_tokens(self, over, call) -> None:
        eng = self._pick(self.engines)
        tokens = seq(-(-(LIMIT + over) // PS))[: (LIMIT + over) * 4]
        if call == "insert":
            refused(InvalidArgument, self.ctl.insert, eng.id, InsertRequest(eng.ns, tokens))
        else:
            refused(InvalidArgument, self.ctl.match, eng.id,
                    MatchRequest(eng.ns, tokens, lock=True, prefetch=call == "prefetch"))

    @op(n=st.sampled_from([-1, -(1 << 63), LIMIT + 1, 1 << 40, 1 << 70]),
        call=st.sampled_from(["match", "allocate", "grow", "allocate_zero"]))
    def bad_counts(self, n, call) -> None:
        eng = self._pick(self.engines)
        if call == "match":
            refused(InvalidArgument, self.ctl.match, eng.id,
                    MatchRequest(eng.ns, seq(2), lock=True, allocate_tokens=n))
        elif call == "allocate_zero":
            refused(InvalidArgument, self.ctl.allocate, eng.id, AllocateRequest(eng.ns, 0))
        else:
            alloc = next((r.alloc_id for r in self.reqs if r.eng is eng and r.alloc_id), None)
            refused(InvalidArgument, self.ctl.allocate, eng.id,
                    AllocateRequest(eng.ns, n, allocation_id=alloc if call == "grow" else None))

    @op(handle=st.one_of(st.just(0), st.integers(-(1 << 70), 1 << 70)),
        call=st.sampled_from(["release_lock", "release_alloc", "insert_lock", "insert_alloc",
                                "load", "grow", "allocate_lock", "prefetch_status", "cancel_prefetch"]))
    def unknown_handles(self, handle, call) -> None:
        eng = self._pick(self.engines)
        known = {r.lock_id for r in self.reqs} | {r.alloc_id for r in self.reqs}
        if handle in known:
            return
        self._dead_handle_call(eng, handle, call)

    @pre(lambda self: self.dead_locks or self.dead_allocs)
    @op(call=st.sampled_from(["release_lock", "release_alloc", "insert_lock", "insert_alloc", "load",
                              "grow", "allocate_lock"]))
    def released_handles(self, call) -> None:
        """Double release, or any use of a handle released or consumed before."""
        pool = self.dead_locks if call in ("release_lock", "insert_lock", "load", "allocate_lock") else self.dead_allocs
        if not pool:
            return
        eng_id, handle = self._pick(pool)
        eng = next(e for e in self.engines if e.id == eng_id)
        self._dead_handle_call(eng, handle, call)

    def _dead_handle_call(self, eng: Engine, handle: int, call: str) -> None:
        ctl = self.ctl
        if call == "release_lock":
            refused(NotFound, ctl.release, eng.id, handle, None)
        elif call == "release_alloc":
            refused(NotFound, ctl.release, eng.id, None, handle)
        elif call == "insert_lock":
            refused(NotFound, ctl.insert, eng.id, InsertRequest(eng.ns, seq(2), lock_id=handle))
        elif call == "insert_alloc":
            refused(NotFound, ctl.insert, eng.id, InsertRequest(eng.ns, seq(2), allocation_id=handle))
        elif call == "load":
            refused(NotFound, load_all, ctl, eng.id, handle)
        elif call == "grow":
            refused(NotFound, ctl.allocate, eng.id, AllocateRequest(eng.ns, 4, allocation_id=handle))
        elif call == "allocate_lock":
            refused(NotFound, ctl.allocate, eng.id, AllocateRequest(eng.ns, 4, lock_id=handle))
        elif call in ("prefetch_status", "cancel_prefetch") and handle not in {p for _, p in self.prefetches}:
            refused(NotFound, getattr(ctl, call), handle, eng.id)

    @pre(lambda self: self.reqs)
    @op(call=st.sampled_from(["release_lock", "release_alloc", "release_both", "insert", "load",
                              "grow", "allocate_lock"]))
    def foreign_handles(self, call) -> None:
        """Another engine's handles are unknown to this one (and stay its owner's)."""
        r = self._pick(self.reqs)
        other = self._other(r.eng)
        ctl = self.ctl
        if call == "release_lock" and r.lock_id:
            refused(NotFound, ctl.release, other.id, r.lock_id, None)
        elif call == "release_alloc" and r.alloc_id:
            refused(NotFound, ctl.release, other.id, None, r.alloc_id)
        elif call == "release_both" and r.lock_id and r.alloc_id:
            refused(NotFound, ctl.release, other.id, r.lock_id, r.alloc_id)
        elif call == "insert":
            refused(NotFound, ctl.insert, other.id, InsertRequest(
                r.eng.ns, r.tokens, lock_id=r.lock_id, allocation_id=r.alloc_id))
        elif call == "load" and r.lock_id:
            refused(NotFound, load_all, ctl, other.id, r.lock_id)
        elif call == "grow" and r.alloc_id:
            refused(NotFound, ctl.allocate, other.id, AllocateRequest(r.eng.ns, 4, allocation_id=r.alloc_id))
        elif call == "allocate_lock" and r.lock_id:
            refused(NotFound, ctl.allocate, other.id, AllocateRequest(r.eng.ns, 4, lock_id=r.lock_id))

    @pre(lambda self: self.prefetches)
    @op()
    def foreign_prefetch(self) -> None:
        owner, pid = self._pick(self.prefetches)
        other = "e2" if owner == "e1" else "e1"
        refused(NotFound, self.ctl.prefetch_status, pid, other)
        refused(NotFound, self.ctl.cancel_prefetch, pid, other)
        try:  # its owner may still ask (unless the op expired from the controller's memory)
            self.ctl.prefetch_status(pid, owner)
        except HicacheError as e:
            _check_error(e)
            assert isinstance(e, NotFound), e

    @pre(lambda self: self.reqs)
    @op(how=st.sampled_from(["prefix", "namespace", "short_alloc", "no_alloc", "keep_without_lock",
                             "bad_bytes", "alloc_without_its_lock", "alloc_of_another_namespace"]))
    def bad_insert(self, how) -> None:
        """An Insert its handles cannot take: refused, the request unchanged (it goes on)."""
        r = self._pick(self.reqs)
        ctl = self.ctl
        req = InsertRequest(r.eng.ns, r.tokens, lock_id=r.lock_id, allocation_id=r.alloc_id)
        if r.lock_id is None and how in ("prefix", "no_alloc", "keep_without_lock"):
            return
        if how == "alloc_without_its_lock":
            # An allocation continuing a lock starts past the root: alone it cannot commit.
            if r.alloc_id is None or r.alloc_start == 0:
                return
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(lock_id=None))
        elif how == "alloc_of_another_namespace":
            other = next((o for o in self.reqs if o.eng.id == r.eng.id and o.eng.ns != r.eng.ns
                          and o.alloc_id is not None), None)
            if other is None:
                return
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(allocation_id=other.alloc_id))
        elif how == "prefix":
            if r.prefix == 0:
                return
            bad = bytearray(r.tokens)
            bad[0:4] = toks([777_777])
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(tokens=bytes(bad)))
        elif how == "namespace":
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(namespace=r.eng.ns + "-other"))
        elif how == "short_alloc":
            if r.alloc_id is None:
                return
            room = r.alloc_start + r.alloc_len  # the first token page past the allocation
            longer = r.tokens[: r.total * PB] + fresh_tokens(max(1, room + 1 - r.total))
            if len(longer) // 4 > LIMIT:
                return
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(tokens=longer))
        elif how == "no_alloc":
            if r.total <= r.dev:
                return
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(allocation_id=None))
        elif how == "keep_without_lock":
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(lock_id=None, keep_lock=True))
        elif how == "bad_bytes":
            refused(InvalidArgument, ctl.insert, r.eng.id, req._replace(tokens=r.tokens + b"\x01"))

    @op(engine_id=st.sampled_from(["ghost", ""]),
        call=st.sampled_from(["match_lock", "match_alloc", "prefetch", "allocate", "insert",
                              "heartbeat", "release", "load"]))
    def unknown_engine(self, engine_id, call) -> None:
        ctl = self.ctl
        want = (FailedPrecondition, NotFound)
        if call == "match_lock":
            refused(FailedPrecondition, ctl.match, engine_id, MatchRequest("", seq(2), lock=True))
        elif call == "match_alloc":
            refused(FailedPrecondition, ctl.match, engine_id, MatchRequest("", seq(2), allocate_tokens=8))
        elif call == "prefetch":
            refused(FailedPrecondition, ctl.match, engine_id, MatchRequest("", seq(2), prefetch=True))
        elif call == "allocate":
            refused(FailedPrecondition, ctl.allocate, engine_id, AllocateRequest("", 8))
        elif call == "insert":
            refused(FailedPrecondition, ctl.insert, engine_id, InsertRequest("", seq(2)))
        elif call == "heartbeat":
            e = refused(HicacheError, ctl.heartbeat, engine_id)
            assert isinstance(e, want), e
        elif call == "release":
            refused(NotFound, ctl.release, engine_id, 12345, None)
        elif call == "load":
            e = refused(HicacheError, load_all, ctl, engine_id, 12345)
            assert isinstance(e, want), e

    @op(args=st.sampled_from([("", 0, 1), ("e1", 1, 1), ("e1", -1, 1), ("e1", 0, 2), ("e1", 0, 0),
                              ("x" * 300, 0, 1)]))
    def bad_attach(self, args) -> None:
        refused(InvalidArgument, self.ctl.attach, *args)

    @op(call=st.sampled_from(["close_session", "release_nothing"]))
    def bad_misc(self, call) -> None:
        if call == "close_session":
            refused(InvalidArgument, self.ctl.close_session, "")
        else:
            refused(InvalidArgument, self.ctl.release, "e1", None, None)

    # ------------------------------------------------------------------ the step

    @classmethod
    def _op_table(cls) -> list[tuple[str, int, dict, object]]:
        table = cls.__dict__.get("_ops")
        if table is None:
            table = []
            for name in sorted(dir(cls)):
                f = getattr(cls, name)
                if callable(f) and hasattr(f, "fuzz_op"):
                    weight, strategies = f.fuzz_op
                    table.append((name, weight, strategies, getattr(f, "fuzz_pre", None)))
            cls._ops = table
        return table

    @rule(data=st.data())
    def step(self, data) -> None:  # type: ignore[no-untyped-def]
        """One op. What is drawn never depends on the state (which op, its arguments, and
        a fixed number of picks that choose among handles, engines, known sequences):
        background copies and prefetches make the state vary a little between runs of
        one example, and hypothesis refuses draws that change with it (flaky data)."""
        table = self._op_table()
        names = [name for name, weight, _, _ in table for _ in range(weight)]
        name = names[data.draw(st.integers(0, len(names) - 1), label="op")]
        _, _, strategies, cond = next(row for row in table if row[0] == name)
        kwargs = {k: data.draw(v, label=k) for k, v in strategies.items()}
        self._picks = iter(data.draw(st.lists(st.integers(0, 255), min_size=PICKS, max_size=PICKS), label="picks"))
        if cond is not None and not cond(self):
            return  # (not in this state: a step that does nothing)
        note(f"op {name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        event(f"op {name}")
        getattr(self, name)(**kwargs)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def integrity(self) -> None:
        if self.ctl is not None:
            self.ctl.check_integrity()
            for r in self.reqs:
                self._check_held(r)


SETTINGS = settings(fuzz_settings(40, *HealthCheck), stateful_step_count=25,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


class PlainFuzz(ControllerFuzz):
    CONFIGS = [
        {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"},
        {"write__l1_to_l2": "write_back", "write__l2_to_l3": "write_back", "sidecar": True,
         "prefetch__policy": "best_effort"},
        {"swa_only": True, "write__l1_to_l2": "write_through", "write__l2_to_l3": "write_back"},
        {"swa_only": True, "write__l1_to_l2": "write_back", "prefetch__policy": "timeout", "l1_tokens": 96},
        {},  # the defaults (write_through, write_through_selective, timeout)
    ]


class HybridFuzz(ControllerFuzz):
    CONFIGS = [
        {"hybrid": True, "write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"},
        {"hybrid": True, "write__l1_to_l2": "write_through", "write__l2_to_l3": "write_back",
         "prefetch__policy": "best_effort"},
        {"hybrid": True, "write__l1_to_l2": "write_back", "write__l2_to_l3": "write_back", "l1_tokens": 96},
    ]


TestPlainFuzz = PlainFuzz.TestCase
TestPlainFuzz.settings = SETTINGS
TestHybridFuzz = HybridFuzz.TestCase
TestHybridFuzz.settings = settings(SETTINGS, max_examples=fuzz_examples(20))  # (~1-1.5 s an example)

# The bugs this fuzz found (write-back L1 -> L2: an interior node stuck in L1, a flush that
# evicted unwritten L2 data, a written-back node never written through to L3) have their
# regression tests in test_write_through.py.
