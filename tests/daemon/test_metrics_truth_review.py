"""Review: do the Prometheus metrics and the `Stats` RPC say what happened?

Real `hicache serve` processes and the real engine client drive known workloads (hits in
L1, L2 and L3, inserts, evictions under pressure, loads, prefetches by outcome, errors of
several codes, Batch calls, hybrid models with sidecars); each test then checks that the
metrics moved by exactly what the workload did, agree with `Stats`, never go down and name
no tenant. Confirmed bugs are strict xfails.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from hicache.client import Client, match_op, release_op
from hicache.errors import (
    HicacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)

from .daemonkit import FULL_SWA_MAMBA, PAGE, Daemon, free_port, scrape, tokens

MakeDaemon = Callable[..., Daemon]
Key = tuple[str, tuple[tuple[str, str], ...]]

NS = "tenant-zebra-secret-ns"
SESSION = "session-zebra-secret-31"
REQUEST = "request-zebra-secret-77"
SEQ = 4 * PAGE  # tokens of one inserted sequence: 4 pages
L1_PAGES, L2_PAGES = 16, 32  # daemonkit.TINY


# --------------------------------------------------------------------------- helpers


class Scrape:
    """One exposition, parsed: every sample by (name, sorted labels), and each family's type."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values: dict[Key, float] = {}
        self.types: dict[str, str] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.values[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.values[(name, tuple(sorted(labels.items())))]

    def by(self, name: str, label: str) -> dict[str, float]:
        return {dict(lb)[label]: v for (n, lb), v in self.values.items() if n == name}

    def pools(self, what: str) -> dict[tuple[str, str], float]:
        return {
            (dict(lb)["tier"], dict(lb)["member"]): v
            for (n, lb), v in self.values.items()
            if n == f"hicache_pool_{what}_pages"
        }

    def counter_samples(self) -> dict[Key, float]:
        """Every sample of a counter family (`*_total`, `*_created` left out)."""
        counters = {n for n, t in self.types.items() if t == "counter"}
        return {
            k: v
            for k, v in self.values.items()
            if k[0].endswith("_total") and k[0][: -len("_total")] in counters
        }

    def rpc_counts(self) -> dict[tuple[str, str], float]:
        return {
            (dict(lb)["method"], dict(lb)["code"]): v
            for (n, lb), v in self.values.items()
            if n == "hicache_rpc_seconds_count"
        }


def metrics(port: int) -> Scrape:
    return Scrape(scrape(port))


def delta(after: dict, before: dict) -> dict:  # type: ignore[type-arg]
    return {
        k: after.get(k, 0) - before.get(k, 0)
        for k in set(after) | set(before)
        if after.get(k, 0) != before.get(k, 0)
    }


def foreground(key: tuple[str, str]) -> bool:
    """False for the calls a client makes on its own (heartbeats, reachability checks)."""
    return not key[0].startswith("grpc.health") and not key[0].endswith("/Heartbeat")


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def insert(c: Client, prompt: bytes, namespace: str = NS) -> None:
    n = len(prompt) // 4
    m = c.match(
        prompt, namespace, lock=True, allocate_tokens=n, session_id=SESSION, request_id=REQUEST
    )
    c.insert(
        prompt,
        namespace,
        lock_id=m.lock_id,
        allocation_id=m.allocation_id,
        session_id=SESSION,
        request_id=REQUEST,
    )


def seq(i: int) -> bytes:
    return tokens(SEQ, start=1_000_000 + 10_000 * i)


def fill_13(c: Client) -> None:
    """13 sequences of 4 pages (52 pages) through L1 (16) and L2 (32), each written to L3:
    afterwards seq 9..12 are in L1, 5..12 in L2, 0..4 in L3 only."""
    for i in range(13):
        insert(c, seq(i))
    wait_for(
        lambda: (
            c.stats().counters["backups_storage"] >= 52 and c.stats().counters["backups_host"] >= 52
        ),
        "backups to L2 and L3",
    )


def assert_stats_agree(s: Scrape, c: Client) -> None:
    """The scrape and the Stats RPC (taken with nothing running between) report the same."""
    snap = c.stats()
    cnt = snap.counters
    assert s.get("hicache_lookups_total") == cnt["lookups"]
    assert s.get("hicache_l3_errors_total") == cnt["l3_errors"]
    assert s.get("hicache_expired_leases_total") == cnt["expired_leases"]
    for group in ("hit_tokens", "evictions", "backups"):
        assert s.by(f"hicache_{group}_total", "tier") == {
            t: cnt[f"{group}_{t}"] for t in ("device", "host", "storage")
        }, group
    assert s.by("hicache_prefetches_total", "outcome") == {
        o: cnt[f"prefetches_{o}"] for o in ("done", "cancelled", "timed_out", "failed")
    }
    assert s.get("hicache_prefetches_running") == cnt["prefetches_running"]
    for what in ("capacity", "used", "locked"):
        assert s.pools(what) == {
            (p.tier, p.member): getattr(p, f"{what}_pages") for p in snap.pools
        }, what


def assert_never_down(scrapes: list[Scrape]) -> None:
    for before, after in itertools.pairwise(scrapes):
        b, a = before.counter_samples(), after.counter_samples()
        for key, value in b.items():
            assert key in a, f"counter sample {key} disappeared"
            assert a[key] >= value, f"counter {key} went down: {value} -> {a[key]}"


# --------------------------------------------------------------------------- the workload


@pytest.mark.timeout(60)
def test_hits_evictions_backups_and_loads_count_what_happened(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    port = free_port()
    d = make_daemon(
        "storage.backend=file",
        f"storage.file.path={tmp_path / 'l3'}",
        "write.l2_to_l3=write_through",
        "prefetch.policy=wait_complete",
        f"metrics.port={port}",
    )
    scrapes = [metrics(port)]
    fresh = scrapes[0]
    assert fresh.get("hicache_lookups_total") == 0
    assert fresh.pools("capacity") == {("device", "full"): L1_PAGES, ("host", "full"): L2_PAGES}
    with d.client() as c:
        c.attach(map_pools=False)
        fill_13(c)
        s1 = metrics(port)
        scrapes.append(s1)
        # Every page of the 52 landed in L1 and was copied to L2 and L3; what is not
        # resident any more was evicted, exactly.
        assert s1.by("hicache_backups_total", "tier") == {"device": 0, "host": 52, "storage": 52}
        used = s1.pools("used")
        assert used == {("device", "full"): L1_PAGES, ("host", "full"): L2_PAGES}
        assert s1.by("hicache_evictions_total", "tier") == {
            "device": 52 - L1_PAGES,
            "host": 52 - L2_PAGES,
            "storage": 0,
        }
        assert s1.get("hicache_lookups_total") == 13
        assert s1.pools("locked") == {("device", "full"): 0, ("host", "full"): 0}
        assert s1.get("hicache_l3_op_seconds_count", backend="file", op="put", outcome="ok") >= 1
        assert_stats_agree(s1, c)

        # One hit per tier: L1 (seq 12), L2 (seq 5, then loaded), L3 (seq 0, no prefetch).
        rpc_before = s1.rpc_counts()
        m = c.match(seq(12), NS, session_id=SESSION, request_id=REQUEST)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (SEQ, 0, 0)
        m = c.match(seq(5), NS, lock=True, session_id=SESSION, request_id=REQUEST)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, SEQ, 0)
        s_locked = metrics(port)
        scrapes.append(s_locked)
        # The lock holds seq 5's 4 pages in L2 (nothing of it in L1 yet).
        assert s_locked.pools("locked") == {("device", "full"): 0, ("host", "full"): 4}
        assert s_locked.get("hicache_active_locks") == 1
        steps = list(c.load(m.lock_id))
        assert steps[-1].device_tokens == SEQ
        s_loaded = metrics(port)
        scrapes.append(s_loaded)
        assert s_loaded.pools("locked") == {("device", "full"): 4, ("host", "full"): 4}
        c.release(lock_id=m.lock_id)
        m = c.match(seq(0), NS, session_id=SESSION, request_id=REQUEST)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, SEQ)
        s2 = metrics(port)
        scrapes.append(s2)
        assert s2.get("hicache_lookups_total") - s1.get("hicache_lookups_total") == 3
        assert delta(
            s2.by("hicache_hit_tokens_total", "tier"), s1.by("hicache_hit_tokens_total", "tier")
        ) == {"device": SEQ, "host": SEQ, "storage": SEQ}
        assert s2.get("hicache_loaded_pages_total") - s1.get("hicache_loaded_pages_total") == 4
        # The load put 4 more pages into a full L1: exactly 4 more L1 evictions; L2 none.
        assert delta(
            s2.by("hicache_evictions_total", "tier"), s1.by("hicache_evictions_total", "tier")
        ) == {"device": 4}
        assert s2.pools("used") == used
        assert s2.pools("locked") == {("device", "full"): 0, ("host", "full"): 0}
        assert s2.get("hicache_active_locks") == 0
        calls = {k: v for k, v in delta(s2.rpc_counts(), rpc_before).items() if foreground(k)}
        assert calls == {
            ("hicache.v1.HiCache/MatchPrefix", "OK"): 3,
            ("hicache.v1.HiCache/Load", "OK"): 1,
            ("hicache.v1.HiCache/Release", "OK"): 1,
            ("hicache.v1.HiCache/Stats", "OK"): 1,  # (assert_stats_agree's)
        }, calls
        assert_stats_agree(s2, c)
    assert_never_down(scrapes)
    for secret in (NS, SESSION, REQUEST):
        assert all(secret not in s.text for s in scrapes), secret


