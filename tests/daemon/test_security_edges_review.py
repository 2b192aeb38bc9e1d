"""Review: TLS and bearer-token edge cases, end to end with real daemons.

One TLS daemon on a wildcard address (0.0.0.0, dialled on 127.0.0.1) with three tokens (a
tenant of `a`/`shared`, a tenant of `b`, an operator's `*`) and a file L3 (prefetches
happen) serves most tests; the rest start daemons of their own for what a start decides
(the listen address's TLS rule, the TLS pair, the tokens).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.client import Client, match_op, release_op
from hicache.errors import NotFound, PermissionDenied, Unauthenticated, Unavailable
from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import admin_pb2_grpc as apb_grpc
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import PAGE, Daemon, free_port, run_cli, tokens

TENANT_A = "review-tenant-a-token-0123456789"
TENANT_B = "review-tenant-b-token-9876543210"
OPERATOR = "review-operator-star-token-55555"
WRONG = "review-wrong-token-never-configured"
ALL_TOKENS = (TENANT_A, TENANT_B, OPERATOR, WRONG)


def make_cert(directory: Path, name: str, san: str) -> tuple[Path, Path]:
    """A self-signed certificate (CN and subjectAltName as given) and its key."""
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=review",
            "-addext",
            f"subjectAltName={san}",
            "-keyout",
            str(key),
            "-out",
            str(crt),
        ],
        check=True,
        capture_output=True,
    )
    return crt, key


class WildcardDaemon(Daemon):
    """A daemon listening on a wildcard address, reached (and probed) on loopback."""

    def __init__(self, workdir: Path, *sets: str, port: int, ca: bytes) -> None:
        super().__init__(workdir, *sets, listen=f"0.0.0.0:{port}", ca=ca)
        self.port = port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


class World:
    def __init__(
        self, daemon: WildcardDaemon, crt: Path, key: Path, other_crt: Path, workdir: Path
    ) -> None:
        self.d = daemon
        self.crt = crt
        self.key = key
        self.ca = crt.read_bytes()
        self.other_crt = other_crt
        self.workdir = workdir

    def client(self, token: str | None, **kwargs: object) -> Client:
        kwargs.setdefault("retries", 0)
        return self.d.client(token=token, **kwargs)

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(self.d.target, grpc.ssl_channel_credentials(self.ca))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("secedge")
    # No DNS name in the certificate: "localhost" must fail hostname verification.
    crt, key = make_cert(work, "daemon", "IP:127.0.0.1,IP:::1")
    other_crt, _ = make_cert(work, "other", "IP:127.0.0.1")
    port = free_port()
    d = WildcardDaemon(
        work,
        f"server.tls_cert={crt}",
        f"server.tls_key={key}",
        f"server.tokens=[{{token: {TENANT_A}, namespaces: [a, shared]}}, "
        f"{{token: {TENANT_B}, namespaces: [b]}}, {{token: {OPERATOR}, namespaces: ['*']}}]",
        "storage.backend=file",
        f"storage.file.path={work / 'l3'}",
        "write.l1_to_l2=write_through",
        "write.l2_to_l3=write_through",
        "prefetch.policy=wait_complete",
        port=port,
        ca=crt.read_bytes(),
    ).start()
    yield World(d, crt, key, other_crt, work)
    d.close()


def wait_for(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def insert(c: Client, prompt: bytes, namespace: str) -> None:
    m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4)
    c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)


# ------------------------------------------------------------------ TLS on the wire


def test_a_wildcard_tls_daemon_serves_tls_only(world: World) -> None:
    """0.0.0.0 with a certificate starts; a plaintext caller (token or not) gets nothing."""
    with (
        Client(world.d.target, tls=False, token=TENANT_A, retries=0, timeout_s=2.0) as plain,
        pytest.raises(Unavailable),
    ):
        plain.serving()
    with world.client(TENANT_A, engine_id="tls-a") as a:
        a.attach(map_pools=False)
        prompt = tokens(2 * PAGE, start=10_000)
        insert(a, prompt, "a")
        assert a.match(prompt, "a").device_tokens == 2 * PAGE


def test_tls_failures_are_unavailable_and_name_the_certificate_problem(world: World) -> None:
    port = world.d.port
    cases = {
        "wrong CA": (f"127.0.0.1:{port}", world.other_crt.read_bytes(), "certificate"),
        "system roots": (f"127.0.0.1:{port}", None, "certificate"),
        "name not in the certificate": (f"localhost:{port}", world.ca, "hostname"),
    }
    for case, (target, roots, why) in cases.items():
        with (
            Client(
                target, tls=True, root_certificates=roots, token=TENANT_A, retries=0, timeout_s=3.0
            ) as c,
            pytest.raises(Unavailable) as info,
        ):
            c.stats()
        assert why in str(info.value).lower(), (case, str(info.value))
        assert TENANT_A not in str(info.value)
    # The right name over IPv6 loopback reaches the same (dual-stack) wildcard bind.
    with Client(f"[::1]:{port}", root_certificates=world.ca, token=TENANT_A, retries=0) as c:
        assert c.serving()


# ------------------------------------------------------------------ tokens


def test_authorization_header_forms(world: World) -> None:
    """The scheme is case-insensitive and spaces around the token are dropped; anything
    but the exact token (a prefix, a longer one, no scheme, another scheme) is refused,
    and no refusal quotes what was sent."""
    with world.channel() as channel:
        stats = pb_grpc.HiCacheStub(channel).Stats
        accepted = [f"bearer {OPERATOR}", f"BEARER {OPERATOR}", f"Bearer   {OPERATOR}   "]
        for value in accepted:
            stats(pb.StatsRequest(), metadata=(("authorization", value),), timeout=10)
        refused = [
            TENANT_A,
            f"Bearer {TENANT_A[:-1]}",
            f"Bearer {TENANT_A}x",
            f"Basic {TENANT_A}",
            f"Bearer {TENANT_A} {TENANT_A}",
            "Bearer",
            "Bearer ",
        ]
        for value in refused:
            with pytest.raises(grpc.RpcError) as info:
                stats(pb.StatsRequest(), metadata=(("authorization", value),), timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, value
            assert TENANT_A[:16] not in (info.value.details() or ""), value


def test_every_call_without_a_token_is_unauthenticated_but_the_health_check(world: World) -> None:
    calls = [
        ("Attach", pb.AttachRequest(engine_id="x", tp_size=1)),
        ("Heartbeat", pb.HeartbeatRequest(engine_id="x")),
        ("MatchPrefix", pb.MatchPrefixRequest(namespace="a", tokens=tokens(PAGE))),
        ("PrefetchStatus", pb.PrefetchStatusRequest(prefetch_id=1)),
        ("CancelPrefetch", pb.CancelPrefetchRequest(prefetch_id=1)),
        ("Allocate", pb.AllocateRequest(namespace="a", num_tokens=PAGE)),
        ("Insert", pb.InsertRequest(namespace="a", tokens=tokens(PAGE))),
        ("Release", pb.ReleaseRequest(lock_id=1)),
        ("CloseSession", pb.CloseSessionRequest(session_id="s")),
        ("Stats", pb.StatsRequest()),
        ("Batch", pb.BatchRequest(ops=[pb.BatchOp(stats=pb.StatsRequest())])),
    ]
    with world.channel() as channel:
        stub = pb_grpc.HiCacheStub(channel)
        for metadata in ((), (("authorization", f"Bearer {WRONG}"),)):
            for name, request in calls:
                with pytest.raises(grpc.RpcError) as info:
                    getattr(stub, name)(request, metadata=metadata, timeout=10)
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, name
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Load(pb.LoadRequest(lock_id=1), metadata=metadata, timeout=10))
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                apb_grpc.AdminStub(channel).Health(
                    apb.HealthRequest(), metadata=metadata, timeout=10
                )
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            # A body that does not parse: the credentials are checked first.
            raw = channel.unary_unary("/hicache.v1.HiCache/MatchPrefix")
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\xff\xff\xff", metadata=metadata, timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        check = health_pb2_grpc.HealthStub(channel).Check
        assert (
            check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_a_tenant_cannot_use_another_namespace_in_any_call(world: World) -> None:
    with world.client(TENANT_B, engine_id="tenant-b-ns") as b:
        b.attach(map_pools=False)
        for call in (
            lambda: b.match(tokens(PAGE), "a"),
            lambda: b.allocate(PAGE, "a"),
            lambda: b.insert(tokens(PAGE), "shared"),
            lambda: b.match(tokens(PAGE), "a", prefetch=True),
            lambda: b.match(tokens(PAGE), "*"),
        ):
            with pytest.raises(PermissionDenied):
                call()
        results = b.batch(
            [
                match_op(tokens(PAGE), "b"),
                match_op(tokens(PAGE), "a"),
                pb.BatchOp(insert=pb.InsertRequest(namespace="shared", tokens=tokens(PAGE))),
                pb.BatchOp(allocate=pb.AllocateRequest(namespace="", num_tokens=PAGE)),
            ]
        )
        assert all(isinstance(r, PermissionDenied) for r in results[1:]), results
        assert not isinstance(results[0], Exception), results


def test_another_tenants_prefetch_and_lock_are_out_of_reach_and_unrevealed(world: World) -> None:
    """Tenant A's prefetch and lock, under an engine id both others also attached with:
    tenant B and even the '*' operator get the NOT_FOUND of an id never issued (per call
    and per Batch op), cancel nothing and release nothing."""
    with (
        world.client(TENANT_A, engine_id="same-engine", retries=3) as a,
        world.client(TENANT_B, engine_id="same-engine") as b,
        world.client(OPERATOR, engine_id="same-engine") as op,
    ):
        for c in (a, b, op):
            c.attach(map_pools=False)
        prompt = tokens(4 * PAGE, start=500_000)
        insert(a, prompt, "a")
        # 48 pages through L1 (16) and L2 (32): `prompt` is left in L3 only.
        for i in range(12):
            insert(a, tokens(4 * PAGE, start=600_000 + 10_000 * i), "a")
        wait_for(lambda: op.stats().counters["backups_storage"] >= 52, 20, "backups to L3")
        m = a.match(prompt, "a", lock=True, prefetch=True, allocate_tokens=4 * PAGE)
        assert m.storage_tokens == 4 * PAGE and m.prefetch_id and m.lock_id, m
        assert m.allocation_id, m
        unknown_prefetch = m.prefetch_id ^ 1
        unknown_lock = m.lock_id ^ 1
        unknown_alloc = m.allocation_id ^ 1

        def message(call, handle: int, unknown: int) -> tuple[str, str]:  # type: ignore[no-untyped-def]
            with pytest.raises(NotFound) as real:
                call(handle)
            with pytest.raises(NotFound) as fake:
                call(unknown)
            return (
                str(real.value).replace(str(handle), "ID"),
                str(fake.value).replace(str(unknown), "ID"),
            )

        for other, namespace in ((b, "b"), (op, "a")):
            for call, handle, unknown in (
                (other.prefetch_status, m.prefetch_id, unknown_prefetch),
                (other.cancel_prefetch, m.prefetch_id, unknown_prefetch),
                (lambda h, o=other: list(o.load(h)), m.lock_id, unknown_lock),
                (lambda h, o=other: o.release(lock_id=h), m.lock_id, unknown_lock),
                (
                    lambda h, o=other, ns=namespace: o.insert(prompt, ns, lock_id=h),
                    m.lock_id,
                    unknown_lock,
                ),
                (lambda h, o=other: o.release(allocation_id=h), m.allocation_id, unknown_alloc),
                (
                    lambda h, o=other, ns=namespace: o.insert(prompt, ns, allocation_id=h),
                    m.allocation_id,
                    unknown_alloc,
                ),
            ):
                real, fake = message(call, handle, unknown)
                assert real == fake
            results = other.batch(
                [
                    release_op(lock_id=m.lock_id),
                    pb.BatchOp(prefetch_status=pb.PrefetchStatusRequest(prefetch_id=m.prefetch_id)),
                    pb.BatchOp(cancel_prefetch=pb.CancelPrefetchRequest(prefetch_id=m.prefetch_id)),
                ]
            )
            assert all(isinstance(r, NotFound) for r in results), results
        assert a.prefetch_status(m.prefetch_id).state.value != "CANCELLED"
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)
        a.release(lock_id=m.lock_id)
        a.release(allocation_id=m.allocation_id)
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)


# ------------------------------------------------------------------ the probe CLI


def test_health_and_stats_through_a_wildcard_tls_config_with_a_token_file(world: World) -> None:
    """`--config` of a 0.0.0.0 TLS daemon: dialled on 127.0.0.1, trusting the config's
    own certificate; the token file may end in CRLF. A wrong token: exit 1, and neither
    it nor any other token in the output."""
    cfg = world.workdir / "probe.yaml"
    cfg.write_text(
        f"server: {{listen: '0.0.0.0:{world.d.port}', tls_cert: '{world.crt}', "
        f"tls_key: '{world.key}'}}\n"
    )
    good, wrong = world.workdir / "good.tok", world.workdir / "wrong.tok"
    good.write_bytes(f"{TENANT_B}\r\n".encode())
    wrong.write_text(f"{WRONG}\n")
    out = run_cli("health", "--config", str(cfg), "--token-file", str(good), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["serving"] is True and "note" not in report, report
    # Stats is every tenant's: a tenant's token is refused, an operator's ('*') served.
    out = run_cli("stats", "--config", str(cfg), "--token-file", str(good), "--json")
    assert out.returncode == 1 and "needs a token that allows every namespace" in out.stdout, out
    operator = world.workdir / "operator.tok"
    operator.write_text(f"{OPERATOR}\n")
    out = run_cli("stats", "--config", str(cfg), "--token-file", str(operator), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["pools"], out.stdout
    out = run_cli("stats", "--config", str(cfg), "--token-file", str(wrong))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "--token-file" in out.stdout + out.stderr
    for secret in ALL_TOKENS:
        assert secret not in out.stdout + out.stderr
    # Another certificate as the root: unreachable (2), not a plaintext fallback.
    out = run_cli(
        "health",
        "--target",
        world.d.target,
        "--ca-file",
        str(world.other_crt),
        "--token-file",
        str(good),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert TENANT_B not in out.stdout + out.stderr


def test_no_token_reaches_the_daemon_log(world: World) -> None:
    """Last of the module's tests on this daemon: after every token (and wrong ones) was
    sent in every shape above, the log holds none of them, nor a traceback."""
    with world.channel() as channel:
        stub = pb_grpc.HiCacheStub(channel)
        for value in (f"Bearer {WRONG}", WRONG, f"Bearer {TENANT_A} trailing"):
            with pytest.raises(grpc.RpcError):
                stub.Stats(pb.StatsRequest(), metadata=(("authorization", value),), timeout=10)
    log = world.d.log()
    assert "ready" in log
    for secret in ALL_TOKENS:
        assert secret not in log
    assert "Traceback" not in log, log


# ------------------------------------------------------------------ what a start decides


def _exit_or_plaintext(d: Daemon, target: str, timeout_s: float = 40.0) -> int | None:
    """The daemon's exit code, or None once it answers plaintext on `target`."""
    assert d.proc is not None
    deadline = time.monotonic() + timeout_s
    with Client(target, tls=False, retries=0, timeout_s=1.0) as probe:
        while time.monotonic() < deadline:
            if d.proc.poll() is not None:
                return d.proc.returncode
            try:
                if probe.serving():
                    return None
            except Exception:
                time.sleep(0.1)
    raise AssertionError(f"neither exited nor served in {timeout_s} s:\n{d.log()}")


