"""Review of tensor-parallel engines (`model.tp_size` > 1) end to end through real daemons:
one engine id, one process per rank, each rank mapping the L1 pools Attach hands it.

The contract (API.md, proto/hicache/v1/hicache.proto): Attach carries `tp_rank`/`tp_size`
and answers "the L1 pools this rank maps", `Pool` being "one per member and tensor-parallel
rank" and `Pool.tp_rank` "the tensor-parallel rank whose shard this pool holds"; L3 keys
carry the TP rank (DESIGN §2). Locks and allocations belong to the engine, not to a rank
(README "Restarts"), so any rank of the group may use them.

Each rank writes its own shard of the KV: a `KvOracle` seeded per rank, so a page that
came back with another rank's bytes reads wrong.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from hicache.bench.oracle import KvOracle
from hicache.client import Attachment, Client
from hicache.config import load_config
from hicache.controller.base import PrefetchState
from hicache.keys import chain_hashes, split_hashes, storage_keys
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.tiers.storage.file import SUFFIX
from hicache.tiers.storage.integrity import key_digest

from .daemonkit import PAGE, TINY, Daemon, eventually, free_port, scrape, tokens

TP = 2
PAGES = 5  # 320 tokens: above the prefetch threshold (256), within L1 (16 pages)


def _sets(l3_dir: Path, metrics_port: int) -> tuple[str, ...]:
    return (
        f"model.tp_size={TP}",
        "storage.backend=file",
        f"storage.file.path={l3_dir}",
        "write.l1_to_l2=write_through",
        "write.l2_to_l3=write_through",
        "prefetch.policy=wait_complete",
        f"metrics.port={metrics_port}",
    )


class Pair:
    """Two daemons of a two-rank model sharing one file L3 directory."""

    def __init__(self, writer: Daemon, reader: Daemon, l3_dir: Path, sets: tuple[str, ...],
                 writer_port: int) -> None:
        self.writer, self.reader, self.l3_dir = writer, reader, l3_dir
        self.sets = sets
        self.writer_port = writer_port


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    l3_dir = tmp_path_factory.mktemp("tp-l3")
    wport, rport = free_port(), free_port()
    writer = Daemon(tmp_path_factory.mktemp("tp-writer"), *_sets(l3_dir, wport))
    reader = Daemon(tmp_path_factory.mktemp("tp-reader"), *_sets(l3_dir, rport))
    try:
        writer.start(wait=False)
        reader.start(wait=False)
        writer.wait_ready()
        reader.wait_ready()
        yield Pair(writer, reader, l3_dir, _sets(l3_dir, wport), wport)
    finally:
        writer.close()
        reader.close()


@pytest.fixture
def group(pair: Pair) -> Iterator[Callable[[Daemon, str], tuple[list[Client], list[Attachment]]]]:
    """A tensor-parallel group on a daemon: one Client per rank (one engine id), attached."""
    made: list[Client] = []

    def make(d: Daemon, engine_id: str) -> tuple[list[Client], list[Attachment]]:
        clients = [d.client(engine_id=engine_id) for _ in range(TP)]
        made.extend(clients)
        return clients, [c.attach(tp_rank=r, tp_size=TP) for r, c in enumerate(clients)]

    yield make
    for c in made:
        c.close()


def oracles(atts: list[Attachment], tag: str) -> list[KvOracle]:
    """One content oracle per rank: each rank's shard has bytes of its own."""
    return [KvOracle(a.info, a.pools, f"{tag}#rank{r}") for r, a in enumerate(atts)]



def wait_prefetch(c: Client, prefetch_id: int) -> PrefetchState:
    assert eventually(
        lambda: c.prefetch_status(prefetch_id).state is not PrefetchState.RUNNING
    )
    state = c.prefetch_status(prefetch_id).state
    return state


def metric(port: int, name: str) -> float:
    for line in scrape(port).splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def store_prefix(clients: list[Client], atts: list[Attachment], seq: bytes, ns: str,
                 tag: str) -> list[KvOracle]:
    """Rank 0 matches with an allocation, every rank writes its shard into its own pool,
    rank 0 inserts and flushes (write-through: L2 and L3 hold the prefix then)."""
    ors = oracles(atts, tag)
    m = clients[0].match(seq, ns, lock=True, allocate_tokens=len(seq) // 4)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 0)
    for o in ors:
        o.write(seq, m.pages, start_page=0)
    done = clients[0].insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id)
    assert done.inserted_tokens == len(seq) // 4
    clients[0].flush(timeout_s=10)
    return ors


# ------------------------------------------------------------------ what works


