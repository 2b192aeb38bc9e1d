"""Fast in-process tests: conversion, the status mapping both ways, auth, the interceptor."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from hicache import convert, errors
from hicache.auth import ANONYMOUS, Authenticator
from hicache.client import Client, insert_op, match_op, release_op
from hicache.client_errors import error_for, op_error
from hicache.config import ConfigError, HicacheConfig, TokenConfig, load_config
from hicache.controller.base import AllocateRequest, PoolUsage, StatsSnapshot
from hicache.controller.controller import build_controller
from hicache.endpoint import parse_address
from hicache.interceptor import status_of
from hicache.metrics import counter_families
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.reload import Reloader, changed_keys
from hicache.server import Daemon
from hicache.tiers.base import PoolDescriptor, PoolKind

from .daemonkit import TINY, tokens

# --------------------------------------------------------------------------- conversion


def test_token_bytes_are_checked_without_copying() -> None:
    data = tokens(10)
    assert convert.check_tokens(data, 10) is data
    with pytest.raises(errors.InvalidArgument, match="6 bytes is not a multiple of 4"):
        convert.check_tokens(b"\x00" * 6, 10)
    with pytest.raises(errors.InvalidArgument, match=r"11 tokens exceed .*max_tokens_per_request \(10\)"):
        convert.check_tokens(tokens(11), 10)
    assert convert.tokens_to_bytes([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert convert.tokens_to_bytes(np.array([7], dtype=np.int64)) == b"\x07\x00\x00\x00"
    # Bytes-like: the wire form already (they were read a token per byte: the wrong prompt).
    wire = b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert convert.tokens_to_bytes(bytearray(wire)) == wire
    assert convert.tokens_to_bytes(memoryview(np.array([1, 2], dtype="<u4"))) == wire
    with pytest.raises(errors.InvalidArgument, match="uint32"):
        convert.tokens_to_bytes([-1])


def test_pages_round_trip_as_int64_arrays() -> None:
    # Page ids are little-endian int32 on the wire: any pool index, and -1 for an SWA
    # tombstone; they come back as writable int64 arrays.
    pages = {"full": np.array([5, 0, 2_000_000_000], dtype=np.int64),
             "swa": np.array([-1, -1, 7], dtype=np.int64), "k_scale": np.array([], dtype=np.int32)}
    msg = pb.AllocateResponse()
    convert.add_pages(msg.pages, pages)
    back = convert.pages_from_pb(msg.pages)
    assert list(back) == ["full", "swa", "k_scale"]
    np.testing.assert_array_equal(back["full"], pages["full"])
    np.testing.assert_array_equal(back["swa"], pages["swa"])
    assert back["k_scale"].dtype == np.int64 and back["k_scale"].size == 0
    assert msg.pages[1].page_ids == np.array([-1, -1, 7], dtype="<i4").tobytes()
    back["full"][0] = 9  # (not a view of the message's bytes)


def test_page_ids_of_a_length_not_a_multiple_of_4_are_refused_by_name() -> None:
    msg = pb.MatchPrefixResponse()
    msg.device_pages.add(member="full", page_ids=b"\x01\x00\x00\x00")
    msg.device_pages.add(member="swa", page_ids=b"\x01\x00\x00")
    with pytest.raises(errors.InvalidArgument, match=r"pages\[swa\]: 3 bytes of page ids is not a multiple of 4"):
        convert.match_from_pb(msg)


def test_batch_results_are_filled_in_place_even_when_every_field_is_zero() -> None:
    from hicache.controller.base import InsertOutcome, MatchOutcome

    result = pb.BatchResponse().results.add()
    convert.insert_to_pb(InsertOutcome(inserted_tokens=0, reused_tokens=0), result.insert)
    assert result.WhichOneof("result") == "insert"
    miss = MatchOutcome(device_tokens=0, host_tokens=0, storage_tokens=0, device_pages={},
                        lock_id=0, prefetch_id=0, allocation_id=0, pages={})
    result = pb.BatchResponse().results.add()
    convert.match_to_pb(miss, result.match_prefix)
    assert result.WhichOneof("result") == "match_prefix"
    hit = MatchOutcome(device_tokens=128, host_tokens=64, storage_tokens=0,
                       device_pages={"full": np.array([3, 4])}, lock_id=9, prefetch_id=0,
                       allocation_id=2, pages={"full": np.array([5])})
    assert convert.match_to_pb(hit, pb.MatchPrefixResponse()) == convert.match_to_pb(hit)


def test_pool_descriptor_round_trips_every_field() -> None:
    d = PoolDescriptor(member="full", kind=PoolKind.CUDA_IPC, handle=b"\x01" * 64, device=1,
                       num_pages=10, layer_stride_bytes=640, page_stride_bytes=64, layers=3,
                       offset_bytes=128, size_bytes=4096, ref_counter_handle=b"rc",
                       ref_counter_offset=8, event_handle=b"ev", event_sync_required=True,
                       device_uuid="GPU-1234")
    msg = convert.pool_to_pb(d, tp_rank=2)
    assert msg.tp_rank == 2 and msg.kind == pb.CUDA_IPC
    assert convert.pool_from_pb(msg) == d


def test_the_client_synchronizes_its_cuda_pools_device_before_insert_and_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon copies inserted pages (write-through) and reuses released ones in its own
    process, where nothing waits for the engine's GPU streams: the client waits for the
    device first (unless told the engine did). Shared-memory pools need nothing."""
    import torch

    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e")
    sent: list[str] = []

    def call(fn: object, request: object, **_kw: object) -> tuple[object, bool]:
        sent.append(type(request).__name__)
        if isinstance(request, pb.BatchRequest):  # (each op answered with an empty response)
            return pb.BatchResponse(results=[pb.BatchResult(**{op.WhichOneof("op"): {}})
                                             for op in request.ops]), False
        if isinstance(request, pb.InsertRequest):
            return pb.InsertResponse(), False
        return pb.ReleaseResponse(), False

    monkeypatch.setattr(client, "_attempts", call)
    try:
        client.insert(tokens(1), lock_id=1)
        assert synced == []  # no CUDA pools mapped
        gpu = torch.device("cuda", 0)
        client._cuda_devices = (gpu,)
        client.insert(tokens(1), lock_id=1)
        client.release(lock_id=1)
        client.batch([insert_op(tokens(1), lock_id=1)])
        client.batch([release_op(lock_id=1)])
        assert synced == [gpu] * 4
        client.insert(tokens(1), lock_id=1, sync=False)
        client.release(lock_id=1, sync=False)
        client.batch([match_op(tokens(1))])  # nothing the daemon would copy or reuse
        assert synced == [gpu] * 4 and len(sent) == 8

        class Event:  # (a torch.cuda.Event recorded after the KV writes)
            def synchronize(self) -> None:
                synced.append("event")

        client.insert(tokens(1), lock_id=1, sync=Event())  # type: ignore[arg-type]
        assert synced == [gpu] * 4 + ["event"]
    finally:
        client.close()


