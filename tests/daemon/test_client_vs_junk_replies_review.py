"""The engine client against replies a correct daemon never sends (a buggy or newer daemon,
a proxy, bit flips).

The client maps the daemon's L1 pools and hands the engine the page ids it writes KV
into: it is the last barrier before engine memory. Each test runs the real
`hicache.client.Client` against a small in-test gRPC server (`_FakeDaemon`) on a unix
socket that answers crafted replies. What the client does with each should be a clear
`hicache.errors` error (or a documented tolerance), never a write through a wrong
mapping, a busy loop, or a KeyError/ValueError from deep inside.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from hicache import errors
from hicache.client import Client, insert_op, match_op, release_op
from hicache.controller.base import PrefetchState
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.tiers.device import SEGMENT_PREFIX, SHM_DIR

PAGE = 16  # tokens per page of the fake geometry
BPP = 64  # bytes_per_page_per_layer
LAYERS = 2
NUM_PAGES = 8
_seq = itertools.count()


def _ids(*ids: int) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _tokens(n: int) -> bytes:
    return np.arange(1, n + 1, dtype="<u4").tobytes()


class _Servicer(pb_grpc.HiCacheServicer):
    """Answers with whatever the test put in `replies` (a reply, or a callable taking the
    request); counts calls by method."""

    def __init__(self) -> None:
        self.replies: dict[str, Any] = {}
        self.calls: dict[str, int] = {}
        self.mu = threading.Lock()

    def _answer(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self.mu:
            self.calls[method] = self.calls.get(method, 0) + 1
        reply = self.replies.get(method)
        if reply is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"fake daemon: no {method} reply")
        return reply(request) if callable(reply) else reply

    def Attach(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Attach", request, context)

    def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Heartbeat", request, context)

    def MatchPrefix(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("MatchPrefix", request, context)

    def Allocate(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Allocate", request, context)

    def Insert(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Insert", request, context)

    def Release(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Release", request, context)

    def PrefetchStatus(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("PrefetchStatus", request, context)

    def CancelPrefetch(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("CancelPrefetch", request, context)

    def CloseSession(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("CloseSession", request, context)

    def Batch(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Batch", request, context)

    def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return self._answer("Stats", request, context)

    def Load(self, request, context):  # type: ignore[no-untyped-def]
        yield from self._answer("Load", request, context)


class _FakeDaemon:
    def __init__(self, sock_dir: Path) -> None:
        self.servicer = _Servicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_HiCacheServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        self.address = f"unix://{sock_dir / 'fake.sock'}"
        self.server.add_insecure_port(self.address)
        self.server.start()
        self.segments: list[Path] = []
        self.clients: list[Client] = []

    @property
    def replies(self) -> dict[str, Any]:
        return self.servicer.replies

    def client(self, **kw: Any) -> Client:
        c = Client(self.address, engine_id="junk-engine", retries=0, timeout_s=5, **kw)
        self.clients.append(c)
        return c

    def segment(self, size: int) -> str:
        """A shared-memory segment of `size` bytes the fake descriptors name (removed after
        the test); named like a daemon's, under an instance no daemon holds a lock of."""
        name = f"{SEGMENT_PREFIX}junkreview{os.getpid()}x{next(_seq)}-{os.getpid()}-full"
        path = SHM_DIR / name
        with open(path, "wb") as f:
            f.truncate(size)
        self.segments.append(path)
        return name

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop(None)
        for path in self.segments:
            path.unlink(missing_ok=True)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[_FakeDaemon]:
    # (a unix socket path is limited to 107 bytes: tmp_path may be longer)
    sock_dir = tmp_path if len(str(tmp_path)) < 80 else Path(tempfile.mkdtemp(prefix="hcj", dir="/tmp"))
    d = _FakeDaemon(sock_dir)
    try:
        yield d
    finally:
        d.close()
        if sock_dir != tmp_path:
            (sock_dir / "fake.sock").unlink(missing_ok=True)
            sock_dir.rmdir()


