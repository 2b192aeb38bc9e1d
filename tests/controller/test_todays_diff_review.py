"""Review of today's source changes (`git diff 6e71ee4..HEAD -- hicache controller tiers`):
the stale-L3-record rewrite (`Node.stored_at`, `slots_for_storage(stale_before)`,
`storage_stale`, `storage_renewed`, `_l2_victim`, the flush), per-job counting of retried
L3 writes, the page-sized write canary, the breakers' names and close log.

Real components: in-process controllers (`engine_sim`) on a private redis-server, the file
backend on tmp_path. Strict xfails pin bugs found in this review.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from engine_sim import Engine, built_controllers, redis_kw, seq, tree_path

from hicache.config import FileStorageConfig, StorageConfig
from hicache.controller.workers import CircuitBreaker
from hicache.tiers.storage import build_backend
from hicache.tiers.storage.base import CANARY_PAYLOAD, HEADER_BYTES, _fill_random
from hicache.types import ComponentKind, StorageBackendName, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


@pytest.fixture
def make(tmp_path) -> Iterator[Callable[..., Any]]:
    with built_controllers(tmp_path, prefix="tdr") as factory:
        yield factory


def _age(ctl: Any, tokens: bytes) -> None:
    """Make the L3 records of `tokens`' path as old as the process (stale for any TTL)."""
    with ctl._mu:
        for node in tree_path(ctl, tokens):
            node.stored_at = 0.0


def _pttls(r: redis.Redis, member: str) -> list[int]:
    ks = sorted(k for k in r.keys("*") if k.split(b"/")[-2] == member.encode())
    pipe = r.pipeline(transaction=False)
    for k in ks:
        pipe.pttl(k)
    return [int(v) for v in pipe.execute()]


def _evict_one_checkpoint_from_l2(ctl: Any) -> None:
    """One MAMBA checkpoint leaves L2 alone (its node's FULL slot stays there), through the
    L2 victim callback, as `Transfers._evict(HOST, MAMBA, 1)`'s first pass does."""
    with ctl._mu:
        res = ctl.tree.evict(Tier.HOST, MAMBA, 1,
                             before_drop=ctl.transfers._victim_callback(Tier.HOST))
        assert res.victims == 1
        for kind, ids in res.freed.items():
            ctl.transfers.free_l2(kind, ids)
    assert ctl.transfers.drain(10)


# ------------------------------------------------------------------ bugs


@pytest.mark.timeout(60)
def test_a_checkpoint_leaving_l2_alone_does_not_renew_the_full_record(
        make: Callable[..., Any], redis_server: Any) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    a = make(hybrid=True, **redis_kw(redis_server.url, 30, write__l2_to_l3="write_back"))
    prompt = seq(6, 500)
    Engine(a, "a").request(prompt)
    assert a.transfers.drain(10)
    a.flush(10)  # FULL, sidecars, SWA and the checkpoint in L3, recorded; L2 keeps them
    with a._mu:
        (node,) = tree_path(a, prompt)
        assert a.tree.is_resident(node, FULL, Tier.HOST)
        assert a.tree.is_resident(node, FULL, Tier.STORAGE)
    time.sleep(1.1)
    before = max(_pttls(r, "full"))
    assert before < 29_000
    _age(a, prompt)  # the record is now older than half the TTL
    present0 = a.stats().counters["backups_l3_present"]
    _evict_one_checkpoint_from_l2(a)  # writes the checkpoint only (mamba + conv objects)
    assert a.stats().counters["backups_l3_present"] == present0  # no FULL page written
    assert max(_pttls(r, "full")) <= before  # FULL objects not renewed
    with a._mu:
        assert a.tree.is_resident(node, FULL, Tier.HOST)
    # Their record must still read stale: the flush then writes (renews) FULL again.
    a.flush(10)
    assert min(_pttls(r, "full")) > before + 500, (
        "FULL objects left to expire under a record marked renewed")
    r.close()


# ------------------------------------------------------------------ pinned behaviour


