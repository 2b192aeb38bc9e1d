"""Review: what the daemon writes to its log and its metrics under trouble.

Real `hicache serve` processes and real redis-servers (one with a password); each scenario
reads the daemon's whole log at the end:

- a Redis URL with a password, the server down for the daemon's whole life (an optional
  backend): the password never logged; the retries every 5 s are no news (one line per
  state change, not per attempt); what it never wrote to L3 is counted at SIGTERM;
- the same server flapping under write-through traffic: the password never logged, one
  "breaker open" line per trip (as many as `hicache_l3_breaker_trips_total`), and the
  recovery said;
- a full Redis refusing every write: throttled, counted, and the line says it is writes;
- a hung store at SIGTERM: the operator learns how many pages were lost;
- bearer tokens: wrong and missing tokens, a namespace the token does not allow, an engine
  dying holding a lock and an allocation, clients cancelling or dropping a `Load`,
  malformed messages; no token nor denied namespace in the log or the metrics, no
  traceback, the lease lapse logged once with its counts; `hicache health`/`stats` with
  token files echo no token;
- configuration errors at start: exit 2, the key named, no traceback, no secret.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
import redis as redis_py

from hicache.bench.services import RedisServer, find_binary
from hicache.client import Client
from hicache.errors import HicacheError, PermissionDenied, Unauthenticated
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

PASSWORD = "Zq7-redis-pw-never-logged-81"
TENANT = "tenant-token-logs-review-0123456789"
OPERATOR = "operator-token-logs-review-9876543210"
WRONG = "wrong-token-logs-review-5555555555"
ALLOWED_NS = "ns-allowed"
DENIED_NS = "tenant-zeta-hidden-namespace"


class PasswordRedis(RedisServer):
    """redis-server that asks for PASSWORD (kept across restarts: it is in the argv)."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--requirepass", PASSWORD]

    @property
    def secret_url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def keys(self) -> int:
        return int(redis_py.Redis(port=self.port, password=PASSWORD).dbsize())


def redis_binary() -> str:
    path = find_binary("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed")
    return path


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def insert(c: Client, prompt: bytes, namespace: str = "") -> None:
    m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4)
    c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)


def samples(text: str, name: str) -> dict[str, float]:
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.MULTILINE)
    return {labels: float(value) for labels, value in pattern.findall(text)}


def between(log: str, start: str, end: str) -> list[str]:
    """The lines after the first line holding `start` and before the first holding `end`."""
    lines = log.splitlines()
    i = next(n for n, line in enumerate(lines) if start in line)
    j = next(n for n, line in enumerate(lines) if end in line)
    return lines[i + 1 : j]


# ------------------------------------------------------------------ L3 down the whole time


class DownAtStart:
    def __init__(self, log: str, rc: int) -> None:
        self.log = log
        self.rc = rc


@pytest.fixture(scope="module")
def down_at_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DownAtStart]:
    """An optional Redis L3 (URL with a password) that never answers; 10 write-back pages
    inserted (in L1/L2 only); 11.5 s of life (two background connect attempts); SIGTERM."""
    redis = PasswordRedis(redis_binary())  # never started: its port refuses connections
    d = Daemon(
        tmp_path_factory.mktemp("down"),
        "storage.backend=redis",
        f"storage.redis.url={redis.secret_url}",
        "storage.timeout_s=1",
        "write.l1_to_l2=write_back",
        "write.l2_to_l3=write_back",
    ).start()
    try:
        with d.client() as c:
            c.attach(map_pools=False)
            for i in range(2):
                insert(c, tokens(5 * PAGE, start=1_000 + 10_000 * i))
        time.sleep(11.5)
        rc = d.stop(timeout_s=30)
    finally:
        d.close()
    yield DownAtStart(d.log(), rc)


