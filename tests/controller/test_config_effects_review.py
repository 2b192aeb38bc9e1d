"""Review: every configuration key takes the effect the README's configuration reference
says, on real components (an in-process controller, a real redis-server).

Keys whose effect other files already pin are left to them (`prefetch_fraction`,
`max_open_sessions`, `closed_session_tombstones`, the L1->L2 batch keys, `capacity_gb`,
`file.threads`, `lease_ms`, `max_tokens_per_request`, `reserve_gb`). Here: the Redis
backend's `batch`, `pool_size` and `storage.timeout_s`; `write.selective_threshold` at
values other than the default; the `prefetch.timeout_*` formula; how `tiers.l1.size_gb`,
`tiers.l1.mamba_slots`, `tiers.l2.ratio` and `tiers.l2.size_gb` size the pools.

A strict xfail is a key whose effect differs from the README's words (fails now, passes
once fixed).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from engine_sim import Engine, evict_all, flushed, seq, wait_prefetch

from hicache.config import OS_PAGE, GiB, RedisStorageConfig, StorageConfig
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.errors import BackendUnavailable
from hicache.tiers.storage import PutStatus, build_backend
from hicache.types import ComponentKind, StorageBackendName, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers" / "storage"))
from storage_pages import Pool, keys

FULL, MAMBA = ComponentKind.FULL, ComponentKind.MAMBA


# --------------------------------------------------------------------------- helpers


def _redis_backend(url: str, *, batch: int = 256, pool_size: int = 8, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    cfg = StorageConfig(backend=StorageBackendName.REDIS, timeout_s=timeout_s,
                        redis=RedisStorageConfig(url=url, batch=batch, pool_size=pool_size))
    return build_backend(cfg)


class _PipelineSizes:
    """Records the commands of every redis-py pipeline sent (one round trip each)."""

    def __init__(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.sizes: list[int] = []
        self._mu = threading.Lock()
        real = redis.client.Pipeline.execute
        outer = self

        def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            with outer._mu:
                outer.sizes.append(len(self.command_stack))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(redis.client.Pipeline, "execute", execute)

    def take(self) -> list[int]:
        with self._mu:
            out, self.sizes = sorted(self.sizes, reverse=True), []
        return out


def _where(ctl, tokens: bytes) -> tuple[bool, bool, bool]:  # type: ignore[no-untyped-def]
    """(L1, L2, L3) residency of the FULL slot of every node on `tokens`' path (no hit)."""
    with ctl._mu:
        tree = ctl.tree
        path = tree._walk(tree._roots.get(""), tokens, len(tokens))
        assert sum(n.npages for n in path) == len(tokens) // 16
        return tuple(all(tree.is_resident(n, FULL, t) for n in path)  # type: ignore[return-value]
                     for t in (Tier.DEVICE, Tier.HOST, Tier.STORAGE))


# --------------------------------------------------------------------------- storage.redis.batch


def test_redis_batch_above_64_is_the_keys_per_round_trip_of_gets_and_puts(redis_server, monkeypatch) -> None:
    backend = _redis_backend(redis_server.url, batch=256)
    try:
        pipes = _PipelineSizes(monkeypatch)
        n = 200
        pool, ks = Pool(n, payload=256), keys(n)
        assert set(backend.put_from(ks, pool.slots())) == {PutStatus.STORED}
        puts = pipes.take()
        out = Pool(n, payload=256, seed=None)
        statuses = backend.get_into(ks, out.slots())
        gets = pipes.take()
        assert all(s.value == "hit" for s in statuses)
        assert (puts, gets) == ([n], [n]), "one pipeline of `batch` (256) keys holds all 200"
    finally:
        backend.close(2)


def test_redis_batch_below_64_cuts_gets_puts_and_existence_checks(redis_server, monkeypatch) -> None:
    """batch 8: every pipeline of a get or a put carries at most 8 keys (25 round trips for
    200), and an existence check of 200 present keys asks in `batch`-key EXISTS rounds."""
    backend = _redis_backend(redis_server.url, batch=8)
    try:
        pipes = _PipelineSizes(monkeypatch)
        n = 200
        pool, ks = Pool(n, payload=256), keys(n)
        backend.put_from(ks, pool.slots())
        assert pipes.take() == [8] * 25
        backend.get_into(ks, Pool(n, payload=256, seed=None).slots())
        assert pipes.take() == [8] * 25
        exists: list[int] = []
        real = backend.client.exists

        def counted(*names):  # type: ignore[no-untyped-def]
            exists.append(len(names))
            return real(*names)

        monkeypatch.setattr(backend.client, "exists", counted)
        assert backend.exists_prefix(ks) == n
        assert max(exists) == 8 and sum(exists) == n
    finally:
        backend.close(2)