@pytest.mark.timeout(60)
def test_a_full_slot_leaving_l2_under_a_stale_record_is_written_again(
        make: Callable[..., Any], redis_server: Any) -> None:
    """write_back L2 -> L3: FULL leaving L2 under a stale record is written again (every
    object renewed, its pages counted present once) and the record is fresh after."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    a = make(**redis_kw(redis_server.url, 30, write__l2_to_l3="write_back"))
    prompt = seq(5, 900)
    Engine(a, "a").request(prompt)
    assert a.transfers.drain(10)
    a.flush(10)
    assert a.stats().counters["backups_l3"] == 5
    time.sleep(1.1)
    before = max(_pttls(r, "full"))
    _age(a, prompt)
    with a._mu:
        a.transfers._evict(Tier.HOST, FULL, a.host.allocator(FULL).total)
    assert a.transfers.drain(10)
    c = a.stats().counters
    assert (c["backups_l3"], c["backups_l3_present"], c["backups_dropped"]) == (5, 5, 0)
    assert min(_pttls(r, "full")) > before + 500
    with a._mu:
        (node,) = tree_path(a, prompt)
        assert not a.tree.storage_stale(node, time.monotonic() - 15)
    r.close()


def test_slots_for_storage_offers_every_l2_slot_of_a_stale_record_only(
        make: Callable[..., Any]) -> None:
    """`slots_for_storage(stale_before)`: a record older than `stale_before` with FULL in
    L2 offers every L2 slot; a fresh one (or no `stale_before`) offers none;
    `storage_renewed` makes it fresh; a split head keeps the record's age."""
    a = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through",
             l1_tokens=512)
    prompt = seq(6, 3000)
    Engine(a, "a").request(prompt)
    assert a.transfers.drain(10)
    with a._mu:
        (node,) = tree_path(a, prompt)
        tree = a.tree
        assert tree.is_resident(node, FULL, Tier.STORAGE)
        assert tree.slots_for_storage(node) == []
        assert tree.slots_for_storage(node, time.monotonic() - 100) == []
        node.stored_at = 1.0
        assert tree.storage_stale(node, 2.0)
        assert tree.slots_for_storage(node, 2.0) == [FULL, SWA, MAMBA]
        assert tree.slots_for_storage(node) == []
        tree.storage_renewed(node)
        assert not tree.storage_stale(node, time.monotonic() - 1)
        node.stored_at = 1.0
    Engine(a, "b").request(seq(3, 3000) + seq(1, 99_000))  # splits after page 3
    with a._mu:
        head, tail = tree_path(a, prompt)
        assert head.stored_at == tail.stored_at == 1.0


def test_breaker_names_its_log_lines_and_times_the_outage_from_its_trip(
        caplog: pytest.LogCaptureFixture) -> None:
    """Named open/close lines; the close line's duration runs from the trip, not from the
    last half-open probe (which restamps the cooldown); a returned probe changes nothing;
    one close line per outage."""
    now = [100.0]
    b = CircuitBreaker(threshold=2, cooldown_s=1.0, clock=lambda: now[0],
                       name="L3 test write breaker", failures="refused writes")
    caplog.set_level(logging.WARNING, logger="hicache.controller.workers")
    b.success()
    b.failure()
    b.failure()
    assert b.is_open and b.trips == 1
    now[0] = 102.0
    token = b.take()
    assert token is not None and token != (None, None)
    b.give_back(token)
    now[0] = 103.0
    assert b.take() is not None  # half-open probe: restamps the cooldown
    b.failure()  # the probe failed: still open, no second trip
    assert b.trips == 1
    now[0] = 110.0
    assert b.allow()
    b.success()
    b.success()
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == ["L3 test write breaker open after 2 refused writes",
                     "L3 test write breaker closed after 10.0 s open"]


@pytest.mark.parametrize("n", [1, 100, CANARY_PAYLOAD, CANARY_PAYLOAD + 1, 3 * CANARY_PAYLOAD + 7])
def test_fill_random_fills_every_byte_with_a_repeated_random_block(n: int) -> None:
    body = np.zeros(n, dtype=np.uint8)
    _fill_random(body)
    block = body[: min(n, CANARY_PAYLOAD)]
    reps = np.resize(block, n)
    assert np.array_equal(body, reps)
    if n >= 100:
        assert np.count_nonzero(block) > len(block) // 2


def test_page_canary_area_is_kept_between_probes_and_grown_once(tmp_path) -> None:
    """`health(deep, canary_bytes)`: a canary larger than the small one gets an area of its
    own, kept for the next probe of the same size or less, replaced when a larger one is
    asked; the small canary keeps using the small area; every canary is removed."""
    cfg = StorageConfig(backend=StorageBackendName.FILE, timeout_s=5.0,
                        file=FileStorageConfig(path=str(tmp_path / "l3")))
    backend = build_backend(cfg)
    try:
        assert backend.health(True).healthy
        assert backend._page_canary is None
        big = HEADER_BYTES + 64 * 1024
        assert backend.health(True, big).healthy
        area = backend._page_canary
        assert area is not None and area.nbytes == 2 * big
        assert backend.health(True, big - 1000).healthy
        assert backend._page_canary is area
        assert backend.health(True, 2 * big).healthy
        assert backend._page_canary is not area and backend._page_canary.nbytes >= 4 * big - 2 * HEADER_BYTES
        assert backend._kept_canaries == []
        assert not [p for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    finally:
        backend.close(2)
