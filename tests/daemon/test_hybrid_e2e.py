"""Hybrid models end to end: real daemons (`hicache serve` with FULL+SWA and FULL+SWA+MAMBA
geometries, sidecars on FULL, SWA and MAMBA) and the real engine client, which maps the L1
pools and writes deterministic bytes into every member, layer and page it is given (and
into the MAMBA slot). Every page a match, a load or a prefetch hands back is compared byte
for byte (SWA: the window before the boundary; MAMBA: the checkpoint at the boundary).

Each test uses its own token range, so tests sharing a daemon share no tree entries.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.client import Attachment, Client
from hicache.controller.base import MatchOutcome, PrefetchState

from .daemonkit import FULL_SWA_MAMBA, Daemon

PS = 4  # model.page_size of every daemon here
PB = PS * 4  # bytes of token ids per page
WINDOW_PAGES = 2
FULL_SWA = (
    "model.page_size=4",
    "model.components={full: {layers: 2, bytes_per_token_per_layer: 8},"
    " swa: {layers: 3, bytes_per_token_per_layer: 4, window_tokens: 8}}",
    "model.sidecars={idx: {anchor: full, layers: 1, bytes_per_token_per_layer: 2},"
    " swaside: {anchor: swa, layers: 2, bytes_per_token_per_layer: 4}}",
)
GEOMETRIES = {"full+swa": FULL_SWA, "full+swa+mamba": FULL_SWA_MAMBA}
# 16 L1 pages per paged pool, 8 MAMBA slots; L2 twice that.
SMALL = ("tiers.l1.tokens=64", "tiers.l1.mamba_slots=8", "prefetch.threshold_tokens=4",
         "prefetch.policy=wait_complete")
L1_PAGES = 16


def toks(n: int, start: int) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


class Engine:
    """An engine over the real client: writes KV that is a function of (the token prefix
    up to the page's end, member, layer) and checks every page it is handed."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.att: Attachment = client.attach()
        assert self.att.info.page_size == PS
        self.members = {m.name: m for m in self.att.info.members}
        self.mamba = {n for n, m in self.members.items() if m.component.value == "mamba"}
        self.checked: dict[str, int] = dict.fromkeys(self.members, 0)

    @staticmethod
    def pattern(key: bytes, member: str, layer: int, size: int) -> np.ndarray:
        seed = hashlib.sha256(key + b"\0" + member.encode() + bytes([layer])).digest()
        return np.frombuffer((seed * (size // 32 + 1))[:size], dtype=np.uint8).copy()

    def state_key(self, tokens: bytes, pages: int) -> bytes:
        return tokens[: pages * PB] + b"state"

    def write(self, pages: dict[str, np.ndarray], tokens: bytes, start: int,
              state_pages: int | None = None) -> None:
        """KV of token pages [start, start + len(ids)) into the given ids (a page past the
        tokens' whole pages is keyed by its partial prefix); MAMBA: the state after
        `state_pages` (default: every whole page)."""
        import torch

        whole = len(tokens) // PB
        for name in self.members:
            ids = pages[name]
            for layer, view in enumerate(self.att.pools[name]):
                if name in self.mamba:
                    assert len(ids) == 1, (name, ids)
                    key = self.state_key(tokens, whole if state_pages is None else state_pages)
                    view[int(ids[0])] = torch.from_numpy(self.pattern(key, name, layer, view.shape[1]))
                    continue
                for i, pid in enumerate(ids):
                    key = tokens[: (start + i + 1) * PB]
                    view[int(pid)] = torch.from_numpy(self.pattern(key, name, layer, view.shape[1]))

    def verify(self, pages: dict[str, np.ndarray], tokens: bytes, n_pages: int,
               window: bool = True) -> None:
        """The prefix of `n_pages` whole pages: FULL and its sidecars on every page, SWA and
        its sidecar exactly on the window before the boundary (-1 before it), MAMBA (and
        its sidecar) the checkpoint at the boundary."""
        assert set(pages) == set(self.members), (sorted(pages), sorted(self.members))
        for name, m in self.members.items():
            ids = pages[name]
            for layer, view in enumerate(self.att.pools[name]):
                if name in self.mamba:
                    if not n_pages:
                        assert len(ids) == 0, (name, ids)
                        continue
                    assert len(ids) == 1, (name, ids)
                    want = self.pattern(self.state_key(tokens, n_pages), name, layer, view.shape[1])
                    got = view[int(ids[0])].numpy()
                    assert np.array_equal(got, want), f"{name} layer {layer}: wrong checkpoint"
                    self.checked[name] += 1
                    continue
                assert len(ids) == n_pages, (name, len(ids), n_pages)
                if window and (m.component.value == "swa" or m.anchor.value == "swa"):
                    keep = min(WINDOW_PAGES, n_pages)
                    assert (ids[: n_pages - keep] == -1).all(), (name, ids)
                    assert (ids[n_pages - keep:] >= 0).all(), (name, ids)
                for i, pid in enumerate(ids):
                    if pid < 0:
                        continue
                    want = self.pattern(tokens[: (i + 1) * PB], name, layer, view.shape[1])
                    got = view[int(pid)].numpy()
                    assert np.array_equal(got, want), f"{name} page {i} layer {layer} wrong"
                    self.checked[name] += 1

    def slot_holds(self, slot: int, tokens: bytes, n_pages: int) -> None:
        """The MAMBA slot (and its sidecar's) holds the state after `n_pages` of `tokens`."""
        for name in self.mamba:
            for layer, view in enumerate(self.att.pools[name]):
                want = self.pattern(self.state_key(tokens, n_pages), name, layer, view.shape[1])
                assert np.array_equal(view[slot].numpy(), want), f"{name} slot {slot} layer {layer}"
                self.checked[name] += 1

    def load(self, m: MatchOutcome) -> tuple[int, dict[str, np.ndarray]]:
        """Load the L2 part of a locked match: per-layer progress, then the pages."""
        steps = list(self.c.load(m.lock_id))
        ready = [s.layers_ready for s in steps]
        total = max(mb.layers for mb in self.att.info.members if mb.component.value == "full")
        assert ready == sorted(ready) and ready[-1] == total, ready
        assert all(s.layers_total == total for s in steps)
        assert all(s.device_pages is None for s in steps[:-1])
        last = steps[-1]
        assert last.device_pages is not None and last.device_tokens is not None
        return last.device_tokens, last.device_pages

    def request(self, tokens: bytes, *, session_id: str = "", checkpoint: bool = True,
                expect_device: int | None = None, expect_host: int | None = None,
                two_step: bool = False) -> MatchOutcome:
        """One request's life: match (lock + allocation), verify what L1 holds, load what
        L2 holds (verified too), write the rest, insert (with a MAMBA checkpoint).
        `two_step`: match with a lock alone, load, then `Allocate(lock_id=)` what is left
        (an engine that allocates once it knows what the load brought)."""
        whole = len(tokens) // PB
        m = self.c.match(tokens, lock=True, session_id=session_id,
                         allocate_tokens=None if two_step else len(tokens) // 4)
        if expect_device is not None:
            assert m.device_tokens == expect_device, m
        if expect_host is not None:
            assert m.host_tokens == expect_host, m
        self.verify(m.device_pages, tokens, m.device_tokens // PS)
        reused = m.device_tokens
        if m.host_tokens:
            reused, pages = self.load(m)
            assert reused == m.device_tokens + m.host_tokens
            self.verify(pages, tokens, reused // PS)
        if two_step:
            a = self.c.allocate(len(tokens) // 4 - reused, lock_id=m.lock_id)
            alloc, alloc_id = a.pages, a.allocation_id
        else:
            skip = (reused - m.device_tokens) // PS  # loaded instead: not written
            alloc = {n: ids if n in self.mamba else ids[skip:] for n, ids in m.pages.items()}
            alloc_id = m.allocation_id
        if self.mamba and reused:
            # Copy-on-write: the allocation's slot starts as the reused checkpoint (for a
            # single-call request, the one at the match's device boundary).
            at = reused if two_step else m.device_tokens
            if at:
                self.slot_holds(int(alloc["mamba"][0]), tokens, at // PS)
        self.write(alloc, tokens, reused // PS)
        out = self.c.insert(tokens, lock_id=m.lock_id, allocation_id=alloc_id,
                            session_id=session_id, mamba_checkpoint=checkpoint)
        assert out.inserted_tokens + out.reused_tokens == whole * PS, out
        return m


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("hy"), *GEOMETRIES[request.param], *SMALL).start()
    yield d
    d.close()


def _hybrid(d: Daemon) -> bool:
    return any(" mamba: {" in s for s in d.sets)


# ----------------------------------------------------------------------------- L1 reuse


def test_a_second_request_reuses_every_member_byte_exact(shared: Daemon) -> None:
    hybrid = _hybrid(shared)
    a = toks(6 * PS, start=10_000)
    with shared.client(engine_id="life-w") as cw, shared.client(engine_id="life-r") as cr:
        writer, reader = Engine(cw), Engine(cr)
        writer.request(a, expect_device=0)
        # A second engine, the prefix plus two more pages and a partial one.
        b = a + toks(2 * PS + 1, start=90_000)
        reader.request(b, expect_device=6 * PS)
        assert reader.checked["full"] == 2 * 6 and reader.checked["idx"] == 6
        assert reader.checked["swa"] == 3 * WINDOW_PAGES and reader.checked["swaside"] == 2 * 2
        if hybrid:
            assert reader.checked["mamba"] == 2 * 2 and reader.checked["conv"] == 2
        # The reader's own state went into its private copy: the checkpoint is intact.
        with cr.matched(a) as again:
            assert again.device_tokens == 6 * PS
            reader.verify(again.device_pages, a, 6)
        with cr.matched(b) as whole:
            assert whole.device_tokens == 8 * PS  # the partial page is never reused
            reader.verify(whole.device_pages, b, 8)
        # A prefix ending inside the inserted span: FULL+SWA reuse it (the window is
        # there); a MAMBA model only at a checkpoint.
        with cr.matched(a[: 4 * PB] + toks(PS, start=1)) as inner:
            assert inner.device_tokens == (0 if hybrid else 4 * PS), inner
            reader.verify(inner.device_pages, a, inner.device_tokens // PS)
        assert cr.heartbeat().locks == 0 and cr.heartbeat().allocations == 0


# ----------------------------------------------------------------------------- L2 -> L1


def _fill(eng: Engine, start: int, n: int = 3, pages: int = 6) -> None:
    """`n` unrelated requests of `pages` pages each: pushes older entries out of L1."""
    for k in range(n):
        eng.request(toks(pages * PS, start=start + 1_000 * k))


def _load_back_from_l2(c: Client, eng: Engine, tokens: bytes, pages: int) -> None:
    """`tokens` (`pages` pages) are in L2 alone: a locked match, a Load, every page
    byte-exact."""
    m = c.match(tokens, lock=True)
    try:
        assert (m.device_tokens, m.host_tokens) == (0, pages * PS), m
        loaded, got = eng.load(m)
        assert loaded == pages * PS
        eng.verify(got, tokens, pages)
    finally:
        c.release(lock_id=m.lock_id)


def test_pages_evicted_to_l2_load_back_byte_exact(shared: Daemon) -> None:
    a = toks(6 * PS, start=20_000)
    with shared.client(engine_id="l2-load") as c:
        eng = Engine(c)
        eng.request(a)
        _fill(eng, 21_000)
        _load_back_from_l2(c, eng, a, 6)
        # Loaded pages stay in L1: a new match needs no load, and a request extending the
        # prefix writes only its own pages.
        b = a + toks(2 * PS, start=29_000)
        eng.request(b, expect_device=6 * PS, expect_host=0)
        with c.matched(b) as hit:
            assert hit.device_tokens == 8 * PS
            eng.verify(hit.device_pages, b, 8)
        assert eng.checked["full"] > 0 and eng.checked["swaside"] > 0


def test_a_checkpoint_evicted_alone_loads_back_with_its_prefix_in_l1(make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon(*FULL_SWA_MAMBA, *SMALL)
    a = toks(6 * PS, start=30_000)
    with d.client(engine_id="ckpt") as c:
        eng = Engine(c)
        eng.request(a)
        for k in range(9):  # one-page requests: 9 checkpoints for 8 slots, 15 FULL pages
            eng.request(toks(PS, start=31_000 + 100 * k))
        _load_back_from_l2(c, eng, a, 6)
        assert eng.checked["mamba"] and eng.checked["conv"]


# ----------------------------------------------------------------------------- L3


def _wait_prefetch(c: Client, prefetch_id: int, timeout_s: float = 10.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (info := c.prefetch_status(prefetch_id)).state is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, f"prefetch {prefetch_id} still running: {info}"
        time.sleep(0.01)
    assert info.tokens_ready == info.tokens_total, info
    return info.state


def _l3(path: Path, policy: str) -> tuple[str, ...]:
    return ("storage.backend=file", f"storage.file.path={path}", "storage.timeout_s=2",
            f"write.l2_to_l3={policy}")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_new_daemon_prefetches_every_member_and_checkpoint_from_l3(
        make_daemon: Callable[..., Daemon], tmp_path: Path, policy: str) -> None:
    l3 = tmp_path / "l3"
    a1 = toks(4 * PS, start=40_000)
    a2 = a1 + toks(4 * PS, start=41_000)
    first = make_daemon(*FULL_SWA_MAMBA, *SMALL, *_l3(l3, policy))
    with first.client(engine_id="l3-first") as c:
        eng = Engine(c)
        eng.request(a1)
        eng.request(a2, expect_device=4 * PS)
        written = c.flush(timeout_s=10)
        if policy == "write_back":  # nothing went down before the flush
            assert written > 0
    assert first.stop() == 0
    assert any(l3.rglob("*")), "nothing in L3"

    second = make_daemon(*FULL_SWA_MAMBA, *SMALL, *_l3(l3, policy))
    with second.client(engine_id="l3-second") as c:
        eng = Engine(c)
        # write_through: L1 all but full (an engine's running requests), the prefetch
        # stays in L2 and a load brings it; write_back: L1 is free, each batch follows
        # into it and the match finds it all in L1.
        held = (L1_PAGES - 1) * PS if policy == "write_through" else 1
        with c.allocation(held):
            m = c.match(a2, prefetch=True)
            assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 8 * PS), m
            assert m.prefetch_id and not m.lock_id
            assert _wait_prefetch(c, m.prefetch_id) is PrefetchState.DONE
        b = a2 + toks(PS, start=49_000)
        in_l1 = 0 if policy == "write_through" else 8 * PS
        hit = eng.request(b, expect_device=in_l1, expect_host=8 * PS - in_l1, two_step=True)
        with c.matched(a2) as again:
            assert again.device_tokens == 8 * PS
            eng.verify(again.device_pages, a2, 8)
        # The inner checkpoint (a1) and its window were not fetched: a prefetch of its own.
        inner = c.match(a1, prefetch=True)
        assert inner.device_tokens + inner.host_tokens + inner.storage_tokens == 4 * PS, inner
        if inner.prefetch_id:
            assert _wait_prefetch(c, inner.prefetch_id) is PrefetchState.DONE
        hit = eng.request(a1 + toks(PS, start=48_000), two_step=True)
        assert hit.device_tokens + hit.host_tokens == 4 * PS, hit
        assert eng.checked["mamba"] >= 2 and eng.checked["conv"] >= 2 and eng.checked["swaside"]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_a_prefix_written_back_to_l3_by_eviction_comes_back_byte_exact(
        make_daemon: Callable[..., Daemon], tmp_path: Path, geometry: str) -> None:
    d = make_daemon(*GEOMETRIES[geometry], *SMALL, *_l3(tmp_path / "l3", "write_back"))
    a = toks(6 * PS, start=50_000)
    with d.client(engine_id="l3-evict") as c:
        eng = Engine(c)
        eng.request(a)
        _fill(eng, 51_000, n=9)  # 54 pages through a 16-page L1 and a 32-page L2
        # The fillers' copies and write-backs land first: one landing after the prefetch
        # would evict its pages again (L2 is all but full of pages parked for their L3
        # writes, and the allocator goes on evicting until one frees at once).
        c.flush(timeout_s=10)
        m = c.match(a, prefetch=True)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 6 * PS), m
        assert m.prefetch_id
        assert _wait_prefetch(c, m.prefetch_id) is PrefetchState.DONE
        before = dict(eng.checked)
        hit = eng.request(a + toks(2 * PS, start=59_000), two_step=True)
        # (L1 is full of the fillers: the prefetch stayed in L2, the load brought it.)
        assert (hit.device_tokens, hit.host_tokens) == (0, 6 * PS), hit
        assert eng.checked["full"] - before["full"] == 2 * 6
        assert eng.checked["swa"] - before["swa"] == 3 * WINDOW_PAGES
        stats = c.stats().counters
        assert stats["prefetches_done"] >= 1 and stats["evictions_host"] > 0


# ----------------------------------------------------------------------------- sessions


def test_a_multi_turn_session_with_mid_request_inserts_and_decode_growth(shared: Daemon) -> None:
    hybrid = _hybrid(shared)
    sid = f"chat-{hybrid}"
    p1 = toks(3 * PS + 2, start=70_000)  # a prompt of 3.5 pages
    with shared.client(engine_id="session") as c:
        eng = Engine(c)
        m = c.match(p1, lock=True, allocate_tokens=len(p1) // 4, session_id=sid)
        assert m.device_tokens == 0 and all(len(ids) == 4 for n, ids in m.pages.items()
                                            if n not in eng.mamba)
        # Prefill (the state checkpointed at the last whole page), then a mid-request
        # insert that keeps the lock and the partial page.
        eng.write(m.pages, p1, 0, state_pages=3)
        out = c.insert(p1, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=sid,
                       keep_lock=True, mamba_checkpoint=True)
        assert (out.inserted_tokens, out.reused_tokens) == (3 * PS, 0)
        assert c.heartbeat().locks == 1 and c.heartbeat().allocations == 1
        # Decode: 6 tokens more (5 pages in all); the allocation grows by one page and
        # still holds the partial one, the grown one last.
        seq1 = p1 + toks(6, start=71_000)
        grown = c.allocate(PS, allocation_id=m.allocation_id)
        assert grown.allocation_id == m.allocation_id
        for name, ids in grown.pages.items():
            if name in eng.mamba:
                # The tree took a copy; the request goes on in its own slot.
                assert len(ids) == 1 and ids[0] == m.pages[name][0], (name, ids)
            else:
                assert len(ids) == 2 and ids[0] == m.pages[name][3], (name, ids)
        if hybrid:
            eng.slot_holds(int(grown.pages["mamba"][0]), p1, 3)
        eng.write(grown.pages, seq1, 3)
        # The committed prefix (and its checkpoint) is intact while the request decodes.
        with c.matched(p1) as mid:
            assert mid.device_tokens == 3 * PS
            eng.verify(mid.device_pages, p1, 3)
        out = c.insert(seq1, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=sid,
                       mamba_checkpoint=True)
        assert (out.inserted_tokens, out.reused_tokens) == (2 * PS, 3 * PS)
        assert c.heartbeat().locks == 0 and c.heartbeat().allocations == 0

        # Turn 2: the whole first turn is reused, from both of its boundaries.
        p2 = seq1 + toks(2 * PS, start=72_000)
        eng.request(p2, session_id=sid, expect_device=5 * PS)
        with c.matched(p2) as hit:
            assert hit.device_tokens == 7 * PS
            eng.verify(hit.device_pages, p2, 7)
        with c.matched(seq1[: 3 * PB] + toks(PS, start=1)) as inner:
            assert inner.device_tokens == 3 * PS  # the mid-request checkpoint
            eng.verify(inner.device_pages, p2, 3)

        refs = c.close_session(sid)
        assert refs >= 1
        assert c.close_session(sid) == refs  # idempotent
        with c.matched(p2) as kept:  # closing drops references, not data
            assert kept.device_tokens == 7 * PS
            eng.verify(kept.device_pages, p2, 7)
        assert c.heartbeat().locks == 0 and c.heartbeat().allocations == 0


def _whole_l1_is_free(c: Client) -> None:
    """Nothing leaked: an allocation of every L1 page (and a MAMBA slot) succeeds once
    everything unlocked is evicted (retried briefly: copies in flight hold pages)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            with c.allocation(L1_PAGES * PS) as a:
                assert all(len(ids) == (1 if n in ("mamba", "conv") else L1_PAGES)
                           for n, ids in a.pages.items())
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_concurrent_duplicate_prefills_and_a_request_without_checkpoint(shared: Daemon) -> None:
    hybrid = _hybrid(shared)
    p = toks(4 * PS, start=80_000)
    with shared.client(engine_id="dup-a") as ca, shared.client(engine_id="dup-b") as cb:
        ea, eb = Engine(ca), Engine(cb)
        # Both engines miss, both prefill the same prompt; A commits first.
        ma = ca.match(p, lock=True, allocate_tokens=len(p) // 4)
        mb = cb.match(p, lock=True, allocate_tokens=len(p) // 4)
        ea.write(ma.pages, p, 0)
        eb.write(mb.pages, p, 0)
        out = ca.insert(p, lock_id=ma.lock_id, allocation_id=ma.allocation_id, mamba_checkpoint=True)
        assert out.inserted_tokens == 4 * PS
        # B's mid-request insert finds it all there: B's pages stay with its allocation
        # (its block table still points at them) and still hold B's bytes.
        out = cb.insert(p, lock_id=mb.lock_id, allocation_id=mb.allocation_id, keep_lock=True,
                        mamba_checkpoint=True)
        assert (out.inserted_tokens, out.reused_tokens) == (0, 4 * PS)
        eb.verify({n: ids for n, ids in mb.pages.items() if n not in eb.mamba}
                  | ({"mamba": ma.pages["mamba"], "conv": ma.pages["conv"]} if hybrid else {}),
                  p, 4, window=False)
        grown = cb.allocate(PS, allocation_id=mb.allocation_id)
        if hybrid:  # B goes on in its own slot (the tree had A's checkpoint already)
            assert grown.pages["mamba"][0] == mb.pages["mamba"][0] != ma.pages["mamba"][0]
            eb.slot_holds(int(grown.pages["mamba"][0]), p, 4)
        seq = p + toks(PS, start=81_000)
        eb.write({n: ids[-1:] if n not in eb.mamba else ids for n, ids in grown.pages.items()}, seq, 4)
        out = cb.insert(seq, lock_id=mb.lock_id, allocation_id=mb.allocation_id, mamba_checkpoint=False)
        assert (out.inserted_tokens, out.reused_tokens) == (PS, 4 * PS)
        # Without a checkpoint at its end, a MAMBA model reuses only up to A's; the
        # FULL+SWA model the whole sequence.
        with ca.matched(seq + toks(PS, start=1)) as hit:
            assert hit.device_tokens == (4 if hybrid else 5) * PS, hit
            ea.verify(hit.device_pages, seq, hit.device_tokens // PS)
        assert ca.heartbeat().allocations == 0 and cb.heartbeat().allocations == 0
        _whole_l1_is_free(ca)


def test_l1_write_back_hybrid_pages_reach_l2_on_eviction_and_load_back(
        make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon(*FULL_SWA_MAMBA, *SMALL, "write.l1_to_l2=write_back")
    a = toks(6 * PS, start=85_000)
    with d.client(engine_id="l1-wb") as c:
        eng = Engine(c)
        eng.request(a)
        assert c.stats().counters["backups_host"] == 0  # nothing copied at insert
        _fill(eng, 86_000)
        eng.request(a + toks(PS, start=89_000), expect_device=0, expect_host=6 * PS)
        with c.matched(a) as again:
            assert again.device_tokens == 6 * PS
            eng.verify(again.device_pages, a, 6)
        assert eng.checked["mamba"] >= 4 and eng.checked["swaside"] >= 4
        _whole_l1_is_free(c)