@pytest.mark.timeout(60)
def test_prefetch_outcomes_and_l3_reads_count_each_prefetch_once(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Prefetches whose deadline has passed at once (TIMED_OUT, however the read ends),
    some cancelled at once (a cancel after the deadline changes nothing), and one whose
    objects were deleted from the store: each counted once, under the outcome
    PrefetchStatus reports."""
    port = free_port()
    l3 = tmp_path / "l3"
    d = make_daemon(
        "storage.backend=file",
        f"storage.file.path={l3}",
        "write.l2_to_l3=write_through",
        "prefetch.policy=timeout",
        "prefetch.timeout_base_s=0",
        "prefetch.timeout_per_ki_token_s=0",
        f"metrics.port={port}",
    )
    with d.client() as c:
        c.attach(map_pools=False)
        fill_13(c)
        sizes = {p.stat().st_size for p in l3.rglob("*") if p.is_file()}
        assert len(sizes) == 1, sizes  # every object the same size
        (obj_bytes,) = sizes
        before = metrics(port)
        seen: Counter[str] = Counter()
        reads = 0
        for i, cancel in ((0, False), (1, False), (2, True), (3, True), (4, False)):
            m = c.match(seq(i), NS, prefetch=True)
            assert m.storage_tokens == SEQ and m.prefetch_id, m
            if cancel:
                c.cancel_prefetch(m.prefetch_id)
            else:
                reads += 1
                first = c.prefetch_status(m.prefetch_id).state.value
                assert first in ("TIMED_OUT", "DONE"), first
            wait_for(lambda: c.stats().counters["prefetches_running"] == 0, "prefetch ends")
            seen[c.prefetch_status(m.prefetch_id).state.value.lower()] += 1
        mid = metrics(port)
        got = delta(
            mid.by("hicache_prefetches_total", "outcome"),
            before.by("hicache_prefetches_total", "outcome"),
        )
        assert got == dict(seen), (got, seen)
        assert (
            mid.get("hicache_prefetches_started_total")
            - before.get("hicache_prefetches_started_total")
            == 5
        )
        get_ok = {"backend": "file", "op": "get", "outcome": "ok"}
        # One read per prefetch that was not cancelled (4 pages: one batch); each object
        # read whole.
        n_get = mid.get("hicache_l3_op_seconds_count", **get_ok) - before.values.get(
            ("hicache_l3_op_seconds_count", tuple(sorted(get_ok.items()))), 0
        )
        assert reads <= n_get <= 5, (reads, n_get)
        got_bytes = mid.get("hicache_l3_bytes_total", backend="file", op="get") - before.get(
            "hicache_l3_bytes_total", backend="file", op="get"
        )
        assert got_bytes == n_get * 4 * obj_bytes, (got_bytes, n_get, obj_bytes)
        assert mid.get("hicache_l3_op_seconds_bucket", le="+Inf", **get_ok) == mid.get(
            "hicache_l3_op_seconds_count", **get_ok
        )

        # The store loses every object (an operator wiped it); the daemon still believes
        # seq 5..8 are there (L2 evicted them for the prefetches): the prefetch fails.
        for p in l3.rglob("*"):
            if p.is_file():
                p.unlink()
        target = next(i for i in range(5, 13) if c.match(seq(i), NS).storage_tokens == SEQ)
        m = c.match(seq(target), NS, prefetch=True)
        assert m.prefetch_id
        wait_for(lambda: c.stats().counters["prefetches_running"] == 0, "prefetch ends")
        # Its deadline (0 s) passed before the read failed: TIMED_OUT, as it is whoever
        # looks first (an engine that had polled at once would have seen that too).
        assert c.prefetch_status(m.prefetch_id).state.value == "TIMED_OUT"
        end = metrics(port)
        assert delta(
            end.by("hicache_prefetches_total", "outcome"),
            mid.by("hicache_prefetches_total", "outcome"),
        ) == {"timed_out": 1}
        assert (
            end.get("hicache_l3_op_seconds_count", **get_ok)
            - mid.get("hicache_l3_op_seconds_count", **get_ok)
            == 1
        )  # answered, all misses
        assert end.get("hicache_l3_bytes_total", backend="file", op="get") == mid.get(
            "hicache_l3_bytes_total", backend="file", op="get"
        )
        assert_stats_agree(end, c)
    assert_never_down([before, mid, end])


# --------------------------------------------------------------------------- RPC metrics


TOKEN = "tok-zebra-0123456789-secret"


@pytest.mark.timeout(60)
def test_rpc_histogram_counts_each_call_once_under_its_final_code(make_daemon: MakeDaemon) -> None:
    port = free_port()
    d = make_daemon(
        f"metrics.port={port}", f"server.tokens=[{{token: {TOKEN}, namespaces: [{NS}]}}]"
    )
    with d.client(token=TOKEN, engine_id="engine-zebra-5") as c:
        c.attach(map_pools=False)
        assert c.serving()  # (the connection is up: no health check before the calls below)
        before = metrics(port)
        with pytest.raises(InvalidArgument):
            c.match(b"\x01\x02\x03", NS)  # 3 bytes of tokens
        with pytest.raises(NotFound):
            list(c.load(987654321))  # a server stream's status
        with pytest.raises(ResourceExhausted):
            c.allocate((L1_PAGES + 1) * PAGE, NS)  # more than all of L1
        with pytest.raises(HicacheError):
            c.match(tokens(PAGE), "tenant-other-secret")  # PERMISSION_DENIED
        results = c.batch(
            [match_op(b"\x01", NS), release_op(lock_id=77), match_op(tokens(SEQ, start=5), NS)]
        )
        assert isinstance(results[0], InvalidArgument) and isinstance(results[1], NotFound)
        m = c.match(tokens(SEQ, start=9), NS, lock=True, allocate_tokens=SEQ)
        c.insert(tokens(SEQ, start=9), NS, lock_id=m.lock_id, allocation_id=m.allocation_id)
    with Client(d.target, retries=0) as anon, pytest.raises(Unauthenticated):
        anon.stats()
    raw = grpc.insecure_channel(d.target)
    try:
        call = raw.unary_unary(
            "/hicache.v1.HiCache/MatchPrefix",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        raw.close()
    after = metrics(port)
    hc = "hicache.v1.HiCache/"
    got = {k: v for k, v in delta(after.rpc_counts(), before.rpc_counts()).items() if foreground(k)}
    assert got == {
        (hc + "MatchPrefix", "INVALID_ARGUMENT"): 2,
        (hc + "MatchPrefix", "PERMISSION_DENIED"): 1,
        (hc + "MatchPrefix", "OK"): 1,
        (hc + "Load", "NOT_FOUND"): 1,
        (hc + "Allocate", "RESOURCE_EXHAUSTED"): 1,
        (hc + "Batch", "OK"): 1,  # once, whatever its ops answered
        (hc + "Insert", "OK"): 1,
        (hc + "Stats", "UNAUTHENTICATED"): 1,
    }, got
    # Only the answered matches are lookups: the Batch's third op and the locked one.
    assert after.get("hicache_lookups_total") - before.get("hicache_lookups_total") == 2
    # Each histogram is whole: +Inf bucket = count, buckets cumulative.
    for (method, code), n in after.rpc_counts().items():
        buckets = sorted(
            (
                (float(dict(lb)["le"]), v)
                for (name, lb), v in after.values.items()
                if name == "hicache_rpc_seconds_bucket"
                and dict(lb)["method"] == method
                and dict(lb)["code"] == code
            )
        )
        assert buckets[-1] == (float("inf"), n)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    for secret in (NS, "tenant-other-secret", TOKEN, "zebra"):
        assert secret not in after.text, secret


@pytest.mark.timeout(60)
def test_health_check_not_found_is_counted_under_not_found(make_daemon: MakeDaemon) -> None:
    port = free_port()
    d = make_daemon(f"metrics.port={port}")
    method = "grpc.health.v1.Health/Check"
    before = metrics(port).rpc_counts()
    channel = grpc.insecure_channel(d.target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"))
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
    got = delta(metrics(port).rpc_counts(), before)
    assert got == {(method, "NOT_FOUND"): 3}, got


# --------------------------------------------------------------------------- pools


@pytest.mark.timeout(60)
def test_locked_pages_include_what_allocations_hold(make_daemon: MakeDaemon) -> None:
    port = free_port()
    d = make_daemon(f"metrics.port={port}")
    with d.client() as c:
        c.attach(map_pools=False)
        with c.allocation(4 * PAGE, NS):
            s = metrics(port)
            assert s.pools("used")[("device", "full")] == 4
            assert s.get("hicache_active_allocations") == 1
            # None of the 4 pages can be evicted or handed to another request.
            with pytest.raises(ResourceExhausted):
                c.allocate((L1_PAGES - 3) * PAGE, NS)
            assert s.pools("locked")[("device", "full")] == 4, s.pools("locked")


@pytest.mark.timeout(60)
def test_storage_evictions_are_counted(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    port = free_port()
    l3 = tmp_path / "l3"
    obj = 4 * 256 * PAGE + 64  # one page of every layer, and the object's header
    d = make_daemon(
        "storage.backend=file",
        f"storage.file.path={l3}",
        f"storage.file.capacity_gb={12 * obj / 2**30}",
        "write.l2_to_l3=write_through",
        f"metrics.port={port}",
    )
    with d.client() as c:
        c.attach(map_pools=False)
        fill_13(c)  # 52 objects written into room for 12
        kept = sum(1 for p in l3.rglob("*") if p.is_file())
        assert kept <= 12, kept
        s = metrics(port)
        assert s.get("hicache_backups_total", tier="storage") == 52
        assert s.get("hicache_evictions_total", tier="storage") == 52 - kept


@pytest.mark.timeout(60)
def test_a_lapsed_lease_is_counted_once_and_what_it_held_leaves_the_pool_gauges(
    make_daemon: MakeDaemon,
) -> None:
    port = free_port()
    d = make_daemon("server.lease_ms=1500", f"metrics.port={port}")
    with d.client() as keeper:  # a second engine whose lease stays alive
        keeper.attach(map_pools=False)
        insert(keeper, seq(0))
        gone = d.client(engine_id="engine-lapsing")
        gone.attach(map_pools=False)
        m = gone.match(seq(0), NS, lock=True, allocate_tokens=SEQ + 2 * PAGE)
        assert m.device_tokens == SEQ and m.allocation_id
        held = metrics(port)
        assert held.pools("used")[("device", "full")] == 4 + 2
        assert held.pools("locked")[("device", "full")] == 4 + 2  # the lock's, the allocation's
        assert held.get("hicache_active_locks") == 1
        assert held.get("hicache_active_allocations") == 1
        gone.close()  # no release, no more heartbeats: the lease lapses
        wait_for(
            lambda: (
                metrics(port).get("hicache_expired_leases_total")
                > held.get("hicache_expired_leases_total")
            ),
            "the lease lapses",
            15,
        )
        time.sleep(1.0)  # (a second sweep must not count it again)
        after = metrics(port)
        assert (
            after.get("hicache_expired_leases_total") - held.get("hicache_expired_leases_total")
            == 1
        )
        assert (
            after.get("hicache_lease_released_locks_total")
            - held.get("hicache_lease_released_locks_total")
            == 1
        )
        assert (
            after.get("hicache_lease_released_allocations_total")
            - held.get("hicache_lease_released_allocations_total")
            == 1
        )
        assert after.get("hicache_active_locks") == 0
        assert after.get("hicache_active_allocations") == 0
        assert after.pools("locked") == {("device", "full"): 0, ("host", "full"): 0}
        assert after.pools("used")[("device", "full")] == 4  # the inserted prompt stays
        assert_stats_agree(after, keeper)
    assert "engine-lapsing" not in after.text


# --------------------------------------------------------------------------- hybrid models

HYBRID = (
    *FULL_SWA_MAMBA,
    "tiers.l1.tokens=64",
    "tiers.l1.mamba_slots=8",
)
PAGED = ("full", "idx", "swa", "swaside")
STATE = ("mamba", "conv")


def per_member(paged: float, state: float) -> dict[str, float]:
    return {**dict.fromkeys(PAGED, paged), **dict.fromkeys(STATE, state)}


@pytest.mark.timeout(60)
def test_hybrid_pools_are_reported_per_member_as_held(make_daemon: MakeDaemon) -> None:
    port = free_port()
    d = make_daemon(*HYBRID, f"metrics.port={port}")
    ps = 4

    def tier(s: Scrape, what: str, t: str) -> dict[str, float]:
        return {m: v for (tt, m), v in s.pools(what).items() if tt == t}

    with d.client() as c:
        c.attach(map_pools=False)
        s0 = metrics(port)
        assert tier(s0, "capacity", "device") == per_member(16, 8)
        assert tier(s0, "capacity", "host") == per_member(32, 16)
        prompt = tokens(8 * ps, start=40_000)
        m = c.match(prompt, NS, lock=True, allocate_tokens=8 * ps)
        assert {k: len(v) for k, v in m.pages.items()} == per_member(8, 1)
        s1 = metrics(port)
        assert tier(s1, "used", "device") == per_member(8, 1)
        assert tier(s1, "used", "host") == per_member(0, 0)
        assert_stats_agree(s1, c)
        c.insert(
            prompt, NS, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True
        )
        # (landed, not only reserved: L2 pages count as used from their reservation, as
        # locked once the tree has them; backups count at landing)
        wait_for(
            lambda: all(p.used_pages for p in c.stats().pools if p.tier == "host")
            and c.stats().counters["backups_host"] >= 8,
            "write-through to L2",
        )
        m = c.match(prompt, NS, lock=True)
        assert m.device_tokens == 8 * ps
        s2 = metrics(port)
        for t in ("device", "host"):
            assert tier(s2, "used", t) == per_member(8, 1), t
            assert tier(s2, "locked", t) == per_member(8, 1), t
        assert s2.get("hicache_hit_tokens_total", tier="device") == 8 * ps
        assert_stats_agree(s2, c)
        c.release(lock_id=m.lock_id)
        s3 = metrics(port)
        for t in ("device", "host"):
            assert tier(s3, "locked", t) == per_member(0, 0), t
        # 6 more prompts of 8 pages through L1 (16) and L2 (32): 56 FULL pages placed in
        # each tier, what is not resident was evicted, exactly.
        for i in range(6):
            p = tokens(8 * ps, start=50_000 + 1_000 * i)
            m = c.match(p, NS, lock=True, allocate_tokens=8 * ps)
            c.insert(p, NS, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True)
        wait_for(lambda: c.stats().counters["backups_host"] >= 56, "write-through to L2")
        s4 = metrics(port)
        used = s4.pools("used")
        ev = s4.by("hicache_evictions_total", "tier")
        assert used[("device", "full")] + ev["device"] == 56
        assert used[("host", "full")] + ev["host"] == 56
        for t in ("device", "host"):
            cap = tier(s4, "capacity", t)
            assert all(v <= cap[k] for k, v in tier(s4, "used", t).items()), t
            # A sidecar's pool moves with its anchor's.
            u = tier(s4, "used", t)
            assert u["idx"] == u["full"] and u["swaside"] == u["swa"] and u["conv"] == u["mamba"]
        assert_stats_agree(s4, c)
    assert_never_down([s0, s1, s2, s3, s4])
    assert all(NS not in s.text for s in (s0, s1, s2, s3, s4))


# --------------------------------------------------------------------------- the port


def _listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # (closed meanwhile)
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", link)
        if found:
            inodes.add(found.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.timeout(60)
def test_metrics_port_zero_serves_nothing_and_a_port_serves_there(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    off = make_daemon(listen=f"unix://{tmp_path}/off.sock")  # daemonkit: metrics.port=0
    assert off.proc is not None
    assert _listening_tcp_ports(off.proc.pid) == set()
    port = free_port()
    on = make_daemon(f"metrics.port={port}", listen=f"unix://{tmp_path}/on.sock")
    assert on.proc is not None and on.proc.poll() is None
    assert _listening_tcp_ports(on.proc.pid) == {port}
    assert "hicache_lookups_total" in scrape(port)
    assert _listening_tcp_ports(off.proc.pid) == set()


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_stops_the_start_and_leaves_nothing(make_daemon: MakeDaemon) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        d = make_daemon(f"metrics.port={port}", start=False)
        d.start(wait=False)
        assert d.proc is not None
        assert d.proc.wait(timeout=30) == 1
    assert f"metrics.port={port}: cannot serve metrics there" in d.log()
    assert not d.socket.exists()
    assert not list(Path("/dev/shm").glob(f"hicache-*-{d.proc.pid}-*"))