# --------------------------------------------------------------------------- storage.redis.pool_size


def test_redis_pool_size_bounds_the_connections_of_concurrent_calls(redis_server) -> None:
    """pool_size 2: six threads getting and checking at once never hold more than two
    connections to the server (the pool waits, within storage.timeout_s)."""
    backend = _redis_backend(redis_server.url, batch=16, pool_size=2, timeout_s=10.0)
    monitor = redis.Redis.from_url(redis_server.url)
    before = int(monitor.info("clients")["connected_clients"])
    stop = threading.Event()
    peak = [0]
    errors: list[BaseException] = []

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], int(monitor.info("clients")["connected_clients"]) - before)
            time.sleep(0.001)

    n = 150
    ks = keys(n)
    try:
        backend.put_from(ks, Pool(n, payload=256).slots())

        def work() -> None:
            try:
                out = Pool(n, payload=256, seed=None)
                for _ in range(3):
                    assert all(s.value == "hit" for s in backend.get_into(ks, out.slots()))
                    assert backend.exists_prefix(ks) == n
            except BaseException as e:  # (reported below)
                errors.append(e)

        watcher = threading.Thread(target=watch)
        watcher.start()
        workers = [threading.Thread(target=work) for _ in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        stop.set()
        watcher.join(10)
        assert not errors, errors
        assert 1 <= peak[0] <= 2, f"{peak[0]} connections with pool_size 2"
    finally:
        stop.set()
        monitor.close()
        backend.close(2)


# --------------------------------------------------------------------------- storage.timeout_s


def test_storage_timeout_s_bounds_gets_and_puts_of_a_hung_redis(redis_factory) -> None:
    """timeout_s 0.5 and a redis-server that stopped answering (SIGSTOP): a many-chunk get
    and put each fail as BackendUnavailable within about the timeout, not a multiple."""
    server = redis_factory()
    backend = _redis_backend(server.url, batch=16, timeout_s=0.5)
    n = 200
    ks = keys(n)
    backend.put_from(ks, Pool(n, payload=256).slots())
    pid = server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for call in (lambda: backend.get_into(ks, Pool(n, payload=256, seed=None).slots()),
                     lambda: backend.put_from(keys(n), Pool(n, payload=256).slots())):
            t0 = time.monotonic()
            with pytest.raises(BackendUnavailable):
                call()
            # (13 chunks: a timeout per chunk would take 6.5 s)
            assert time.monotonic() - t0 < 3.0, "a call outlived storage.timeout_s"
    finally:
        os.kill(pid, signal.SIGCONT)
        backend.close(2)


# --------------------------------------------------------------------------- write.selective_threshold


@pytest.mark.parametrize("threshold", [1, 3])
@pytest.mark.parametrize("tier", ["l1_to_l2", "l2_to_l3"])
def test_selective_threshold_is_the_hits_before_a_node_goes_down(make, threshold: int, tier: str) -> None:
    """`write_through_selective` backs a node up at its `threshold`-th hit, not before
    (an insert is no hit), for L1->L2 and for L2->L3 alike."""
    if tier == "l1_to_l2":
        ctl = make(write__l1_to_l2="write_through_selective", write__l2_to_l3="write_back",
                   write__selective_threshold=threshold)
        level = 1
    else:
        ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through_selective",
                   write__selective_threshold=threshold)
        level = 2
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request(tokens)
    assert ctl.transfers.drain(10)
    seen = [_where(ctl, tokens)[level]]
    for _ in range(threshold):
        ctl.match("e1", MatchRequest("", tokens))
        assert ctl.transfers.drain(10)  # (L1->L2 copies, then L3 writes, landed)
        seen.append(_where(ctl, tokens)[level])
    assert seen == [False] * threshold + [True]


