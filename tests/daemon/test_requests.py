"""Requests through the real client against a real daemon process (one per module).

Each test uses its own token range, so the tests do not share tree entries.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache.client import Client, allocate_op, close_session_op, insert_op, match_op, release_op
from hicache.controller.base import InsertOutcome, MatchOutcome
from hicache.errors import (
    FailedPrecondition,
    HicacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import PAGE, Daemon, kv_pattern, scrape, tokens


def write_kv(pools: dict, pages: np.ndarray, seed: int) -> None:
    for layer, view in enumerate(pools["full"]):
        for i, page in enumerate(pages):
            view[int(page)] = torch_from(kv_pattern(seed + i, layer, view.shape[1]))


def torch_from(a: np.ndarray):  # type: ignore[no-untyped-def]
    import torch

    return torch.from_numpy(a)


def read_kv(pools: dict, pages: np.ndarray) -> list[bytes]:
    return [bytes(view[int(p)].numpy()) for view in pools["full"] for p in pages]


def test_full_request_life_second_engine_reads_identical_bytes(daemon: Daemon) -> None:
    prompt = tokens(4 * PAGE, start=1_000)
    with daemon.client(engine_id="writer") as writer, daemon.client(engine_id="reader") as reader:
        w = writer.attach()
        assert w.info.page_size == PAGE
        assert [m.name for m in w.info.members] == ["full"]
        m = writer.match(prompt, lock=True, allocate_tokens=4 * PAGE)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 0)
        assert m.lock_id and m.allocation_id and len(m.pages["full"]) == 4
        write_kv(w.pools, m.pages["full"], seed=7)
        expected = read_kv(w.pools, m.pages["full"])
        assert writer.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id) == (
            InsertOutcome(inserted_tokens=4 * PAGE, reused_tokens=0)
        )

        r = reader.attach()
        with reader.matched(prompt) as hit:
            assert hit.device_tokens == 4 * PAGE
            np.testing.assert_array_equal(hit.device_pages["full"], m.pages["full"])
            assert read_kv(r.pools, hit.device_pages["full"]) == expected
        assert reader.heartbeat().locks == 0  # the context manager released the lock


def test_load_brings_an_l2_prefix_back_layer_by_layer(daemon: Daemon) -> None:
    with daemon.client(engine_id="loader") as c:
        att = c.attach()
        first = tokens(2 * PAGE, start=50_000)
        m = c.match(first, lock=True, allocate_tokens=2 * PAGE)
        write_kv(att.pools, m.pages["full"], seed=11)
        expected = read_kv(att.pools, m.pages["full"])
        c.insert(first, lock_id=m.lock_id, allocation_id=m.allocation_id)
        for k in range(8):  # push `first` out of the 16-page L1 (it stays in L2)
            other = tokens(2 * PAGE, start=60_000 + 1_000 * k)
            o = c.match(other, lock=True, allocate_tokens=2 * PAGE)
            c.insert(other, lock_id=o.lock_id, allocation_id=o.allocation_id)
        with c.matched(first) as again:
            assert (again.device_tokens, again.host_tokens) == (0, 2 * PAGE)
            steps = list(c.load(again.lock_id))
            assert [s.layers_ready for s in steps][-1] == steps[-1].layers_total == 4
            assert [s.layers_ready for s in steps] == sorted(s.layers_ready for s in steps)
            last = steps[-1]
            assert last.device_tokens == 2 * PAGE and last.device_pages is not None
            assert read_kv(att.pools, last.device_pages["full"]) == expected


def test_batch_runs_every_op_and_reports_the_failing_one(daemon: Daemon) -> None:
    prompt = tokens(PAGE, start=2_000)
    with daemon.client(engine_id="batcher") as c:
        c.attach(map_pools=False)
        results = c.batch([
            match_op(prompt, lock=True, allocate_tokens=PAGE),
            release_op(lock_id=987_654),
            pb.BatchOp(insert=pb.InsertRequest(tokens=b"\x01\x02\x03")),
            pb.BatchOp(),
            pb.BatchOp(stats=pb.StatsRequest()),
        ])
        match, missing, odd, empty, stats = results
        assert isinstance(match, MatchOutcome) and match.allocation_id
        assert isinstance(missing, NotFound) and "op 1 (release)" in str(missing)
        assert "987654" in str(missing)
        assert isinstance(odd, InvalidArgument) and "multiple of 4" in str(odd)
        assert isinstance(empty, InvalidArgument) and "empty op" in str(empty)
        assert {p.tier for p in stats.pools} == {"device", "host"}
        # Later ops see earlier ones: the insert consumes the batch's own match.
        done = c.batch([insert_op(prompt, lock_id=match.lock_id, allocation_id=match.allocation_id),
                        release_op(lock_id=match.lock_id)])
        assert done[0] == InsertOutcome(inserted_tokens=PAGE, reused_tokens=0)
        assert isinstance(done[1], NotFound)


def test_decode_growth_and_sessions_through_batch_and_the_allocation_context(daemon: Daemon) -> None:
    prompt = tokens(3 * PAGE, start=6_000)
    with daemon.client(engine_id="decoder") as c:
        c.attach(map_pools=False)
        with c.allocation(PAGE) as a:  # released on exit: nothing inserted it
            assert len(a.pages["full"]) == 1
        with pytest.raises(NotFound, match=f"allocation {a.allocation_id}"):
            c.release(allocation_id=a.allocation_id)

        # Prefill of the first page within a session, then decode grows the allocation.
        m = c.match(prompt[: 4 * PAGE], lock=True, allocate_tokens=PAGE, session_id="chat-1")
        grown, done, closed, unknown, empty = c.batch([
            allocate_op(2 * PAGE, allocation_id=m.allocation_id),
            insert_op(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id),
            close_session_op("chat-1"),
            close_session_op("never-opened"),
            close_session_op(""),
        ])
        assert len(grown.pages["full"]) == 3  # the first page plus the two grown
        assert np.array_equal(grown.pages["full"][:1], m.pages["full"])
        assert done == InsertOutcome(inserted_tokens=3 * PAGE, reused_tokens=0)
        assert closed >= 1  # the session referenced the inserted path
        assert isinstance(unknown, NotFound) and "never-opened" in str(unknown)
        assert isinstance(empty, InvalidArgument) and "session_id" in str(empty)
        assert c.match(prompt).device_tokens == 3 * PAGE  # closing keeps the data


def _malformed_calls(c: Client) -> dict[str, tuple[type[HicacheError], str, object]]:
    held = c.match(tokens(PAGE, start=3_000), lock=True)
    c.release(lock_id=held.lock_id)
    short = c.match(tokens(2 * PAGE, start=4_000), lock=True, allocate_tokens=PAGE)
    return {
        "odd-length tokens (match)": (InvalidArgument, "multiple of 4",
                                      lambda: c.match(b"\x00" * 7)),
        "odd-length tokens (insert)": (InvalidArgument, "multiple of 4",
                                       lambda: c.insert(b"\x00" * 5)),
        "too many tokens": (InvalidArgument, "max_tokens_per_request",
                            lambda: c.match(tokens(8193))),
        "message over the size limit": (ResourceExhausted, "",
                                        lambda: c.match(b"\x00" * (12 << 20))),
        "tokens disagree with pages": (InvalidArgument, "covers",
                                       lambda: c.insert(tokens(2 * PAGE, start=4_000),
                                                        lock_id=short.lock_id,
                                                        allocation_id=short.allocation_id)),
        "unknown lock": (NotFound, "lock 424242", lambda: c.release(lock_id=424242)),
        "double release": (NotFound, f"lock {held.lock_id}",
                           lambda: c.release(lock_id=held.lock_id)),
        "insert on a released lock": (NotFound, f"lock {held.lock_id}",
                                      lambda: c.insert(tokens(PAGE, start=3_000),
                                                       lock_id=held.lock_id)),
        "unknown allocation": (NotFound, "allocation 515151",
                               lambda: c.release(allocation_id=515151)),
        "allocation 0 to grow": (NotFound, "0 is never a handle",
                                 lambda: c.allocate(PAGE, allocation_id=0)),
        "release of lock 0": (NotFound, "0 is never a handle", lambda: c.release(lock_id=0)),
        "unknown prefetch": (NotFound, "prefetch 99", lambda: c.prefetch_status(99)),
        "cancel unknown prefetch": (NotFound, "prefetch 98", lambda: c.cancel_prefetch(98)),
        "load on an unknown lock": (NotFound, "lock 77", lambda: list(c.load(77))),
        "huge allocation": (InvalidArgument, "max_tokens_per_request",
                            lambda: c.allocate(1 << 30)),
        "allocation larger than L1": (ResourceExhausted, "L1", lambda: c.allocate(8192)),
        "wrong tp_size": (InvalidArgument, "tp_size", lambda: c.attach(tp_size=3)),
    }


def test_malformed_input_gets_the_right_code_and_the_daemon_keeps_serving(daemon: Daemon) -> None:
    with daemon.client(engine_id="fuzzer", retries=0) as c:
        c.attach(map_pools=False)
        for name, (error, fragment, call) in _malformed_calls(c).items():
            with pytest.raises(error) as info:
                call()  # type: ignore[operator]
            assert fragment in str(info.value), (name, str(info.value))
            assert c.serving(), name
        assert c.stats().counters["lookups"] > 0


def test_requests_before_attach_are_refused(daemon: Daemon) -> None:
    with daemon.client(engine_id="never-attached", retries=0) as c:
        # API.md: a call that needs Attach first is FAILED_PRECONDITION (an engine whose
        # lease expired is NOT_FOUND instead).
        with pytest.raises(FailedPrecondition, match="never-attached"):
            c.heartbeat()
        with pytest.raises(FailedPrecondition, match="call Attach first"):
            c.match(tokens(PAGE), lock=True)


def test_metrics_count_rpcs_and_pools_without_namespaces(daemon: Daemon, metrics_port: int) -> None:
    with daemon.client(engine_id="metered") as c:
        c.attach(map_pools=False)
        c.match(tokens(PAGE, start=9_000), "tenant-secret-ns")
        with pytest.raises(NotFound):
            c.release(lock_id=31337)
    text = scrape(metrics_port)
    assert 'hicache_rpc_seconds_count{code="OK",method="hicache.v1.HiCache/MatchPrefix"}' in text
    assert 'code="NOT_FOUND",method="hicache.v1.HiCache/Release"' in text
    assert 'hicache_pool_capacity_pages{member="full",tier="device"} 16.0' in text
    assert 'hicache_hit_tokens_total{tier="device"}' in text
    assert "hicache_lookups_total" in text
    assert "tenant-secret-ns" not in text


def test_write_through_copies_land_after_insert_and_batch_rpcs_however_they_end(daemon: Daemon) -> None:
    """Copies an Insert or Batch starts are held until the RPC has ended (its response
    sent), then go; a failing RPC releases its hold too, or later copies would wait."""
    import time

    def host_backups(c: Client) -> int:
        return c.stats().counters["backups_host"]

    def wait_for(c: Client, n: int) -> None:
        deadline = time.monotonic() + 10
        while host_backups(c) < n:
            assert time.monotonic() < deadline, f"backups_host stayed at {host_backups(c)} (< {n})"
            time.sleep(0.01)

    with daemon.client(engine_id="backer") as c:
        c.attach(map_pools=False)
        before = host_backups(c)
        with pytest.raises(InvalidArgument):
            c.insert(b"\x01\x02\x03")  # a failing Insert RPC
        one = tokens(PAGE, start=300_000)
        m = c.match(one, lock=True, allocate_tokens=PAGE)
        c.insert(one, lock_id=m.lock_id, allocation_id=m.allocation_id)
        wait_for(c, before + 1)
        prompts = [tokens(PAGE, start=310_000 + 1_000 * i) for i in range(3)]
        matches = c.batch([match_op(t, lock=True, allocate_tokens=PAGE) for t in prompts])
        c.batch([insert_op(t, lock_id=r.lock_id, allocation_id=r.allocation_id)
                 for t, r in zip(prompts, matches, strict=True)])
        wait_for(c, before + 4)


def test_a_body_that_is_no_valid_message_is_invalid_argument(daemon: Daemon) -> None:
    """gRPC answers INTERNAL when the request parser raises; a caller sending bytes that
    are no valid message (here a namespace that is not UTF-8) gets INVALID_ARGUMENT."""
    import grpc

    junk = b"\x0a\x02\xff\xfe"  # field 1 (namespace), 2 bytes, not UTF-8
    with grpc.insecure_channel(daemon.target) as channel:
        for method in ("/hicache.v1.HiCache/MatchPrefix", "/hicache.v1.HiCache/Batch"):
            call = channel.unary_unary(method)
            with pytest.raises(grpc.RpcError) as info:
                call(junk, metadata=(("x-hicache-engine", "junk"),), timeout=10)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid message" in info.value.details(), method
    with daemon.client(engine_id="after-junk", retries=0) as c:
        assert c.serving()


def test_an_error_quoting_a_long_input_keeps_its_code(daemon: Daemon) -> None:
    """Messages quote the caller's strings (here a session id of the longest allowed,
    1,024 characters; 20,000 were accepted before names were bounded); past gRPC's
    metadata limit the caller lost the status: RESOURCE_EXHAUSTED ("Stream removed")
    instead of NOT_FOUND. Messages are cut to 1,024 characters."""
    from hicache.interceptor import MAX_STATUS_MESSAGE

    with daemon.client(engine_id="long-input", retries=0) as c:
        with pytest.raises(NotFound) as info:
            c.close_session("x" * 1_024)
        assert "more characters)" in str(info.value)
        assert len(str(info.value)) < MAX_STATUS_MESSAGE + 200


def test_a_health_check_of_an_unknown_service_says_why(daemon: Daemon) -> None:
    """The standard health service's NOT_FOUND carried no message."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(daemon.target) as channel, pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no service named 'no.such.Service'" in info.value.details()


