"""What operators rely on, against real `hicache serve` processes and a real redis-server:
readiness/liveness (the main socket and `server.probe_listen`), `hicache health` exit codes
(0/1/2) as a Kubernetes exec probe sees them, Prometheus metrics (families, labels, values,
no tenant in them), SIGTERM under traffic and with a dead L3, `hicache stats` and
`hicache config check` against the daemon's real state.

README "CLI", "Deployment", "Failure handling", "Configuration reference"; ../shared/API.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.bench.services import RedisServer
from hicache.cli import main
from hicache.client import Client
from hicache.config import load_config
from hicache.errors import HicacheError, NotFound, Unavailable
from hicache.server import longest_stop_s

from .daemonkit import PAGE, Daemon, eventually, free_port, run_cli, scrape, tokens

MakeDaemon = Callable[..., Daemon]
MakeRedis = Callable[[], RedisServer]

SECRET_NS = "tenant-acme-secret-ns"
SECRET_TOKEN = "tok-acme-0123456789-secret"
OPERATOR_TOKEN = "tok-operator-0123456789-star"


def samples(text: str, name: str) -> dict[str, float]:
    """`labels` -> value of every sample of `name` (labels as written, '' for none)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.MULTILINE)
    return {labels: float(value) for labels, value in pattern.findall(text)}


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().out


def serving(target: str, service: str = "") -> bool | None:
    """The grpc.health.v1 status at `target`, None when it does not answer."""
    try:
        with Client(target, retries=0, timeout_s=2.0) as c:
            return c.serving(service)
    except HicacheError:
        return None


def insert(c: Client, prompt: bytes, namespace: str = "") -> None:
    n = len(prompt) // 4
    m = c.match(prompt, namespace, lock=True, allocate_tokens=n)
    c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)


# --------------------------------------------------------------------------- readiness


@pytest.mark.timeout(120)
def test_readiness_goes_not_serving_with_a_required_backend_down_and_serving_once_it_is_back(
    make_daemon: MakeDaemon, redis_factory: MakeRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """Deployment: readiness ("" on the probe listener and the main socket) is NOT_SERVING
    while a `required` backend is down and SERVING again once it is back; liveness
    (`hicache.v1.HiCache`) stays SERVING; `hicache health` exits 1, then 0 again; the
    backend gauge follows."""
    redis = redis_factory()
    probe, port = f"127.0.0.1:{free_port()}", free_port()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=1", "storage.required=true",
                    f"server.probe_listen={probe}", f"metrics.port={port}")
    assert serving(probe) is True and serving(probe, "hicache.v1.HiCache") is True
    assert cli(capsys, "health", "--target", d.target)[0] == 0
    assert samples(scrape(port), "hicache_backend_healthy") == {'backend="redis"': 1.0}

    redis.stop()
    wait_for(lambda: serving(probe) is False, 15, "probe listener NOT_SERVING")
    assert serving(d.target) is False
    assert serving(probe, "hicache.v1.HiCache") is True  # liveness: L1/L2 still serve
    rc, out = cli(capsys, "health", "--target", d.target, "--json")
    report = json.loads(out)
    assert rc == 1 and report["serving"] is False and report["reachable"] is True, out
    text = scrape(port)
    assert samples(text, "hicache_backend_healthy") == {'backend="redis"': 0.0}
    assert samples(text, "hicache_l3_op_seconds_count").get(
        'backend="redis",op="probe",outcome="unavailable"', 0) >= 1, text
    assert run_cli("health", "--target", probe).returncode == 1  # (the probe port too)

    redis.start()  # same port
    wait_for(lambda: serving(probe) is True, 20, "probe listener SERVING again")
    assert serving(d.target) is True
    rc, out = cli(capsys, "health", "--target", d.target, "--deep", "--json")
    assert rc == 0, out
    assert samples(scrape(port), "hicache_backend_healthy") == {'backend="redis"': 1.0}


