"""A test engine: writes KV whose bytes are a function of (namespace, page hash, layer,
member) into the L1 pages it is given, and checks every reused page byte for byte."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hicache.config import HicacheConfig, build_config
from hicache.controller.base import InsertRequest, MatchOutcome, MatchRequest, PrefetchState
from hicache.controller.controller import HybridCacheController, build_controller
from hicache.errors import NotFound
from hicache.keys import chain_hashes
from hicache.types import ComponentKind, Tier

MAMBA = ComponentKind.MAMBA


_instances = itertools.count()


@contextlib.contextmanager
def built_controllers(tmp_path, prefix: str = "t") -> Iterator[Callable[..., HybridCacheController]]:
    """A factory of controllers from `tiny_config(tmp_path, **overrides)`, each audited
    (`check_integrity`) and closed at the end (closed even when an audit fails: no
    shared-memory segment may outlive the test). Instance names start with `prefix`."""
    built: list[HybridCacheController] = []

    def factory(**kw: object) -> HybridCacheController:
        cfg = tiny_config(tmp_path, **kw)  # type: ignore[arg-type]
        # (the pid: every xdist worker counts from 0, and two may build their k-th
        # controller in one millisecond; the second would find the instance locked)
        ctl = build_controller(cfg, f"{prefix}{os.getpid()}x{next(_instances)}")
        built.append(ctl)
        return ctl

    try:
        yield factory
        for ctl in built:
            ctl.check_integrity()
    finally:
        for ctl in built:
            ctl.close()


def tiny_config(tmp_path, *, hybrid: bool = False, sidecar: bool = False, backend: str = "file",
                l1_tokens: int = 64 * 4, swa_only: bool = False, **sets: object) -> HicacheConfig:
    """`hybrid`: FULL+SWA+MAMBA with an indexer and a conv sidecar; `swa_only`: FULL+SWA
    (no MAMBA: every boundary with its SWA window is reusable)."""
    comps: dict = {"full": {"layers": 2, "bytes_per_token_per_layer": 8}}
    sidecars: dict = {}
    if sidecar:
        sidecars = {"indexer": {"anchor": "full", "layers": 2, "bytes_per_token_per_layer": 2}}
    if swa_only:
        comps["swa"] = {"layers": 2, "bytes_per_token_per_layer": 8, "window_tokens": 8}
    elif hybrid:
        comps["swa"] = {"layers": 2, "bytes_per_token_per_layer": 8, "window_tokens": 8}
        comps["mamba"] = {"layers": 2, "state_bytes_per_layer": 64}
        sidecars = {
            "indexer": {"anchor": "full", "layers": 2, "bytes_per_token_per_layer": 2},
            "conv": {"anchor": "mamba", "layers": 1, "state_bytes_per_layer": 32},
        }
    raw: dict = {
        "model": {"page_size": 4, "components": comps, "sidecars": sidecars},
        "tiers": {"l1": {"tokens": l1_tokens, "mamba_slots": 16}, "l2": {"ratio": 2, "reserve_gb": 0}},
        "prefetch": {"threshold_tokens": 4, "policy": "wait_complete"},
        "storage": {"backend": backend, "file": {"path": str(tmp_path / "l3")}, "timeout_s": 2},
        "metrics": {"port": 0},
    }
    for key, value in sets.items():
        node = raw
        parts = key.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return build_config(raw)


def redis_kw(url: str, ttl_s: int | None, **kw: object) -> dict[str, object]:
    """`built_controllers` keywords of a controller on the Redis at `url` (objects expire
    `ttl_s` after their last use; None: never), writing through to L2 and L3, L1 512
    tokens unless `kw` says otherwise."""
    kw.setdefault("write__l1_to_l2", "write_through")
    kw.setdefault("write__l2_to_l3", "write_through")
    kw.setdefault("l1_tokens", 512)
    return {"backend": "redis", "storage__redis": {"url": url, "ttl_s": ttl_s}, **kw}


def toks(ids) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def seq(n_pages: int, base: int = 0) -> bytes:
    """`n_pages` pages of 4 tokens (the tiny config's page size) counting from `base`."""
    return toks(np.arange(base, base + n_pages * 4))


def tree_path(ctl, tokens: bytes):  # type: ignore[no-untyped-def]
    """The tree's nodes along `tokens` in the default namespace (no hit counted)."""
    tree = ctl.tree
    return tree._walk(tree._roots.get(""), tokens, len(tokens))


def fully_in(ctl, tokens: bytes, tier: Tier) -> bool:  # type: ignore[no-untyped-def]
    """Every page of `tokens` (page size 16) is in the tree, FULL resident in `tier`."""
    with ctl._mu:
        path = tree_path(ctl, tokens)
        return (sum(n.npages for n in path) == len(tokens) // 16
                and all(ctl.tree.is_resident(n, ComponentKind.FULL, tier) for n in path))


def evict_all(ctl, *tiers: Tier) -> None:
    """Drop every page of every family from `tiers`, after queued copies landed."""
    assert ctl.transfers.drain(10)  # write-through copies land first
    with ctl._mu:
        for tier in tiers:
            pools = ctl.device if tier is Tier.DEVICE else ctl.host
            for kind in ctl._kinds:
                ctl.transfers._evict(tier, kind, pools.allocator(kind).total)


def prefetch_back(ctl, tokens: bytes, state: PrefetchState = PrefetchState.DONE,
                  engine_id: str = "e1") -> MatchOutcome:
    """Match `tokens` with a prefetch, wait until it ends in `state`, release the lock;
    the match's outcome."""
    m = ctl.match(engine_id, MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id) is state
    ctl.release(engine_id, m.lock_id, None)
    return m


def hold_nth_read(ctl, monkeypatch, n: int):  # type: ignore[no-untyped-def]
    """Make the `n`-th L3 read of `ctl` wait for the returned `gate` (at most 5 s);
    `reached` is set when it starts waiting. Returns (gate, reached)."""
    import threading

    gate, reached = threading.Event(), threading.Event()
    real = ctl.l3.backend._read_into
    calls = [0]

    def read(keys, buffers):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == n:
            reached.set()
            gate.wait(5)
        return real(keys, buffers)

    monkeypatch.setattr(ctl.l3.backend, "_read_into", read)
    return gate, reached


def wait_prefetch(ctl, prefetch_id: int, timeout_s: float = 10.0):
    """Poll the prefetch until it leaves RUNNING (at most `timeout_s`); its final state."""
    deadline = time.monotonic() + timeout_s
    while (state := ctl.prefetch_status(prefetch_id).state) is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, f"prefetch {prefetch_id} still running"
        time.sleep(0.005)
    return state


class Engine:
    def __init__(self, ctl: HybridCacheController, engine_id: str = "e1", namespace: str = "") -> None:
        self.ctl = ctl
        self.id = engine_id
        self.ns = namespace
        self.cfg = ctl.cfg
        self.ps = self.cfg.model.page_size
        ctl.attach(engine_id, 0, 1)
        self.checked = 0

    def hashes(self, tokens: bytes) -> list[bytes]:
        blob = chain_hashes(self.cfg.model.chain_seed(self.ns), tokens, self.ps * 4)
        return [blob[i : i + 16] for i in range(0, len(blob), 16)]

    def pattern(self, page_hash: bytes, member: str, layer: int, size: int) -> np.ndarray:
        seed = hashlib.sha256(page_hash + member.encode() + bytes([layer])).digest()
        return np.frombuffer((seed * (size // 32 + 1))[:size], dtype=np.uint8)

    def _rows(self, member: str, layer: int) -> np.ndarray:
        return self.ctl.device.layer(member, layer).numpy()

    def write(self, pages: dict[str, np.ndarray], tokens: bytes, start_page: int) -> None:
        hs = self.hashes(tokens)
        for m in self.cfg.model.members:
            ids = pages[m.name]
            for layer in range(m.layers):
                rows = self._rows(m.name, layer)
                if m.component is MAMBA:
                    rows[int(ids[0])] = self.pattern(hs[-1] + b"state", m.name, layer, rows.shape[1])
                    continue
                for i, pid in enumerate(ids[: len(hs) - start_page]):
                    rows[int(pid)] = self.pattern(hs[start_page + i], m.name, layer, rows.shape[1])

    def verify(self, pages: dict[str, np.ndarray], tokens: bytes, n_pages: int) -> None:
        """Every reused page byte for byte (SWA: only pages it holds, -1 is a tombstone)."""
        hs = self.hashes(tokens)
        for m in self.cfg.model.members:
            ids = pages[m.name]
            for layer in range(m.layers):
                rows = self._rows(m.name, layer)
                if m.component is MAMBA:
                    if len(ids):
                        want = self.pattern(hs[n_pages - 1] + b"state", m.name, layer, rows.shape[1])
                        assert np.array_equal(rows[int(ids[0])], want), f"{m.name} checkpoint wrong"
                        self.checked += 1
                    continue
                assert len(ids) == n_pages, (m.name, len(ids), n_pages)
                for i, pid in enumerate(ids):
                    if pid < 0:
                        continue
                    want = self.pattern(hs[i], m.name, layer, rows.shape[1])
                    assert np.array_equal(rows[int(pid)], want), f"{m.name} page {i} layer {layer} wrong"
                    self.checked += 1

    def insert_with_swa_tail(self, tokens: bytes, tail: int, *, hold_copies: bool = False) -> object:
        """Like an engine that freed SWA pages outside the window during a long prefill
        (the daemon's API always inserts whole allocations, so this goes to the tree under
        the controller's mutex): writes the KV of every page of `tokens`, frees all but
        the last `tail` SWA pages and inserts with -1 for them, then applies the write
        policy. `hold_copies`: its L1->L2 copies wait until `release_flushes`. Returns
        the end node."""
        n = len(tokens) // (self.ps * 4)
        transfers = self.ctl.transfers
        with self.ctl._mu:
            pages = {kind: transfers.allocate_l1(kind, n) for kind in (ComponentKind.FULL, ComponentKind.SWA)}
            slot = transfers.allocate_l1(MAMBA, 1)
            by_member = {m.name: pages.get(m.component, slot) for m in self.cfg.model.members}
            self.write(by_member, tokens, 0)
            swa = pages[ComponentKind.SWA]
            transfers.free_l1(ComponentKind.SWA, swa[: n - tail])
            given = swa.copy()
            given[: n - tail] = -1
            if hold_copies:
                assert transfers.hold_flushes()
            r = self.ctl.tree.insert(self.ns, tokens, {ComponentKind.FULL: pages[ComponentKind.FULL],
                                                       ComponentKind.SWA: given},
                                     mamba_slot=int(slot[0]))
            transfers.after_insert(r.end)
            return r.end

    def request_then_only_in_l3(self, tokens: bytes) -> None:
        """One request for `tokens` (the config writes through to L3), then L1 and L2
        emptied: the pages are left in L3 alone."""
        self.request(tokens)
        evict_all(self.ctl, Tier.DEVICE, Tier.HOST)

    def assert_cached(self, tokens: bytes) -> MatchOutcome:
        """`tokens` whole in L1 (a plain match of them), every page byte-exact."""
        n = len(tokens) // (self.ps * 4)
        hit = self.ctl.match(self.id, MatchRequest(self.ns, tokens))
        assert hit.device_tokens == n * self.ps, (hit.device_tokens, n * self.ps)
        self.verify(hit.device_pages, tokens, n)
        return hit

    def request(self, tokens: bytes, *, checkpoint: bool = True, load: bool = True, prefetch: bool = False):
        """One request's life: match (+allocate), load what L2 holds, write new KV, insert."""
        total_pages = len(tokens) // (self.ps * 4)
        m = self.ctl.match(self.id, MatchRequest(self.ns, tokens, lock=True, prefetch=prefetch,
                                                 allocate_tokens=len(tokens) // 4))
        reused = m.device_tokens
        self.verify(m.device_pages, tokens, reused // self.ps)
        device_pages = m.device_pages
        if load and m.host_tokens:
            *_, last = list(self.ctl.load(self.id, m.lock_id))
            assert last.device_pages is not None and last.device_tokens is not None
            reused = last.device_tokens
            device_pages = last.device_pages
            self.verify(device_pages, tokens, reused // self.ps)
        start = reused // self.ps
        skip = max(0, start - m.device_tokens // self.ps)
        mamba = {mb.name for mb in self.cfg.model.family(MAMBA)}
        alloc = {name: ids if name in mamba else ids[skip:] for name, ids in m.pages.items()}
        # The allocation starts at the match's device boundary; after a load it is ahead.
        self.write(alloc, tokens, start)
        out = self.ctl.insert(self.id, InsertRequest(self.ns, tokens, lock_id=m.lock_id,
                                                     allocation_id=m.allocation_id,
                                                     mamba_checkpoint=checkpoint))
        assert out.inserted_tokens + out.reused_tokens == total_pages * self.ps
        return m


def in_l2_only(ctl, eng: Engine, tokens: bytes) -> None:  # type: ignore[no-untyped-def]
    """One request for `tokens` (write-through to L2), then L1 emptied."""
    eng.request(tokens)
    evict_all(ctl, Tier.DEVICE)


def l1_full(ctl) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(FULL pages the tree holds in L1, free FULL pages of L1)."""
    with ctl._mu:
        return (ctl.tree.resident_pages(Tier.DEVICE, ComponentKind.FULL),
                ctl.device.allocator(ComponentKind.FULL).free_count)


def l2_prefix_request(ctl, eng: Engine, base: int, tail_base: int,  # type: ignore[no-untyped-def]
                      engine_id: str = "e1") -> tuple[bytes, bytes, MatchOutcome]:
    """8 pages only L2 holds (from `base`), then a request for them and 4 new pages
    (from `tail_base`): its locked match with an allocation for all 12 (the L2 part
    included). Returns (the prefix, the prompt, the match)."""
    prefix = seq(8, base=base)
    in_l2_only(ctl, eng, prefix)
    prompt = prefix + seq(4, base=tail_base)
    m = ctl.match(engine_id, MatchRequest("", prompt, lock=True, allocate_tokens=len(prompt) // 4))
    return prefix, prompt, m


def flushed(ctl, tokens: bytes) -> None:  # type: ignore[no-untyped-def]
    """Flush, then check `tokens`' pages are recorded in L3 (a flush returns the pages it
    wrote itself, none when write-through already did: no check)."""
    ctl.flush(10)
    pages = len(tokens) // (4 * ctl.cfg.model.page_size)
    assert ctl.tree.resident_pages(Tier.STORAGE, ComponentKind.FULL) >= pages


class CopyGate:
    """Holds every L2 -> L1 copy (each load's `host_to_device`) until `open()`, or with
    `first_only` the first one alone (the others copy at once); counts the copies that
    reached the gate; with `fail`, the first held copy raises."""

    def __init__(self, ctl, first_only: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.gate = threading.Event()
        self.cond = threading.Condition()
        self.reached = 0
        self.fail = False
        copier = ctl.transfers.copier
        self.original = copier.host_to_device

        def held(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.cond:
                self.reached += 1
                mine = self.reached
                self.cond.notify_all()
            if first_only and mine > 1:
                return self.original(*args, **kwargs)
            assert self.gate.wait(10), "copy gate never opened"
            if self.fail and mine == 1:
                raise OSError("injected copy failure")
            return self.original(*args, **kwargs)

        copier.host_to_device = held

    def held_load(self, engine_id: str, lock_id: int) -> Loader:
        """`ctl.load(engine_id, lock_id)` started on a thread, returned once its copy is
        held here."""
        loader = Loader(self.ctl, engine_id, lock_id)
        reached = self.reached
        loader.start()
        self.wait_reached(reached + 1)
        return loader

    def wait_reached(self, n: int, timeout_s: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.reached >= n, timeout_s), (
                f"{self.reached} of {n} copies reached the gate")

    def open(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        self.ctl.transfers.copier.host_to_device = self.original


def tree_l1_pages(ctl, kind: ComponentKind = ComponentKind.FULL) -> set[int]:  # type: ignore[no-untyped-def]
    """The L1 page ids of `kind` the tree owns."""
    with ctl._mu:
        out: set[int] = set()
        for node in ctl.tree.iter_nodes():
            ids = ctl.tree.pages_of(node, kind, Tier.DEVICE)
            if ids is not None:
                out |= {int(i) for i in ids if i >= 0}
        return out


def release_during_load(ctl, engine_id: str, lock_id: int) -> None:  # type: ignore[no-untyped-def]
    """A Load of `lock_id` held at its copy while its lock is released: the load ends
    NotFound ("released while its load was copying"); the copier restored."""
    gate = CopyGate(ctl)
    try:
        loader = gate.held_load(engine_id, lock_id)
        ctl.release(engine_id, lock_id, None)
        gate.open()
        with pytest.raises(NotFound, match="released while its load was copying"):
            loader.result()
    finally:
        gate.restore()


def session_request(ctl, eng: Engine, tokens: bytes, session_id: str = "s"):  # type: ignore[no-untyped-def]
    """One request of a session (match + allocation, write, insert), nothing reused
    assumed: the engine writes every page of `tokens`."""
    m = ctl.match(eng.id, MatchRequest(eng.ns, tokens, session_id=session_id, lock=True,
                                       allocate_tokens=len(tokens) // 4))
    eng.write(m.pages, tokens, 0)
    ctl.insert(eng.id, InsertRequest(eng.ns, tokens, lock_id=m.lock_id,
                                     allocation_id=m.allocation_id, session_id=session_id))
    return m


@contextlib.contextmanager
def failing_load(ctl, engine_id: str, lock_id: int) -> Iterator[Loader]:  # type: ignore[no-untyped-def]
    """A Load of `lock_id` held at its copy while the block runs, then failed by the
    injected copy error (checked); the copier restored whatever happens."""
    gate = CopyGate(ctl)
    gate.fail = True
    try:
        loader = gate.held_load(engine_id, lock_id)
        yield loader
        gate.open()
        try:
            loader.result()
        except OSError as e:
            assert "injected copy failure" in str(e), e
        else:
            raise AssertionError("the load did not fail")
    finally:
        gate.restore()


class Loader(threading.Thread):
    """Runs `ctl.load(engine, lock_id)` to its end on a thread; keeps the messages or
    the error, and when it started and ended."""

    def __init__(self, ctl, engine_id: str, lock_id: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.ctl, self.engine_id, self.lock_id = ctl, engine_id, lock_id
        self.messages: list = []
        self.error: BaseException | None = None
        self.started_at = self.ended_at = 0.0

    def run(self) -> None:
        self.started_at = time.monotonic()
        try:
            for msg in self.ctl.load(self.engine_id, self.lock_id):
                self.messages.append(msg)
        except BaseException as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def result(self, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
        self.join(timeout_s)
        assert not self.is_alive(), "load did not finish"
        if self.error is not None:
            raise self.error
        return self.messages
