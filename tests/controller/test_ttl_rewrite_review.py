"""Review of the day's two changes: Redis's `batch` as its pipeline chunk, and an L3 record
half a TTL old (`storage.redis.ttl_s`) written again when a request's write-through path
goes through it (`Node.stored_at`, `slots_for_storage(node, stale_before)`,
`storage_renewed`, `Transfers._maybe_l3`).

In-process controllers (`engine_sim`: the engine writes and checks KV byte for byte) on a
private redis-server. TTLs are whole seconds: the tests that need an object to expire wait
for it (2 s); the ones that only need a record to be stale age it (`stored_at`). Strict
xfails pin bugs found in this review.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from engine_sim import Engine, built_controllers, evict_all, prefetch_back, redis_kw, seq, tree_path

from hicache.config import RedisStorageConfig, StorageConfig
from hicache.controller.base import MatchRequest
from hicache.tiers.storage import PutStatus, build_backend
from hicache.tiers.storage.base import GetStatus
from hicache.types import ComponentKind, StorageBackendName, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


@pytest.fixture
def make(tmp_path) -> Iterator[Callable[..., Any]]:
    with built_controllers(tmp_path, prefix="ttl") as factory:
        yield factory


def _poll(cond: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _age(ctl: Any, tokens: bytes) -> None:
    """Make the L3 records of `tokens`' path as old as the process (stale for any TTL)."""
    with ctl._mu:
        for node in tree_path(ctl, tokens):
            node.stored_at = 0.0


def _counters(ctl: Any) -> tuple[int, int]:
    c = ctl.stats().counters
    return c["backups_l3"], c["backups_l3_present"]


# ------------------------------------------------------------------ bugs


def _evict_pages(ctl: Any, tier: Tier, n: int) -> None:
    """Evict `n` FULL pages from `tier` (leaves first: a path's tail before its head)."""
    assert ctl.transfers.drain(10)
    with ctl._mu:
        ctl.transfers._evict(tier, FULL, n)


@pytest.mark.timeout(60)
def test_a_stale_head_held_in_l1_only_is_written_again_under_a_longer_prompt(
        make: Callable[..., Any], redis_factory: Callable[[], Any]) -> None:
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    kw = redis_kw(server.url, 2, write__l1_to_l2="write_back")
    a, c = make(**kw), make(**kw)
    head, longer = seq(4, 2000), seq(4, 2000) + seq(4, 8000)
    ea = Engine(a, "a")
    ea.request(head)
    evict_all(a, Tier.DEVICE)  # write-back: L2, then written through to L3
    assert a.transfers.drain(10)
    assert r.dbsize() == 4
    ea.request(head)  # loaded back into L1
    evict_all(a, Tier.HOST)  # L2 needed the room: the head stays in L1 (and L3)
    _poll(lambda: r.dbsize() == 0, what="the head to expire")
    m = ea.request(longer)
    assert m.device_tokens == 16  # the head from L1
    _evict_pages(a, Tier.DEVICE, 4)  # the tail leaves L1: L2, then L3
    assert a.transfers.drain(10)
    assert r.dbsize() == 8  # the head written again (staged through L2), and the tail
    got = c.match("c", MatchRequest("", longer))
    # Was 0: L3 held the tail's 4 objects only, the head never written again.
    assert got.storage_tokens == 32, (got.storage_tokens, r.dbsize())
    r.close()


@pytest.mark.timeout(60)
def test_a_flush_writes_a_stale_head_again_with_its_new_tail(
        make: Callable[..., Any], redis_factory: Callable[[], Any]) -> None:
    server = redis_factory()
    r = redis.Redis.from_url(server.url)
    kw = redis_kw(server.url, 2, write__l2_to_l3="write_back")
    a, c = make(**kw), make(**kw)
    head, longer = seq(4, 2000), seq(4, 2000) + seq(4, 8000)
    ea = Engine(a, "a")
    ea.request(head)
    evict_all(a, Tier.HOST)  # write-back: the head goes to L3 as it leaves L2
    assert a.transfers.drain(10)
    assert r.dbsize() == 4
    _poll(lambda: r.dbsize() == 0, what="the head to expire")
    ea.request(longer)  # head in L1; the write-through copy puts head and tail in L2
    assert a.transfers.drain(10)
    with a._mu:
        first = tree_path(a, longer)[0]
        assert a.tree.is_resident(first, FULL, Tier.HOST)  # L2 holds the stale head
        assert a.tree.is_resident(first, FULL, Tier.STORAGE)
    a.flush(10)
    assert r.dbsize() >= 4  # the tail went down
    got = c.match("c", MatchRequest("", longer))
    # Was 0: the flush wrote the tail's 4 objects only.
    assert got.storage_tokens == 32, (got.storage_tokens, r.dbsize())
    r.close()