def test_listen_addresses_follow_the_loopback_rule(tmp_path: Path) -> None:
    """Plaintext TCP: `[::]` (every IPv6 address, and IPv4 too) is refused at start with
    the key to set; 127.0.0.2 (loopback, not 127.0.0.1) serves."""
    refused = Daemon(tmp_path, listen=f"[::]:{free_port()}").start(wait=False)
    try:
        assert refused.proc is not None and refused.proc.wait(timeout=60) == 1
        log = refused.log()
        assert "requires TLS" in log and "server.tls_cert" in log and "Traceback" not in log, log
    finally:
        refused.close()
    port = free_port()
    served = Daemon(
        tmp_path,
        f"server.tokens=[{{token: {TENANT_A}, namespaces: [a]}}]",
        listen=f"127.0.0.2:{port}",
    ).start()
    try:
        with served.client(token=TENANT_A, retries=0) as c:
            assert c.serving() and c.attach(map_pools=False).info
        with served.client(retries=0) as anonymous, pytest.raises(Unauthenticated):
            anonymous.stats()
    finally:
        served.close()


def test_an_empty_tls_key_never_means_plaintext_on_a_public_address(tmp_path: Path) -> None:
    crt, _ = make_cert(tmp_path, "half", "IP:127.0.0.1")
    port = free_port()
    d = Daemon(
        tmp_path, f"server.tls_cert={crt}", "server.tls_key=''", listen=f"0.0.0.0:{port}"
    ).start(wait=False)
    try:
        rc = _exit_or_plaintext(d, f"127.0.0.1:{port}")
        assert rc is not None, "the daemon serves plaintext TCP on 0.0.0.0"
        assert rc in (1, 2) and "tls_key" in d.log() and "Traceback" not in d.log(), d.log()
    finally:
        d.close()