def test_a_down_redis_never_logs_its_password_and_the_start_says_it_is_down(
    down_at_start: DownAtStart,
) -> None:
    log = down_at_start.log
    assert down_at_start.rc == 0, log
    assert PASSWORD not in log, log
    assert "redis://***@127.0.0.1" in log, log  # the URL shown without its credentials
    assert re.search(r"ERROR .*L3 redis unavailable, serving from L1/L2 only", log), log
    assert "Traceback" not in log, log


def test_retries_of_an_optional_backend_that_stays_down_are_no_news(
    down_at_start: DownAtStart,
) -> None:
    """Between "ready" and "stopping" nothing changed (the store was down at start and
    stayed down) over two retries: at most one line, not two per retry."""
    quiet = between(down_at_start.log, "daemon ready", "daemon stopping")
    assert len(quiet) <= 1, "\n".join(quiet)


def test_sigterm_with_l3_never_connected_counts_the_pages_it_could_not_write(
    down_at_start: DownAtStart,
) -> None:
    log = down_at_start.log
    after_stop = log.split("daemon stopping", 1)[1].splitlines()
    warned = [line for line in after_stop if " WARNING " in line or " ERROR " in line]
    assert any(re.search(r"\b10\b.*\bpages?\b", line) for line in warned), log


# ------------------------------------------------------------------ a flapping store


class Stopped(NamedTuple):
    """A daemon's run, over: its whole log, its last metrics scrape, its exit code."""

    log: str
    metrics: str
    rc: int


@pytest.fixture(scope="module")
def flapping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    """A password Redis L3 under write-through traffic, killed and restarted twice; each
    time the breaker trips while it is down, and backups land again once it is back."""
    redis = PasswordRedis(redis_binary())
    redis.start()
    metrics_port = free_port()
    d = Daemon(
        tmp_path_factory.mktemp("flap"),
        "storage.backend=redis",
        f"storage.redis.url={redis.secret_url}",
        "storage.timeout_s=1",
        "write.l1_to_l2=write_through",
        "write.l2_to_l3=write_through",
        f"metrics.port={metrics_port}",
    ).start()
    n = [0]

    def one_request(c: Client) -> None:
        n[0] += 1
        with contextlib.suppress(HicacheError):
            insert(c, tokens(2 * PAGE, start=100_000 + 1_000 * n[0]))
        time.sleep(0.02)

    def trips() -> int:
        return d.log().count("circuit breaker open after")

    try:
        with d.client(timeout_s=5) as c:
            c.attach(map_pools=False)
            one_request(c)
            wait_for(lambda: redis.keys() > 0, 10, "backups land")
            for cycle in range(2):
                redis.stop(kill=True)
                deadline = time.monotonic() + 15
                while trips() < cycle + 1:
                    assert time.monotonic() < deadline, d.log()
                    one_request(c)
                redis.start()  # empty: what lands now was written after the restart
                deadline = time.monotonic() + 15
                while redis.keys() == 0:
                    assert time.monotonic() < deadline, d.log()
                    one_request(c)
        metrics = scrape(metrics_port)
        rc = d.stop(timeout_s=30)
    finally:
        d.close()
        redis.close()
    yield Stopped(d.log(), metrics, rc)


def test_a_flapping_redis_logs_no_password_one_line_per_trip_and_counts_them(
    flapping: Stopped,
) -> None:
    log = flapping.log
    assert flapping.rc == 0, log
    assert PASSWORD not in log and PASSWORD not in flapping.metrics
    assert "Traceback" not in log, log
    trip_lines = [line for line in log.splitlines() if "circuit breaker open after" in line]
    # (two outages: two trips, unless a call that succeeded just before a kill reopened
    # the count; either way one line per trip)
    assert len(trip_lines) >= 2, log
    assert samples(flapping.metrics, "hicache_l3_breaker_trips_total") == {"": len(trip_lines)}
    assert samples(flapping.metrics, "hicache_l3_errors_total")[""] >= 2
    # The per-call failures are throttled: far fewer lines than failed calls.
    failures = [line for line in log.splitlines() if "ConnectionError" in line]
    assert 1 <= len(failures) <= 4, "\n".join(failures)


