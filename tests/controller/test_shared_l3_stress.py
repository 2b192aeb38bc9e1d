"""Several controllers ("nodes") in one process sharing ONE L3 store, driven at once from
threads by a seeded random workload with heavily overlapping prefixes.

Each node has its own L1/L2; the store is a file directory with a small
`storage.file.capacity_gb` (every node deletes objects the others wrote), or a real
redis-server (plain, or with `maxmemory` and `allkeys-lru`: Redis drops keys underneath
us; or `noeviction`: puts are refused). A node is also closed mid-write while the others
read on, and objects are torn as a writer dying without fsync leaves them. Every page a
match or load reports present is checked byte for byte against the bytes its own
sequence's engine wrote (`Engine.verify`): a node must never serve another sequence's
KV, whatever the other nodes do to the store. At the end every tree passes
`check_integrity`, no handle is left and the pools drain.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import threading
import time
from collections import Counter

import pytest
import redis
from engine_sim import Engine, evict_all, seq, tiny_config, wait_prefetch

from hicache.config import GiB
from hicache.controller.base import InsertRequest, MatchRequest
from hicache.controller.controller import build_controller
from hicache.errors import NotFound, ResourceExhausted
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL
PS = 4  # the tiny config's page size
OBJ = 64 + 2 * 8 * PS  # one FULL page object: header + 2 layers x 8 B x 4 tokens
_ids = iter(range(1_000_000))


def _ctl(cfg, tag: str):
    return build_controller(cfg, f"sl3{tag}{next(_ids)}x{int(time.time() * 1000) % 100000}")


def _file_cfg(tmp_path, *, capacity_objects: int | None = 40, **kw):
    storage = {"path": str(tmp_path / "l3")}
    if capacity_objects is not None:
        storage["capacity_gb"] = capacity_objects * OBJ / GiB
    return tiny_config(tmp_path, backend="file", storage__file=storage, **_policies(kw))


def _redis_cfg(tmp_path, url: str, **kw):
    return tiny_config(tmp_path, backend="redis", storage__redis={"url": url, "batch": 8}, **_policies(kw))


def _policies(kw: dict) -> dict:
    out = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through",
           "l1_tokens": 128, "storage__timeout_s": 2.0}
    out.update(kw)
    return out


# ---------------------------------------------------------------------------- workload

TRUNKS = 5  # prefixes every node draws from: heavy overlap between nodes


def _sequence(rng: random.Random) -> bytes:
    """A trunk prefix of 1-8 pages, often followed by one of 3 branches of 1-3 pages."""
    trunk = rng.randrange(TRUNKS)
    head = seq(rng.randint(1, 8), 100_000 * (trunk + 1))
    if rng.random() < 0.6:
        branch = rng.randrange(3)
        head += seq(rng.randint(1, 3), 100_000 * (trunk + 1) + 10_000 * (branch + 1))
    return head


def _request(eng: Engine, tokens: bytes) -> None:
    """One request's life (as `Engine.request`): match + allocate, verify, load what L2
    holds, verify, write its own bytes into the allocation, insert. Handles are released
    when a step fails (no room in L1 for the load)."""
    ctl = eng.ctl
    total = len(tokens) // (PS * 4)
    m = ctl.match(eng.id, MatchRequest(eng.ns, tokens, lock=True, allocate_tokens=len(tokens) // 4))
    inserted = False
    try:
        eng.verify(m.device_pages, tokens, m.device_tokens // PS)
        reused = m.device_tokens
        if m.host_tokens:
            *_, last = list(ctl.load(eng.id, m.lock_id))
            assert last.device_pages is not None and last.device_tokens is not None
            reused = last.device_tokens
            eng.verify(last.device_pages, tokens, reused // PS)
        start = reused // PS
        skip = start - m.device_tokens // PS
        mamba = {mb.name for mb in eng.cfg.model.family(ComponentKind.MAMBA)}
        eng.write({name: ids if name in mamba else ids[skip:] for name, ids in m.pages.items()},
                  tokens, start)
        out = ctl.insert(eng.id, InsertRequest(eng.ns, tokens, lock_id=m.lock_id,
                                               allocation_id=m.allocation_id, mamba_checkpoint=True))
        inserted = True
        assert out.inserted_tokens + out.reused_tokens == total * PS
    finally:
        if not inserted and (m.lock_id or m.allocation_id):
            with contextlib.suppress(NotFound):
                ctl.release(eng.id, m.lock_id or None, m.allocation_id or None)


def _prefetch_then_load(eng: Engine, tokens: bytes, stats: Counter) -> int:
    """Match with a prefetch and wait for it; then match again, load what L1/L2 hold and
    verify every page the match and the load report; release. Returns the pages the
    request then finds in L1 (all verified)."""
    ctl = eng.ctl
    m = ctl.match(eng.id, MatchRequest(eng.ns, tokens, lock=True, prefetch=True))
    try:
        eng.verify(m.device_pages, tokens, m.device_tokens // PS)
        if m.prefetch_id:
            state = wait_prefetch(ctl, m.prefetch_id, timeout_s=15)
            stats[f"prefetch_{state.value}"] += 1
            info = ctl.prefetch_status(m.prefetch_id)
            assert info.tokens_ready % PS == 0 and info.tokens_ready <= info.tokens_total
            stats["prefetched_pages"] += info.tokens_ready // PS
    finally:
        if m.lock_id:
            ctl.release(eng.id, m.lock_id, None)
    m = ctl.match(eng.id, MatchRequest(eng.ns, tokens, lock=True))
    ready = m.device_tokens // PS
    try:
        eng.verify(m.device_pages, tokens, ready)
        if m.lock_id and m.host_tokens:
            *_, last = list(ctl.load(eng.id, m.lock_id))
            assert last.device_pages is not None and last.device_tokens is not None
            assert last.device_tokens >= m.device_tokens
            eng.verify(last.device_pages, tokens, last.device_tokens // PS)
            ready = last.device_tokens // PS
        stats["ready_pages"] += ready
    finally:
        if m.lock_id:
            ctl.release(eng.id, m.lock_id, None)
    return ready


def _worker(eng: Engine, seed: int, ops: int, errors: list, stats: Counter,
            evictor: bool, stop: threading.Event | None = None) -> None:
    rng = random.Random(seed)
    try:
        for _ in range(ops):
            if stop is not None and stop.is_set():
                return
            tokens = _sequence(rng)
            r = rng.random()
            try:
                if r < 0.55:
                    _request(eng, tokens)
                    stats["requests"] += 1
                elif r < 0.9:
                    _prefetch_then_load(eng, tokens, stats)
                    stats["prefetches"] += 1
                elif evictor:
                    evict_all(eng.ctl, Tier.DEVICE, Tier.HOST)
                    stats["evictions"] += 1
                else:
                    eng.ctl.match(eng.id, MatchRequest(eng.ns, tokens))
            except ResourceExhausted:
                stats["exhausted"] += 1
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def _drive(nodes, seed: int, ops: int, engines_per_node: int = 2) -> Counter:
    stats: Counter = Counter()
    errors: list = []
    threads = []
    for n, ctl in enumerate(nodes):
        for e in range(engines_per_node):
            eng = Engine(ctl, f"n{n}e{e}")
            t = threading.Thread(target=_worker, args=(eng, seed * 100 + n * 10 + e, ops, errors, stats,
                                                       e == 0), daemon=True)
            threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a worker hung"
    if errors:
        raise errors[0]
    return stats


def _settled(ctl) -> None:
    """Drained, audited, no handle left, and once L1/L2 are evicted every page is free."""
    assert ctl.transfers.drain(15)
    ctl.check_integrity()
    counters = ctl.stats().counters
    assert counters["active_locks"] == 0 and counters["active_allocations"] == 0, counters
    deadline = time.monotonic() + 10
    while ctl.prefetcher.running:
        assert time.monotonic() < deadline, "prefetches still running"
        time.sleep(0.01)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)  # (write-back: L1 -> L2 -> L3 jobs park pages)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert ctl.transfers.drain(15)
    with ctl._mu:
        for kind in ctl._kinds:
            for pools in (ctl.device, ctl.host):
                alloc = pools.allocator(kind)
                assert alloc.free_count == alloc.total, (kind, alloc.free_count, alloc.total)
    ctl.check_integrity()


def _fresh_reads_verify(ctl, seed: int) -> int:
    """With L1/L2 empty, every sequence's L3 part is prefetched and loaded, and verified."""
    eng = Engine(ctl, f"final{seed}")
    stats: Counter = Counter()
    rng = random.Random(seed)
    for _ in range(30):
        _prefetch_then_load(eng, _sequence(rng), stats)
    return stats["ready_pages"]


