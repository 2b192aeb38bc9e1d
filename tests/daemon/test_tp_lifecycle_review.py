"""Review of tensor-parallel engine groups over their lifetime, through real daemons.

`model.tp_size` 2 on the shared-memory L1: each page's row holds both ranks' shards and each
rank maps its own (README `model.tp_size`, "Restarts"). Every rank here is a real
`hicache.client.Client` that maps the pools its Attach hands it, with an instance id of its
own (`RankClient`: in one test process every Client would otherwise share the process's
id, while a real group runs one process per rank), and writes a shard of its own
(`KvOracle` seeded per rank), so a page that comes back with another rank's bytes, or
bytes of a stale mapping, reads wrong.

What `test_tensor_parallel_review.py` and `test_sessions_leases_review.py` cover already
(handles shared by the ranks, restarts and leases counted on raw stubs without bytes, the
L3 round trip to a second daemon, the shape of the L3 objects, Attach's argument checks
on a raw stub) is not repeated; this file checks the bytes and the mappings over the
group's life: ranks attaching late and in any order, one rank's restart, the whole group
restarting rank by rank, a daemon restart under an attached group (`x-hicache-run`), L1 ->
L2 -> L1 round trips in both L2 layouts, daemons of another `tp_size` on the same L3, a
hybrid model's members and checkpoints per rank.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hicache.client as hclient
from hicache import convert
from hicache.bench.oracle import KvOracle
from hicache.client import Attachment, Client
from hicache.controller.base import PrefetchState
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import FULL_SWA_MAMBA, PAGE, Daemon, eventually, free_port, scrape, tokens

TP = 2
MakeDaemon = Callable[..., Daemon]
_IID_MU = threading.Lock()


class RankClient(Client):
    """A Client that attaches and heartbeats as a process of its own (`instance_id`)."""

    def __init__(self, target: str, iid: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self.iid = iid

    @property
    def instance_id(self) -> str:
        return self.iid

    def attach(self, tp_rank: int = 0, tp_size: int = 1, map_pools: bool = True) -> Attachment:
        with _IID_MU:  # (Client.attach sends the module's process-wide id)
            saved = hclient._INSTANCE_ID
            hclient._INSTANCE_ID = self.iid
            try:
                return super().attach(tp_rank, tp_size, map_pools)
            finally:
                hclient._INSTANCE_ID = saved

    def heartbeat(self) -> Any:
        self._settle_owed()
        return convert.heartbeat_from_pb(self._call(
            self._stub.Heartbeat,
            pb.HeartbeatRequest(engine_id=self.engine_id, tp_rank=self._tp_rank,
                                instance_id=self.iid),
            repeatable=True))


def tp_sets(l3_dir: Path | None, tp: int = TP,
            bytes_per_token: int = 256) -> tuple[str, ...]:
    out = [f"model.tp_size={tp}",
           f"model.components={{full: {{layers: 4, bytes_per_token_per_layer: {bytes_per_token}}}}}",
           "write.l1_to_l2=write_through", "prefetch.policy=wait_complete"]
    if l3_dir is not None:
        out += ["storage.backend=file", f"storage.file.path={l3_dir}",
                "write.l2_to_l3=write_through"]
    return tuple(out)


def daemon(workdir: Path, *sets: str) -> Daemon:
    """A Daemon (not started) with a metrics port of its own (`d.metrics_port`)."""
    port = free_port()
    d = Daemon(workdir, *sets, f"metrics.port={port}")
    d.metrics_port = port  # type: ignore[attr-defined]
    return d


class Shared:
    def __init__(self, d: Daemon, l3_dir: Path) -> None:
        self.d, self.l3_dir = d, l3_dir


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    l3_dir = tmp_path_factory.mktemp("tp-life-l3")
    d = daemon(tmp_path_factory.mktemp("tp-life"), *tp_sets(l3_dir))
    try:
        d.start()
        yield Shared(d, l3_dir)
    finally:
        d.close()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Private daemons with a metrics port each, started, closed after the test."""
    made: list[Daemon] = []

    def make(*sets: str) -> Daemon:
        wd = tmp_path / f"d{len(made)}"
        wd.mkdir()
        d = daemon(wd, *sets)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.close()


