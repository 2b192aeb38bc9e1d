"""Conformance of the running daemon to ../shared/API.md, field by field, through raw gRPC
stubs (no `hicache.client`): every request field honoured (explicit 0 vs unset for the
`optional` ones), every response field populated as described, the status-code table
(each condition triggered, its exact code, and a message naming what was wrong), handle 0,
Release twice, sessions, prefetch, Load, Stats, Admin. A review; one daemon per module
(an L3 `file` backend so that every tier exists), own token ranges per test.

Confirmed mismatches are strict xfails."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import admin_pb2_grpc as apb_grpc
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import FULL_SWA_MAMBA, PAGE, Daemon, tokens

ENGINE = "conformance"
T = PAGE * 4  # bytes of one page of tokens
PROTO = Path(__file__).resolve().parents[2] / "proto" / "hicache" / "v1" / "hicache.proto"


class Raw:
    """Raw stubs of one engine: `md` carries its x-hicache-engine header."""

    def __init__(self, target: str, engine_id: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.s = pb_grpc.HiCacheStub(self.channel)
        self.admin = apb_grpc.AdminStub(self.channel)
        self.engine_id = engine_id
        self.md = (("x-hicache-engine", engine_id),)

    def attach(self) -> Any:
        return self.s.Attach(pb.AttachRequest(engine_id=self.engine_id, tp_size=1), timeout=10)

    def match(self, toks: bytes, **kw: Any) -> Any:
        return self.s.MatchPrefix(pb.MatchPrefixRequest(tokens=toks, **kw), metadata=self.md, timeout=10)

    def insert(self, toks: bytes, **kw: Any) -> Any:
        return self.s.Insert(pb.InsertRequest(tokens=toks, **kw), metadata=self.md, timeout=10)

    def allocate(self, n: int, **kw: Any) -> Any:
        return self.s.Allocate(pb.AllocateRequest(num_tokens=n, **kw), metadata=self.md, timeout=10)

    def release(self, **kw: Any) -> Any:
        return self.s.Release(pb.ReleaseRequest(**kw), metadata=self.md, timeout=10)

    def heartbeat(self) -> tuple[int, int]:
        hb = self.s.Heartbeat(pb.HeartbeatRequest(engine_id=self.engine_id), timeout=10)
        return hb.locks, hb.allocations

    def load(self, lock_id: int) -> list[Any]:
        return list(self.s.Load(pb.LoadRequest(lock_id=lock_id), metadata=self.md, timeout=20))

    def status(self, prefetch_id: int) -> Any:
        return self.s.PrefetchStatus(pb.PrefetchStatusRequest(prefetch_id=prefetch_id),
                                     metadata=self.md, timeout=10)

    def put(self, toks: bytes, **kw: Any) -> Any:
        """A whole request: MatchPrefix(allocate_tokens) then Insert."""
        m = self.match(toks, allocate_tokens=len(toks) // 4)
        return self.insert(toks, lock_id=m.lock_id, allocation_id=m.allocation_id, **kw)


def ids(pages: Any) -> dict[str, list[int]]:
    return {p.member: np.frombuffer(p.page_ids, "<i4").tolist() for p in pages}


def refused(call: Callable[[], Any], code: grpc.StatusCode, fragment: str = "") -> str:
    """The status message of a call that must fail with `code` (and name `fragment`)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    assert err.code() is code, (err.code(), err.details())
    assert err.details(), "a status must carry a message saying what was wrong"
    assert fragment.lower() in err.details().lower(), err.details()
    return str(err.details())


@pytest.fixture(scope="module")
def dm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("conf")
    # (wait_complete: a prefetch on a loaded machine is DONE, not TIMED_OUT past 2 s)
    d = Daemon(work, "storage.backend=file", f"storage.file.path={work / 'l3'}",
               "prefetch.policy=wait_complete").start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def raw(dm: Daemon) -> Iterator[Raw]:
    r = Raw(dm.target, ENGINE)
    r.attach()
    yield r
    r.channel.close()


# --------------------------------------------------------------------------- Attach, Heartbeat