def _close_all(nodes) -> None:
    for ctl in nodes:
        ctl.close()


# ---------------------------------------------------------------------------- file L3


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "hybrid"), [("write_through", False), ("write_back", False),
                                                ("write_through", True)])
def test_two_nodes_share_a_small_file_store(tmp_path, policy: str, hybrid: bool) -> None:
    """Capacity 40 objects (hybrid: 300 of all sizes), some 200 distinct pages: each node
    deletes objects the other wrote (and is reading). Write-back: a node drops L2 pages
    once L3 answered for them. Hybrid: FULL+SWA+MAMBA with sidecars (a page needs every
    member's object, a boundary its window and checkpoint)."""
    kw: dict = {"write__l2_to_l3": policy, "hybrid": hybrid}
    if policy == "write_back":
        kw["write__l1_to_l2"] = "write_back"
    nodes = [_ctl(_file_cfg(tmp_path, capacity_objects=300 if hybrid else 40, **kw), "f") for _ in range(2)]
    try:
        stats = _drive(nodes, seed=1, ops=400)
        assert stats["requests"] > 200 and stats["prefetches"] > 100, stats
        assert stats["prefetch_DONE"] > 10 and stats["prefetched_pages"] > 100, stats
        assert stats["ready_pages"] > 300, stats
        for ctl in nodes:
            _settled(ctl)
            backend = ctl.l3.backend
            # Each node's view of the directory stays within its capacity, and it did
            # delete (the directory holds fewer objects than were stored).
            assert backend.used_bytes <= backend.capacity_bytes
            assert backend.stats().stored > (300 if hybrid else 40)
        objects = [f for _, _, fs in os.walk(tmp_path / "l3") for f in fs]
        assert not [f for f in objects if not f.endswith(".kv")], "temp files left"
        if not hybrid:
            assert len(objects) <= 2 * 40
        loaded = sum(_fresh_reads_verify(ctl, 7) for ctl in nodes)
        assert loaded > 0
        for ctl in nodes:
            _settled(ctl)
            assert ctl.l3.backend.stats().corrupt == 0
            assert ctl.serving() and ctl.l3.probe(deep=True).healthy
    finally:
        _close_all(nodes)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.timeout(120)
