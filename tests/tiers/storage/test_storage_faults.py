"""Services that die or stop answering: BackendUnavailable within the timeout, then recovery."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import pytest
from storage_pages import Pool, keys, mooncake_config, storage_config

from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.errors import BackendUnavailable
from hicache.tiers.storage import GetStatus, PutStatus, StorageBackend, build_backend
from hicache.types import StorageBackendName

TIMEOUT_S = 1.0
SLACK_S = 2.0  # generous: the machine is noisy


def _unavailable_within(fn: Callable[[], object], bound: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable):
        fn()
    assert time.monotonic() - t0 < bound


def _eventually_stores(backend: StorageBackend, pool: Pool, deadline_s: float) -> list[PutStatus]:
    end = time.monotonic() + deadline_s
    while True:
        try:
            out = backend.put_from(keys(1), pool.slots([0]))
            if out == [PutStatus.STORED]:
                return out
        except BackendUnavailable:
            if time.monotonic() > end:
                raise
        time.sleep(0.2)


def test_redis_killed_then_restarted(redis_factory: Callable[[], RedisServer]) -> None:
    server = redis_factory()
    backend = build_backend(
        storage_config(StorageBackendName.REDIS, timeout_s=TIMEOUT_S, redis_url=server.url)
    )
    pool = Pool(2)
    backend.put_from(keys(1), pool.slots([0]))

    server.stop(kill=True)
    _unavailable_within(lambda: backend.put_from(keys(1), pool.slots([1])), TIMEOUT_S + SLACK_S)
    _unavailable_within(lambda: backend.exists_prefix(keys(1)), TIMEOUT_S + SLACK_S)
    assert not backend.health().healthy
    assert backend.stats().unavailable == 2

    server.start()
    assert _eventually_stores(backend, pool, 5.0) == [PutStatus.STORED]
    assert backend.health(deep=True).healthy
    backend.close()


def test_redis_that_stops_answering_times_out(redis_factory: Callable[[], RedisServer]) -> None:
    server = redis_factory()
    backend = build_backend(
        storage_config(StorageBackendName.REDIS, timeout_s=TIMEOUT_S, redis_url=server.url)
    )
    pool = Pool(1)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)  # alive, accepting nothing: a hung server
    try:
        _unavailable_within(lambda: backend.get_into(keys(1), pool.slots()), TIMEOUT_S + SLACK_S)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert _eventually_stores(backend, pool, 5.0) == [PutStatus.STORED]
    backend.close()


def test_mooncake_master_killed_then_restarted(
    mooncake_factory: Callable[[], MooncakeMaster],
) -> None:
    master = mooncake_factory()
    backend = build_backend(mooncake_config(master, timeout_s=TIMEOUT_S))
    pool = Pool(2).register(backend)
    assert backend.put_from(keys(1), pool.slots([0])) == [PutStatus.STORED]

    master.stop(kill=True)
    # health_check() alone still says 0 here; the probe's RPC tells the truth.
    assert not backend.health().healthy
    _unavailable_within(lambda: backend.put_from(keys(1), pool.slots([1])), TIMEOUT_S + SLACK_S)

    master.start()  # same ports: the client reconnects by itself
    assert _eventually_stores(backend, pool, 30.0) == [PutStatus.STORED]
    assert backend.health(deep=True).healthy
    backend.close()


def test_two_nodes_share_objects(
    redis_server: RedisServer, mooncake_master: MooncakeMaster, tmp_path: os.PathLike[str]
) -> None:
    """Node A stores, node B (another client of the same service) reads them."""
    configs = [
        storage_config(StorageBackendName.REDIS, redis_url=redis_server.url),
        mooncake_config(mooncake_master),
    ]
    for cfg in configs:
        node_a, node_b = build_backend(cfg), build_backend(cfg)
        src, dst = Pool(4, seed=9).register(node_a), Pool(4, seed=None).register(node_b)
        src.register(node_b)
        ks = keys(4)
        assert node_a.put_from(ks, src.slots()) == [PutStatus.STORED] * 4
        assert node_b.exists_prefix(ks) == 4
        assert node_b.get_into(ks, dst.slots()) == [GetStatus.HIT] * 4
        assert (dst.pages == src.pages).all()
        assert node_b.put_from(ks, src.slots()) == [PutStatus.PRESENT] * 4
        node_b.close()
        node_a.close()


@pytest.mark.parametrize("down", ["master", "metadata server"])
def test_mooncake_without_its_master_fails_fast_and_leaves_the_process_running(
    down: str, mooncake_factory: Callable[[], MooncakeMaster]
) -> None:
    """Mooncake's setup() holds the GIL while it tries a master that is not there (~90 s
    here): the whole daemon froze, the call's own timeout included, at every start and
    every reconnect attempt. The backend now first checks that the master (and an HTTP
    metadata server) accept a connection, within storage.timeout_s."""
    from hicache.bench.services import free_port

    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    master = mooncake_factory()
    cfg = storage_config(
        StorageBackendName.MOONCAKE,
        timeout_s=TIMEOUT_S,
        mooncake_master=nobody if down == "master" else master.master,
        mooncake_metadata=(master.metadata_server if down == "master"
                           else f"http://{nobody}/metadata"),
    )
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match=f"the {down} .* does not accept connections"):
        build_backend(cfg)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S  # (it was ~90 s, GIL held)


def test_mooncake_warns_when_other_nodes_cannot_reach_this_nodes_segment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A remote master with local_hostname left at 127.0.0.1: objects in this node's
    segment are out of every other node's reach. Said at start (the master being down
    here, the start then fails fast)."""
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")
    from hicache.bench.services import free_port

    cfg = storage_config(StorageBackendName.MOONCAKE, timeout_s=0.5,
                         mooncake_master=f"192.0.2.1:{free_port()}",  # (TEST-NET-1: no host)
                         mooncake_metadata="P2PHANDSHAKE")
    with caplog.at_level(logging.WARNING), pytest.raises(BackendUnavailable, match="the master"):
        build_backend(cfg)
    assert "other nodes cannot read" in caplog.text


def test_mooncake_addresses_the_reachability_check_cannot_read_are_left_to_setup() -> None:
    """An HA master (`etcd://h1:2379;h2:2379`) is resolved by Mooncake through etcd: the
    check misread it as a host and refused every start. A metadata URL with a bad port
    is an unavailable backend (a traceback at start before)."""
    from hicache.tiers.storage.mooncake import _host_port

    assert _host_port("etcd://10.0.0.1:2379;10.0.0.2:2379") is None
    assert _host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert _host_port("[::1]:50051") == ("::1", 50051)
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")
    cfg = storage_config(StorageBackendName.MOONCAKE, timeout_s=0.5,
                         mooncake_master="127.0.0.1:1", mooncake_metadata="http://127.0.0.1:abc/metadata")
    with pytest.raises(BackendUnavailable, match="is not a valid URL"):
        build_backend(cfg)