def test_the_breaker_closing_after_an_outage_is_logged(flapping: Stopped) -> None:
    lines = flapping.log.splitlines()
    last_trip = max(n for n, line in enumerate(lines) if "circuit breaker open after" in line)
    recovered = re.compile(
        r"(?i)\b(closed|recovered|back up|healthy again|resumed|reconnected)\b")
    assert any(recovered.search(line) for line in lines[last_trip + 1 :]), "\n".join(lines)


# ------------------------------------------------------------------ a store refusing writes


@pytest.fixture(scope="module")
def full_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    """A Redis over its maxmemory (noeviction): every put is refused (OOM), reads work."""
    redis = RedisServer(redis_binary())
    redis.start()
    admin = redis_py.Redis(port=redis.port)
    admin.set("filler", b"x" * 2_000_000)
    admin.config_set("maxmemory", "1mb")
    admin.config_set("maxmemory-policy", "noeviction")
    metrics_port = free_port()
    d = Daemon(
        tmp_path_factory.mktemp("full"),
        "storage.backend=redis",
        f"storage.redis.url={redis.url}",
        "storage.timeout_s=1",
        "write.l1_to_l2=write_through",
        "write.l2_to_l3=write_through",
        f"metrics.port={metrics_port}",
    ).start()
    try:
        with d.client() as c:
            c.attach(map_pools=False)
            i = 0
            deadline = time.monotonic() + 15
            while "breaker open" not in d.log() or i < 20:
                assert time.monotonic() < deadline, d.log()
                insert(c, tokens(2 * PAGE, start=500_000 + 1_000 * i))
                i += 1
                time.sleep(0.02)
        wait_for(lambda: "giving up on write-through" in d.log(), 15, "a backup given up")
        metrics = scrape(metrics_port)
        rc = d.stop(timeout_s=30)
    finally:
        d.close()
        redis.close()
    yield Stopped(d.log(), metrics, rc)


def test_a_store_refusing_every_write_is_throttled_and_counted(full_store: Stopped) -> None:
    log = full_store.log
    assert full_store.rc == 0, log
    assert "Traceback" not in log, log
    refused = [line for line in log.splitlines() if "refused a put" in line]
    assert len(refused) == 1, "\n".join(refused)  # 20+ refused batches, one line
    assert samples(full_store.metrics, "hicache_backups_l3_failed_total")[""] >= 1
    assert samples(full_store.metrics, "hicache_backups_total").get('tier="storage"') == 0.0
    # What it could not write is said at the stop.
    assert re.search(r"WARNING .*\b\d+ pages L3 lacks were not flushed", log), log


def test_a_write_breaker_trip_says_it_is_writes_that_stopped(full_store: Stopped) -> None:
    lines = [line for line in full_store.log.splitlines() if "breaker open after" in line]
    assert lines, full_store.log
    assert all(re.search(r"(?i)\bwrites?\b", line) for line in lines), "\n".join(lines)


# ------------------------------------------------------------------ SIGTERM, store hung


def test_sigterm_with_a_hung_store_says_how_many_pages_leave_with_the_daemon(
    tmp_path: Path,
) -> None:
    redis = RedisServer(redis_binary())
    redis.start()
    d = Daemon(
        tmp_path,
        "storage.backend=redis",
        f"storage.redis.url={redis.url}",
        "storage.timeout_s=1",
        "server.shutdown_flush_s=2",
        "write.l1_to_l2=write_back",
        "write.l2_to_l3=write_back",
    ).start()
    try:
        with d.client() as c:
            c.attach(map_pools=False)
            for i in range(2):
                insert(c, tokens(5 * PAGE, start=700_000 + 10_000 * i))
        assert redis.pid is not None
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            assert d.stop(timeout_s=40) == 0
        finally:
            os.kill(redis.pid, signal.SIGCONT)
    finally:
        d.close()
        redis.close()
    log = d.log()
    assert "Traceback" not in log, log
    assert re.search(r"WARNING .*\b10 pages L3 lacks were not flushed", log), log
    assert "daemon stopped" in log