def test_a_node_closed_mid_workload_and_torn_objects_never_serve_wrong_bytes(tmp_path) -> None:
    """Three nodes on one file store (no capacity: what a node wrote stays unless found
    broken). The third is closed while its backups are queued; then objects are torn
    (cut to half, emptied) as a writer dying without fsync leaves them, and a dead
    writer's temp file is planted. The survivors, and a node started afterwards (its
    start sweeps the dead writer's temp file), read on: every page served is the right
    one, and the broken objects are found corrupt and removed, never served."""
    cfg = _file_cfg(tmp_path, capacity_objects=None)
    a, b, c = (_ctl(cfg, "k") for _ in range(3))
    nodes = [a, b]
    late = None
    real_write = c.l3.backend._write_sync
    gate, entered = threading.Event(), threading.Event()
    gate.set()

    def slow_write(keys, buffers):  # the third node's store is slow (and held at the end)
        entered.set()
        assert gate.wait(10)
        time.sleep(0.005)
        return real_write(keys, buffers)

    c.l3.backend._write_sync = slow_write
    try:
        stop = threading.Event()
        errors: list = []
        stats: Counter = Counter()
        third = [threading.Thread(target=_worker, args=(Engine(c, f"c{i}"), 90 + i, 10_000, errors, stats,
                                                        i == 0, stop), daemon=True) for i in range(2)]
        for t in third:
            t.start()
        # The survivors run their workload while the third works, and after it is gone.
        survivors = threading.Thread(target=lambda: stats.update(_drive([a, b], seed=3, ops=150)), daemon=True)
        survivors.start()
        deadline = time.monotonic() + 20
        while c.stats().counters.get("backups_l3", 0) < 20:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.005)
        stop.set()
        for t in third:
            t.join(30)
            assert not t.is_alive()
        # One more request, whose write is held in the store's call while the node closes.
        gate.clear()
        entered.clear()
        _request(Engine(c, "c-last"), seq(6, 900_000))
        assert entered.wait(10), "the third node's last write never started"
        assert not c.transfers.backup_worker.drain(0)
        threading.Timer(0.2, gate.set).start()
        c.close()  # the held write goes on mid-close; what is queued lands or is given up
        survivors.join(60)
        assert not survivors.is_alive()
        if errors:
            raise errors[0]
        for ctl in nodes:
            _settled(ctl)

        # The third node's interrupted writes left whole objects only (and, once its last
        # write returned, no temp file).
        root = tmp_path / "l3"
        deadline = time.monotonic() + 10
        while list(root.rglob("*.tmp")):
            assert time.monotonic() < deadline, "temp files left"
            time.sleep(0.01)
        objects = sorted(str(p) for p in root.rglob("*.kv"))
        assert len(objects) > 20
        assert all(os.path.getsize(p) == OBJ for p in objects)
        # Tear objects of sequences the nodes request, as a dying writer leaves them.
        rng = random.Random(5)
        torn = rng.sample(objects, 12)
        for i, path in enumerate(torn):
            with open(path, "r+b") as f:
                f.truncate(0 if i % 3 == 0 else (OBJ // 2 if i % 3 == 1 else 40))
        dead_tmp = f"{objects[0]}.{_file_host_tag()}.{_dead_pid()}.1.tmp"
        with open(dead_tmp, "wb") as f:
            f.write(b"\0" * (OBJ // 3))  # a dead writer's partial object
        late = _ctl(cfg, "l")
        assert late.l3.backend.wait_indexed(10)  # (the start's walk runs in the background)
        assert not os.path.exists(dead_tmp), "a dead writer's temp file survived the start-up sweep"
        nodes.append(late)
        stats = _drive(nodes, seed=4, ops=120)
        for ctl in nodes:
            _settled(ctl)
        loaded = sum(_fresh_reads_verify(ctl, 11) for ctl in nodes)
        assert loaded > 0
        found = sum(ctl.l3.backend.stats().corrupt for ctl in nodes)
        removed = sum(ctl.l3.backend.stats().corrupt_removed for ctl in nodes)
        assert found > 0 and removed > 0, (found, removed)
        still_torn = [p for p in torn if os.path.exists(p) and os.path.getsize(p) != OBJ]
        for ctl in nodes:
            _settled(ctl)
            assert ctl.serving()
        # Every torn object a node read was removed (or replaced by a whole one); those left
        # were never read since.
        assert len(still_torn) < len(torn)
    finally:
        _close_all(nodes)


def _file_host_tag() -> str:
    from hicache.tiers.storage.file import _host_tag

    return _host_tag()


# ---------------------------------------------------------------------------- redis L3

BIG = 256  # bytes per token per layer: objects of 2 KiB + header, so maxmemory bites soon
BIG_OBJ = 64 + 2 * BIG * PS


def _redis_nodes(tmp_path, url: str, n: int = 2):
    cfg = _redis_cfg(tmp_path, url, model__components={"full": {"layers": 2, "bytes_per_token_per_layer": BIG}})
    return [_ctl(cfg, "r") for _ in range(n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eviction", [None, "allkeys-lru", "noeviction"])
def test_two_nodes_share_a_redis_store(tmp_path, redis_factory, eviction: str | None) -> None:
    """A real redis-server; with `maxmemory` some 60 objects above what it holds empty,
    and `allkeys-lru` (Redis drops keys the nodes are reading) or `noeviction` (puts are
    refused: backups stop, serving goes on)."""
    server = redis_factory()
    client = redis.Redis.from_url(server.url)
    nodes = _redis_nodes(tmp_path, server.url)
    try:
        if eviction is not None:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used + 60 * (BIG_OBJ + 200))
            client.config_set("maxmemory-policy", eviction)
        stats = _drive(nodes, seed=2, ops=250)
        assert stats["requests"] > 150 and stats["prefetches"] > 80, stats
        for ctl in nodes:
            _settled(ctl)
            assert ctl.serving()
        keys = client.dbsize()
        if eviction == "allkeys-lru":
            assert int(client.info("stats")["evicted_keys"]) > 0
        stored = sum(ctl.l3.backend.stats().stored for ctl in nodes)
        if eviction is None:
            assert keys == stored  # (SET NX: every key stored once, by one node)
        loaded = sum(_fresh_reads_verify(ctl, 5) for ctl in nodes)
        assert loaded > 0 or eviction is not None
        for ctl in nodes:
            _settled(ctl)
            assert ctl.l3.backend.stats().corrupt == 0
        if eviction == "noeviction":
            assert sum(ctl.l3.backend.stats().put_failed for ctl in nodes) > 0
    finally:
        _close_all(nodes)
        client.close()


# ---------------------------------------------------------------------------- findings


def _page_paths(ctl, tokens: bytes) -> list[str]:
    hashes = [bytes(h) for h in _hashes(ctl, tokens)]
    keys = ctl.l3.keys("", hashes, ctl.cfg.model.family(FULL))
    return [ctl.l3.backend.path_of(k) for k in keys]


def _hashes(ctl, tokens: bytes) -> list[bytes]:
    from hicache.keys import chain_hashes

    blob = chain_hashes(ctl.cfg.model.chain_seed(""), tokens, PS * 4)
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


def test_a_node_writing_a_page_whose_object_is_torn_stores_it_whole(tmp_path) -> None:
    """Node A stored a prefix; one of its objects is then torn (a crash without fsync
    leaves it empty). Node B computes the same prefix and writes it through: L3 must then
    hold every page whole, so a third node loads all of them from L3."""
    cfg = _file_cfg(tmp_path, capacity_objects=None)
    a, b, c = (_ctl(cfg, "t") for _ in range(3))
    try:
        tokens = seq(4, 700_000)
        _request(Engine(a, "a"), tokens)
        assert a.transfers.drain(10)
        paths = _page_paths(a, tokens)
        assert all(os.path.getsize(p) == OBJ for p in paths)
        with open(paths[3], "r+b") as f:
            f.truncate(0)  # A's object of page 3, torn
        _request(Engine(b, "b"), tokens)  # B computes all 4 pages and writes them through
        assert b.transfers.drain(10)
        eng = Engine(c, "c")
        assert _prefetch_then_load(eng, tokens, Counter()) == 4
        assert c.l3.backend.stats().corrupt == 0  # B replaced the torn object
    finally:
        _close_all([a, b, c])
