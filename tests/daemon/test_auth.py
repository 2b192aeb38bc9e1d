"""Bearer tokens and namespaces over TCP loopback, and the plain-TCP probe listener."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.client import match_op
from hicache.controller.base import MatchOutcome
from hicache.errors import HicacheError, NotFound, PermissionDenied, Unauthenticated
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import PAGE, Daemon, free_port, tokens

TENANT_A = "token-of-tenant-a-0123456789"
ADMIN = "token-of-the-operator-987654321"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    probe = free_port()
    d = Daemon(
        tmp_path_factory.mktemp("auth"),
        f"server.tokens=[{{token: {TENANT_A}, namespaces: [a, shared]}}, "
        f"{{token: {ADMIN}, namespaces: ['*']}}]",
        f"server.probe_listen=127.0.0.1:{probe}",
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    yield d, probe
    d.close()


def test_missing_or_wrong_token_is_unauthenticated(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with d.client(retries=0) as anonymous, pytest.raises(Unauthenticated, match="Bearer"):
        anonymous.stats()
    with d.client(token="not-a-token-at-all-xx", retries=0) as wrong:
        with pytest.raises(Unauthenticated, match="invalid bearer token"):
            wrong.attach(map_pools=False)
        assert wrong.serving()  # the standard health check needs no credentials


def test_namespaces_follow_the_token(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with d.client(token=TENANT_A, engine_id="tenant-a") as a:
        a.attach(map_pools=False)
        assert a.match(tokens(PAGE), "a").device_tokens == 0
        with pytest.raises(PermissionDenied, match="namespace 'b'"):
            a.match(tokens(PAGE), "b")
        with pytest.raises(PermissionDenied, match="namespace ''"):
            a.allocate(PAGE)
        with pytest.raises(PermissionDenied):
            a.insert(tokens(PAGE), "b")
        ok, denied, shared = a.batch([match_op(tokens(PAGE), "a"), match_op(tokens(PAGE), "b"),
                                      match_op(tokens(PAGE), "shared")])
        assert isinstance(ok, MatchOutcome) and isinstance(shared, MatchOutcome)
        assert isinstance(denied, PermissionDenied) and "op 1" in str(denied)
    with d.client(token=ADMIN, engine_id="operator") as op:
        op.attach(map_pools=False)
        assert op.match(tokens(PAGE), "b").device_tokens == 0


def test_another_token_naming_the_same_engine_reaches_none_of_its_handles(
    secured: tuple[Daemon, int],
) -> None:
    """Engine ids are the engine's own choice, and lock ids count up: a caller with
    another token who sends a tenant's engine id (header or Heartbeat) must not release
    its locks, use its allocations or see its counts."""
    d, _ = secured
    prompt = tokens(PAGE, start=900_000)
    with d.client(token=TENANT_A, engine_id="shared-name") as a, \
            d.client(token=ADMIN, engine_id="shared-name", retries=0) as other:
        a.attach(map_pools=False)
        m = a.match(prompt, "a", lock=True, allocate_tokens=PAGE)
        assert a.heartbeat().locks == 1
        with pytest.raises(HicacheError):
            other.release(lock_id=m.lock_id)
        with pytest.raises(HicacheError):
            other.release(allocation_id=m.allocation_id)
        with pytest.raises(HicacheError):
            other.heartbeat()  # not attached under this token
        other.attach(map_pools=False)  # a namesake of its own, with nothing held
        assert other.heartbeat().locks == 0
        with pytest.raises(NotFound, match=f"lock {m.lock_id} is unknown"):
            other.release(lock_id=m.lock_id)
        with pytest.raises(NotFound, match=f"allocation {m.allocation_id} is unknown"):
            other.release(allocation_id=m.allocation_id)
        with pytest.raises(NotFound, match=f"allocation {m.allocation_id} is unknown"):
            other.allocate(PAGE, "a", allocation_id=m.allocation_id)  # nor grow it
        hb = a.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)
        a.insert(prompt, "a", lock_id=m.lock_id, allocation_id=m.allocation_id)


def test_tokens_never_reach_the_log(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with d.client(token=TENANT_A, retries=0) as a, pytest.raises(PermissionDenied):
        a.match(tokens(PAGE), "b")
    log = d.log()
    assert "ready" in log
    assert TENANT_A not in log and ADMIN not in log


def test_probe_listener_serves_only_health(secured: tuple[Daemon, int]) -> None:
    _, probe = secured
    with grpc.insecure_channel(f"127.0.0.1:{probe}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        serving = health_pb2.HealthCheckResponse.SERVING
        assert check(health_pb2.HealthCheckRequest(service="")).status == serving
        assert check(health_pb2.HealthCheckRequest(service="hicache.v1.HiCache")).status == serving
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.HiCacheStub(channel).Stats(pb.StatsRequest())
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_sessions_are_scoped_to_the_token(secured: tuple[Daemon, int]) -> None:
    """Two tenants using the same session id do not share a session, and one cannot
    close the other's (session ids were global)."""
    from hicache.errors import NotFound

    d, _ = secured
    with d.client(token=TENANT_A, engine_id="ta") as a, d.client(token=ADMIN, engine_id="op") as op:
        a.attach(map_pools=False)
        op.attach(map_pools=False)
        prompt = tokens(2 * PAGE, start=77_000)
        m = a.match(prompt, "a", lock=True, allocate_tokens=2 * PAGE, session_id="conv-1")
        a.insert(prompt, "a", lock_id=m.lock_id, allocation_id=m.allocation_id)
        with pytest.raises(NotFound):
            op.close_session("conv-1")
        assert a.close_session("conv-1") >= 1