def test_attach_describes_every_member_and_maps_every_pool(raw: Raw) -> None:
    at = raw.attach()
    assert at.page_size == PAGE and at.lease_ms > 0
    assert [(m.name, m.component, m.anchor) for m in at.members] == [("full", "full", "full")]
    (member,) = at.members
    assert member.layers == 4 and member.bytes_per_page_per_layer == PAGE * 256 and member.window_tokens == 0
    (pool,) = at.pools
    assert (pool.member, pool.tp_rank, pool.kind, pool.device) == ("full", 0, pb.SHM, -1)
    assert pool.handle and pool.num_pages == 16 and pool.layers == member.layers
    assert pool.page_stride_bytes == member.bytes_per_page_per_layer
    assert pool.layer_stride_bytes == pool.num_pages * pool.page_stride_bytes
    assert pool.size_bytes >= pool.offset_bytes + pool.layers * pool.layer_stride_bytes


def test_heartbeat_reports_what_the_daemon_holds_for_that_engine_only(dm: Daemon, raw: Raw) -> None:
    other = Raw(dm.target, "hb-other")
    try:
        lease = other.attach().lease_ms
        base = tokens(4 * PAGE, start=10_000)
        a = other.match(base, lock=True)
        b = other.match(base, allocate_tokens=2 * PAGE)  # a lock and an allocation
        c = other.allocate(PAGE)
        assert (a.allocation_id, b.allocation_id != 0, c.allocation_id != 0) == (0, True, True)
        assert other.heartbeat() == (2, 2)
        assert raw.heartbeat() == (0, 0)  # another engine's handles are not this one's
        hb = other.s.Heartbeat(pb.HeartbeatRequest(engine_id="hb-other"), timeout=10)
        assert hb.lease_ms == lease
        other.insert(base[: 2 * T], lock_id=b.lock_id, allocation_id=b.allocation_id)
        assert other.heartbeat() == (1, 1)  # Insert consumed b's allocation and lock
        other.release(lock_id=a.lock_id)
        other.release(allocation_id=c.allocation_id)
        assert other.heartbeat() == (0, 0)
        refused(lambda: other.release(lock_id=a.lock_id), grpc.StatusCode.NOT_FOUND, str(a.lock_id))
        refused(lambda: other.release(allocation_id=c.allocation_id), grpc.StatusCode.NOT_FOUND,
                str(c.allocation_id))
        refused(lambda: other.release(lock_id=b.lock_id), grpc.StatusCode.NOT_FOUND, "released")
        refused(lambda: other.release(allocation_id=b.allocation_id), grpc.StatusCode.NOT_FOUND,
                "released")
    finally:
        other.channel.close()


# --------------------------------------------------------------------------- MatchPrefix fields