def test_a_streaming_request_that_is_no_valid_message_is_refused_and_the_daemon_stops(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Server reflection's request stream parsed by gRPC's own deserializer: a message
    that did not parse answered INTERNAL with a traceback logged, and some such calls
    never finished, so a SIGTERM waited for them forever (no flush, no exit)."""
    import signal
    import subprocess

    import grpc

    d = make_daemon()
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    codes = set()
    with grpc.insecure_channel(d.target) as channel:
        for _ in range(10):  # (each call left a stuck one some of the time)
            with pytest.raises(grpc.RpcError) as info:
                list(channel.stream_stream(method)(iter([b"\x0a\x03\xff\xfe\xfd"]), timeout=10))
            codes.add(info.value.code())
            assert "not a valid message" in info.value.details()
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    try:
        assert d.stop(signal.SIGTERM, timeout_s=15) == 0
    except subprocess.TimeoutExpired:
        d.stop(signal.SIGKILL)
        pytest.fail("SIGTERM: the daemon did not exit in 15 s")
    assert "Traceback" not in d.log()


def test_matched_releases_both_handles_and_never_hides_the_body_error(daemon: Daemon) -> None:
    prompt = tokens(2 * PAGE, start=700_000)
    with daemon.client(engine_id="ctx") as c:
        c.attach(map_pools=False)
        with pytest.raises(RuntimeError, match="engine failed"), \
                c.matched(prompt, allocate_tokens=2 * PAGE) as m:
            assert m.lock_id and m.allocation_id
            raise RuntimeError("engine failed mid-prefill")
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)
        with c.matched(prompt, allocate_tokens=2 * PAGE) as m:  # the usual life: Insert
            c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        hb = c.heartbeat()
        assert (hb.locks, hb.allocations) == (0, 0)


def test_a_reply_listing_every_members_pages_at_page_size_1_is_sent(tmp_path) -> None:
    """At page size 1 a reply carries 4 bytes a token for every member (twice for a match
    that also allocates): more than the request's 4 bytes a token. The send limit used to
    be the request's, so such calls failed with RESOURCE_EXHAUSTED within the limits."""
    tokens_n = 200_000
    d = Daemon(tmp_path, "model.page_size=1", "prefetch.threshold_tokens=1",
               "model.components.full.layers=1", "model.components.full.bytes_per_token_per_layer=1",
               "model.sidecars={a: {anchor: full, layers: 1, bytes_per_token_per_layer: 1}, "
               "b: {anchor: full, layers: 1, bytes_per_token_per_layer: 1}}",
               "tiers.l1.tokens=524288", f"server.max_tokens_per_request={tokens_n}").start()
    try:
        with d.client(engine_id="page-1", retries=0) as c:
            c.attach(map_pools=False)
            a = c.allocate(tokens_n)
            assert {len(ids) for ids in a.pages.values()} == {tokens_n}
            c.release(allocation_id=a.allocation_id)
            prompt, half = tokens(tokens_n, start=1), tokens_n // 2
            m = c.match(prompt[: 4 * half], lock=True, allocate_tokens=half)
            c.insert(prompt[: 4 * half], lock_id=m.lock_id, allocation_id=m.allocation_id)
            again = c.match(prompt, lock=True, allocate_tokens=tokens_n)  # half hit, half new
            assert again.device_tokens == half
            assert {len(ids) for ids in again.device_pages.values()} == {half}
            assert {len(ids) for ids in again.pages.values()} == {half}
            c.release(lock_id=again.lock_id)
            c.release(allocation_id=again.allocation_id)
    finally:
        d.close()