def test_pools_carry_the_rank_and_any_rank_uses_the_engines_handles(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    """Handles belong to the engine: a lock and an allocation rank 1 made are inserted by
    rank 0, Load and Release work from either rank, and every rank's heartbeat reports the
    engine's count."""
    (c0, c1), (a0, a1) = group(pair.writer, "cross-rank")
    for att in (a0, a1):
        assert [p.member for p in att.info.pools] == [m.name for m in att.info.members]
        assert att.info.lease_ms > 0
    ns = f"cross-{uuid.uuid4().hex[:6]}"
    seq = tokens(2 * PAGE, start=1_000)
    m = c1.match(seq, ns, lock=True, allocate_tokens=2 * PAGE)
    assert (c0.heartbeat().locks, c0.heartbeat().allocations) == (1, 1)
    assert (c1.heartbeat().locks, c1.heartbeat().allocations) == (1, 1)
    assert c0.insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id).inserted_tokens == 2 * PAGE
    assert (c1.heartbeat().locks, c1.heartbeat().allocations) == (0, 0)
    hit = c0.match(seq, ns, lock=True)
    assert hit.device_tokens == 2 * PAGE
    steps = list(c1.load(hit.lock_id))  # rank 1 loads rank 0's match (nothing to copy)
    assert steps[-1].device_tokens == 2 * PAGE
    assert steps[-1].layers_ready == steps[-1].layers_total == a0.info.members[0].layers
    c1.release(lock_id=hit.lock_id)
    assert (c0.heartbeat().locks, c0.heartbeat().allocations) == (0, 0)
    # A second release (from the other rank) is NOT_FOUND like any double release.
    with pytest.raises(Exception) as err:
        c0.release(lock_id=hit.lock_id)
    assert type(err.value).__name__ == "NotFound"