def test_the_devices_to_synchronize_are_the_pools_gpus_as_this_process_numbers_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by UUID among this process's GPUs; a GPU it cannot see, or no CUDA at all,
    adds none (it cannot have written those pools)."""
    import torch

    import hicache.tiers.cuda as cuda_mod
    from hicache.client import _cuda_devices

    def pool(kind: PoolKind, uuid: str) -> PoolDescriptor:
        return PoolDescriptor(member="full", kind=kind, handle=b"h", device=0, num_pages=1,
                              layer_stride_bytes=1, page_stride_bytes=1, layers=1,
                              device_uuid=uuid)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {"GPU-a": 1, "GPU-b": 1}

    def ordinal(desc: PoolDescriptor) -> int:
        if desc.device_uuid not in seen:
            raise errors.FailedPrecondition("not visible")
        return seen[desc.device_uuid]

    monkeypatch.setattr(cuda_mod, "local_ordinal", ordinal)
    assert _cuda_devices([pool(PoolKind.SHM, "")]) == ()
    assert _cuda_devices([pool(PoolKind.CUDA_IPC, "GPU-a"), pool(PoolKind.CUDA_IPC, "GPU-b"),
                          pool(PoolKind.CUDA_IPC, "GPU-z")]) == (torch.device("cuda", 1),)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _cuda_devices([pool(PoolKind.CUDA_IPC, "GPU-a")]) == ()


def test_stats_map_core_counter_aliases_to_the_wire_and_keep_extras_for_metrics() -> None:
    snap = StatsSnapshot(
        pools=(PoolUsage("device", "full", 16, 4, 2),),
        counters={"lookups": 3, "hit_tokens_device": 128, "backups_l2": 5, "backups_l3": 2,
                  "leases_expired": 1, "prefetches_done": 4, "backups_l3_failed": 9},
    )
    back = convert.stats_from_pb(convert.stats_to_pb(snap))
    assert back.pools == snap.pools
    c = back.counters
    assert (c["lookups"], c["hit_tokens_device"], c["backups_host"], c["backups_storage"]) == (3, 128, 5, 2)
    assert (c["expired_leases"], c["prefetches_done"], c["evictions_device"]) == (1, 4, 0)
    families = {f.name: f for f in counter_families(snap)}
    backups = {s.labels["tier"]: s.value for s in families["hicache_backups"].samples if s.name.endswith("_total")}
    assert backups == {"device": 0, "host": 5, "storage": 2}
    assert "hicache_backups_l3_failed" in families


# --------------------------------------------------------------------------- status mapping


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ConfigError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("gone"), grpc.StatusCode.NOT_FOUND),
        (errors.FailedPrecondition("later"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unauthenticated("who"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PermissionDenied("no"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.BackendUnavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (errors.ObjectCorrupt("bits"), grpc.StatusCode.DATA_LOSS),
        (errors.Unimplemented("probe listener"), grpc.StatusCode.UNIMPLEMENTED),
    ],
)
def test_typed_errors_map_to_codes_and_back(error: errors.HicacheError, code: grpc.StatusCode) -> None:
    got, message = status_of(error)
    assert got is code and message == str(error)
    back = error_for(got, message)
    assert type(back).grpc_code_name == code.name and str(back) == message
    assert type(op_error(code.value[0], message)) is type(back)


def test_unexpected_exceptions_are_internal_and_unknown_codes_stay_generic() -> None:
    code, message = status_of(KeyError("x"))
    assert code is grpc.StatusCode.INTERNAL and "KeyError" in message
    assert type(error_for(grpc.StatusCode.UNKNOWN, "m")) is errors.HicacheError
    assert type(error_for(grpc.StatusCode.ABORTED, "m")) is errors.HicacheError
    assert isinstance(error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "m"), errors.Unavailable)
    # A daemon ending the call as it stops is away too (the client tells its own close apart).
    cancelled = error_for(grpc.StatusCode.CANCELLED, "")
    assert isinstance(cancelled, errors.Unavailable) and "stopping or restarting" in str(cancelled)


# --------------------------------------------------------------------------- auth, addresses


def test_authenticator() -> None:
    auth = Authenticator((TokenConfig("a" * 16, ("x",)), TokenConfig("b" * 16, ("*",))))
    assert Authenticator(()).authenticate([]) is ANONYMOUS
    with pytest.raises(errors.Unauthenticated, match="missing credentials"):
        auth.authenticate([("x-hicache-engine", "e")])
    with pytest.raises(errors.Unauthenticated, match="invalid bearer token"):
        auth.authenticate([("authorization", "Bearer " + "c" * 16)])
    tenant = auth.authenticate([("authorization", "bearer " + "a" * 16)])
    tenant.require("x")
    with pytest.raises(errors.PermissionDenied, match="token#0") as info:
        tenant.require("y")
    assert "a" * 16 not in str(info.value)
    auth.authenticate([("authorization", "Bearer " + "b" * 16)]).require("anything")


def _who(auth: Authenticator, token: str) -> str:
    return auth.authenticate([("authorization", "Bearer " + token)]).label


def test_authenticator_labels_hold_across_replacements() -> None:
    """A label is whose the scoped engines, sessions and locks are: kept by a token value
    (or a name) across reloads, never handed to another token."""
    a, b, c, d = ("a" * 16, "b" * 16, "c" * 16, "d" * 16)
    auth = Authenticator((TokenConfig(a, ("x",)), TokenConfig(b, ("x",))))
    assert (_who(auth, a), _who(auth, b)) == ("token#0", "token#1")  # the list's places
    auth.replace((TokenConfig(c, ("x",)), TokenConfig(a, ("x",))))
    assert (_who(auth, c), _who(auth, a)) == ("token#2", "token#0")  # new, kept
    with pytest.raises(errors.Unauthenticated):
        _who(auth, b)
    auth.replace((TokenConfig(b, ("x",)), TokenConfig(d, ("x",), name="team")))
    assert (_who(auth, b), _who(auth, d)) == ("token#1", "team")  # back: its own again
    auth.replace((TokenConfig(a, ("x",), name="team"), TokenConfig(d, ("x",), name="team")))
    assert _who(auth, a) == _who(auth, d) == "team"  # one tenant, two values (a rotation)
    auth.replace(())
    assert auth.authenticate([]) is ANONYMOUS and not auth.enabled


def test_token_names_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"server.tokens\[0\].name: must be 1-64 letters.*hidden"):
        load_config(None, ['server.tokens=[{token: aaaaaaaaaaaaaaaa, namespaces: [x], name: "t#1"}]'])
    with pytest.raises(ConfigError, match=r"server.tokens\[0\].name"):
        load_config(None, ["server.tokens=[{token: aaaaaaaaaaaaaaaa, namespaces: [x], name: ''}]"])
    cfg = load_config(None, ["server.tokens=[{token: aaaaaaaaaaaaaaaa, namespaces: [x], name: t-1.b_2}]"])
    assert cfg.server.tokens[0].name == "t-1.b_2"


def test_reloader_applies_all_or_nothing() -> None:
    base = load_config(None, ["server.tokens=[{token: aaaaaaaaaaaaaaaa, namespaces: [x]}]"])
    auth = Authenticator(base.server.tokens)
    files = iter([
        ["server.tokens=[{token: bbbbbbbbbbbbbbbb, namespaces: [x]}]", "server.lease_ms=9000",
         "tiers.l1.tokens=2048"],
        ["server.tokens=[{token: short, namespaces: [x]}]"],
        ["server.tokens=[]"],
    ])
    reloader = Reloader(base, lambda: load_config(None, next(files)), auth, None)
    first = reloader.reload()
    assert first.ok and first.applied == ("server.tokens (1 token)",)
    assert first.restart_needed == ("tiers.l1.tokens", "server.lease_ms")
    assert _who(auth, "b" * 16) == "token#1"
    assert reloader.running.server.lease_ms == base.server.lease_ms  # (what is in effect)
    second = reloader.reload()
    assert not second.ok and "at least 16 characters" in (second.error or "")
    assert second.applied == () and _who(auth, "b" * 16) == "token#1"
    third = reloader.reload()
    assert third.applied == () and _who(auth, "b" * 16) == "token#1"
    assert "server.tokens (authentication is turned on or off at a restart)" in third.restart_needed


def test_a_reload_that_raises_unexpectedly_is_a_failed_reload() -> None:
    """Whatever the loader raises, the daemon's main thread (which runs reloads) goes on."""
    base = load_config(None, ["server.tokens=[{token: aaaaaaaaaaaaaaaa, namespaces: [x]}]"])
    auth = Authenticator(base.server.tokens)

    def broken() -> HicacheConfig:
        raise OSError("disk on fire")

    outcome = Reloader(base, broken, auth, None).reload()
    assert not outcome.ok and "OSError: disk on fire" in (outcome.error or "")
    assert _who(auth, "a" * 16) == "token#0"


