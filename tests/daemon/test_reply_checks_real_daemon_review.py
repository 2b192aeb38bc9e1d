"""Review of the client's reply checks (`hicache.reply_checks.ReplyBounds`, wired into
`Client.attach/match/allocate/load/batch`, and `tiers/device.py:_check_descriptor`) against
the REAL daemon's replies.

The checks were written against a fake daemon sending junk; a false positive (a legitimate
reply refused) is as bad as a miss: it breaks engines. Every test here drives a real
`hicache serve` through one family of legitimate reply shapes with the real
`hicache.client.Client` and requires that none is refused, and that the handles the
requests made are all given back (Heartbeat: locks and allocations 0).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.client import (
    Client,
    allocate_op,
    close_session_op,
    insert_op,
    match_op,
    release_op,
)
from hicache.controller.base import MatchOutcome, PrefetchState
from hicache.errors import FailedPrecondition, HicacheError, NotFound
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.reply_checks import ReplyBounds

from .daemonkit import FULL_SWA_MAMBA, Daemon

PS = 4  # page size of the hybrid geometry
PB = PS * 4
# 16 L1 pages per paged pool, 8 MAMBA slots (L2 twice that).
SMALL = ("tiers.l1.tokens=64", "tiers.l1.mamba_slots=8", "prefetch.threshold_tokens=4",
         "prefetch.policy=wait_complete")


def toks(n: int, start: int) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


def _l3(path: Path, policy: str = "write_through") -> tuple[str, ...]:
    return ("storage.backend=file", f"storage.file.path={path}", "storage.timeout_s=2",
            f"write.l2_to_l3={policy}")


def _idle(c: Client) -> None:
    hb = c.heartbeat()
    assert (hb.locks, hb.allocations) == (0, 0), hb


def _wait_prefetch(c: Client, prefetch_id: int, timeout_s: float = 10.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (info := c.prefetch_status(prefetch_id)).state is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, info
        time.sleep(0.01)
    return info.state


def _swa_holes(m: MatchOutcome) -> bool:
    return any((ids < 0).any() for ids in m.device_pages.values() if len(ids))


def _request(c: Client, tokens: bytes, *, session_id: str = "", checkpoint: bool = True,
             two_step: bool = False) -> MatchOutcome:
    """One request's life (match + allocation, load of the L2 part, insert)."""
    m = c.match(tokens, lock=True, session_id=session_id,
                allocate_tokens=None if two_step else len(tokens) // 4)
    reused = m.device_tokens
    if m.host_tokens:
        steps = list(c.load(m.lock_id))
        assert steps[-1].device_pages is not None
        reused = steps[-1].device_tokens
        assert reused == m.device_tokens + m.host_tokens
    alloc_id = m.allocation_id
    if two_step:
        alloc_id = c.allocate(max(1, len(tokens) // 4 - reused), lock_id=m.lock_id).allocation_id
    c.insert(tokens, lock_id=m.lock_id, allocation_id=alloc_id, session_id=session_id,
             mamba_checkpoint=checkpoint)
    return m


@pytest.fixture(scope="module")
def hy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("rc-hy"), *FULL_SWA_MAMBA, *SMALL).start()
    yield d
    d.close()


# ----------------------------------------------------------------------------- hybrid L1


def test_hybrid_match_shapes_in_l1_are_all_accepted(hy: Daemon) -> None:
    """SWA windows with -1 holes, MAMBA slots, sidecars on each anchor, a partial last
    page, a match with no checkpoint, allocate_tokens below the match, sessions."""
    a = toks(6 * PS, start=10_000)
    with hy.client(engine_id="rc-shapes") as c:
        att = c.attach()
        assert {p.member for p in att.info.pools} == {"full", "idx", "swa", "swaside",
                                                      "mamba", "conv"}
        _request(c, a, session_id="s1")
        b = a + toks(2 * PS + 1, start=90_000)  # a partial last page
        m = _request(c, b, session_id="s1")
        assert m.device_tokens == 6 * PS and _swa_holes(m), m
        assert len(m.device_pages["mamba"]) == 1 and len(m.device_pages["conv"]) == 1
        # allocate_tokens smaller than the match, and 0
        for want in (PS, 0, 1):
            m = c.match(b, lock=True, allocate_tokens=want)
            assert m.device_tokens == 8 * PS and m.allocation_id
            c.release(lock_id=m.lock_id)
            c.release(allocation_id=m.allocation_id)
        # no checkpoint at the end of an inner prefix: nothing reusable, FULL in the tree
        inner = c.match(a[: 4 * PB] + toks(PS, start=1), lock=True)
        assert inner.device_tokens == 0, inner
        if inner.lock_id:
            c.release(lock_id=inner.lock_id)
        # plain lookups, and a session's match
        assert c.match(b).device_tokens == 8 * PS
        with c.matched(b, session_id="s2") as again:
            assert again.device_tokens == 8 * PS
        c.close_session("s1")
        c.close_session("s2")
        _idle(c)


def test_keep_lock_mid_request_insert_then_growth_then_final_insert(hy: Daemon) -> None:
    """Prefill inserted mid-request (keep_lock, with a checkpoint), the allocation grown
    for decode (its reply: every page it still holds), matches in between, final insert."""
    prompt = toks(5 * PS + 2, start=20_000)
    with hy.client(engine_id="rc-keep") as c:
        c.attach()
        m = c.match(prompt, lock=True, allocate_tokens=len(prompt) // 4)
        assert m.device_tokens == 0 and len(m.pages["full"]) == 6
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                 mamba_checkpoint=True, keep_lock=True)
        grown = c.allocate(2 * PS, allocation_id=m.allocation_id)
        assert grown.allocation_id == m.allocation_id
        assert len(grown.pages["full"]) == 3, grown  # the partial page + 2 grown
        whole = prompt + toks(3 * PS - 2, start=29_000)
        again = c.match(whole, lock=True)
        assert again.device_tokens == 5 * PS, again
        c.release(lock_id=again.lock_id)
        grown = c.allocate(1, allocation_id=m.allocation_id)
        c.insert(whole, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
        _idle(c)


def test_a_batch_of_every_op_kind_is_answered_without_refusals(hy: Daemon) -> None:
    a = toks(3 * PS, start=30_000)
    with hy.client(engine_id="rc-batch") as c:
        c.attach()
        _request(c, a)
        b = a + toks(PS + 3, start=39_000)
        ops = [
            pb.BatchOp(attach=pb.AttachRequest(engine_id=c.engine_id, tp_rank=0, tp_size=1)),
            pb.BatchOp(heartbeat=pb.HeartbeatRequest(engine_id=c.engine_id)),
            match_op(b),  # no lock: makes nothing
            match_op(b, lock=True, allocate_tokens=len(b) // 4, session_id="bs"),
            match_op(toks(PS, start=38_000), lock=True),  # nothing matched: maybe no lock
            allocate_op(PS),
            pb.BatchOp(prefetch_status=pb.PrefetchStatusRequest(prefetch_id=123456)),
            pb.BatchOp(cancel_prefetch=pb.CancelPrefetchRequest(prefetch_id=123456)),
            pb.BatchOp(stats=pb.StatsRequest()),
            close_session_op("nobody"),
        ]
        out = c.batch(ops)
        bad = [r for r in out if isinstance(r, FailedPrecondition)]
        assert not bad, bad
        m = out[3]
        assert isinstance(m, MatchOutcome) and m.device_tokens == 3 * PS, out
        grown_and_more = c.batch([
            allocate_op(PS, allocation_id=out[5].allocation_id),
            allocate_op(2, lock_id=m.lock_id),
            insert_op(b, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="bs",
                      mamba_checkpoint=True),
        ])
        assert not [r for r in grown_and_more if isinstance(r, HicacheError)], grown_and_more
        releases = [release_op(allocation_id=out[5].allocation_id),
                    release_op(allocation_id=grown_and_more[1].allocation_id),
                    close_session_op("bs")]
        if out[4].lock_id:
            releases.append(release_op(lock_id=out[4].lock_id))
        assert not [r for r in c.batch(releases) if isinstance(r, HicacheError)]
        _idle(c)


# ----------------------------------------------------------------------------- L2 -> L1


def test_loads_of_whole_and_partial_l2_parts_are_accepted(make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon(*FULL_SWA_MAMBA, *SMALL)
    a = toks(4 * PS, start=40_000)
    ab = a + toks(4 * PS, start=41_000)
    shapes = set()
    with d.client(engine_id="rc-load") as c:
        c.attach()
        _request(c, a)
        _request(c, ab)
        for k in range(4):  # push older entries out of L1 (the probes make them hot again)
            _request(c, toks(6 * PS, start=42_000 + 1_000 * k))
            if k % 2 == 0:
                continue
            for probe in (a, ab):
                m = c.match(probe, lock=True)
                shapes.add((m.device_tokens, m.host_tokens))
                if m.host_tokens:
                    steps = list(c.load(m.lock_id))
                    assert steps[-1].device_tokens == m.device_tokens + m.host_tokens
                if m.lock_id:
                    c.release(lock_id=m.lock_id)
        # and a full request through a load, with and without an allocation first
        _request(c, ab + toks(PS, start=49_000), two_step=True)
        _idle(c)
    # a load of the L2 part behind an L1 part, and one of a match all in L2
    assert (4 * PS, 4 * PS) in shapes, sorted(shapes)


# ----------------------------------------------------------------------------- L3


@pytest.mark.parametrize("geometry", ["full", "hybrid"])
def test_l3_only_hits_and_prefetch_then_load_are_accepted(
        make_daemon: Callable[..., Daemon], tmp_path: Path, geometry: str) -> None:
    """`storage_tokens` alone (a new daemon over the L3 another one wrote), a prefetch
    (`prefetch=true`) then a Load of what it brought, and an allocation beside it."""
    sets = (*FULL_SWA_MAMBA, *SMALL) if geometry == "hybrid" else (
        "prefetch.threshold_tokens=64", "prefetch.policy=wait_complete")
    ps = PS if geometry == "hybrid" else 64
    l3 = tmp_path / "l3"
    a = toks(6 * ps, start=50_000)
    first = make_daemon(*sets, *_l3(l3))
    with first.client(engine_id="rc-l3-w") as c:
        c.attach()
        _request(c, a[: 3 * ps * 4])
        _request(c, a)
        c.flush(timeout_s=10)
    assert first.stop() == 0
    second = make_daemon(*sets, *_l3(l3))
    with second.client(engine_id="rc-l3-r") as c:
        c.attach()
        longer = a + toks(ps + 1, start=59_000)
        m = c.match(longer)  # a lookup: L3 only
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 6 * ps), m
        m = c.match(longer, lock=True, allocate_tokens=len(longer) // 4)
        assert m.storage_tokens == 6 * ps and m.allocation_id, m
        c.release(lock_id=m.lock_id)
        c.release(allocation_id=m.allocation_id)
        m = c.match(longer, prefetch=True, lock=True)
        assert m.prefetch_id and m.storage_tokens == 6 * ps, m
        assert _wait_prefetch(c, m.prefetch_id) is PrefetchState.DONE
        c.release(lock_id=m.lock_id)
        m = c.match(longer, lock=True, allocate_tokens=len(longer) // 4)
        assert m.device_tokens + m.host_tokens == 6 * ps, m
        if m.host_tokens:
            last = list(c.load(m.lock_id))[-1]
            assert last.device_tokens == 6 * ps
        c.insert(longer, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
        _idle(c)


# ----------------------------------------------------------------------------- geometries


@pytest.mark.parametrize("geometry", ["full", "hybrid"])
def test_tensor_parallel_ranks_each_attach_and_use_replies(
        make_daemon: Callable[..., Daemon], geometry: str) -> None:
    sets = (*FULL_SWA_MAMBA, *SMALL) if geometry == "hybrid" else ()
    ps = PS if geometry == "hybrid" else 64
    d = make_daemon(*sets, "model.tp_size=2")
    r0, r1 = d.client(engine_id="rc-tp"), d.client(engine_id="rc-tp")
    try:
        a0, a1 = r0.attach(tp_rank=0, tp_size=2), r1.attach(tp_rank=1, tp_size=2)
        assert set(a0.pools) == set(a1.pools) and a0.pools
        a = toks(5 * ps + 1, start=60_000)
        m = _request(r0, a)
        m = r1.match(a + toks(ps, start=69_000), lock=True, allocate_tokens=6 * ps)
        assert m.device_tokens == 5 * ps, m
        for name, ids in m.pages.items():  # each rank writes its shard through its view
            for view in a1.pools[name]:
                view[ids] = 7
        r0.insert(a + toks(ps, start=69_000), lock_id=m.lock_id, allocation_id=m.allocation_id,
                  mamba_checkpoint=True)
        _idle(r0)
    finally:
        r0.close()
        r1.close()


FULL_SWA = (
    "model.page_size=4",
    "model.components={full: {layers: 2, bytes_per_token_per_layer: 8},"
    " swa: {layers: 3, bytes_per_token_per_layer: 4, window_tokens: 8}}",
    "model.sidecars={idx: {anchor: full, layers: 3, bytes_per_token_per_layer: 2},"
    " swaside: {anchor: swa, layers: 2, bytes_per_token_per_layer: 4}}",
)


@pytest.mark.parametrize("page", [1, 4, 256])
def test_page_size_one_and_large_pages(make_daemon: Callable[..., Daemon], page: int) -> None:
    """page 1 (hybrid, every id a token), page 4 FULL+SWA with a FULL sidecar of more
    layers than FULL (Load's layers_total), page 256 FULL."""
    if page == 1:
        d = make_daemon(*FULL_SWA_MAMBA, *SMALL, "model.page_size=1")
    elif page == 4:
        d = make_daemon(*FULL_SWA, *SMALL)
    else:
        d = make_daemon(f"model.page_size={page}", "tiers.l1.tokens=4096")
    with d.client(engine_id="rc-page") as c:
        att = c.attach()
        assert att.info.page_size == page
        a = toks(5 * page, start=70_000)
        _request(c, a)
        b = a + toks(2 * page + (page // 2 if page > 1 else 0), start=79_000)
        m = _request(c, b)
        assert m.device_tokens == 5 * page, m
        with c.matched(b, allocate_tokens=1) as again:
            assert again.device_tokens == 7 * page
            assert not again.host_tokens or list(c.load(again.lock_id))[-1].device_pages
        for k in range(4):  # evict b's tail to L2, then load it back behind its L1 head
            _request(c, toks(5 * page, start=71_000 + 1_000 * k))
        m = c.match(b, lock=True)
        if m.host_tokens:
            steps = list(c.load(m.lock_id))
            assert steps[-1].device_tokens == m.device_tokens + m.host_tokens
        c.release(lock_id=m.lock_id)
        _idle(c)


def test_the_shortest_lease_a_daemon_gives_is_accepted(make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon("server.lease_ms=100")
    with d.client(engine_id="rc-lease") as c:
        # (no pools mapped: a first torch import would hold this process past the lease)
        assert c.attach(map_pools=False).info.lease_ms == 100
        assert c.heartbeat().lease_ms == 100
        for attempt in range(3):
            try:
                _request(c, toks(2 * 64, start=75_000))
                break
            except (NotFound, FailedPrecondition):  # (a 70 ms stall here lapses the lease)
                assert attempt < 2
                c.attach(map_pools=False)
        _idle(c)


def test_a_client_that_maps_no_pools_gets_every_reply(hy: Daemon) -> None:
    a = toks(4 * PS, start=80_000)
    with hy.client(engine_id="rc-nomap") as c:
        att = c.attach(map_pools=False)
        assert not att.pools
        _request(c, a)
        m = _request(c, a + toks(PS + 2, start=89_000))
        assert m.device_tokens == 4 * PS and _swa_holes(m)
        _idle(c)


def test_bounds_follow_a_reattach_after_a_restart_with_another_geometry(
        make_daemon: Callable[..., Daemon]) -> None:
    """The first run: page 64, 16 L1 pages; the second: the hybrid model at page 4, 256
    L1 pages (ids past the old pools, counts not whole old pages); then back."""
    runs = [(), (*FULL_SWA_MAMBA, "tiers.l1.tokens=1024", "tiers.l1.mamba_slots=8"), ()]
    with Client(f"unix://{make_daemon(start=False).socket}", engine_id="rc-restart",
                retries=3) as c:
        for k, sets in enumerate(runs):
            d = make_daemon(*sets)
            att = c.attach()
            ps = att.info.page_size
            # fill past the old pool's pages (the second run's ids go past 16)
            for j in range(6):
                a = toks(3 * ps, start=100_000 * (k + 1) + 1_000 * j)
                _request(c, a)
            m = c.match(a + toks(ps + 1, start=5), lock=True, allocate_tokens=5 * ps)
            assert m.device_tokens == 3 * ps, m
            c.release(lock_id=m.lock_id)
            c.release(allocation_id=m.allocation_id)
            _idle(c)
            assert d.stop() == 0


# ----------------------------------------------------------------------------- refusals




def test_a_refused_reply_releases_exactly_what_it_made(hy: Daemon) -> None:
    a = toks(4 * PS, start=110_000)
    with hy.client(engine_id="rc-refused") as c:
        att = c.attach()
        _request(c, a)
        keep = c.allocate(PS)  # held across the refusals: must stay held
        info = att.info
        pools = tuple(dataclasses.replace(p, num_pages=1) for p in info.pools)
        good, c._bounds = c._bounds, ReplyBounds(dataclasses.replace(info, pools=pools))
        with pytest.raises(FailedPrecondition):
            c.match(a, lock=True, allocate_tokens=6 * PS)
        with pytest.raises(FailedPrecondition):
            c.allocate(3 * PS)
        with pytest.raises(FailedPrecondition):
            c.allocate(3 * PS, allocation_id=keep.allocation_id)  # growth: nothing new made
        out = c.batch([match_op(a, lock=True, allocate_tokens=6 * PS), allocate_op(2 * PS)])
        assert all(isinstance(r, FailedPrecondition) for r in out), out
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 1), hb
        c._bounds = good
        c.release(allocation_id=keep.allocation_id)
        _idle(c)


def test_the_checks_cost_little(hy: Daemon) -> None:
    """2,000 matches of an 8-page hybrid prompt with and without the checks (reported,
    not asserted)."""
    a = toks(8 * PS + 1, start=120_000)
    with hy.client(engine_id="rc-cost") as c:
        c.attach()
        _request(c, a)
        bounds = c._bounds
        assert bounds is not None
        times = {"with": [], "without": []}
        for _ in range(2):
            for name, b in (("with", bounds), ("without", None)):
                c._bounds = b
                t0 = time.perf_counter()
                for _ in range(2000):
                    c.match(a)
                times[name].append(time.perf_counter() - t0)
        c._bounds = bounds
        m = c.match(a)
        t0 = time.perf_counter()
        for _ in range(2000):
            bounds.match(m, len(a) // 4)
        alone = time.perf_counter() - t0
        best = {k: min(v) for k, v in times.items()}
        print(f"\n2000 client.match (best of 2): with checks {best['with']:.3f} s, without "
              f"{best['without']:.3f} s (all: {times}); ReplyBounds.match alone "
              f"{alone * 1e6 / 2000:.1f} us/call")
        _idle(c)