def test_a_rank_attaching_again_keeps_the_groups_handles_and_counts_no_restart(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    """The same process attaching a rank again (same instance id, or none) is a renewal:
    nothing is released and no restart is counted; a heartbeat of a rank outside the group
    is refused. Every pool of an Attach reply names the attaching rank."""
    (c0, c1), _ = group(pair.writer, "re-attach")
    ns = f"again-{uuid.uuid4().hex[:6]}"
    m = c0.match(tokens(2 * PAGE, start=2_000), ns, lock=True, allocate_tokens=2 * PAGE)
    restarts = metric(pair.writer_port, "hicache_engine_restarts_total")
    c1.attach(tp_rank=1, tp_size=TP)
    c1.attach(tp_rank=1, tp_size=TP)
    with grpc.insecure_channel(pair.writer.target) as ch:
        stub = pb_grpc.HiCacheStub(ch)
        for rank in range(TP):  # (no instance id: the same process, taken over as it is)
            again = stub.Attach(pb.AttachRequest(engine_id="re-attach", tp_rank=rank,
                                                 tp_size=TP), timeout=10)
            assert {p.tp_rank for p in again.pools} == {rank}
        with pytest.raises(grpc.RpcError) as err:  # rank 5 of a two-rank group never attached
            stub.Heartbeat(pb.HeartbeatRequest(engine_id="re-attach", tp_rank=5,
                                               instance_id="who"), timeout=10)
        assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
        with pytest.raises(grpc.RpcError) as err:
            stub.Attach(pb.AttachRequest(engine_id="re-attach", tp_rank=TP, tp_size=TP,
                                         instance_id="who"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    hb = c0.heartbeat()
    assert (hb.locks, hb.allocations) == (1, 1)
    assert metric(pair.writer_port, "hicache_engine_restarts_total") == restarts
    c1.release(lock_id=m.lock_id)
    c1.release(allocation_id=m.allocation_id)
    assert (c0.heartbeat().locks, c0.heartbeat().allocations) == (0, 0)


def test_rank1_of_a_second_daemon_prefetches_and_loads_what_the_group_stored(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    """The tier path with ranks, tokens only: the first daemon's group stores a prefix
    (write-through to L3); on the second daemon rank 0 prefetches it and rank 1 loads it."""
    ns = f"path-{uuid.uuid4().hex[:6]}"
    seq = tokens(PAGES * PAGE, start=3_000)
    wc, wa = group(pair.writer, "path-writer")
    store_prefix(wc, wa, seq, ns, "path")
    assert wc[0].stats().counters["backups_storage"] >= PAGES
    (r0, r1), ra = group(pair.reader, "path-reader")
    probe = r1.match(seq, ns)
    assert (probe.device_tokens, probe.host_tokens, probe.storage_tokens) == (0, 0, PAGES * PAGE)
    with r0.matched(seq, ns, prefetch=True) as m:
        assert m.prefetch_id
        # The prefetch is the engine's: rank 1 follows the one rank 0 started.
        assert wait_prefetch(r1, m.prefetch_id) is PrefetchState.DONE
        assert r1.prefetch_status(m.prefetch_id).tokens_ready == PAGES * PAGE
    with r0.matched(seq, ns) as hit:
        assert hit.device_tokens + hit.host_tokens == PAGES * PAGE
        last = list(r1.load(hit.lock_id))[-1]
        assert last.device_tokens == PAGES * PAGE
        assert last.layers_ready == last.layers_total == ra[0].info.members[0].layers
        assert last.device_pages is not None
        assert len(last.device_pages["full"]) == PAGES
    assert r0.match(seq, ns).device_tokens == PAGES * PAGE


# ------------------------------------------------------------------ bugs


def test_each_rank_maps_a_pool_of_its_own_and_gets_its_shard_back_on_a_hit(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    (c0, c1), (a0, a1) = group(pair.writer, "shards-l1")
    ns = f"l1-{uuid.uuid4().hex[:6]}"
    seq = tokens(2 * PAGE, start=4_000)
    ors = oracles([a0, a1], "l1")
    m = c0.match(seq, ns, lock=True, allocate_tokens=2 * PAGE)
    for o in ors:
        o.write(seq, m.pages, start_page=0)
    c0.insert(seq, ns, lock_id=m.lock_id, allocation_id=m.allocation_id)
    with c1.matched(seq, ns) as hit:
        assert hit.device_tokens == 2 * PAGE
        for o in ors:
            o.verify(seq, hit.device_pages, 2)
    assert [o.wrong_bytes for o in ors] == [0, 0]
    # Each rank maps its own shard of the group's rows: same rows, disjoint bytes.
    for p0, p1 in zip(a0.info.pools, a1.info.pools, strict=True):
        width = next(m.bytes_per_page_per_layer for m in a0.info.members if m.name == p0.member)
        assert p0.page_stride_bytes == p1.page_stride_bytes == TP * width
        assert p1.offset_bytes - p0.offset_bytes == width


def test_write_through_stores_every_ranks_shard_in_the_groups_l3_object(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    """One object per page holds the whole group's row (every rank's shard): a page is
    stored, found and read for the group at once, never with one rank's shard missing."""
    ns = f"keys-{uuid.uuid4().hex[:6]}"
    seq = tokens(PAGES * PAGE, start=5_000)
    wc, wa = group(pair.writer, "shards-keys")
    store_prefix(wc, wa, seq, ns, "keys")
    cfg = load_config(overrides=(*TINY, *pair.sets))
    hashes = split_hashes(chain_hashes(cfg.model.chain_seed(ns), seq, PAGE * 4))
    assert len(hashes) == PAGES

    def sizes(rank: int) -> list[int]:
        keys = storage_keys(ns, cfg.model.id, hashes, ["full"], rank, TP)
        out = []
        for k in keys:
            h = key_digest(k).hex()
            path = pair.l3_dir / h[0:2] / h[2:4] / f"{h}{SUFFIX}"
            out.append(path.stat().st_size if path.is_file() else 0)
        return out

    rank_bytes = next(m.bytes_per_page for m in wa[0].info.members if m.name == "full")
    assert all(size >= TP * rank_bytes for size in sizes(0)), sizes(0)
    assert sizes(1) == [0] * PAGES  # (no per-rank objects)


def test_every_ranks_shard_comes_back_identical_from_l3_on_a_second_daemon(
    pair: Pair, group: Callable[[Daemon, str], tuple[list[Client], list[Attachment]]],
) -> None:
    ns = f"rt-{uuid.uuid4().hex[:6]}"
    seq = tokens(PAGES * PAGE, start=6_000)
    wc, wa = group(pair.writer, "shards-rt-writer")
    store_prefix(wc, wa, seq, ns, "rt")
    (r0, r1), ra = group(pair.reader, "shards-rt-reader")
    readers = oracles(ra, "rt")
    with r0.matched(seq, ns, prefetch=True) as m:
        assert m.storage_tokens == PAGES * PAGE and m.prefetch_id
        assert wait_prefetch(r0, m.prefetch_id) is PrefetchState.DONE
    with r0.matched(seq, ns) as hit:
        last = list(r1.load(hit.lock_id))[-1]
        assert last.device_tokens == PAGES * PAGE and last.device_pages is not None
        for o in readers:
            o.verify(seq, last.device_pages, PAGES)
    assert [o.pages_checked for o in readers] == [PAGES * ra[0].info.members[0].layers] * TP
    assert [o.wrong_bytes for o in readers] == [0] * TP