# ------------------------------------------------------------------ pinned behaviour


def _pttls(r: redis.Redis) -> list[int]:
    ks = sorted(r.keys("*"))
    pipe = r.pipeline(transaction=False)
    for k in ks:
        pipe.pttl(k)
    return [int(v) for v in pipe.execute()]


@pytest.mark.timeout(60)
def test_a_stale_hybrid_record_is_renewed_whole_once_and_counted_present(
        make: Callable[..., Any], redis_server: Any) -> None:
    """FULL+SWA+MAMBA with indexer and conv sidecars: a stale record's rewrite renews every
    object of the node (FULL, sidecars, SWA window, checkpoint), counts its FULL pages in
    `backups_l3_present` once (none stored), refuses no landing, and the next request
    through it writes nothing."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    a = make(hybrid=True, **redis_kw(redis_server.url, 30))
    prompt = seq(6, 100)
    ea = Engine(a, "a")
    ea.request(prompt)
    assert a.transfers.drain(10)
    assert _counters(a) == (6, 0)
    n_keys = r.dbsize()
    assert n_keys == 20  # 6 x (full, indexer, swa) + the checkpoint's mamba and conv
    time.sleep(1.1)
    before = max(_pttls(r))
    assert before < 29_000
    _age(a, prompt)
    ea.request(prompt)
    assert a.transfers.drain(10)
    assert _counters(a) == (6, 6)
    assert r.dbsize() == n_keys
    assert min(_pttls(r)) > before + 500, "every object of the node renewed"
    c = a.stats().counters
    assert (c["l2_landings_refused"], c["backups_l3_failed"], c["backups_dropped"]) == (0, 0, 0)
    ea.request(prompt)
    assert a.transfers.drain(10)
    assert _counters(a) == (6, 6)
    r.close()


@pytest.mark.timeout(60)
def test_a_stale_record_with_an_swa_tail_is_rewritten_once_without_a_refused_landing(
        make: Callable[..., Any], redis_server: Any) -> None:
    """A node whose SWA slot is a tail (partial, never recorded in L3): its stale record's
    rewrite offers the tail too, lands without `InvalidArgument`, and is not repeated."""
    redis.Redis.from_url(redis_server.url).flushall()
    a = make(hybrid=True, **redis_kw(redis_server.url, 30))
    prompt = seq(6, 300)
    ea = Engine(a, "a")
    end = ea.insert_with_swa_tail(prompt, 2)
    assert a.transfers.drain(10)
    with a._mu:
        assert a.tree.is_resident(end, FULL, Tier.STORAGE)
        assert not a.tree.is_resident(end, SWA, Tier.STORAGE)
    assert _counters(a) == (6, 0)
    _age(a, prompt)
    for _ in range(3):
        ea.request(prompt)
        assert a.transfers.drain(10)
    assert _counters(a) == (6, 6)
    assert a.stats().counters["l2_landings_refused"] == 0
    with a._mu:
        assert not a.tree.is_resident(end, SWA, Tier.STORAGE)


@pytest.mark.timeout(60)
def test_a_stale_record_split_while_its_rewrite_is_queued(
        make: Callable[..., Any], redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A match splits the node whose rewrite waits in the L3 worker: the rewrite lands (the
    tail renewed, nothing refused), the bytes stay right, and the head's record is renewed
    with it (both halves fresh, nothing written twice)."""
    import threading

    redis.Redis.from_url(redis_server.url).flushall()
    a = make(**redis_kw(redis_server.url, 30))
    prompt = seq(6, 700)
    ea = Engine(a, "a")
    ea.request(prompt)
    assert a.transfers.drain(10)
    assert _counters(a) == (6, 0)
    gate, reached = threading.Event(), threading.Event()
    real = a.l3.backend._write_from

    def held(keys, buffers):  # type: ignore[no-untyped-def]
        reached.set()
        assert gate.wait(10)
        return real(keys, buffers)

    monkeypatch.setattr(a.l3.backend, "_write_from", held)
    _age(a, prompt)
    ea.request(prompt)
    assert reached.wait(10)
    Engine(a, "b").request(seq(3, 700) + seq(2, 9000))  # splits the node after page 3
    gate.set()
    assert a.transfers.drain(10)
    monkeypatch.setattr(a.l3.backend, "_write_from", real)
    with a._mu:
        head, tail = tree_path(a, prompt)
        assert (head.npages, tail.npages) == (3, 3)
        assert tail.stored_at > 0.0
    assert a.stats().counters["l2_landings_refused"] == 0
    for _ in range(2):
        ea.request(prompt)  # verifies every reused page
        assert a.transfers.drain(10)
    stored, present = _counters(a)
    assert stored == 6 + 2  # b's new tail
    # The rewrite (6) only: it renews the head split off it too (the split copied the
    # record's old age to the head; its objects were written again once more before
    # session 27's review: a wasted write).
    assert present == 6
    with a._mu:
        assert not a.tree.slots_for_storage(head, time.monotonic() - 15)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["redis-no-ttl", "file"])