def _member(name: str = "full", component: str = "full", layers: int = LAYERS,
            bpp: int = BPP, window: int = 0) -> pb.Member:
    return pb.Member(name=name, component=component, anchor=component, layers=layers,
                     bytes_per_page_per_layer=bpp, window_tokens=window)


def _pool(handle: str, *, member: str = "full", num_pages: int = NUM_PAGES, layers: int = LAYERS,
          page_stride: int = BPP, layer_stride: int | None = None, offset: int = 0,
          kind: int = pb.SHM) -> pb.Pool:
    layer_stride = num_pages * page_stride if layer_stride is None else layer_stride
    return pb.Pool(member=member, kind=kind, handle=handle.encode() if isinstance(handle, str) else handle,
                   device=-1, num_pages=num_pages, layer_stride_bytes=layer_stride,
                   page_stride_bytes=page_stride, layers=layers, offset_bytes=offset,
                   size_bytes=layers * layer_stride)


def _attach_reply(fake: _FakeDaemon, *, members: list[pb.Member] | None = None,
                  pools: list[pb.Pool] | None = None, lease_ms: int = 60_000) -> pb.AttachResponse:
    if pools is None:
        pools = [_pool(fake.segment(LAYERS * NUM_PAGES * BPP))]
    return pb.AttachResponse(page_size=PAGE, members=members or [_member()], pools=pools,
                             lease_ms=lease_ms, daemon_run="run-1")


def _attached(fake: _FakeDaemon, **kw: Any) -> tuple[Client, Any]:
    fake.replies["Attach"] = _attach_reply(fake, **kw)
    fake.replies.setdefault("Heartbeat", pb.HeartbeatResponse(lease_ms=60_000))
    client = fake.client()
    return client, client.attach()



# ----------------------------------------------------------------------------- Attach


def test_a_sane_fake_attach_maps_the_pool_the_descriptor_names(fake: _FakeDaemon) -> None:
    """The harness itself: a consistent descriptor maps [num_pages, bpp] per layer over the
    segment, layer-major, and a write lands at offset + layer * stride + page * bpp."""
    _client, att = _attached(fake)
    rows = att.pools["full"]
    assert len(rows) == LAYERS and all(r.shape == (NUM_PAGES, BPP) for r in rows)
    rows[1][3] = 7
    raw = np.fromfile(fake.segments[0], dtype=np.uint8)
    hit = np.flatnonzero(raw)
    assert hit[0] == 1 * NUM_PAGES * BPP + 3 * BPP and len(hit) == BPP


def test_an_unknown_pool_kind_is_a_typed_error(fake: _FakeDaemon) -> None:
    pool = _pool(fake.segment(LAYERS * NUM_PAGES * BPP), kind=7)
    with pytest.raises(errors.FailedPrecondition, match="pool kind 7"):
        _attached(fake, pools=[pool])


def test_a_segment_smaller_than_its_descriptor_is_a_typed_error(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP - 1)
    with pytest.raises(errors.InvalidArgument, match="descriptor needs"):
        _attached(fake, pools=[_pool(seg)])


def test_an_offset_past_the_segment_is_a_typed_error(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP)
    with pytest.raises(errors.InvalidArgument, match="descriptor needs"):
        _attached(fake, pools=[_pool(seg, offset=1 << 62)])


def test_a_member_page_wider_than_the_pool_stride_is_a_typed_error(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP)
    with pytest.raises(errors.InvalidArgument, match="a page of 128 bytes in a stride of 64"):
        _attached(fake, members=[_member(bpp=128)], pools=[_pool(seg)])


@pytest.mark.parametrize("handle", ["../hicache-x", "/dev/shm/hicache-x", "not-hicache"])
def test_a_handle_that_is_no_hicache_segment_name_is_refused(fake: _FakeDaemon, handle: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="is not a hicache shm segment name"):
        _attached(fake, pools=[_pool(handle)])


def test_a_missing_segment_is_not_found(fake: _FakeDaemon) -> None:
    with pytest.raises(errors.NotFound, match="does not exist"):
        _attached(fake, pools=[_pool(f"{SEGMENT_PREFIX}junkreview-gone-1-full")])