# --------------------------------------------------------------------------- prefetch.timeout_*


@pytest.mark.parametrize(("max_s", "want"), [(50.0, 1.0 + 100.0 * 40 / 1024), (3.0, 3.0)])
def test_prefetch_deadline_is_the_readme_formula(make, max_s: float, want: float) -> None:
    """deadline = min(timeout_max_s, timeout_base_s + timeout_per_ki_token_s x tokens / 1024)
    for the 40 tokens a prefetch fetches, from the match that starts it."""
    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               prefetch__policy="timeout", prefetch__timeout_base_s=1.0,
               prefetch__timeout_per_ki_token_s=100.0, prefetch__timeout_max_s=max_s)
    eng = Engine(ctl)
    tokens = seq(10)
    eng.request(tokens)
    flushed(ctl, tokens)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    t0 = time.monotonic()
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    t1 = time.monotonic()
    assert m.storage_tokens == 40 and m.prefetch_id
    op = ctl.prefetcher.get(m.prefetch_id)
    assert op is not None and op.deadline is not None
    assert t0 + want - 1e-6 <= op.deadline <= t1 + want + 1e-6
    assert wait_prefetch(ctl, m.prefetch_id) is PrefetchState.DONE
    ctl.release("e1", m.lock_id, None)


# --------------------------------------------------------------------------- tier sizes


def test_l1_mamba_slots_and_l2_ratio_size_the_pools(make) -> None:
    """mamba_slots 5, ratio 2.5, 256 L1 tokens of page 4: L1 holds 64 pages and 5 slots,
    L2 ceil(2.5 x 64) = 160 pages and ceil(2.5 x 5) = 13 slots, for every member."""
    ctl = make(hybrid=True, tiers__l1__mamba_slots=5, tiers__l2__ratio=2.5)
    assert ctl.device.allocator(MAMBA).total == 5
    assert ctl.host.allocator(MAMBA).total == math.ceil(2.5 * 5)
    assert ctl.device.allocator(FULL).total == 64
    assert ctl.host.allocator(FULL).total == 160
    for m in ctl.cfg.model.members:
        assert ctl.device.num_pages(m.component) == (5 if m.component is MAMBA else 64)


def test_l1_size_gb_overrides_tokens_mamba_slots_first(make) -> None:
    """size_gb 64 KiB for all L1 pools: MAMBA's 16 slots first (16 x 160 bytes), the rest
    split into pages of every token pool (144 bytes a page): 437 pages, whatever `tokens`
    says, and the segments together within the budget."""
    budget = 64 * 1024
    ctl = make(hybrid=True, tiers__l1__size_gb=budget / GiB, tiers__l1__tokens=4,
               tiers__l2__size_gb=1 / 1024)
    members = ctl.cfg.model.members
    token_bytes = sum(m.bytes_per_page for m in members if m.component is not MAMBA)
    slot_bytes = sum(m.bytes_per_page for m in members if m.component is MAMBA)
    assert (token_bytes, slot_bytes) == (144, 160)
    assert ctl.device.allocator(MAMBA).total == 16
    assert ctl.device.allocator(FULL).total == (budget - 16 * slot_bytes) // token_bytes == 437
    assert sum(p.stat().st_size for p in ctl.device.segment_paths()) <= budget


def test_l2_size_gb_overrides_ratio_and_fits_its_budget(make) -> None:
    """size_gb 1 MiB for all L2 pools (page_first with an L3: each page's 64-byte header
    and padding count, and each member's region starts on an OS page): every pool the
    same number of entries, the buffer within 1 MiB, one more page per pool would not
    have fitted."""
    budget = 1 << 20
    ctl = make(hybrid=True, tiers__l2__size_gb=budget / GiB, tiers__l2__ratio=100)
    pages = ctl.host.allocator(FULL).total
    assert ctl.host.allocator(MAMBA).total == pages
    assert ctl.host.buffer_size <= budget
    slots = [ctl.host.slot_bytes(m) for m in ctl.cfg.model.members]
    assert all(s % 64 == 0 and s >= 64 + m.bytes_per_page for s, m in zip(slots, ctl.cfg.model.members, strict=True))
    assert sum(-(-(pages + 1) * s // OS_PAGE) * OS_PAGE for s in slots) > budget