def test_changed_keys_name_leaves() -> None:
    a = load_config(None)
    b = load_config(None, ["eviction.policy=lfu", "model.page_size=32", "server.tokens="
                           "[{token: aaaaaaaaaaaaaaaa, namespaces: [x]}]"])
    assert set(changed_keys(a, b)) >= {"eviction.policy", "model.page_size", "server.tokens"}
    assert list(changed_keys(a, a)) == []


def test_addresses() -> None:
    assert parse_address("unix:///run/h.sock").is_unix
    assert parse_address("127.0.0.1:5").is_loopback and parse_address("[::1]:5").is_loopback
    assert not parse_address("10.0.0.1:5").is_loopback
    name = parse_address("unix:///run/h-1.sock").instance_name()
    assert name.startswith("h_1_sock_") and name.replace("_", "").isalnum()
    with pytest.raises(errors.InvalidArgument, match="unix:///absolute/path"):
        parse_address("unix://relative.sock")
    # A directory, or a path sun_path cannot hold: refused by name, not a traceback (a
    # `serve --listen unix:///` crashed) or gRPC's own "in use?" (a path too long).
    for bad in ("unix:///", "unix:///run/hicache/"):
        with pytest.raises(errors.InvalidArgument, match="names a directory"):
            parse_address(bad)
    assert parse_address("unix:///" + "x" * 106).is_unix  # 107 bytes: the most it holds
    with pytest.raises(errors.InvalidArgument, match="108 bytes, over the 107"):
        parse_address("unix:///" + "x" * 107)
    with pytest.raises(errors.ConfigError, match=r"server\.listen: 'unix:///': names a directory"):
        load_config(None, ["server.listen=unix:///"], env={})
    # One host:port rule for the daemon, the config loader and the CLI's --target.
    for bad in ("http://127.0.0.1:5", "host/x:80", "a b:1", ":5", "h:0"):
        with pytest.raises(errors.InvalidArgument, match="neither unix"):
            parse_address(bad)