@pytest.fixture
def ranks() -> Iterator[Callable[..., RankClient]]:
    """`ranks(daemon, engine_id, iid)`: a rank's client (closed after the test)."""
    made: list[RankClient] = []

    def make(d: Daemon, engine_id: str, iid: str, **kw: Any) -> RankClient:
        c = RankClient(d.target, iid, engine_id=engine_id, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def oracle(att: Attachment, rank: int, tag: str) -> KvOracle:
    return KvOracle(att.info, att.pools, f"{tag}#rank{rank}")


def ns_of(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:6]}"


def counters(d: Daemon) -> dict[str, float]:
    """The daemon's `hicache_<name>_total` counters (the engine ones are metrics only)."""
    out: dict[str, float] = {}
    for line in scrape(d.metrics_port).splitlines():  # type: ignore[attr-defined]
        if line.startswith("hicache_") and "{" not in line and " " in line:
            name, value = line.split()[:2]
            out[name.removeprefix("hicache_").removesuffix("_total")] = float(value)
    return out


def l1_used(c: Client) -> int:
    return next(p.used_pages for p in c.stats().pools if p.tier == "device")



def store(c0: Client, ors: list[KvOracle], seq: bytes, ns: str) -> None:
    """Rank 0 matches with an allocation, every rank writes its shard, rank 0 inserts."""
    m = c0.match(seq, ns, lock=True, allocate_tokens=len(seq) // 4)
    assert m.device_tokens + m.host_tokens == 0
    for o in ors:
        o.write(seq, m.pages, start_page=0)
    assert c0.insert(seq, ns, lock_id=m.lock_id,
                     allocation_id=m.allocation_id).inserted_tokens == len(seq) // 4


def verify_hit(c: Client, ors: list[KvOracle], seq: bytes, ns: str, pages: int,
               page: int = PAGE) -> None:
    """A locked match of `seq` in L1 (loading what L2 holds), each rank's shard checked."""
    with c.matched(seq, ns) as hit:
        assert hit.device_tokens + hit.host_tokens == pages * page, hit
        got = hit.device_pages
        if hit.host_tokens:
            last = list(c.load(hit.lock_id))[-1]
            assert last.device_tokens == pages * page
            got = last.device_pages
        for o in ors:
            o.verify(seq, got, pages)
    for o in ors:
        assert o.pages_checked > 0
    assert [o.wrong_bytes for o in ors] == [0] * len(ors), [o.wrong_bytes for o in ors]


# ------------------------------------------------------------------ attach order


def test_ranks_attaching_late_and_in_reverse_order_write_and_read_their_own_shards(
    shared: Shared, ranks: Callable[..., RankClient],
) -> None:
    """Rank 1 attaches first and writes its shard into an allocation it made before rank 0
    exists; rank 0 attaches later (another process), writes its shard into the same pages
    and inserts. Both shards come back, each through its own mapping, and neither rank's
    view holds the other's bytes."""
    d = shared.d
    ns = ns_of("order")
    seq = tokens(3 * PAGE, start=100_000)
    c1 = ranks(d, "order", "order-p1")
    a1 = c1.attach(tp_rank=1, tp_size=TP)
    m = c1.match(seq, ns, lock=True, allocate_tokens=3 * PAGE)
    o1 = oracle(a1, 1, "order")
    o1.write(seq, m.pages, start_page=0)
    c0 = ranks(d, "order", "order-p0")
    a0 = c0.attach(tp_rank=0, tp_size=TP)
    assert (c0.heartbeat().locks, c0.heartbeat().allocations) == (1, 1)
    o0 = oracle(a0, 0, "order")
    o0.write(seq, m.pages, start_page=0)
    assert counters(d)["engine_restarts"] == 0
    done = c0.insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id)
    assert done.inserted_tokens == 3 * PAGE
    verify_hit(c1, [o0, o1], seq, ns, 3)
    # Rank 0's oracle reading rank 1's view (and the reverse) finds other bytes.
    cross = [KvOracle(a1.info, a1.pools, "order#rank0"), KvOracle(a0.info, a0.pools, "order#rank1")]
    with c0.matched(seq, ns) as hit:
        for o in cross:
            o.verify(seq, hit.device_pages, 3)
    assert all(o.wrong_bytes > 0 for o in cross)