# ------------------------------------------------------------------ tokens and tenants


DYING_ENGINE = """
import os, sys
from hicache.client import Client
c = Client(sys.argv[1], engine_id="dying-engine", token=sys.argv[2], retries=0)
c.attach(map_pools=False)
p = (bytes(range(1, 5)) * {n})
m = c.match(p, sys.argv[3], lock=True, allocate_tokens=len(p) // 4)
assert m.lock_id and m.allocation_id
print("held", flush=True)
os._exit(0)
"""


class Tenants:
    def __init__(self, d: Daemon, metrics_port: int, workdir: Path) -> None:
        self.d = d
        self.metrics_port = metrics_port
        self.workdir = workdir


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    metrics_port = free_port()
    work = tmp_path_factory.mktemp("tenants")
    d = Daemon(
        work,
        f"server.tokens=[{{token: {TENANT}, namespaces: [{ALLOWED_NS}]}}, "
        f"{{token: {OPERATOR}, namespaces: ['*']}}]",
        "server.lease_ms=3000",  # (short, for the dying engine's lapse; not under a stall)
        f"metrics.port={metrics_port}",
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    yield Tenants(d, metrics_port, work)
    d.close()


def _raw(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    return channel.unary_unary(method, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)


def test_troubled_callers_leave_no_secret_no_tenant_and_no_traceback(tenants: Tenants) -> None:
    d = tenants.d
    # Wrong and missing tokens, a namespace the token does not allow (in a call and a Batch).
    with d.client(token=WRONG, retries=0) as c, pytest.raises(Unauthenticated):
        c.stats()
    with d.client(retries=0) as c, pytest.raises(Unauthenticated):
        c.stats()
    with d.client(token=TENANT, retries=0) as c:
        c.attach(map_pools=False)
        with pytest.raises(PermissionDenied):
            c.match(tokens(PAGE), DENIED_NS, lock=True)
        # Data in L2 only: a prompt pushed out of L1 (16 pages) by four others.
        prompt = tokens(4 * PAGE, start=3_000_000)
        insert(c, prompt, ALLOWED_NS)
        for i in range(5):
            insert(c, tokens(4 * PAGE, start=3_100_000 + 10_000 * i), ALLOWED_NS)
        m = c.match(prompt, ALLOWED_NS, lock=True)
        assert m.host_tokens > 0, m
        # A Load cancelled after its first message (the generator closed: the call cancelled).
        stream = c.load(m.lock_id)
        next(stream)
        stream.close()
        c.release(lock_id=m.lock_id)
        # A Load whose client drops the connection mid-stream.
        m = c.match(prompt, ALLOWED_NS, lock=True)
        channel = grpc.insecure_channel(d.target)
        call = pb_grpc.HiCacheStub(channel).Load(pb.LoadRequest(lock_id=m.lock_id),
                                                 metadata=c._metadata, timeout=10)
        next(call)
        channel.close()
        time.sleep(0.3)
        with contextlib.suppress(HicacheError):  # (the load may still hold it, or ended)
            c.release(lock_id=m.lock_id)
        # Malformed messages, with and without credentials; a call past its deadline.
        with grpc.insecure_channel(d.target) as raw:
            for method in ("/hicache.v1.HiCache/MatchPrefix", "/hicache.v1.HiCache/Batch",
                           "/hicache.v1.Admin/Health"):
                for metadata in (c._metadata, ()):
                    with pytest.raises(grpc.RpcError) as info:
                        _raw(raw, method)(b"\xff\xff\xff\xff\x0f junk", metadata=metadata,
                                          timeout=5)
                    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                 grpc.StatusCode.UNAUTHENTICATED)
            try:  # (may still make it in time)
                pb_grpc.HiCacheStub(raw).MatchPrefix(
                    pb.MatchPrefixRequest(namespace=ALLOWED_NS, tokens=tokens(8 * PAGE),
                                          lock=True), metadata=c._metadata, timeout=0.001)
            except grpc.RpcError as e:
                assert e.code() is grpc.StatusCode.DEADLINE_EXCEEDED, e
    time.sleep(0.5)
    log = d.log()
    metrics = scrape(tenants.metrics_port)
    for secret in (TENANT, OPERATOR, WRONG, DENIED_NS):
        assert secret not in log, (secret, log)
        assert secret not in metrics, secret
    assert "Traceback" not in log, log
    assert not [line for line in log.splitlines() if " ERROR " in line], log
    # The denial is measured under its code, labelled by method only.
    codes = samples(metrics, "hicache_rpc_seconds_count")
    assert codes.get('code="PERMISSION_DENIED",method="hicache.v1.HiCache/MatchPrefix"') == 1.0


def test_an_engine_dying_with_a_lock_and_an_allocation_is_logged_once_with_its_counts(
    tenants: Tenants,
) -> None:
    d = tenants.d
    out = subprocess.run(
        [sys.executable, "-c", DYING_ENGINE.replace("{n}", str(2 * PAGE)), d.target, TENANT,
         ALLOWED_NS],
        capture_output=True, text=True, timeout=60,
    )
    assert "held" in out.stdout, out.stdout + out.stderr

    def lapse_lines() -> list[str]:
        return [line for line in d.log().splitlines()
                if "dying-engine" in line and "lease lapsed" in line]

    wait_for(lambda: bool(lapse_lines()), 20, "the lease lapse")
    time.sleep(4)  # more than a lease: a second line would have come by now
    lines = lapse_lines()
    assert len(lines) == 1, lines
    assert " WARNING " in lines[0] and "released 1 locks, 1 allocations" in lines[0], lines
    assert TENANT not in lines[0] and ALLOWED_NS not in lines[0], lines
    metrics = scrape(tenants.metrics_port)
    assert samples(metrics, "hicache_lease_released_locks_total")[""] >= 1
    assert samples(metrics, "hicache_lease_released_allocations_total")[""] >= 1


def test_health_and_stats_with_token_files_echo_no_token(tenants: Tenants) -> None:
    d = tenants.d
    right, wrong = tenants.workdir / "right.tok", tenants.workdir / "wrong.tok"
    right.write_text(OPERATOR + "\n")
    wrong.write_text(WRONG + "\n")
    for command in ("health", "stats"):
        for token_file, ok in ((right, True), (wrong, False)):
            out = run_cli(command, "--target", d.target, "--token-file", str(token_file),
                          "--json")
            text = out.stdout + out.stderr
            assert OPERATOR not in text and WRONG not in text and TENANT not in text, text
            assert "Traceback" not in text, text
            if ok:
                assert out.returncode == 0, text
            else:
                assert out.returncode in (0, 1), text  # (health: the standard check decides)
    assert OPERATOR not in d.log() and WRONG not in d.log()


# ------------------------------------------------------------------ configuration errors


@pytest.mark.parametrize(("sets", "key"), [
    (("tiers.l2.ratio=1.0",), "tiers.l2.ratio"),
    ((f"storage.redis.url=redis://:{PASSWORD}@127.0.0.1:notaport/0", "storage.backend=redis"),
     "storage.redis.url"),
    ((f"server.tokens=[{{token: short{PASSWORD[:3]}, namespaces: [a]}}]",), "server.tokens"),
    (("server.lease_ms=5",), "server.lease_ms"),
])
def test_a_configuration_error_at_start_names_the_key_exits_2_without_traceback_or_secret(
    tmp_path: Path, sets: tuple[str, ...], key: str
) -> None:
    argv = ["serve", "--listen", f"unix://{tmp_path}/x.sock"]
    for item in ("tiers.l1.tokens=1024", "tiers.l2.reserve_gb=0", "metrics.port=0", *sets):
        argv += ["--set", item]
    out = run_cli(*argv, timeout_s=60)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert key in text, text
    assert "Traceback" not in text, text
    assert PASSWORD not in text and f"short{PASSWORD[:3]}" not in text, text