# --------------------------------------------------------------------------- interceptor, in process

_instances = itertools.count()


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    cfg = load_config(None, TINY)
    core = build_controller(cfg, f"u{os.getpid()}_{next(_instances)}")
    daemon = Daemon(cfg, core, parse_address(f"unix://{tmp_path}/u.sock"))
    daemon.start()
    client = Client(daemon.endpoint.address, retries=0)
    yield daemon, client
    client.close()
    daemon.stop()


def test_an_unexpected_exception_is_internal_logged_and_the_daemon_keeps_serving(
    in_process: tuple[Daemon, Client], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, client = in_process

    def broken() -> StatsSnapshot:
        raise RuntimeError("boom")

    monkeypatch.setattr(daemon.core, "stats", broken)
    with caplog.at_level(logging.ERROR, logger="hicache.rpc"), pytest.raises(errors.HicacheError) as info:
        client.stats()
    assert type(info.value) is errors.HicacheError and "RuntimeError: boom" in str(info.value)
    assert any("Stats failed unexpectedly" in r.message and r.exc_info for r in caplog.records)
    client.attach(map_pools=False)
    stats_op, match_op_result = client.batch([pb.BatchOp(stats=pb.StatsRequest()),
                                              pb.BatchOp(match_prefix=pb.MatchPrefixRequest(tokens=tokens(64)))])
    assert "boom" in str(stats_op) and match_op_result.device_tokens == 0
    assert client.serving()
    samples = {
        (s.labels["method"], s.labels["code"]): s.value
        for metric in daemon.metrics.registry.collect() if metric.name == "hicache_rpc_seconds"
        for s in metric.samples if s.name.endswith("_count")
    }
    assert samples[("hicache.v1.HiCache/Stats", "INTERNAL")] == 1
    assert samples[("hicache.v1.HiCache/Batch", "OK")] == 1


def test_handles_of_a_call_the_caller_gave_up_on_are_released(
    in_process: tuple[Daemon, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's deadline passes while the daemon still matches (or allocates): it
    gets DEADLINE_EXCEEDED and never learns the lock or allocation ids, so the daemon
    releases them itself (the engine's heartbeats would otherwise keep them forever)."""
    import time

    daemon, client = in_process
    client.attach(map_pools=False)
    core = daemon.core
    match, allocate = core.match, core.allocate

    def slow_match(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = match(*args, **kwargs)
        time.sleep(0.3)
        return out

    def slow_allocate(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = allocate(*args, **kwargs)
        time.sleep(0.3)
        return out

    monkeypatch.setattr(core, "match", slow_match)
    monkeypatch.setattr(core, "allocate", slow_allocate)
    with Client(daemon.endpoint.address, retries=0, timeout_s=0.1, engine_id=client.engine_id) as hasty:
        hasty.attach(map_pools=False)  # the same engine, a tighter deadline
        with pytest.raises(errors.HicacheError, match=r"(?i)deadline"):
            hasty.match(tokens(128), lock=True, allocate_tokens=128)
        with pytest.raises(errors.HicacheError, match=r"(?i)deadline"):
            hasty.allocate(64)
    deadline = time.monotonic() + 5
    while True:  # the handlers finish after the caller left
        hb = client.heartbeat()
        if (hb.locks, hb.allocations) == (0, 0):
            break
        assert time.monotonic() < deadline, (hb.locks, hb.allocations)
        time.sleep(0.05)


def test_handles_of_calls_whose_deadline_passes_while_replying_are_released(
    in_process: tuple[Daemon, Client],
) -> None:
    """Deadlines of 1 ms: some pass while the handler runs, some while the reply is being
    sent (after the handler's own check). Either way, and for Batch calls too, every lock
    and allocation the engine never learned of is released."""
    import threading
    import time

    from hicache.client import match_op

    daemon, client = in_process
    client.attach(map_pools=False)
    hasty = Client(daemon.endpoint.address, retries=0, timeout_s=0.001, engine_id=client.engine_id)
    hasty._metadata = client._metadata  # the same engine, without its own (timed) Attach
    gave_up = [0]

    def requests(t: int) -> None:
        for i in range(150):
            try:
                m = hasty.match(tokens(64, start=10_000_000 * (t + 1) + 100 * i), lock=True,
                                allocate_tokens=64)
            except errors.HicacheError:
                gave_up[0] += 1
                continue
            client.release(lock_id=m.lock_id)
            client.release(allocation_id=m.allocation_id)

    threads = [threading.Thread(target=requests, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        ops = [match_op(tokens(256, start=50_000_000 + 10_000 * k + 1_000_000 * i), lock=True,
                        allocate_tokens=64) for k in range(16)]
        try:
            for r in hasty.batch(ops):
                if not isinstance(r, errors.HicacheError):
                    client.release(lock_id=r.lock_id)
                    client.release(allocation_id=r.allocation_id)
        except errors.HicacheError:
            gave_up[0] += 1
    hasty.close()
    assert gave_up[0] > 0  # the deadlines did pass
    deadline = time.monotonic() + 5
    while True:
        hb = client.heartbeat()
        if (hb.locks, hb.allocations) == (0, 0):
            break
        assert time.monotonic() < deadline, (hb.locks, hb.allocations)
        time.sleep(0.05)


class _LateContext:
    """A servicer context whose caller has 3 ms left when the handler ends."""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("x-hicache-engine", "e")]

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float:
        return 0.003

    def add_callback(self, _callback: object) -> bool:
        return True


def test_a_late_batch_fails_only_when_it_made_handles_to_release() -> None:
    """Under the reply margin, a Batch that made locks or allocations releases them and
    says so (DEADLINE_EXCEEDED). One that made none (Inserts, Releases) used to fail the
    same way although every op was applied: a retry then found its handles gone."""
    from hicache.controller.base import MatchOutcome
    from hicache.service import HiCacheServicer

    released: list[tuple[int | None, int | None]] = []

    class Core:
        def hold_background(self):  # type: ignore[no-untyped-def]
            return lambda: None

        def release(self, _engine: str, lock_id: int | None, allocation_id: int | None) -> None:
            released.append((lock_id, allocation_id))

        def match(self, _engine: str, _req: object) -> MatchOutcome:
            return MatchOutcome(device_tokens=0, host_tokens=0, storage_tokens=0,
                                device_pages={}, lock_id=5, allocation_id=6)

    servicer = HiCacheServicer(Core(), 1 << 20)  # type: ignore[arg-type]
    releases = pb.BatchRequest(ops=[pb.BatchOp(release=pb.ReleaseRequest(lock_id=7)),
                                    pb.BatchOp(release=pb.ReleaseRequest(allocation_id=9))])
    response = servicer.Batch(releases, _LateContext())
    assert [r.status.code for r in response.results] == [0, 0]
    assert released == [(7, None), (None, 9)]
    released.clear()
    matches = pb.BatchRequest(ops=[pb.BatchOp(match_prefix=pb.MatchPrefixRequest(tokens=b"\0" * 4))])
    with pytest.raises(errors.DeadlineExceeded, match="were released"):
        servicer.Batch(matches, _LateContext())
    assert released == [(5, None), (None, 6)]


def test_a_server_stream_its_caller_cancels_is_measured_as_cancelled() -> None:
    """A cancelled Load ends its handler's generator with GeneratorExit, which the
    interceptor's `except Exception` let through: the RPC was measured as OK."""
    from hicache.interceptor import ServerInterceptor

    observed: list[tuple[str, str]] = []

    class Metrics:
        def observe(self, method: str, code: str, seconds: float) -> None:
            observed.append((method, code))

    def load(_request: object, _context: object) -> Iterator[int]:
        yield from range(10)

    wrapped = ServerInterceptor(Authenticator(()), Metrics())._wrap(  # type: ignore[arg-type]
        "/hicache.v1.HiCache/Load", grpc.unary_stream_rpc_method_handler(load))
    # (served as a request stream of one message: `ServerInterceptor._read`)
    stream = wrapped.stream_stream(iter([object()]), None)
    assert next(stream) == 0
    stream.close()  # what gRPC does when the caller cancels
    assert observed == [("hicache.v1.HiCache/Load", "CANCELLED")]
    assert list(wrapped.stream_stream(iter([object()]), None)) == list(range(10))
    assert observed[-1] == ("hicache.v1.HiCache/Load", "OK")


def test_a_lapsed_lease_that_held_nothing_is_not_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A client that closes stops heartbeating (there is no detach call): its lapse used
    to be logged as a WARNING like an engine that died holding locks."""
    cfg = load_config(None, [*TINY, "server.lease_ms=100"], env={})
    ctl = build_controller(cfg, f"lapse{os.getpid()}_{next(_instances)}")
    try:
        ctl.attach("closed-cleanly", 0, 1)
        ctl.attach("died-holding", 0, 1)
        ctl.allocate("died-holding", AllocateRequest("", 16))
        time.sleep(0.15)
        with caplog.at_level(logging.INFO, logger="hicache.controller"):
            assert ctl.expire_leases() == 2
        levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records
                  if "lease lapsed" in r.getMessage()}
        assert levels == {"engine closed-cleanly": "INFO", "engine died-holding": "WARNING"}
        assert ctl.counters["leases_expired"] == 2 and ctl.counters["lease_released_allocations"] == 1
    finally:
        ctl.close()


def test_a_batch_answered_with_fewer_results_than_ops_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Results pair with ops by position: a reply with another count (a daemon of another
    version, a broken proxy) would pair them wrongly or silently drop ops' results."""
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e")
    monkeypatch.setattr(client, "_attempts", lambda fn, request, **_kw: (pb.BatchResponse(), False))
    try:
        with pytest.raises(errors.HicacheError, match="answered 0 results for 2 ops"):
            client.batch([release_op(lock_id=1), release_op(lock_id=2)])
    finally:
        client.close()


def test_an_enum_value_this_client_does_not_know_is_a_clear_error() -> None:
    """A newer daemon may send a prefetch state or pool kind this build lacks: a
    FailedPrecondition that says so, not a KeyError. (A pool in an unknown tier is shown
    as `tier<N>` by Stats: tests/test_cli_fuzz.py.)"""
    with pytest.raises(errors.FailedPrecondition, match="prefetch state 99, which this client does not know"):
        convert.prefetch_from_pb(pb.PrefetchStatusResponse(state=99))  # type: ignore[arg-type]


def test_calls_that_come_while_the_daemon_stops_are_unavailable_and_those_under_way_finish(
    in_process: tuple[Daemon, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """API.md: UNAVAILABLE while shutting down. gRPC's own stop cancelled the calls that
    came during its grace period (CANCELLED, which a client does not read as "away");
    the interceptor refuses them first, while the health check still answers (NOT_SERVING
    by then, for probes) and calls under way finish."""
    import threading

    daemon, client = in_process
    entered, release = threading.Event(), threading.Event()
    real = daemon.core.stats

    def slow() -> StatsSnapshot:
        entered.set()
        release.wait(5)
        return real()

    monkeypatch.setattr(daemon.core, "stats", slow)
    done: list[StatsSnapshot] = []
    under_way = threading.Thread(target=lambda: done.append(client.stats()))
    under_way.start()
    assert entered.wait(5)
    daemon.interceptor.begin_stop()
    with Client(daemon.endpoint.address, retries=0) as late:
        with pytest.raises(errors.Unavailable, match="shutting down"):
            late.stats()
        assert late.serving()  # (the health check is answered)
    assert not daemon.interceptor.wait_idle(0.1)  # the Stats under way
    release.set()
    under_way.join(5)
    assert len(done) == 1 and daemon.interceptor.wait_idle(1)


def test_a_release_a_lock_block_could_not_make_is_made_before_the_next_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `matched()` block that raised, its release failing too (the daemon away longer
    than the retries): the block's error is raised, the release is owed and made before
    the next heartbeat, which would otherwise renew the lease holding the handles for
    the engine's life (found by the client fault fuzz)."""
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e")
    sent: list[str] = []

    def attempts(fn: object, request: object, **_kw: object) -> tuple[object, bool]:
        sent.append(type(request).__name__)
        if isinstance(request, pb.BatchRequest):
            if sent.count("BatchRequest") == 1:
                raise errors.Unavailable("daemon away")
            return pb.BatchResponse(results=[pb.BatchResult(release=pb.ReleaseResponse())
                                             for _ in request.ops]), False
        return pb.HeartbeatResponse(), False

    monkeypatch.setattr(client, "_attempts", attempts)
    try:
        with pytest.raises(RuntimeError, match="kernel"), client._released_on_exit(lock_id=7, allocation_id=9):
            raise RuntimeError("kernel")
        assert client._owed == [(7, 9)]
        client.heartbeat()
        assert sent == ["BatchRequest", "BatchRequest", "HeartbeatRequest"] and client._owed == []
        # A block that ends well is told (Unavailable), and the release is owed too.
        sent.clear()
        with pytest.raises(errors.Unavailable), client._released_on_exit(lock_id=8):
            pass
        assert client._owed == [(8, 0)]
        client.heartbeat()
        assert sent == ["BatchRequest", "BatchRequest", "HeartbeatRequest"] and client._owed == []
    finally:
        client.close()


class _RpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "slow daemon"


def test_a_block_release_past_its_deadline_is_owed_and_made_before_the_next_call() -> None:
    """A release that ran past its deadline may not have been made: owed like one that
    could not reach the daemon, and made before the next call (not only the next
    heartbeat: the engine would hold the handles meanwhile; found by the client fault
    fuzz under load)."""
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e")
    client._reached = True
    sent: list[str] = []

    class Stub:
        def Batch(self, request: pb.BatchRequest, **_kw: object) -> pb.BatchResponse:
            sent.append("Batch")
            if sent.count("Batch") == 1:
                raise _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
            return pb.BatchResponse(results=[pb.BatchResult(release=pb.ReleaseResponse())
                                             for _ in request.ops])

        def Stats(self, _request: object, **_kw: object) -> pb.StatsResponse:
            sent.append("Stats")
            return pb.StatsResponse()

    client._stub = Stub()  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="kernel"), client._released_on_exit(lock_id=7, allocation_id=9):
            raise RuntimeError("kernel")
        assert client._owed == [(7, 9)]
        client.stats()
        assert sent == ["Batch", "Batch", "Stats"] and client._owed == []
    finally:
        client.close()


def test_close_during_a_failing_heartbeat_is_no_detach(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() ends a heartbeat under way (retrying while the daemon is away) with the
    closed client's FailedPrecondition: that is no "the daemon lost this engine" (it
    used to set `detached`, log an error and call `on_detached`)."""
    detaches: list[object] = []
    client = Client("unix:///nonexistent/hicache.sock", engine_id="e", on_detached=detaches.append)

    def beat() -> None:
        client._closed = True  # (close() ran while this beat retried)
        raise client._closed_error()

    monkeypatch.setattr(client, "heartbeat", beat)
    client._heartbeat_interval_s = 0.01
    client._start_heartbeat()
    thread = client._heartbeat_thread
    assert thread is not None
    thread.join(2)
    assert not thread.is_alive() and detaches == [] and client.detached is None
    client.close()


def test_an_engine_id_no_header_can_carry_is_refused(in_process: tuple[Daemon, Client]) -> None:
    """Calls name the engine in a header (printable ASCII only): an id with a newline or
    'é' attached, then every call failed INTERNAL "Invalid metadata"."""
    daemon, _ = in_process
    for bad in ("a\nb", "caf\u00e9"):
        with pytest.raises(errors.InvalidArgument, match="printable ASCII"):
            Client(daemon.endpoint.address, engine_id=bad)
        channel = grpc.insecure_channel(daemon.endpoint.target)
        try:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.HiCacheStub(channel).Attach(pb.AttachRequest(engine_id=bad, tp_size=1), timeout=5)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "printable ASCII" in (info.value.details() or "")
        finally:
            channel.close()


def test_a_daemon_without_a_configuration_source_reloads_nothing_and_counts_nothing(
    in_process: tuple[Daemon, Client], caplog: pytest.LogCaptureFixture,
) -> None:
    """`serve(load=None)` (an embedding that gives no way to read its config again): a
    SIGHUP is a warning, not a failed reload counted against the operator's file."""
    daemon, client = in_process
    with caplog.at_level(logging.WARNING, logger="hicache.server"):
        outcome = daemon.reload()
    assert not outcome.ok and outcome.error == "no configuration source"
    assert any("no configuration source" in r.message for r in caplog.records)
    assert daemon.metrics.registry.get_sample_value(
        "hicache_config_reloads_total", {"outcome": "failed"}) == 0
    assert client.serving()