# ------------------------------------------------------------------ one rank's restart


def test_one_ranks_restart_frees_the_groups_handles_and_keeps_every_shard_and_mapping(
    shared: Shared, ranks: Callable[..., RankClient],
) -> None:
    d = shared.d
    ns = ns_of("restart1")
    seq = tokens(2 * PAGE, start=110_000)
    c0, c1 = ranks(d, "restart1", "r1-p0"), ranks(d, "restart1", "r1-p1")
    a0, a1 = c0.attach(tp_rank=0, tp_size=TP), c1.attach(tp_rank=1, tp_size=TP)
    ors = [oracle(a0, 0, "restart1"), oracle(a1, 1, "restart1")]
    store(c0, ors, seq, ns)
    # A request under way: a lock on the prefix and an allocation of 3 more pages.
    other = tokens(2 * PAGE + 3 * PAGE, start=110_000)
    held = c0.match(other, ns, lock=True, allocate_tokens=5 * PAGE)  # (the whole request)
    assert [len(p) for p in held.pages.values()] == [3]
    assert held.device_tokens == 2 * PAGE
    used_held = l1_used(c0)
    before = counters(d)
    # Rank 1's process dies (no more heartbeats) and a new one attaches rank 1.
    c1.close()
    n1 = ranks(d, "restart1", "r1-p1-new")
    na1 = n1.attach(tp_rank=1, tp_size=TP)
    after = counters(d)
    assert after["engine_restarts"] == before["engine_restarts"] + 1
    assert after["restart_released_locks"] == before["restart_released_locks"] + 1
    assert after["restart_released_allocations"] == before["restart_released_allocations"] + 1
    assert l1_used(c0) == used_held - 3  # the allocation's pages are free again
    # Rank 0 lives on: its heartbeat is taken, its handles are gone.
    hb = c0.heartbeat()
    assert (hb.locks, hb.allocations) == (0, 0)
    assert c0.detached is None
    with pytest.raises(NotFound):
        c0.insert(other, ns, lock_id=held.lock_id, allocation_id=held.allocation_id)
    # The data stays: rank 0 through the mapping it had, rank 1 through its new one.
    verify_hit(n1, [ors[0], oracle(na1, 1, "restart1")], seq, ns, 2)


def test_a_group_restarting_rank_by_rank_reads_what_its_predecessors_wrote(
    shared: Shared, ranks: Callable[..., RankClient],
) -> None:
    d = shared.d
    ns = ns_of("rolling")
    seq = tokens(2 * PAGE, start=120_000)
    o0c, o1c = ranks(d, "rolling", "roll-o0"), ranks(d, "rolling", "roll-o1")
    oa0, oa1 = o0c.attach(tp_rank=0, tp_size=TP), o1c.attach(tp_rank=1, tp_size=TP)
    store(o0c, [oracle(oa0, 0, "rolling"), oracle(oa1, 1, "rolling")], seq, ns)
    o0c.close()
    o1c.close()
    restarts = counters(d)["engine_restarts"]
    n1 = ranks(d, "rolling", "roll-n1")  # the new group: rank 1 first this time
    na1 = n1.attach(tp_rank=1, tp_size=TP)
    grabbed = n1.match(tokens(3 * PAGE, start=120_500), ns, lock=True, allocate_tokens=3 * PAGE)
    n0 = ranks(d, "rolling", "roll-n0")
    na0 = n0.attach(tp_rank=0, tp_size=TP)  # joins the restart: nothing more released
    assert counters(d)["engine_restarts"] == restarts + 1
    hb = n0.heartbeat()
    assert (hb.locks, hb.allocations) == (1, 1)
    assert n1.heartbeat().locks == 1 and n1.detached is None
    n0.release(allocation_id=grabbed.allocation_id)
    n0.release(lock_id=grabbed.lock_id)
    verify_hit(n0, [oracle(na0, 0, "rolling"), oracle(na1, 1, "rolling")], seq, ns, 2)