def test_server_reflection_needs_a_token_like_the_cache_api(secured: tuple[Daemon, int]) -> None:
    """Reflection (a streaming-request RPC) used to be left out of authentication: it
    listed the services and handed out their descriptors without a token."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    d, _ = secured
    ask = reflection_pb2.ServerReflectionRequest(list_services="")

    def services(metadata: tuple[tuple[str, str], ...]) -> list[str]:
        with grpc.insecure_channel(d.target) as channel:
            info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
            replies = list(info(iter([ask]), metadata=metadata, timeout=10))
        return [s.name for s in replies[0].list_services_response.service]

    for metadata in ((), (("authorization", "Bearer not-a-token-at-all-xx"),)):
        with pytest.raises(grpc.RpcError) as info:
            services(metadata)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "hicache.v1.HiCache" in services((("authorization", f"Bearer {TENANT_A}"),))


def test_health_without_the_token_goes_by_the_standard_check(secured: tuple[Daemon, int],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A probe or cron job without the token file: the standard check (no credentials,
    NOT_SERVING while a required backend is down) decides, and the output says why the
    per-backend report is missing. It used to exit 1 (unhealthy) for a healthy daemon."""
    from hicache.cli import main
    from hicache.ops import EXIT_OK, health_report

    d, _ = secured
    for deep in (False, True):
        report, rc = health_report(d.target, deep)
        assert rc == EXIT_OK and report["serving"] is True, report
        assert "needs a valid --token-file" in report["note"] and "error" not in report
    assert main(["health", "--target", d.target]) == 0
    assert "backends not reported" in capsys.readouterr().out
    report, rc = health_report(d.target, True, token=TENANT_A)
    assert rc == EXIT_OK and "note" not in report


def test_flush_needs_a_token_for_every_namespace(secured: tuple[Daemon, int]) -> None:
    """Flush writes every tenant's pages down at the store's full bandwidth: an operator's
    call, refused to a token limited to some namespaces (any token could run it)."""
    d, _ = secured
    with d.client(token=TENANT_A, retries=0) as tenant:
        with pytest.raises(PermissionDenied, match=r"Flush needs a token that allows every namespace"):
            tenant.flush()
        assert tenant.health() == ()  # reading the backends' state is anyone's
    with d.client(token=ADMIN, retries=0) as operator:
        assert operator.flush() == 0  # (no L3 here)


def test_an_engine_id_is_counted_as_sent_not_with_the_tokens_scope(secured: tuple[Daemon, int]) -> None:
    """With tokens the daemon knows an engine as "<token label>/<id>"; the length limit
    (256) is the id's as sent: a 250-character id was refused as "259 characters"."""
    d, _ = secured
    with d.client(token=TENANT_A, engine_id="e" * 256, retries=0) as c:
        assert c.attach(map_pools=False).info.page_size == PAGE
        assert c.heartbeat().locks == 0
    with d.client(token=TENANT_A, engine_id="e" * 257, retries=0) as c, \
            pytest.raises(HicacheError, match="engine_id: 257 characters, at most 256"):
        c.attach(map_pools=False)


def test_a_heartbeat_without_an_engine_id_names_the_request_field(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with grpc.insecure_channel(d.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.HiCacheStub(channel).Heartbeat(
            pb.HeartbeatRequest(engine_id=""), metadata=(("authorization", f"Bearer {ADMIN}"),))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Heartbeat names its engine in the request" in (info.value.details() or "")