def test_allocate_tokens_set_to_zero_differs_from_unset(raw: Raw) -> None:
    toks = tokens(3 * PAGE, start=20_000)
    plain = raw.match(toks)
    assert (plain.device_tokens, plain.host_tokens, plain.storage_tokens) == (0, 0, 0)
    assert (plain.lock_id, plain.prefetch_id, plain.allocation_id, len(plain.pages)) == (0, 0, 0, 0)
    assert raw.heartbeat() == (0, 0)
    locked = raw.match(toks, lock=True)
    assert locked.lock_id and not locked.allocation_id and not locked.pages
    zero = raw.match(toks, allocate_tokens=0)  # set, to 0: an allocation (of no pages) and a lock
    assert zero.allocation_id and zero.lock_id
    assert ids(zero.pages) == {"full": []}
    assert raw.heartbeat() == (2, 1)
    # allocate_tokens counts past device_tokens, rounded up to whole pages
    some = raw.match(toks, allocate_tokens=PAGE + 1)
    assert len(ids(some.pages)["full"]) == 2
    for m in (locked, zero, some):
        raw.release(lock_id=m.lock_id)
    for m in (zero, some):
        raw.release(allocation_id=m.allocation_id)
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def test_counts_are_page_aligned_and_allocation_starts_past_device_tokens(raw: Raw) -> None:
    toks = tokens(3 * PAGE, start=30_000)
    raw.put(toks)
    m = raw.match(toks + tokens(PAGE - 1, start=1), allocate_tokens=5 * PAGE)  # a partial page more
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (3 * PAGE, 0, 0)
    assert len(ids(m.device_pages)["full"]) == 3
    assert len(ids(m.pages)["full"]) == 2  # allocate_tokens - device_tokens
    assert not set(ids(m.pages)["full"]) & set(ids(m.device_pages)["full"])
    raw.release(lock_id=m.lock_id)
    raw.release(allocation_id=m.allocation_id)
    short = raw.match(toks[: 2 * T + 4 * 5])
    assert short.device_tokens == 2 * PAGE and len(ids(short.device_pages)["full"]) == 2
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def three_tiers(raw: Raw, start: int) -> bytes:
    """X of 8 pages: its first 2 in L1 (and L2), the next 2 in L2 only, the last 4 in L3
    only (L1 16 pages, L2 32)."""
    x = tokens(8 * PAGE, start=start)
    raw.put(x[: 2 * T])
    raw.put(x[: 4 * T])
    raw.put(x)
    raw.admin.Flush(apb.FlushRequest(), timeout=30)
    hold = raw.match(x[: 2 * T], lock=True)
    room = raw.allocate(14 * PAGE)  # L1 evicts all but the locked 2 pages
    raw.release(allocation_id=room.allocation_id)
    raw.release(lock_id=hold.lock_id)
    hold = raw.match(x[: 4 * T], lock=True)
    for i in range(4):  # fresh requests push the unlocked tail out of L2
        raw.put(tokens(14 * PAGE, start=start + 100_000 + i * 1_000))
    raw.release(lock_id=hold.lock_id)
    m = raw.match(x)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (2 * PAGE, 2 * PAGE, 4 * PAGE)
    return x