# ------------------------------------------------------------------ a daemon restart


def test_a_daemon_restart_refuses_each_rank_until_it_attaches_again_and_serves_new_pools(
    private: MakeDaemon, ranks: Callable[..., RankClient], tmp_path: Path,
) -> None:
    """The group attached, the daemon restarts (SIGTERM, same socket): every call of each
    rank that names the earlier run is refused (releases: NOT_FOUND) until that rank
    attaches again, whatever the other rank did; each rank's heartbeat detaches it; after
    attaching again each rank maps the new pools and reads its shard, prefetched from L3,
    and bytes written through a stale mapping never reach them."""
    l3_dir = tmp_path / "l3"
    l3_dir.mkdir()
    d = private(*tp_sets(l3_dir))
    ns = ns_of("drestart")
    seq = tokens(5 * PAGE, start=130_000)
    c0, c1 = ranks(d, "drestart", "dr-p0"), ranks(d, "drestart", "dr-p1")
    a0, a1 = c0.attach(tp_rank=0, tp_size=TP), c1.attach(tp_rank=1, tp_size=TP)
    store(c0, [oracle(a0, 0, "dr"), oracle(a1, 1, "dr")], seq, ns)
    held = c0.match(seq, ns, lock=True, allocate_tokens=PAGE)
    c0.flush(timeout_s=10)
    assert d.stop() == 0
    d.start()

    def refused(c: Client) -> None:
        for call in (
            lambda: c.match(seq, ns),
            lambda: c.match(seq, ns, lock=True, allocate_tokens=PAGE),
            lambda: c.allocate(PAGE, ns),
            lambda: c.insert(seq, ns, lock_id=held.lock_id, allocation_id=held.allocation_id),
            lambda: list(c.load(held.lock_id)),
        ):
            with pytest.raises(FailedPrecondition, match="attach again"):
                call()
        with pytest.raises(NotFound, match="restart released it"):
            c.release(lock_id=held.lock_id)

    refused(c0)
    refused(c1)
    for c in (c0, c1):
        with pytest.raises(FailedPrecondition):
            c.heartbeat()
    na0 = c0.attach(tp_rank=0, tp_size=TP)
    assert [p.handle for p in na0.info.pools] != [p.handle for p in a0.info.pools]
    refused(c1)  # rank 0 attached again; rank 1 has not
    with c0.matched(seq, ns, prefetch=True) as m:
        assert m.storage_tokens == 5 * PAGE and m.prefetch_id
        assert eventually(lambda: c0.prefetch_status(m.prefetch_id).state
                          is not PrefetchState.RUNNING)
        with pytest.raises(FailedPrecondition):
            c1.prefetch_status(m.prefetch_id)
    na1 = c1.attach(tp_rank=1, tp_size=TP)
    assert counters(d)["engine_restarts"] == 0
    # The old mappings are not the new pools: what a stale process writes there is lost.
    for att in (a0, a1):
        for layer in att.pools["full"]:
            layer[:] = 0xEE
    verify_hit(c1, [oracle(na0, 0, "dr"), oracle(na1, 1, "dr")], seq, ns, 5)


# ------------------------------------------------------------------ L2 and L3 round trips


