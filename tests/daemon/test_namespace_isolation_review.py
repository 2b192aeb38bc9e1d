"""Review: namespace isolation between tenants, end to end with real daemons.

A namespace is the isolation domain (API.md: "pages never match across namespaces, in any
tier"); `server.tokens` maps each bearer token to the namespaces it may use, and with
tokens engine ids and session ids are scoped to the token. These tests look for every way
one tenant (or namespace) can reach, hit, close or observe another's KV or state, and for
namespaces that collide (in the tree, in L3 keys shared by two daemons, in a Batch), and
for state the daemon keeps per namespace that a caller can grow without bound.

One TCP-loopback daemon with three tokens (tenant A: `a`, `shared`; tenant B: `b`; an
operator: `*`) and a cap of two open sessions serves the tenant tests; the L3 and memory
tests start daemons of their own.
"""

from __future__ import annotations

import time
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache.client import Client, allocate_op, insert_op, match_op
from hicache.controller.base import MatchOutcome
from hicache.errors import InvalidArgument, NotFound, PermissionDenied
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.tree import HiRadixTree

from .daemonkit import PAGE, Daemon, free_port, scrape, tokens

TENANT_A = "nsiso-tenant-a-token-0123456789"
TENANT_B = "nsiso-tenant-b-token-9876543210"
OPERATOR = "nsiso-operator-star-token-55555"
MAX_OPEN_SESSIONS = 2
WRITE_THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through")


class World:
    def __init__(self, daemon: Daemon, metrics_port: int) -> None:
        self.d = daemon
        self.metrics_port = metrics_port

    def client(self, token: str, engine_id: str, **kwargs: Any) -> Client:
        kwargs.setdefault("retries", 0)
        return self.d.client(token=token, engine_id=engine_id, **kwargs)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    metrics = free_port()
    d = Daemon(
        tmp_path_factory.mktemp("nsiso"),
        f"server.tokens=[{{token: {TENANT_A}, namespaces: [a, shared]}}, "
        f"{{token: {TENANT_B}, namespaces: [b]}}, {{token: {OPERATOR}, namespaces: ['*']}}]",
        f"eviction.max_open_sessions={MAX_OPEN_SESSIONS}",
        f"metrics.port={metrics}",
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    yield World(d, metrics)
    d.close()


def insert(c: Client, prompt: bytes, namespace: str, **kwargs: Any) -> None:
    m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4, **kwargs)
    c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------ handles and namespaces


