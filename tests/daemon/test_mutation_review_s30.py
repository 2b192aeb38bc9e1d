"""Mutation review (session 30), the client half: behaviour no test pinned until now.

Written against a mutant the rest of the suite let through (named in the docstring);
passes on the product as it is and fails under the mutant. The real `hicache health`
against a real daemon and redis-server, and the real `hicache.client.Client` against the
in-test gRPC server of `test_client_vs_junk_replies_review` (`_FakeDaemon`: a daemon's
stop cancelling one call cannot be timed from outside)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from hicache.bench.services import RedisServer
from hicache.cli import main
from hicache.client import Client
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from . import test_client_vs_junk_replies_review as junk
from .daemonkit import Daemon, eventually

OPERATOR = "tok-mutation-review-s30-operator"
fake = junk.fake  # (the fixture: an in-test gRPC server on a unix socket, closed after the test)


@pytest.mark.timeout(120)
def test_health_without_a_token_fails_while_a_required_backend_is_down(
    make_daemon: Callable[..., Daemon], redis_factory: Callable[[], RedisServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mutant: `health_report`'s Unauthenticated branch answers EXIT_OK whatever the
    standard check said (the suite checked only a healthy daemon there). A daemon with
    tokens whose required Redis is down is NOT_SERVING: `hicache health` without the
    token file (a Kubernetes exec probe) exits 1, and says why the backends are missing."""
    redis = redis_factory()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=1", "storage.required=true",
                    f"server.tokens=[{{token: {OPERATOR}, namespaces: ['*']}}]")
    assert main(["health", "--target", d.target]) == 0
    capsys.readouterr()
    redis.stop()

    def unhealthy() -> bool:
        rc = main(["health", "--target", d.target, "--json"])
        return json.loads(capsys.readouterr().out)["serving"] is False and rc == 1

    assert eventually(unhealthy, timeout_s=20, poll_s=0.2), d.log()
    assert main(["health", "--target", d.target, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["reachable"] is True and "needs a valid --token-file" in report["note"], report


def test_a_stats_call_the_daemon_cancelled_as_it_stopped_is_retried(fake: junk._FakeDaemon) -> None:
    """Mutant: CANCELLED dropped from `client_errors.RETRYABLE`. gRPC's server cancels
    the calls under way when the daemon stops (a bare CANCELLED); a repeatable call
    (Stats) is retried, and the daemon that is back answers it: the caller sees its
    reply, not an error, and the daemon saw the call twice."""
    answer = fake.servicer._answer
    cancelled: list[str] = []

    def stopping_once(method: str, request: Any, context: grpc.ServicerContext) -> Any:
        if method == "Stats" and not cancelled:
            cancelled.append(method)
            answer(method, request, context)  # (counted)
            context.abort(grpc.StatusCode.CANCELLED, "")
        return answer(method, request, context)

    fake.servicer._answer = stopping_once  # type: ignore[method-assign]
    fake.replies["Stats"] = pb.StatsResponse()
    with Client(fake.address, engine_id="mr30-engine", retries=2, timeout_s=5) as client:
        snap = client.stats()
    assert snap.pools == ()
    assert fake.servicer.calls["Stats"] == 2