def test_health_cli_against_the_probe_listener_of_a_healthy_daemon_exits_0(
    make_daemon: MakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probe listener serves grpc.health.v1 (all `hicache health` needs for its verdict
    without a token); exit 1 means "a backend is unhealthy / NOT_SERVING", which a healthy
    daemon without L3 is not."""
    probe = f"127.0.0.1:{free_port()}"
    make_daemon(f"server.probe_listen={probe}")
    assert serving(probe) is True
    rc, out = cli(capsys, "health", "--target", probe, "--json")
    assert rc == 0, out


# --------------------------------------------------------------------------- SIGTERM


def paused_writes(redis: RedisServer, ms: int) -> None:
    """A slow (alive) L3: redis holds every write command for `ms`."""
    import redis as redis_lib

    with redis_lib.Redis.from_url(redis.url) as r:
        r.execute_command("CLIENT", "PAUSE", str(ms), "WRITE")


def redis_keys(redis: RedisServer) -> int:
    import redis as redis_lib

    with redis_lib.Redis.from_url(redis.url) as r:
        return int(r.dbsize())


WRITE_BACK = ("write.l1_to_l2=write_back", "write.l2_to_l3=write_back")


def write_back_daemon(make_daemon: MakeDaemon, redis: RedisServer, *sets: str) -> Daemon:
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}", *WRITE_BACK, *sets)
    with d.client() as c:
        c.attach(map_pools=False)
        for i in range(5):  # 10 pages, all in L1 (16): nothing went down yet
            insert(c, tokens(2 * PAGE, start=10_000 * (i + 1)))
    assert redis_keys(redis) == 0
    return d


def blocked_clients(redis: RedisServer) -> int:
    import redis as redis_lib

    with redis_lib.Redis.from_url(redis.url) as r:
        return int(r.info("clients")["blocked_clients"])


class FlushInFlight:
    """An Admin.Flush under way (its writes held by a paused redis) when SIGTERM comes;
    `release()` lets its writes go (the daemon's stop waits STOP_GRACE_S, 5 s, for it)."""

    def __init__(self, d: Daemon, redis: RedisServer) -> None:
        self.result: list[object] = []
        self.redis = redis
        paused_writes(redis, 20_000)

        def call() -> None:
            try:
                with d.client(retries=0, timeout_s=20) as c:
                    self.result.append(c.flush(8.0))
            except HicacheError as e:
                self.result.append(e)

        self.thread = threading.Thread(target=call)
        self.thread.start()
        # The flush is waiting on its first write (nothing else writes: write-back, and
        # all of it in L1) ...
        assert eventually(lambda: blocked_clients(redis) > 0, 20)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        # ... and the daemon is stopping, the flush still under way.
        assert eventually(lambda: serving(d.target) is False, 5)

    def release(self) -> None:
        import redis as redis_lib

        with redis_lib.Redis.from_url(self.redis.url) as r:
            r.execute_command("CLIENT", "UNPAUSE")


@pytest.mark.timeout(120)
def test_a_stopping_daemon_is_not_serving_to_probes_and_finishes_the_call_under_way(
    make_daemon: MakeDaemon, redis_factory: MakeRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM: health NOT_SERVING (the check still answers), `hicache health` exits 1,
    new calls UNAVAILABLE "shutting down", the call under way finishes (its pages go down),
    exit 0."""
    redis = redis_factory()
    d = write_back_daemon(make_daemon, redis, "storage.timeout_s=5")
    flush = FlushInFlight(d, redis)
    assert serving(d.target) is False and serving(d.target, "hicache.v1.HiCache") is False
    rc, out = cli(capsys, "health", "--target", d.target, "--json")
    report = json.loads(out)
    assert rc == 1 and report["reachable"] is True and report["serving"] is False, out
    with d.client(retries=0) as late, pytest.raises(Unavailable, match="shutting down"):
        late.stats()
    flush.release()
    assert d.stop(timeout_s=30) == 0
    flush.thread.join(10)
    assert flush.result == [10], flush.result  # finished, not cut off
    assert redis_keys(redis) >= 10
    assert not d.socket.exists()


@pytest.mark.timeout(120)
def test_the_probe_listener_answers_not_serving_while_the_daemon_stops(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    redis = redis_factory()
    probe = f"127.0.0.1:{free_port()}"
    d = write_back_daemon(make_daemon, redis, "storage.timeout_s=5", f"server.probe_listen={probe}")
    assert serving(probe) is True
    flush = FlushInFlight(d, redis)
    try:
        assert serving(d.target) is False  # stopping: the main socket says so
        assert serving(probe) is False  # (None: connection refused)
    finally:
        flush.release()
        assert d.stop(timeout_s=30) == 0
        flush.thread.join(10)


@pytest.mark.timeout(120)
def test_stats_cli_on_a_stopping_daemon_says_it_answered(
    make_daemon: MakeDaemon, redis_factory: MakeRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: stats' exit codes are health's (0, 1 refused, 2 unreachable); health gives a
    stopping daemon 1 (it answers, NOT_SERVING)."""
    redis = redis_factory()
    d = write_back_daemon(make_daemon, redis, "storage.timeout_s=5")
    flush = FlushInFlight(d, redis)
    try:
        rc, out = cli(capsys, "stats", "--target", d.target, "--json")
        assert json.loads(out)["reachable"] is True, out
        assert rc == 1, out
    finally:
        flush.release()
        assert d.stop(timeout_s=30) == 0
        flush.thread.join(10)


@pytest.mark.timeout(120)
def test_sigterm_under_engine_traffic_with_a_slow_l3_flushes_write_back_data_and_exits_0(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    """Engines keep calling through the stop: each call either succeeds or is Unavailable
    (never another error); the write-back pages reach a slow (paused) L3 within
    `server.shutdown_flush_s`; shared memory and the socket are gone; exit 0."""
    redis = redis_factory()
    d = write_back_daemon(make_daemon, redis, "storage.timeout_s=4", "server.shutdown_flush_s=6")
    with d.client() as c:
        segments = [Path("/dev/shm") / p.handle.decode() for p in c.attach(map_pools=False).info.pools]
    assert segments and all(s.exists() for s in segments)
    stop = threading.Event()
    ok: list[int] = []
    errors: list[HicacheError] = []

    def engine(n: int) -> None:
        with d.client(retries=0, timeout_s=5, engine_id=f"engine-{n}") as c:
            c.attach(map_pools=False)
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    with c.matched(tokens(2 * PAGE, start=10_000 * (i % 5 + 1))) as m:
                        ok.append(m.device_tokens)
                except HicacheError as e:
                    errors.append(e)
                    time.sleep(0.01)

    engines = [threading.Thread(target=engine, args=(n,)) for n in range(2)]
    for t in engines:
        t.start()
    try:
        wait_for(lambda: len(ok) >= 20, 10, "engines running")
        paused_writes(redis, 2000)
        started = time.monotonic()
        assert d.stop(timeout_s=30) == 0
        took = time.monotonic() - started
        time.sleep(0.3)  # engines call a stopped daemon too
    finally:
        stop.set()
        for t in engines:
            t.join(10)
    assert set(ok) == {2 * PAGE}
    assert errors and all(isinstance(e, Unavailable) for e in errors), {repr(e) for e in errors}
    assert "flushed 10 pages to L3" in d.log(), d.log()
    assert redis_keys(redis) >= 10
    assert took >= 1.0  # it waited for the paused store
    assert not any(s.exists() for s in segments) and not d.socket.exists()


@pytest.mark.timeout(120)
def test_sigterm_with_a_hung_l3_exits_0_within_longest_stop_s(
    make_daemon: MakeDaemon, redis_factory: MakeRedis
) -> None:
    """A store that never answers (SIGSTOP): the flush gives up after
    `server.shutdown_flush_s`, closing waits `storage.timeout_s` + 5 s at most; the daemon
    still unlinks its shared memory and exits 0 within `hicache.server.longest_stop_s`."""
    redis = redis_factory()
    sets = ("storage.timeout_s=1", "server.shutdown_flush_s=2")
    d = write_back_daemon(make_daemon, redis, *sets)
    with d.client() as c:
        segments = [Path("/dev/shm") / p.handle.decode() for p in c.attach(map_pools=False).info.pools]
    bound = longest_stop_s(load_config(None, list(d.sets)))
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert d.stop(timeout_s=bound + 10) == 0
        took = time.monotonic() - started
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    assert took < bound, (took, bound)
    assert not any(s.exists() for s in segments) and not d.socket.exists()
    assert "stopped" in d.log()


# --------------------------------------------------------------------------- metrics


def series(text: str) -> set[str]:
    """The names of every sample in an exposition."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.timeout(120)
def test_metrics_export_the_documented_families_move_with_traffic_and_name_no_tenant(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    port = free_port()
    d = make_daemon("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
                    "write.l1_to_l2=write_through", "write.l2_to_l3=write_through",
                    "prefetch.policy=wait_complete", f"metrics.port={port}",
                    f"server.tokens=[{{token: {SECRET_TOKEN}, namespaces: [{SECRET_NS}]}},"
                    f" {{token: {OPERATOR_TOKEN}, namespaces: ['*']}}]")
    a = tokens(4 * PAGE, start=500_000)
    with d.client(token=SECRET_TOKEN, engine_id="engine-acme-7") as c:
        c.attach(map_pools=False)
        insert(c, a, SECRET_NS)
        before = scrape(port)
        with c.matched(a, SECRET_NS) as hit:
            assert hit.device_tokens == 4 * PAGE
        after = scrape(port)
        assert samples(after, "hicache_lookups_total")[""] == \
            samples(before, "hicache_lookups_total")[""] + 1
        device = 'tier="device"'
        assert samples(after, "hicache_hit_tokens_total")[device] == \
            samples(before, "hicache_hit_tokens_total")[device] + 4 * PAGE
        for i in range(12):  # 48 pages through L1 (16) and L2 (32): `a` is in L3 only
            insert(c, tokens(4 * PAGE, start=600_000 + 10_000 * i), SECRET_NS)
        # (Stats is an operator's: this tenant's token reads the metrics instead.)
        # (60 s: a CI snapshot, 3 workers on 2 cores and other daemons' files, once took
        # more than 15 s for these 52 pages; here they take ~1 s)
        wait_for(lambda: samples(scrape(port), "hicache_backups_total")['tier="storage"'] >= 52,
                 60, "backups to L3")
        with c.matched(a, SECRET_NS, prefetch=True) as m:
            assert m.storage_tokens == 4 * PAGE and m.prefetch_id
            wait_for(lambda: c.prefetch_status(m.prefetch_id).state.value != "RUNNING", 15,
                     "prefetch done")
        with pytest.raises(HicacheError):
            c.match(a, "other-tenant-zzz")  # PERMISSION_DENIED
        m = c.match(a, SECRET_NS, lock=True)
        c.release(lock_id=m.lock_id)
        with pytest.raises(NotFound):
            c.release(lock_id=m.lock_id)
        with d.client(token=OPERATOR_TOKEN) as operator:  # Stats is every tenant's
            snap = operator.stats()
    text = scrape(port)

    documented = {
        "hicache_rpc_seconds_bucket", "hicache_rpc_seconds_count", "hicache_rpc_seconds_sum",
        "hicache_hit_tokens_total", "hicache_lookups_total", "hicache_pool_capacity_pages",
        "hicache_pool_used_pages", "hicache_pool_locked_pages", "hicache_evictions_total",
        "hicache_backups_total", "hicache_prefetches_total", "hicache_backend_healthy",
        "hicache_backend_probe_latency_seconds", "hicache_l3_errors_total",
        "hicache_expired_leases_total", "hicache_backups_l3_present_total",
        "hicache_l3_op_seconds_bucket", "hicache_l3_op_seconds_count", "hicache_l3_op_seconds_sum",
        "hicache_l3_bytes_total", "hicache_l3_corrupt_objects_total",
    }
    assert documented <= series(text), documented - series(text)
    rpc = samples(text, "hicache_rpc_seconds_count")
    for method, code in (("hicache.v1.HiCache/MatchPrefix", "OK"),
                         ("hicache.v1.HiCache/MatchPrefix", "PERMISSION_DENIED"),
                         ("hicache.v1.HiCache/Release", "NOT_FOUND"),
                         ("hicache.v1.HiCache/Insert", "OK")):
        assert rpc.get(f'code="{code}",method="{method}"', 0) >= 1, (method, code, rpc)
    for name, label in (("hicache_hit_tokens_total", "tier"), ("hicache_evictions_total", "tier"),
                        ("hicache_backups_total", "tier")):
        assert set(samples(text, name)) == {f'{label}="{t}"' for t in ("device", "host", "storage")}
    assert {f'outcome="{o}"' for o in ("done", "cancelled", "timed_out", "failed")} <= \
        set(samples(text, "hicache_prefetches_total"))
    assert samples(text, "hicache_prefetches_total")['outcome="done"'] == 1
    assert samples(text, "hicache_evictions_total")['tier="device"'] > 0
    assert samples(text, "hicache_evictions_total")['tier="host"'] > 0
    assert samples(text, "hicache_backups_total")['tier="storage"'] >= 52
    assert samples(text, "hicache_hit_tokens_total")['tier="storage"'] == 4 * PAGE
    assert samples(text, "hicache_backend_healthy") == {'backend="file"': 1.0}
    for op in ("put", "exists", "get"):
        assert samples(text, "hicache_l3_op_seconds_count").get(
            f'backend="file",op="{op}",outcome="ok"', 0) >= 1, op
    # The same figures `hicache stats` (the Stats RPC) reports.
    assert samples(text, "hicache_lookups_total")[""] == snap.counters["lookups"]
    for t in ("device", "host", "storage"):
        assert samples(text, "hicache_hit_tokens_total")[f'tier="{t}"'] == \
            snap.counters[f"hit_tokens_{t}"]
    for p in snap.pools:
        labels = f'member="{p.member}",tier="{p.tier}"'
        assert samples(text, "hicache_pool_capacity_pages")[labels] == p.capacity_pages
        assert samples(text, "hicache_pool_used_pages")[labels] == p.used_pages
    # No tenant: neither namespace (allowed or refused), token nor engine id.
    for secret in (SECRET_NS, "other-tenant-zzz", SECRET_TOKEN, "acme"):
        assert secret not in text, secret
        assert secret not in d.log(), secret


def test_the_documented_backup_counters_are_exported_from_the_start(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """README (Deployment): a skipped L1 -> L2 write-through is "counted as
    `hicache_backups_l2_skipped_total`" (an alert's input), pages the store already held
    are `hicache_backups_l3_present_total`: both must exist (at 0) on a fresh daemon, as
    `hicache_l3_errors_total` does, or an alert/dashboard reads "no data"."""
    port = free_port()
    make_daemon("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
                f"metrics.port={port}")
    names = series(scrape(port))
    assert "hicache_l3_errors_total" in names
    assert {"hicache_backups_l2_skipped_total", "hicache_backups_l3_present_total"} <= names


# --------------------------------------------------------------------------- stats, config


class ConfiguredDaemon(Daemon):
    """`hicache serve --config FILE` alone (no --listen, no --set)."""

    def __init__(self, workdir: Path, config: Path) -> None:
        super().__init__(workdir)
        self.config = config

    def argv(self) -> list[str]:
        return [*super().argv()[:4], "--config", str(self.config)]


@pytest.mark.timeout(120)
def test_config_check_stats_and_health_of_one_config_file_agree_with_the_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`config check FILE` prints the pools the daemon built from FILE; `stats --config FILE`
    and `health --config FILE` find that daemon by the file's `server.listen`."""
    sock = tmp_path / "cfg.sock"
    config = tmp_path / "hicache.yaml"
    config.write_text(
        f"server: {{listen: 'unix://{sock}', max_tokens_per_request: 8192}}\n"
        "metrics: {port: 0}\n"
        "model: {page_size: 32, components: {full: {layers: 2, bytes_per_token_per_layer: 128}}}\n"
        "tiers: {l1: {tokens: 1280}, l2: {ratio: 2.5, reserve_gb: 0}}\n"
    )
    rc, out = cli(capsys, "config", "check", str(config))
    assert rc == 0, out
    assert "l1_pages: 40 (1280 tokens)" in out and "l2_pages: 100 (3200 tokens)" in out, out
    d = ConfiguredDaemon(tmp_path, config)
    d.socket, d.listen = sock, f"unix://{sock}"
    try:
        d.start()
        with d.client() as c:
            c.attach(map_pools=False)
            insert(c, tokens(3 * 32))  # 3 pages
            with c.matched(tokens(3 * 32)) as m:
                assert m.device_tokens == 3 * 32
        rc, out = cli(capsys, "stats", "--config", str(config), "--json")
        assert rc == 0, out
        report = json.loads(out)
        pools = {(p["tier"], p["member"]): p for p in report["pools"]}
        assert pools[("device", "full")]["capacity_pages"] == 40
        assert pools[("host", "full")]["capacity_pages"] == 100
        assert pools[("device", "full")]["used_pages"] == 3
        assert report["counters"]["lookups"] == 2
        assert report["counters"]["hit_tokens_device"] == 3 * 32
        rc, out = cli(capsys, "stats", "--config", str(config))
        assert rc == 0 and re.search(r"^device\s+full\s+40\s+3\s+\d+$", out, re.MULTILINE), out
        assert "hit_tokens_device: 96" in out
        assert cli(capsys, "health", "--config", str(config))[0] == 0
    finally:
        d.close()
    assert cli(capsys, "health", "--config", str(config))[0] == 2  # stopped: unreachable


@pytest.mark.timeout(120)
def test_an_optional_backend_down_at_start_is_unhealthy_then_connected_in_the_background(
    make_daemon: MakeDaemon, redis_factory: MakeRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """`storage.required: false`: it starts without L3, stays SERVING, `hicache health`
    exits 1 and the gauge says 0; once redis answers it is connected (every 5 s): 0 and 1."""
    redis = redis_factory()
    redis.stop()
    port = free_port()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=1", f"metrics.port={port}")
    assert serving(d.target) is True
    rc, out = cli(capsys, "health", "--target", d.target, "--json")
    assert rc == 1 and json.loads(out)["serving"] is True, out
    assert samples(scrape(port), "hicache_backend_healthy") == {'backend="redis"': 0.0}
    redis.start()
    wait_for(lambda: cli(capsys, "health", "--target", d.target)[0] == 0, 15, "connected")
    assert samples(scrape(port), "hicache_backend_healthy") == {'backend="redis"': 1.0}