def test_a_lock_or_allocation_never_carries_pages_into_another_namespace(world: World) -> None:
    """A token allowed two namespaces: a lock or allocation made in one, named by an
    Insert or Allocate (plain or as Batch ops) in the other, is refused, and nothing of
    the first namespace's prefix becomes visible in the second."""
    prompt = tokens(3 * PAGE, start=310_000)
    with world.client(TENANT_A, "ta-mix") as a:
        a.attach(map_pools=False)
        insert(a, prompt[: 2 * 4 * PAGE], "a")
        m = a.match(prompt, "a", lock=True, allocate_tokens=3 * PAGE)
        assert m.device_tokens == 2 * PAGE, m
        with pytest.raises(InvalidArgument, match="namespace 'shared' does not match"):
            a.insert(prompt, "shared", lock_id=m.lock_id, allocation_id=m.allocation_id)
        with pytest.raises(InvalidArgument, match="does not match"):
            a.allocate(PAGE, "shared", allocation_id=m.allocation_id)
        with pytest.raises(InvalidArgument, match="does not match"):
            a.allocate(PAGE, "shared", lock_id=m.lock_id)
        results = a.batch([
            insert_op(prompt, "shared", lock_id=m.lock_id, allocation_id=m.allocation_id),
            allocate_op(PAGE, "shared", allocation_id=m.allocation_id),
            insert_op(prompt, "b", lock_id=m.lock_id, allocation_id=m.allocation_id),
            match_op(prompt, "shared"),
        ])
        assert isinstance(results[0], InvalidArgument), results
        assert isinstance(results[1], InvalidArgument), results
        assert isinstance(results[2], PermissionDenied), results
        seen = results[3]
        assert isinstance(seen, MatchOutcome), results
        assert (seen.device_tokens, seen.host_tokens, seen.storage_tokens) == (0, 0, 0)
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)  # the refused ops consumed nothing
        a.insert(prompt, "a", lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert a.match(prompt, "a").device_tokens == 3 * PAGE
        assert a.match(prompt, "shared").device_tokens == 0
    with world.client(OPERATOR, "op-mix") as op:
        op.attach(map_pools=False)
        for ns in ("A", "a ", " a", "", "shared", "a\x00", "*"):
            got = op.match(prompt, ns)
            assert (got.device_tokens, got.host_tokens) == (0, 0), (ns, got)


# ------------------------------------------------------------------ sessions across tenants


def test_a_tenant_opening_sessions_never_closes_another_tenants_session(world: World) -> None:
    """Session ids are scoped to the token so that "one cannot close another's" (README),
    but `eviction.max_open_sessions` is one LRU over every tenant: tenant A opening
    sessions closes tenant B's. B's request in flight then references nothing, and B's
    CloseSession answers the depth of the path it had before (the tombstone)."""
    p2 = tokens(2 * PAGE, start=320_000)
    p3 = tokens(3 * PAGE, start=320_000)
    with world.client(TENANT_B, "tb-sess") as b, world.client(TENANT_A, "ta-sess") as a:
        b.attach(map_pools=False)
        a.attach(map_pools=False)
        insert(b, p2, "b", session_id="conv-b")
        m = b.match(p3, "b", lock=True, allocate_tokens=3 * PAGE, session_id="conv-b")
        # Tenant A: MAX_OPEN_SESSIONS + 1 sessions of its own.
        for i in range(MAX_OPEN_SESSIONS + 1):
            la = a.match(tokens(PAGE, start=330_000 + 1000 * i), "a", lock=True,
                         session_id=f"conv-a-{i}")
            a.release(lock_id=la.lock_id)
        b.insert(p3, "b", lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert b.close_session("conv-b") == 3, "B's session was closed by tenant A's sessions"


def test_a_tenant_cannot_see_or_close_another_tenants_session(world: World) -> None:
    """Same session id in two tenants: two sessions; closing one leaves the other."""
    prompt = tokens(2 * PAGE, start=340_000)
    with world.client(TENANT_A, "ta-s2") as a, world.client(TENANT_B, "tb-s2") as b:
        a.attach(map_pools=False)
        b.attach(map_pools=False)
        insert(a, prompt, "a", session_id="same-id")
        with pytest.raises(NotFound):
            b.close_session("same-id")
        results = b.batch([pb.BatchOp(close_session=pb.CloseSessionRequest(session_id="same-id"))])
        assert isinstance(results[0], NotFound), results
        assert a.close_session("same-id") == 2


# ------------------------------------------------------------------ what a tenant observes


def test_a_tenants_stats_do_not_reveal_another_tenants_activity(world: World) -> None:
    """Flush is refused to a token limited to some namespaces ("every tenant's data");
    Stats hands such a token every tenant's counters: tenant B watches tenant A's lookups,
    hit tokens, locks and allocations move. Either refused, or B's own figures only."""
    prompt = tokens(2 * PAGE, start=350_000)
    with world.client(TENANT_A, "ta-stats") as a, world.client(TENANT_B, "tb-stats") as b:
        a.attach(map_pools=False)
        insert(a, prompt, "a")
        try:
            before = b.stats().counters
        except PermissionDenied:
            return
        held = a.match(prompt, "a", lock=True, allocate_tokens=3 * PAGE)
        for _ in range(3):
            a.match(prompt, "a")
        after = b.stats().counters
        a.release(lock_id=held.lock_id)
        a.release(allocation_id=held.allocation_id)
    moved = {k: (before.get(k), after.get(k)) for k in
             ("lookups", "hit_tokens_device", "active_locks", "active_allocations")
             if before.get(k) != after.get(k)}
    assert not moved, f"tenant B saw tenant A's activity: {moved}"


def test_namespaces_and_tokens_reach_neither_log_nor_metrics(world: World) -> None:
    """README: "Namespaces and tokens never appear in metrics or logs", errors included
    (a denied namespace, a lock of another namespace, an unknown session)."""
    secret_ns = "nsiso-secret-namespace-zebra"
    prompt = tokens(2 * PAGE, start=360_000)
    with world.client(OPERATOR, "op-log") as op, world.client(TENANT_B, "tb-log") as b:
        op.attach(map_pools=False)
        b.attach(map_pools=False)
        insert(op, prompt, secret_ns, session_id=f"{secret_ns}-session")
        m = op.match(prompt, secret_ns, lock=True)
        with pytest.raises(InvalidArgument):
            op.insert(prompt, secret_ns + "-other", lock_id=m.lock_id)
        op.release(lock_id=m.lock_id)
        with pytest.raises(PermissionDenied):
            b.match(prompt, secret_ns)
        with pytest.raises(NotFound):
            b.close_session(f"{secret_ns}-session")
        b.batch([match_op(prompt, secret_ns), insert_op(prompt, secret_ns)])
        assert op.close_session(f"{secret_ns}-session") == 2
    log = world.d.log()
    metrics = scrape(world.metrics_port)
    assert "hicache_rpc_seconds" in metrics and "ready" in log
    for secret in ("nsiso-secret", TENANT_A, TENANT_B, OPERATOR):
        assert secret not in log, secret
        assert secret not in metrics, secret


# ------------------------------------------------------------------ L3 shared by two daemons


@pytest.mark.timeout(60)
def test_two_daemons_on_one_file_l3_never_share_near_namespaces(make_daemon: Any, tmp_path: Path) -> None:
    """Daemon 1 stores one prompt under several namespaces; daemon 2, on the same store,
    finds it in L3 under exactly those namespaces and under none that differ by case,
    spaces, a separator, a NUL, or Unicode normalization (NFC vs NFD). Daemon 1's own
    tree tells them apart too."""
    sets = (*WRITE_THROUGH, "storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
            "prefetch.policy=wait_complete")
    salt = uuid.uuid4().hex[:6]
    stored = [f"t{salt}", f"c{salt}-caf\u00e9", f"p{salt}/x", ""]
    near = [f"T{salt}", f"t{salt} ", f" t{salt}", f"t{salt}\x00",
            unicodedata.normalize("NFD", stored[1]), f"p{salt}", f"p{salt}/", f"p{salt}/x/",
            f"p{salt}x", " ", "\x00", "*"]
    assert unicodedata.normalize("NFD", stored[1]) != stored[1]
    prompt = tokens(2 * PAGE, start=370_000)
    first = make_daemon(*sets, listen=f"unix://{tmp_path}/first.sock")
    second = make_daemon(*sets, listen=f"unix://{tmp_path}/second.sock")
    with first.client(engine_id="w") as w:
        w.attach(map_pools=False)
        for ns in stored:
            insert(w, prompt, ns)
        w.flush(timeout_s=10)
        assert w.stats().counters["backups_storage"] == 2 * len(stored)
        for ns in near:
            got = w.match(prompt, ns)
            assert (got.device_tokens, got.host_tokens, got.storage_tokens) == (0, 0, 0), (ns, got)
    with second.client(engine_id="r") as r:
        r.attach(map_pools=False)
        for ns in stored:
            got = r.match(prompt, ns)
            assert (got.device_tokens, got.host_tokens, got.storage_tokens) == (0, 0, 2 * PAGE), (ns, got)
        for ns in near:
            got = r.match(prompt, ns)
            assert (got.device_tokens, got.host_tokens, got.storage_tokens) == (0, 0, 0), (ns, got)


@pytest.mark.timeout(60)
def test_redis_keys_never_name_the_namespace_and_differ_by_case(make_daemon: Any, tmp_path: Path,
                                                               redis_server: Any) -> None:
    """L3 keys carry a tag of the namespace, never its name ("tenants are not named in
    L3"), and two namespaces differing only in case share no key."""
    import redis

    sets = (*WRITE_THROUGH, "storage.backend=redis", f"storage.redis.url={redis_server.url}")
    salt = uuid.uuid4().hex[:8]
    upper, lower = f"TenantNs{salt}", f"tenantns{salt}"
    prompt = tokens(2 * PAGE, start=380_000)
    r = redis.Redis.from_url(redis_server.url)
    before = set(r.keys("hc2/*"))
    d = make_daemon(*sets)
    with d.client(engine_id="w") as w:
        w.attach(map_pools=False)
        insert(w, prompt, upper)
        w.flush(timeout_s=10)
        made_upper = set(r.keys("hc2/*")) - before
        insert(w, prompt, lower)
        w.flush(timeout_s=10)
        made_lower = set(r.keys("hc2/*")) - before - made_upper
        assert w.match(prompt, upper).storage_tokens == 0  # (in L1: not counted again)
    assert len(made_upper) == len(made_lower) == 2, (made_upper, made_lower)
    for key in made_upper | made_lower:
        assert salt.encode() not in key.lower() and b"tenant" not in key.lower(), key


# ------------------------------------------------------------------ per-namespace state


@pytest.mark.timeout(60)
def test_inserts_of_nothing_into_new_namespaces_leave_no_state_behind(make_daemon: Any) -> None:
    """Empty namespaces' roots go (session 20: "namespace roots growing without bound"),
    but only went when a root's last child was deleted: an Insert of fewer tokens than a
    page (or none) into a namespace the tree lacked created its root and left it, with the
    namespace string, for the daemon's life (120 such calls with ~0.9 MB names kept ~110
    MB). Now such an Insert keeps no root, and a namespace past 1024 characters is refused
    before anything is kept."""
    d = make_daemon()
    assert d.proc is not None
    with d.client(engine_id="e") as c:
        c.attach(map_pools=False)
        with pytest.raises(InvalidArgument, match="namespace: 900000 characters; at most 1024"):
            c.insert(b"", "n" * 900_000)
        with pytest.raises(InvalidArgument, match="namespace"):
            c.match(tokens(PAGE), "n" * 1025)
        name = "n" * 1000
        for _ in range(200):  # the process's buffers, once
            c.insert(b"", name)
        base = rss_bytes(d.proc.pid)
        for i in range(3000):
            if i % 2:
                c.insert(b"", f"{i:06d}" + name)
            else:
                c.insert(tokens(PAGE // 2), f"{i:06d}" + name)
        grown = rss_bytes(d.proc.pid) - base
        assert c.match(tokens(PAGE), f"{0:06d}" + name).device_tokens == 0
    # A root kept for each is ~1 KB of name and a node: ~4.4 MB measured.
    assert grown < 2.5e6, f"daemon memory grew {grown / 1e6:.1f} MB for 3000 empty inserts"


def test_an_empty_insert_into_a_new_namespace_keeps_no_root() -> None:
    """The tree itself: nothing committed, no root; the integrity check refuses one."""
    tree = HiRadixTree(4)
    tree.insert("fresh", b"", {})
    tree.insert("fresh2", np.arange(2, dtype="<u4").tobytes(), {})  # under one page
    assert not tree._roots
    tree.check_integrity()