def test_an_attach_member_of_an_unknown_component_is_a_typed_error(fake: _FakeDaemon) -> None:
    with pytest.raises(errors.HicacheError, match="mla"):
        _attached(fake, members=[_member(component="mla")])


@pytest.mark.parametrize("handle", [b"hicache-\xff\xfe-1-full", b"hicache-a\x00b-1-full"],
                         ids=["not-utf8", "nul-byte"])
def test_a_junk_pool_handle_is_a_typed_error(fake: _FakeDaemon, handle: bytes) -> None:
    with pytest.raises(errors.HicacheError, match="full"):
        _attached(fake, pools=[_pool(handle)])  # type: ignore[arg-type]


def test_a_pool_of_zero_layers_is_a_typed_error(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP)
    with pytest.raises(errors.HicacheError, match="full"):
        _attached(fake, pools=[_pool(seg, layers=0, layer_stride=2 * NUM_PAGES * BPP)])


def test_a_pool_with_fewer_layers_than_its_member_is_a_typed_error(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP)
    with pytest.raises(errors.HicacheError, match="layers"):
        _attached(fake, pools=[_pool(seg, layers=1)])


def test_overlapping_layer_regions_are_refused(fake: _FakeDaemon) -> None:
    seg = fake.segment(LAYERS * NUM_PAGES * BPP)
    with pytest.raises(errors.HicacheError, match="full"):
        _client, att = _attached(fake, pools=[_pool(seg, layer_stride=BPP)])
        rows = att.pools["full"]
        rows[0][1] = 1
        assert int(rows[1][0].sum()) == 0, "layer 1's page 0 changed by a write to layer 0's page 1"


def test_two_pools_for_one_member_are_refused(fake: _FakeDaemon) -> None:
    a, b = (fake.segment(LAYERS * NUM_PAGES * BPP) for _ in range(2))
    with pytest.raises(errors.HicacheError, match="full"):
        _attached(fake, pools=[_pool(a), _pool(b)])


def test_a_zero_lease_does_not_make_the_heartbeat_spin(fake: _FakeDaemon) -> None:
    try:
        _attached(fake, lease_ms=0)
    except errors.HicacheError:
        return  # refusing the reply is fine too
    time.sleep(0.5)
    assert fake.servicer.calls.get("Heartbeat", 0) <= 5


# ----------------------------------------------------------------------------- MatchPrefix, Allocate


def _match_reply(*, device_tokens: int = 0, device_pages: bytes = b"", pages: bytes = b"",
                 member: str = "full", lock_id: int = 11, allocation_id: int = 12) -> pb.MatchPrefixResponse:
    r = pb.MatchPrefixResponse(device_tokens=device_tokens, lock_id=lock_id, allocation_id=allocation_id)
    if device_pages:
        r.device_pages.add(member=member, page_ids=device_pages)
    if pages:
        r.pages.add(member=member, page_ids=pages)
    return r