def test_a_token_too_long_to_send_is_refused_at_start_or_works(tmp_path: Path) -> None:
    long_token = "T" * 20_000
    d = Daemon(
        tmp_path,
        f"server.tokens=[{{token: {long_token}, namespaces: ['*']}}]",
        listen=f"127.0.0.1:{free_port()}",
    ).start(wait=False)
    try:
        assert d.proc is not None
        deadline = time.monotonic() + 40
        with Client(d.target, retries=0, timeout_s=1.0) as probe:
            while d.proc.poll() is None and time.monotonic() < deadline:
                try:
                    if probe.serving():
                        break
                except Exception:
                    time.sleep(0.1)
        if d.proc.poll() is not None:  # refused at start: a configuration error, token hidden
            assert d.proc.returncode == 2 and "tokens[0].token" in d.log(), d.log()
            assert long_token[:32] not in d.log()
            return
        with d.client(token=long_token, retries=0, timeout_s=5.0) as c:
            assert c.stats().pools
    finally:
        d.close()


def test_unauthenticated_health_watches_do_not_starve_the_cache_api(tmp_path: Path) -> None:
    from hicache.server import WORKERS

    d = Daemon(
        tmp_path,
        f"server.tokens=[{{token: {TENANT_A}, namespaces: ['*']}}]",
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    channel = grpc.insecure_channel(d.target)
    streams = []
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch
        refused = []
        for _ in range(WORKERS):
            stream = watch(health_pb2.HealthCheckRequest(service=""))  # no credentials
            streams.append(stream)
            try:
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as e:  # past the daemon's bound on Watch streams
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "Watch" in (e.details() or ""), e.details()
                refused.append(e)
        assert len(refused) < WORKERS  # some are served, as a standard health service must
        with d.client(token=TENANT_A, retries=0, timeout_s=5.0) as c:
            assert c.stats().pools
            assert c.serving()
        for stream in streams:  # ended streams give their places back
            stream.cancel()
        deadline = time.monotonic() + 20
        while True:
            again = watch(health_pb2.HealthCheckRequest(service=""))
            streams.append(again)
            try:
                assert next(again).status == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        for stream in streams:
            stream.cancel()
        channel.close()
        d.close()