def _evict_l1(c: Client, ns: str, start: int) -> None:
    """Fill the 16-page L1 with 18 pages of other prefixes (LRU: the oldest leave L1;
    the 32-page L2 keeps them all)."""
    for i in range(3):
        seq = tokens(6 * PAGE, start=start + i * 10_000)
        m = c.match(seq, ns, lock=True, allocate_tokens=6 * PAGE)
        c.insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id)
        c.flush(timeout_s=10)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_each_ranks_shard_survives_an_l1_to_l2_round_trip(
    layout: str, shared: Shared, private: MakeDaemon, ranks: Callable[..., RankClient],
) -> None:
    d = shared.d if layout == "page_first" else private(*tp_sets(None))
    ns = ns_of(f"l2-{layout}")
    seq = tokens(3 * PAGE, start=140_000)
    c0, c1 = ranks(d, f"l2-{layout}", "l2-p0"), ranks(d, f"l2-{layout}", "l2-p1")
    a0, a1 = c0.attach(tp_rank=0, tp_size=TP), c1.attach(tp_rank=1, tp_size=TP)
    ors = [oracle(a0, 0, "l2"), oracle(a1, 1, "l2")]
    store(c0, ors, seq, ns)
    c0.flush(timeout_s=10)
    _evict_l1(c0, ns, 150_000)
    probe = c1.match(seq, ns)
    assert (probe.device_tokens, probe.host_tokens) == (0, 3 * PAGE), probe
    verify_hit(c1, ors, seq, ns, 3)


def test_daemons_of_another_tp_size_find_nothing_in_the_groups_l3(
    shared: Shared, ranks: Callable[..., RankClient], tmp_path: Path,
) -> None:
    ns = ns_of("tpsize")
    seq = tokens(4 * PAGE, start=160_000)
    c0, c1 = ranks(shared.d, "tpsize", "ts-p0"), ranks(shared.d, "tpsize", "ts-p1")
    a0, a1 = c0.attach(tp_rank=0, tp_size=TP), c1.attach(tp_rank=1, tp_size=TP)
    store(c0, [oracle(a0, 0, "ts"), oracle(a1, 1, "ts")], seq, ns)
    c0.flush(timeout_s=10)
    assert c0.stats().counters["backups_storage"] >= 4  # (in L3: there to be found)
    # The same whole row (512 bytes per token per layer) split otherwise: another KV
    # layout, never read as this group's. (A second daemon of the same tp_size reading
    # each rank's shard back: test_tensor_parallel_review.py.)
    readers = {
        1: daemon(tmp_path / "tp1", *tp_sets(shared.l3_dir, tp=1, bytes_per_token=512)),
        4: daemon(tmp_path / "tp4", *tp_sets(shared.l3_dir, tp=4, bytes_per_token=128)),
    }
    try:
        for r in readers.values():
            r.workdir.mkdir()
            r.start(wait=False)
        for r in readers.values():
            r.wait_ready()
        for size, r in readers.items():
            rc = ranks(r, f"tpsize-{size}", f"ts-{size}")
            rc.attach(tp_rank=size - 1, tp_size=size)
            m = rc.match(seq, ns)
            assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 0), (size, m)
    finally:
        for r in readers.values():
            r.close()


# ------------------------------------------------------------------ attach arguments


def test_a_wrong_tp_size_or_rank_is_invalid_argument_and_leaves_an_attached_rank_as_it_was(
    shared: Shared, ranks: Callable[..., RankClient],
) -> None:
    d = shared.d
    fresh = ranks(d, "badargs-fresh", "ba-f")
    for rank, size, field in ((0, 1, "tp_size"), (0, 4, "tp_size"), (2, 2, "tp_rank"),
                              (9, 2, "tp_rank")):
        with pytest.raises(InvalidArgument, match=field):
            fresh.attach(tp_rank=rank, tp_size=size)
    assert fresh._heartbeat_thread is None  # nothing attached, nothing heartbeats
    with pytest.raises(FailedPrecondition, match="Attach"):
        fresh.match(tokens(PAGE, start=170_000), "x", lock=True)
    c1 = ranks(d, "badargs", "ba-p1")
    a1 = c1.attach(tp_rank=1, tp_size=TP)
    m = c1.match(tokens(2 * PAGE, start=171_000), "x", lock=True, allocate_tokens=2 * PAGE)
    for rank, size in ((0, 1), (1, 3), (2, 2)):
        with pytest.raises(InvalidArgument):
            c1.attach(tp_rank=rank, tp_size=size)
    hb = c1.heartbeat()  # still rank 1, still holding its handles
    assert (hb.locks, hb.allocations) == (1, 1)
    assert {p.member for p in a1.info.pools} == {"full"}
    c1.release(lock_id=m.lock_id)
    c1.release(allocation_id=m.allocation_id)