def test_each_tier_is_counted_beyond_the_previous_and_namespaces_never_meet(raw: Raw) -> None:
    x = three_tiers(raw, 1_000_000)
    m = raw.match(x + tokens(PAGE // 2, start=7))
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (2 * PAGE, 2 * PAGE, 4 * PAGE)
    assert m.prefetch_id == 0 and len(ids(m.device_pages)["full"]) == 2  # device part only
    m = raw.match(x[: 5 * T])
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (2 * PAGE, 2 * PAGE, PAGE)
    # Below prefetch.threshold_tokens (256): no prefetch.
    low = raw.match(x[: 7 * T], prefetch=True)
    assert (low.storage_tokens, low.prefetch_id) == (3 * PAGE, 0)
    for ns in ("other", "tenant/b"):
        o = raw.match(x, namespace=ns)
        assert (o.device_tokens, o.host_tokens, o.storage_tokens) == (0, 0, 0), ns
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def test_prefetch_status_cancel_and_load_answer_as_documented(raw: Raw) -> None:
    x = three_tiers(raw, 2_000_000)
    # prefetch without lock: a prefetch_id, no lock_id, nothing held
    m = raw.match(x, prefetch=True)
    assert m.storage_tokens == 4 * PAGE == 256 and m.prefetch_id and not m.lock_id
    assert raw.heartbeat() == (0, 0)
    deadline = time.monotonic() + 15
    seen = []
    while True:
        st = raw.status(m.prefetch_id)
        seen.append(st.state)
        assert st.tokens_total == 4 * PAGE and 0 <= st.tokens_ready <= st.tokens_total
        assert st.tokens_ready % PAGE == 0
        if st.state != pb.RUNNING or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert st.state == pb.DONE and st.tokens_ready == st.tokens_total, seen
    cancel = raw.s.CancelPrefetch(pb.CancelPrefetchRequest(prefetch_id=m.prefetch_id),
                                  metadata=raw.md, timeout=10)
    assert cancel.tokens_ready == 4 * PAGE
    # another engine does not see it
    refused(lambda: raw.s.PrefetchStatus(pb.PrefetchStatusRequest(prefetch_id=m.prefetch_id),
                                         metadata=(("x-hicache-engine", "nobody"),), timeout=10),
            grpc.StatusCode.NOT_FOUND, str(m.prefetch_id))
    # what arrived is usable: now L2 holds it; Load brings L2 into L1, layer by layer
    locked = raw.match(x, lock=True)
    assert (locked.device_tokens, locked.host_tokens, locked.storage_tokens) == (2 * PAGE, 6 * PAGE, 0)
    steps = raw.load(locked.lock_id)
    ready = [s.layers_ready for s in steps]
    assert all(s.layers_total == 4 for s in steps) and ready == sorted(ready) and ready[-1] == 4
    assert all(not s.device_pages and s.device_tokens == 0 for s in steps[:-1])
    last = steps[-1]
    assert last.device_tokens == 8 * PAGE
    got = ids(last.device_pages)["full"]
    assert len(got) == 8 and got[:2] == ids(locked.device_pages)["full"]
    again = raw.match(x)
    assert (again.device_tokens, ids(again.device_pages)["full"]) == (8 * PAGE, got)
    raw.release(lock_id=locked.lock_id)
    refused(lambda: raw.load(locked.lock_id), grpc.StatusCode.NOT_FOUND, str(locked.lock_id))
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def test_a_load_with_nothing_in_l2_answers_the_match_in_one_message(raw: Raw) -> None:
    toks = tokens(2 * PAGE, start=40_000)
    raw.put(toks)
    m = raw.match(toks, lock=True)
    (only,) = raw.load(m.lock_id)
    assert (only.layers_ready, only.layers_total, only.device_tokens) == (4, 4, 2 * PAGE)
    assert ids(only.device_pages) == ids(m.device_pages)
    raw.release(lock_id=m.lock_id)
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def test_load_before_attach_is_failed_precondition_naming_attach(dm: Daemon, raw: Raw) -> None:
    m = raw.match(tokens(PAGE, start=41_000), lock=True)
    stranger = Raw(dm.target, "never-attached-loader")
    try:
        refused(lambda: stranger.load(m.lock_id), grpc.StatusCode.FAILED_PRECONDITION, "Attach")
        no_header = Raw(dm.target, "")
        try:
            refused(lambda: list(no_header.s.Load(pb.LoadRequest(lock_id=m.lock_id), timeout=10)),
                    grpc.StatusCode.FAILED_PRECONDITION, "x-hicache-engine")
        finally:
            no_header.channel.close()
    finally:
        stranger.channel.close()
    raw.release(lock_id=m.lock_id)
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


# --------------------------------------------------------------------------- Allocate, Insert


def test_allocate_extends_a_match_and_insert_commits_it(raw: Raw) -> None:
    toks = tokens(4 * PAGE, start=50_000)
    raw.put(toks[: 2 * T])
    m = raw.match(toks, lock=True)
    assert m.device_tokens == 2 * PAGE
    # lock_id: the allocation extends the match (its pages follow the device part)
    a = raw.allocate(2 * PAGE - 3, lock_id=m.lock_id)
    assert len(ids(a.pages)["full"]) == 2
    out = raw.insert(toks, lock_id=m.lock_id, allocation_id=a.allocation_id)
    assert (out.inserted_tokens, out.reused_tokens) == (2 * PAGE, 2 * PAGE)
    # unless keep_lock, Insert released the lock and consumed the allocation
    refused(lambda: raw.release(lock_id=m.lock_id), grpc.StatusCode.NOT_FOUND)
    refused(lambda: raw.release(allocation_id=a.allocation_id), grpc.StatusCode.NOT_FOUND)
    assert raw.match(toks).device_tokens == 4 * PAGE
    # a second request inserting the same sequence reuses everything; the daemon frees
    # its duplicate pages
    dup = raw.put(toks + tokens(5, start=3))
    assert (dup.inserted_tokens, dup.reused_tokens) == (0, 4 * PAGE)
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


def test_insert_mid_request_keeps_the_lock_and_the_rest_of_the_allocation(raw: Raw) -> None:
    toks = tokens(4 * PAGE, start=60_000)
    m = raw.match(toks, allocate_tokens=4 * PAGE, session_id="mid-request")
    assert len(ids(m.pages)["full"]) == 4
    first = raw.insert(toks[: 2 * T + 40], lock_id=m.lock_id, allocation_id=m.allocation_id,
                       keep_lock=True)
    assert (first.inserted_tokens, first.reused_tokens) == (2 * PAGE, 0)
    assert raw.heartbeat() == (1, 1)
    grown = raw.allocate(PAGE, allocation_id=m.allocation_id)
    held = ids(grown.pages)["full"]
    assert grown.allocation_id == m.allocation_id
    assert held[:2] == ids(m.pages)["full"][2:] and len(held) == 3  # uncommitted ones, grown last
    final = raw.insert(toks + tokens(PAGE, start=5), lock_id=m.lock_id, allocation_id=m.allocation_id)
    assert (final.inserted_tokens, final.reused_tokens) == (3 * PAGE, 2 * PAGE)
    assert raw.heartbeat() == (0, 0)
    # the session named at MatchPrefix carried to the Inserts: 5 pages deep
    closed = raw.s.CloseSession(pb.CloseSessionRequest(session_id="mid-request"), timeout=10)
    assert closed.released_refs == 5


def test_allocate_evicts_for_room_and_is_resource_exhausted_when_locks_leave_none(raw: Raw) -> None:
    toks = tokens(4 * PAGE, start=70_000)
    raw.put(toks)  # evictable
    big = raw.allocate(12 * PAGE)
    msg = refused(lambda: raw.allocate(8 * PAGE), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert re.search(r"L1|room|pages", msg), msg
    stats = raw.s.Stats(pb.StatsRequest(), timeout=10)
    device = next(p for p in stats.pools if p.tier == pb.DEVICE and p.member == "full")
    assert device.locked_pages >= 12 and device.capacity_pages == 16
    raw.release(allocation_id=big.allocation_id)
    ok = raw.allocate(16 * PAGE)  # evicts the inserted pages
    raw.release(allocation_id=ok.allocation_id)
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


# --------------------------------------------------------------------------- sessions


def test_close_session_drops_references_not_data(raw: Raw) -> None:
    toks = tokens(3 * PAGE, start=80_000)
    raw.put(toks, session_id="conf-s1")
    r = raw.s.CloseSession(pb.CloseSessionRequest(session_id="conf-s1"), timeout=10)
    assert r.released_refs == 3
    assert raw.match(toks).device_tokens == 3 * PAGE  # not its data
    refused(lambda: raw.s.CloseSession(pb.CloseSessionRequest(session_id="conf-never"), timeout=10),
            grpc.StatusCode.NOT_FOUND, "conf-never")
    refused(lambda: raw.s.CloseSession(pb.CloseSessionRequest(), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, "session_id")
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


# --------------------------------------------------------------------------- status codes


ZERO_HANDLE_CALLS: dict[str, Callable[[Raw], Any]] = {
    "Release lock_id=0": lambda r: r.release(lock_id=0),
    "Release allocation_id=0": lambda r: r.release(allocation_id=0),
    "Insert lock_id=0": lambda r: r.insert(b"", lock_id=0),
    "Insert allocation_id=0": lambda r: r.insert(b"", allocation_id=0),
    "Allocate lock_id=0": lambda r: r.allocate(PAGE, lock_id=0),
    "Allocate allocation_id=0": lambda r: r.allocate(PAGE, allocation_id=0),
    "Load lock_id=0": lambda r: r.load(0),
    "PrefetchStatus 0": lambda r: r.status(0),
    "CancelPrefetch 0": lambda r: r.s.CancelPrefetch(pb.CancelPrefetchRequest(prefetch_id=0),
                                                     metadata=r.md, timeout=10),
}


@pytest.mark.parametrize("name", list(ZERO_HANDLE_CALLS))
def test_handle_zero_is_not_found_in_every_rpc(raw: Raw, name: str) -> None:
    refused(lambda: ZERO_HANDLE_CALLS[name](raw), grpc.StatusCode.NOT_FOUND, " 0 ")
    assert raw.heartbeat() == (0, 0)


def test_each_listed_condition_answers_its_code_and_says_what_was_wrong(raw: Raw) -> None:
    code = grpc.StatusCode
    odd = tokens(PAGE)[:-1]
    refused(lambda: raw.match(odd), code.INVALID_ARGUMENT, "multiple of 4")
    refused(lambda: raw.insert(odd), code.INVALID_ARGUMENT, "multiple of 4")
    op = raw.s.Batch(pb.BatchRequest(ops=[pb.BatchOp(match_prefix=pb.MatchPrefixRequest(tokens=odd))]),
                     metadata=raw.md, timeout=10).results[0]
    assert op.WhichOneof("result") == "status" and op.status.code == code.INVALID_ARGUMENT.value[0]
    assert "multiple of 4" in op.status.message
    toks = tokens(3 * PAGE, start=90_000)
    # token count and pages disagree: the allocation covers 1 page, the insert needs 3
    m = raw.match(toks, allocate_tokens=PAGE)
    refused(lambda: raw.insert(toks, lock_id=m.lock_id, allocation_id=m.allocation_id),
            code.INVALID_ARGUMENT, f"allocation {m.allocation_id}")
    refused(lambda: raw.insert(toks, lock_id=m.lock_id), code.INVALID_ARGUMENT, "allocation_id")
    # the refused inserts changed nothing: the handles still work
    raw.release(lock_id=m.lock_id)
    raw.release(allocation_id=m.allocation_id)
    other = tokens(3 * PAGE, start=91_000)
    raw.put(other[:T])
    m = raw.match(other, allocate_tokens=3 * PAGE)
    assert m.device_tokens == PAGE
    refused(lambda: raw.insert(tokens(3 * PAGE, start=5), lock_id=m.lock_id, allocation_id=m.allocation_id),
            code.INVALID_ARGUMENT, "prefix")
    raw.release(lock_id=m.lock_id)
    raw.release(allocation_id=m.allocation_id)
    refused(lambda: raw.allocate(0), code.INVALID_ARGUMENT, "num_tokens")
    refused(lambda: raw.match(toks, allocate_tokens=1 << 20), code.INVALID_ARGUMENT, "allocate_tokens")
    refused(lambda: raw.allocate(8192), code.RESOURCE_EXHAUSTED, "L1")
    refused(lambda: raw.release(), code.INVALID_ARGUMENT, "lock_id")
    refused(lambda: raw.release(lock_id=12345), code.NOT_FOUND, "12345")
    refused(lambda: raw.load(12345), code.NOT_FOUND, "12345")
    refused(lambda: raw.status(12345), code.NOT_FOUND, "12345")
    refused(lambda: raw.s.Attach(pb.AttachRequest(engine_id=ENGINE, tp_size=2), timeout=10),
            code.INVALID_ARGUMENT, "tp_size")
    refused(lambda: raw.s.Heartbeat(pb.HeartbeatRequest(), timeout=10), code.INVALID_ARGUMENT, "engine_id")
    assert raw.heartbeat() == (0, 0)  # (nothing left held)


# --------------------------------------------------------------------------- Stats, Admin


def test_stats_report_pools_per_tier_and_member_and_count_lookups(raw: Raw) -> None:
    before = raw.s.Stats(pb.StatsRequest(), timeout=10)
    toks = tokens(2 * PAGE, start=95_000)
    raw.put(toks)
    raw.match(toks)
    after = raw.s.Stats(pb.StatsRequest(), timeout=10)
    assert after.counters.lookups == before.counters.lookups + 2
    assert after.counters.hit_tokens.device == before.counters.hit_tokens.device + 2 * PAGE
    pools = {(p.tier, p.member): p for p in after.pools}
    assert {pb.DEVICE, pb.HOST} <= {t for t, _ in pools}
    assert pools[(pb.DEVICE, "full")].capacity_pages == 16
    assert pools[(pb.HOST, "full")].capacity_pages == 32
    for p in after.pools:
        assert p.locked_pages <= p.used_pages <= p.capacity_pages, p


def test_stats_rows_are_l1_and_l2_and_l3_figures_are_in_admin_health(raw: Raw) -> None:
    """Stats' pool rows cover the daemon's own tiers, L1 and L2 (README, API overview):
    an L3 is shared by daemons and models, so pages per member of it are no figure of
    this daemon's; its bytes are in Admin Health (and the L3 metrics)."""
    raw.put(tokens(PAGE, start=97_000))
    raw.admin.Flush(apb.FlushRequest(), timeout=30)
    tiers = {p.tier for p in raw.s.Stats(pb.StatsRequest(), timeout=10).pools}
    assert tiers == {pb.DEVICE, pb.HOST}
    (b,) = raw.admin.Health(apb.HealthRequest(deep=True), timeout=30).backends
    assert b.capacity_bytes >= b.used_bytes > 0


def test_flush_writes_what_l3_lacks_and_health_reports_the_backend(raw: Raw) -> None:
    raw.admin.Flush(apb.FlushRequest(), timeout=30)  # (what earlier tests left)
    raw.put(tokens(3 * PAGE, start=98_000))
    assert raw.admin.Flush(apb.FlushRequest(timeout_ms=20_000), timeout=30).pages_written == 3
    assert raw.admin.Flush(apb.FlushRequest(), timeout=30).pages_written == 0
    for deep in (False, True):
        (b,) = raw.admin.Health(apb.HealthRequest(deep=deep), timeout=30).backends
        assert b.name == "file" and b.healthy and b.latency_ms >= 0 and b.capacity_bytes > 0
    assert b.capacity_bytes >= b.used_bytes > 0 and "canary" in b.detail  # deep: a round trip now


# --------------------------------------------------------------------------- hybrid members


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Raw]:
    d = Daemon(tmp_path_factory.mktemp("hyb"), *FULL_SWA_MAMBA, "tiers.l1.tokens=64").start()
    r = Raw(d.target, "hybrid")
    r.attach()
    yield r
    r.channel.close()
    d.close()


def test_device_pages_and_pages_list_every_member_sidecars_with_their_anchor(hybrid: Raw) -> None:
    at = hybrid.attach()
    names = [m.name for m in at.members]
    toks = tokens(24)
    m = hybrid.match(toks, allocate_tokens=26)
    pages = ids(m.pages)
    assert list(pages) == names and pages["idx"] == pages["full"] and pages["conv"] == pages["mamba"]
    assert pages["swaside"] == pages["swa"] and len(pages["full"]) == 7 and len(pages["mamba"]) == 1
    hybrid.insert(toks, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
    again = hybrid.match(toks, lock=True)
    dev = ids(again.device_pages)
    assert list(dev) == names and again.device_tokens == 24
    assert dev["idx"] == dev["full"] and dev["swaside"] == dev["swa"] and dev["conv"] == dev["mamba"]
    window = 8 // 4  # swa window_tokens 8, page 4: pages outside it are -1
    assert dev["swa"][:-window] == [-1] * 4 and -1 not in dev["swa"][-window:]
    hybrid.release(lock_id=again.lock_id)


def test_load_layers_total_is_what_the_proto_says(hybrid: Raw) -> None:
    toks = tokens(16, start=500)
    hybrid.put(toks, mamba_checkpoint=True)
    room = hybrid.allocate(64)  # all of L1: the sequence is left in L2 only
    hybrid.release(allocation_id=room.allocation_id)
    m = hybrid.match(toks, lock=True)
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    steps = hybrid.load(m.lock_id)
    hybrid.release(lock_id=m.lock_id)
    # The proto: the FULL family's layer count (the other components are in L1 before the
    # first message); here 2, while swa has 3 layers.
    full = max(mb.layers for mb in hybrid.attach().members if mb.component == "full")
    assert "the FULL family's layer count" in PROTO.read_text()
    assert steps[-1].layers_total == full == 2, (steps[-1].layers_total, full)