def test_a_sane_match_reply_hands_the_engine_its_page_ids(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["MatchPrefix"] = _match_reply(device_tokens=PAGE, device_pages=_ids(2), pages=_ids(5))
    m = client.match(_tokens(2 * PAGE), lock=True, allocate_tokens=2 * PAGE)
    assert m.device_tokens == PAGE and m.lock_id == 11 and m.allocation_id == 12
    assert m.device_pages["full"].tolist() == [2] and m.pages["full"].tolist() == [5]


def test_page_ids_of_an_odd_byte_length_are_a_typed_error_naming_the_member(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["MatchPrefix"] = _match_reply(pages=_ids(1, 2)[:7])
    with pytest.raises(errors.InvalidArgument, match=r"pages\[full\]: 7 bytes"):
        client.match(_tokens(PAGE), allocate_tokens=PAGE)
    fake.replies["Allocate"] = pb.AllocateResponse(
        allocation_id=3, pages=[pb.MemberPages(member="full", page_ids=b"\x01")])
    with pytest.raises(errors.InvalidArgument, match=r"pages\[full\]: 1 bytes"):
        client.allocate(PAGE)


def test_an_swa_members_minus_one_outside_the_window_reaches_the_engine(fake: _FakeDaemon) -> None:
    """README: -1 marks an SWA page outside the window (a documented value, kept)."""
    seg_full, seg_swa = fake.segment(LAYERS * NUM_PAGES * BPP), fake.segment(LAYERS * NUM_PAGES * BPP)
    client, _att = _attached(
        fake, members=[_member(), _member("swa", "swa", window=PAGE)],
        pools=[_pool(seg_full), _pool(seg_swa, member="swa")])
    reply = _match_reply(device_tokens=2 * PAGE, device_pages=_ids(1, 2))
    reply.device_pages.add(member="swa", page_ids=_ids(-1, 4))
    fake.replies["MatchPrefix"] = reply
    m = client.match(_tokens(2 * PAGE))
    assert m.device_pages["swa"].tolist() == [-1, 4] and m.device_pages["full"].tolist() == [1, 2]


def test_a_negative_page_id_is_refused_before_the_engine_writes_through_it(fake: _FakeDaemon) -> None:
    client, att = _attached(fake)
    fake.replies["MatchPrefix"] = _match_reply(pages=_ids(-2))
    with pytest.raises(errors.HicacheError, match="full"):
        m = client.match(_tokens(PAGE), lock=True, allocate_tokens=PAGE)
        rows = att.pools["full"][0]
        rows[m.pages["full"]] = 9  # what README's example does with the allocation's pages
        assert int(rows[NUM_PAGES - 2].sum()) == 0, "the write landed in page num_pages - 2"


def test_a_page_id_past_the_pool_is_refused(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Allocate"] = pb.AllocateResponse(
        allocation_id=3, pages=[pb.MemberPages(member="full", page_ids=_ids(1, NUM_PAGES))])
    with pytest.raises(errors.HicacheError, match="full"):
        client.allocate(2 * PAGE)


def test_a_match_reusing_more_tokens_than_the_prompt_is_refused(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["MatchPrefix"] = _match_reply(device_tokens=4 * PAGE, device_pages=_ids(0, 1, 2, 3))
    with pytest.raises(errors.HicacheError, match="device_tokens"):
        client.match(_tokens(2 * PAGE))


# ----------------------------------------------------------------------------- Load


def _progress(ready: int, total: int = LAYERS, pages: bytes = b"", tokens: int = 0) -> pb.LoadProgress:
    msg = pb.LoadProgress(layers_ready=ready, layers_total=total, device_tokens=tokens)
    if pages:
        msg.device_pages.add(member="full", page_ids=pages)
    return msg


def test_a_sane_load_stream_ends_with_the_device_pages(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Load"] = lambda _r: iter([_progress(1), _progress(2, pages=_ids(3), tokens=PAGE)])
    got = list(client.load(11))
    assert [p.layers_ready for p in got] == [1, 2] and got[0].device_pages is None
    assert got[-1].device_pages is not None and got[-1].device_pages["full"].tolist() == [3]
    assert got[-1].device_tokens == PAGE


def test_a_load_the_daemon_fails_midway_is_a_typed_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)

    def stream(_r: Any) -> Iterator[pb.LoadProgress]:
        yield _progress(1)
        raise errors.FailedPrecondition("boom")  # (the servicer answers UNKNOWN: a crash)

    fake.replies["Load"] = stream
    it = client.load(11)
    assert next(it).layers_ready == 1
    with pytest.raises(errors.HicacheError, match="UNKNOWN"):
        next(it)


def test_a_load_stream_that_ends_without_its_final_message_is_an_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Load"] = lambda _r: iter([_progress(1)])
    with pytest.raises(errors.HicacheError, match="layers"):
        list(client.load(11))


def test_a_load_stream_that_goes_backwards_is_an_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Load"] = lambda _r: iter(
        [_progress(2, total=3), _progress(1, total=3), _progress(3, total=3, pages=_ids(1), tokens=PAGE)])
    with pytest.raises(errors.HicacheError, match="layers"):
        list(client.load(11))


# ----------------------------------------------------------------------------- Batch


def test_a_batch_answered_with_more_results_than_ops_is_a_typed_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Batch"] = pb.BatchResponse(results=[pb.BatchResult(release=pb.ReleaseResponse())] * 3)
    with pytest.raises(errors.HicacheError, match="answered 3 results for 2 ops"):
        client.batch([release_op(lock_id=1), release_op(lock_id=2)])
    fake.replies["Batch"] = pb.BatchResponse()
    with pytest.raises(errors.HicacheError, match="answered 0 results for 1 ops"):
        client.batch([release_op(lock_id=1)])


def test_a_batch_status_result_is_the_ops_typed_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Batch"] = pb.BatchResponse(results=[
        pb.BatchResult(status=pb.OpStatus(code=grpc.StatusCode.NOT_FOUND.value[0], message="lock 1")),
        pb.BatchResult(status=pb.OpStatus(code=999, message="what")),
    ])
    out = client.batch([release_op(lock_id=1), release_op(lock_id=2)])
    assert isinstance(out[0], errors.NotFound) and "lock 1" in str(out[0])
    assert type(out[1]) is errors.HicacheError and "UNKNOWN" in str(out[1])