# ------------------------------------------------------------------ a hybrid model per rank


HYBRID = (*FULL_SWA_MAMBA, "tiers.l1.tokens=64", "tiers.l1.mamba_slots=8",
          "prefetch.threshold_tokens=4")


def test_a_hybrid_groups_members_and_checkpoints_come_back_per_rank_from_l1_and_l3(
    private: MakeDaemon, ranks: Callable[..., RankClient], tmp_path: Path,
) -> None:
    """FULL+SWA+MAMBA with sidecars, two ranks: each rank writes its shard of every member
    and its own MAMBA state; a reuse on the same daemon, and a prefetch on a second daemon
    from the file L3, give each rank exactly its own bytes."""
    l3_dir = tmp_path / "hl3"
    l3_dir.mkdir()
    sets = (*HYBRID, *tp_sets(l3_dir)[2:], f"model.tp_size={TP}")
    writer = private(*sets)
    ns = ns_of("hyb")
    seq = np.arange(200_000, 200_000 + 24, dtype="<u4").tobytes()  # 6 pages of 4 tokens
    pages = 6
    c0, c1 = ranks(writer, "hyb", "hy-p0"), ranks(writer, "hyb", "hy-p1")
    a0, a1 = c0.attach(tp_rank=0, tp_size=TP), c1.attach(tp_rank=1, tp_size=TP)
    ors = [oracle(a0, 0, "hyb"), oracle(a1, 1, "hyb")]
    m = c0.match(seq, ns, lock=True, allocate_tokens=len(seq) // 4)
    for o in ors:
        o.write(seq, m.pages, start_page=0)
    c0.insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
    with c1.matched(seq, ns) as hit:
        assert hit.device_tokens == pages * 4
        for o in ors:
            o.verify(seq, hit.device_pages, pages)
    assert [o.wrong_bytes for o in ors] == [0, 0]
    c0.flush(timeout_s=10)
    # A request under way (its own MAMBA slot, a checkpoint taken mid-request, pages past
    # it) when rank 1's process restarts: every L1 page and slot it held is free again.
    def used() -> dict[str, int]:
        return {p.member: p.used_pages for p in c0.stats().pools if p.tier == "device"}

    base = used()
    more = np.arange(200_000, 200_000 + 40, dtype="<u4").tobytes()
    run = c0.match(more, ns, lock=True, allocate_tokens=40)
    assert run.device_tokens == 24
    for o in ors:
        o.write(more[:32 * 4], run.pages, start_page=6)
    c0.insert(more[:32 * 4], ns, lock_id=run.lock_id, allocation_id=run.allocation_id,
              keep_lock=True, mamba_checkpoint=True)
    assert used() != base
    c1.close()
    n1 = ranks(writer, "hyb", "hy-p1-new")
    n1.attach(tp_rank=1, tp_size=TP)
    assert (c0.heartbeat().locks, c0.heartbeat().allocations) == (0, 0)
    # What stays is what the Insert committed: 2 pages of each paged member and one
    # checkpoint (the allocation's 2 other pages and its working slot are free).
    assert used() == {k: v + (1 if k in ("mamba", "conv") else 2) for k, v in base.items()}
    reader = private(*sets)
    r0, r1 = ranks(reader, "hyb-r", "hy-r0"), ranks(reader, "hyb-r", "hy-r1")
    ra1, ra0 = r1.attach(tp_rank=1, tp_size=TP), r0.attach(tp_rank=0, tp_size=TP)
    with r1.matched(seq, ns, prefetch=True) as pm:
        assert pm.storage_tokens == pages * 4 and pm.prefetch_id
        assert eventually(lambda: r1.prefetch_status(pm.prefetch_id).state
                          is not PrefetchState.RUNNING)
        assert r1.prefetch_status(pm.prefetch_id).state is PrefetchState.DONE
    reads = [oracle(ra0, 0, "hyb"), oracle(ra1, 1, "hyb")]
    verify_hit(r0, reads, seq, ns, pages, page=4)
