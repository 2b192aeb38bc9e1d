"""Fault injection with the real services: a backend dies in the middle of a stream of
backups and prefetches. No worker dies, serving from L1/L2 goes on, health reports the
backend down, and after a restart backups resume and new L3 hits appear."""

from __future__ import annotations

import time

import pytest
from engine_sim import Engine, evict_all, seq, tiny_config

from hicache.controller.base import MatchRequest
from hicache.controller.controller import build_controller
from hicache.errors import FailedPrecondition
from hicache.types import ComponentKind, Tier

FULL = ComponentKind.FULL


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _run_outage(ctl, stop, start) -> None:
    ctl.probe_interval_s = 0.1
    eng = Engine(ctl)
    for i in range(3):
        eng.request(seq(4, 1000 * i))
    assert ctl.transfers.drain(15)
    assert ctl.health(deep=True)[0].healthy
    stop()
    t0 = time.monotonic()
    for i in range(3, 12):  # serving goes on while backups fail
        eng.request(seq(4, 1000 * i))
        ctl.match("e1", MatchRequest("", seq(4, 0)))
    serving_s = time.monotonic() - t0
    assert wait_for(lambda: ctl.l3.breaker.is_open), "breaker never opened"
    assert not ctl.health(deep=True)[0].healthy
    assert ctl.transfers.backup_worker.alive and ctl.transfers.copy_worker.alive
    assert ctl.prefetcher.worker.alive
    assert serving_s < 30
    before = ctl.stats().counters.get("backups_l3", 0)
    start()
    assert wait_for(lambda: not ctl.l3.breaker.is_open), "breaker never closed after restart"
    eng.request(seq(4, 50_000))
    assert wait_for(lambda: ctl.stats().counters.get("backups_l3", 0) > before), "backups did not resume"
    assert ctl.transfers.drain(30)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    assert wait_for(lambda: ctl.match("e1", MatchRequest("", seq(4, 50_000))).storage_tokens == 16)
    ctl.check_integrity()


def test_redis_stopped_mid_stream(tmp_path, redis_factory) -> None:
    server = redis_factory()
    cfg = tiny_config(tmp_path, backend="redis", storage__redis={"url": server.url},
                      storage__timeout_s=1.0, write__l1_to_l2="write_through",
                      write__l2_to_l3="write_through")
    ctl = build_controller(cfg, f"faultr{int(time.time() * 1000) % 100000}")
    try:
        _run_outage(ctl, server.stop, server.start)
    finally:
        ctl.close()


@pytest.mark.slow
def test_mooncake_master_killed_mid_stream(tmp_path, mooncake_factory) -> None:
    master = mooncake_factory()
    cfg = tiny_config(tmp_path, backend="mooncake",
                      storage__mooncake={"master": master.master, "metadata_server": master.metadata_server,
                                         "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20},
                      storage__timeout_s=2.0, write__l1_to_l2="write_through",
                      write__l2_to_l3="write_through")
    ctl = build_controller(cfg, f"faultm{int(time.time() * 1000) % 100000}")
    try:
        _run_outage(ctl, lambda: master.stop(kill=True), master.start)
    finally:
        ctl.close()


def test_an_l3_down_at_start_is_reported_and_connected_when_it_comes_up(
        tmp_path, redis_factory, monkeypatch) -> None:
    """Not required and unreachable at start: the daemon serves from L1/L2, `health`
    reports the backend unhealthy (it said "no L3 configured", so probes passed), and
    the backend is connected in the background once it answers."""
    import hicache.controller.controller as controller_module

    monkeypatch.setattr(controller_module, "L3_CONNECT_RETRY_S", 0.1)
    server = redis_factory()
    server.stop()
    cfg = tiny_config(tmp_path, backend="redis", storage__redis={"url": server.url},
                      storage__timeout_s=0.5, write__l1_to_l2="write_through",
                      write__l2_to_l3="write_through")
    ctl = build_controller(cfg, f"faultd{int(time.time() * 1000) % 100000}")
    try:
        ctl.probe_interval_s = 0.05
        assert ctl.l3 is None
        (health,) = ctl.health(deep=False)
        assert health.name == "redis" and not health.healthy and "not connected" in health.detail
        eng = Engine(ctl)
        eng.request(seq(4))  # serving goes on
        server.start()
        assert wait_for(lambda: ctl.l3 is not None), "never connected"
        assert ctl.health(deep=True)[0].healthy
        eng.request(seq(4, 70_000))
        assert wait_for(lambda: ctl.stats().counters.get("backups_l3", 0) > 0)
        assert ctl.transfers.drain(10)
        ctl.check_integrity()
    finally:
        ctl.close()


def test_a_backend_that_fails_to_register_is_retried_not_fatal(tmp_path, redis_factory, monkeypatch) -> None:
    """Connecting an L3 that came up late can fail one step further (Mooncake refusing the
    buffer registration): the connect thread lives on and retries."""
    import hicache.controller.controller as controller_module
    from hicache.tiers.storage.redis import RedisBackend

    monkeypatch.setattr(controller_module, "L3_CONNECT_RETRY_S", 0.1)
    server = redis_factory()
    server.stop()
    cfg = tiny_config(tmp_path, backend="redis", storage__redis={"url": server.url},
                      storage__timeout_s=0.5)
    ctl = build_controller(cfg, f"faultg{int(time.time() * 1000) % 100000}")
    try:
        ctl.probe_interval_s = 0.05
        failures = [1]
        register = RedisBackend.register_host_buffer

        def flaky(self, address, size):
            if failures:
                failures.pop()
                raise RuntimeError("registration refused")
            return register(self, address, size)

        monkeypatch.setattr(RedisBackend, "register_host_buffer", flaky)
        server.start()
        assert wait_for(lambda: ctl.l3 is not None), "never connected"
        assert not failures and ctl._prober.is_alive()
    finally:
        ctl.close()


@pytest.mark.parametrize("still_running", [True, False])
def test_close_frees_l2_only_once_no_l3_call_can_write_into_it(
    tmp_path, monkeypatch, caplog, still_running: bool
) -> None:
    """An L3 call given up on may still move data into L2 (a Mooncake transfer into the
    registered pool): while the backend's close says one still runs, L2 stays mapped
    until the process ends (logged); otherwise it is freed."""
    ctl = build_controller(tiny_config(tmp_path), f"closing{int(still_running)}x{time.monotonic_ns() % 100000}")
    assert ctl.l3 is not None
    waits: list[float] = []
    kept: list[bool] = []
    real_close = ctl.host.close
    backend = ctl.l3.backend
    real_backend_close = backend.close

    def backend_close(wait_s: float = 0.0) -> bool:
        waits.append(wait_s)
        real_backend_close(wait_s)
        return not still_running

    def host_close(keep_memory: bool = False) -> None:
        kept.append(keep_memory)
        real_close(keep_memory)

    monkeypatch.setattr(backend, "close", backend_close)
    monkeypatch.setattr(ctl.host, "close", host_close)
    try:
        ctl.close()
        assert kept == [still_running] and len(waits) == 1 and waits[0] > 0
        assert ("L2 stays mapped" in caplog.text) is still_running
        member = ctl.cfg.model.members[0].name
        if still_running:
            assert ctl.host.payload_view(member, 0).sum() >= 0  # mapped: readable
        else:
            with pytest.raises(FailedPrecondition):
                ctl.host.payload_view(member, 0)
    finally:
        real_close()