def test_a_batch_result_of_a_kind_this_client_does_not_know_is_a_typed_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    result_field = max(f.number for f in pb.BatchResult.DESCRIPTOR.fields) + 1
    newer = pb.BatchResult.FromString(bytes([(result_field << 3) | 2, 0]))  # (an empty message)
    assert newer.WhichOneof("result") is None
    fake.replies["Batch"] = pb.BatchResponse(results=[newer])
    try:
        out = client.batch([release_op(lock_id=1)])
    except errors.HicacheError:
        return
    assert isinstance(out[0], errors.HicacheError)


def test_a_batch_result_of_another_ops_kind_is_a_typed_error(fake: _FakeDaemon) -> None:
    client, _att = _attached(fake)
    fake.replies["Batch"] = pb.BatchResponse(results=[
        pb.BatchResult(insert=pb.InsertResponse(inserted_tokens=PAGE)),
        pb.BatchResult(match_prefix=_match_reply())])
    try:
        out = client.batch([match_op(_tokens(PAGE)), insert_op(_tokens(PAGE), lock_id=1)])
    except errors.HicacheError:
        return
    assert all(isinstance(o, errors.HicacheError) for o in out), out


# ----------------------------------------------------------------------------- PrefetchStatus, Stats


def test_an_unknown_prefetch_state_is_a_typed_error(fake: _FakeDaemon) -> None:
    client = fake.client()
    fake.replies["PrefetchStatus"] = pb.PrefetchStatusResponse(state=42, tokens_ready=PAGE)  # type: ignore[arg-type]
    with pytest.raises(errors.FailedPrecondition, match="prefetch state 42"):
        client.prefetch_status(5)
    fake.replies["PrefetchStatus"] = pb.PrefetchStatusResponse(state=pb.DONE, tokens_ready=PAGE)
    assert client.prefetch_status(5).state is PrefetchState.DONE


def test_stats_with_an_unknown_tier_and_unknown_counters_are_shown_not_fatal(fake: _FakeDaemon) -> None:
    """A newer daemon's tier is shown as `tier<N>`; counters this client does not know (fields
    it has no name for, kept by protobuf as unknown fields) are ignored, the known ones read."""
    client = fake.client()
    counters = pb.Counters(lookups=3).SerializeToString() + bytes([0xA0, 0x38, 7])  # + field 900 = 7
    counters_field = pb.StatsResponse.DESCRIPTOR.fields_by_name["counters"].number
    raw = (pb.StatsResponse(pools=[pb.PoolStats(tier=9, member="full", capacity_pages=4)]).SerializeToString()
           + bytes([(counters_field << 3) | 2, len(counters)]) + counters)
    fake.replies["Stats"] = pb.StatsResponse.FromString(raw)
    assert fake.replies["Stats"].counters.lookups == 3
    s = client.stats()
    assert s.pools[0].tier == "tier9" and s.pools[0].capacity_pages == 4
    assert s.counters["lookups"] == 3