def test_no_ttl_means_no_record_is_ever_written_again(
        make: Callable[..., Any], redis_server: Any, store: str) -> None:
    """`ttl_s: null`, or a store that does not expire objects (file; a `ttl_s` under
    `storage.redis` does not apply to it): records however old are never written again."""
    redis.Redis.from_url(redis_server.url).flushall()
    if store == "file":
        a = make(storage__redis={"url": redis_server.url, "ttl_s": 2},
                 write__l1_to_l2="write_through", write__l2_to_l3="write_through", l1_tokens=512)
        assert a.l3.object_ttl_s is None
    else:
        a = make(**redis_kw(redis_server.url, None))
    prompt = seq(5, 40_000 + (store == "file") * 1000)
    ea = Engine(a, "a")
    ea.request(prompt)
    assert a.transfers.drain(10)
    written = _counters(a)
    assert written[0] == 5
    for _ in range(3):
        _age(a, prompt)
        ea.request(prompt)
        ea.request(prompt + seq(1, 90_000))
        assert a.transfers.drain(10)
    stored, present = _counters(a)
    assert present == written[1]
    assert stored == written[0] + 1


@pytest.mark.timeout(60)
def test_a_prefetch_landing_records_a_fresh_l3_copy(
        make: Callable[..., Any], redis_server: Any) -> None:
    """Pages read back from L3 (a read renews their TTL) are recorded as just renewed: the
    next request's write-through path does not write them again."""
    redis.Redis.from_url(redis_server.url).flushall()
    a = make(hybrid=True, **redis_kw(redis_server.url, 30))
    prompt = seq(6, 1300)
    ea = Engine(a, "a")
    ea.request(prompt)
    evict_all(a, Tier.DEVICE, Tier.HOST)
    assert _counters(a) == (6, 0)
    prefetch_back(a, prompt, engine_id="a")
    for _ in range(2):
        ea.request(prompt)
        assert a.transfers.drain(10)
    assert _counters(a) == (6, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ttl_s", [None, 30])
def test_a_2000_key_batch_round_trips_intact(redis_server: Any, ttl_s: int | None) -> None:
    """`batch` 2048 (one pipeline for the whole call since the chunk follows it): 2000
    objects of 16 KiB stored, found, read back byte for byte, stored again as PRESENT
    (and, with a TTL, every one of them renewed), each call within `timeout_s` (a call past
    it answers FAILED)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers" / "storage"))
    from storage_pages import Pool, keys

    cfg = StorageConfig(backend=StorageBackendName.REDIS, timeout_s=30.0,
                        redis=RedisStorageConfig(url=redis_server.url, batch=2048, ttl_s=ttl_s))
    backend = build_backend(cfg)
    backend.start()
    try:
        assert backend.pipeline_chunk == 2048
        n = 2000
        src, ks = Pool(n, payload=16 * 1024, seed=7), keys(n)
        assert set(backend.put_from(ks, src.slots())) == {PutStatus.STORED}
        assert backend.exists_prefix(ks) == n
        out = Pool(n, payload=16 * 1024, seed=None)
        assert set(backend.get_into(ks, out.slots())) == {GetStatus.HIT}
        assert np.array_equal(out.memory, src.memory)
        assert set(backend.put_from(ks, src.slots())) == {PutStatus.PRESENT}
        r = redis.Redis.from_url(redis_server.url)
        pipe = r.pipeline(transaction=False)
        for k in ks:
            pipe.pttl(k)
        ttls = pipe.execute()
        if ttl_s is None:
            assert set(ttls) == {-1}
        else:
            assert min(ttls) > 25_000
        r.delete(*ks)
        r.close()
        assert backend.stats().unavailable == 0
    finally:
        backend.close(2)
