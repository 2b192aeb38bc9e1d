"""Mutation review (session 31, round d): the engine client's request paths, the
protobuf <-> core conversions and the servicer's per-RPC logic. Each test names the
mutant of the product code it kills (a comment) and passes on the product as it is.
Conversion tests run in this process; the others use a real daemon (one per module)
through the real `Client`."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache import convert
from hicache.client import Client, allocate_op, close_session_op, match_op, release_op
from hicache.controller.base import LoadProgress, PrefetchState
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.tiers.storage.base import BackendHealth

from .daemonkit import PAGE, Daemon, eventually, tokens
from .test_client_vs_junk_replies_review import NUM_PAGES, _attached, _FakeDaemon, _ids
from .test_client_vs_junk_replies_review import PAGE as JUNK_PAGE

MakeDaemon = Callable[..., Daemon]


# ----------------------------------------------------------------------------- conversions


def test_an_empty_prompt_given_as_an_empty_list_or_generator_is_zero_tokens() -> None:
    """An engine may pass its (empty) token list as a Python list or generator: it is the
    empty prompt on the wire, not an error about float ids.
    Mutant: `if not items: return b""` dropped (numpy makes an empty float array)."""
    assert convert.tokens_to_bytes([]) == b""
    assert convert.tokens_to_bytes(iter(())) == b""
    assert convert.tokens_to_bytes(np.array([], dtype=np.uint32)) == b""


def test_the_largest_uint32_token_id_is_sent_and_the_next_refused() -> None:
    """Token ids are uint32: 0xFFFFFFFF (and 0) are valid ids sent exactly, 2**32 is refused.
    Mutant: `arr.max() > 0xFFFFFFFF` as `>=`."""
    assert convert.tokens_to_bytes([0, 0xFFFFFFFF]) == b"\x00\x00\x00\x00\xff\xff\xff\xff"
    assert convert.tokens_to_bytes(np.array([0xFFFFFFFF], dtype=np.uint64)) == b"\xff" * 4
    with pytest.raises(InvalidArgument, match="uint32"):
        convert.tokens_to_bytes([0x1_0000_0000])


def test_a_store_that_reports_no_capacity_reads_back_as_unknown_not_zero() -> None:
    """`hicache health` shows a backend without capacity figures (a redis that does not say)
    as unknown (None), and one that does with its figures: the wire's 0 means "not
    reported", never a full or empty store of size 0.
    Mutant: `capacity_bytes=b.capacity_bytes or None` as `b.capacity_bytes`."""
    sent = (BackendHealth("redis", True, 1.5, "ok"),
            BackendHealth("file", False, 0.25, "disk full", capacity_bytes=1 << 30, used_bytes=1 << 30))
    assert convert.health_from_pb(convert.health_to_pb(sent)) == sent
    (back, _) = convert.health_from_pb(convert.health_to_pb(sent))
    assert back.capacity_bytes is None and back.used_bytes is None


def test_the_cores_own_extra_counters_are_only_those_the_wire_does_not_carry() -> None:
    """The core's counters split into the figures the wire carries (aliases summed under
    the canonical key) and its own extras (exported apart): a figure never shows in both,
    or it would be counted twice by whoever adds them up.
    Mutant: `used.update(aliases)` dropped (every counter also an extra)."""
    canonical, extras = convert.canonical_counters(
        {"hit_tokens_l1": 3, "hit_tokens_device": 4, "leases_expired": 2, "lookups": 9,
         "backups_l3_failed": 5})
    assert canonical["hit_tokens_device"] == 7
    assert canonical["expired_leases"] == 2 and canonical["lookups"] == 9
    assert extras == {"backups_l3_failed": 5}


def test_a_load_message_before_the_last_carries_no_device_tokens_or_pages() -> None:
    """Only the last Load message (every layer ready) hands the engine its device pages and
    token count; an earlier one says None for both, so an engine cannot mistake a partial
    load for a finished one.
    Mutant: `device_tokens=r.device_tokens if last else None` as `r.device_tokens`."""
    early = convert.load_from_pb(pb.LoadProgress(layers_ready=1, layers_total=4, device_tokens=0))
    assert (early.device_tokens, early.device_pages) == (None, None)
    done = convert.load_from_pb(convert.load_to_pb(
        LoadProgress(4, 4, {"full": np.array([3, 5])}, device_tokens=2 * PAGE)))
    assert done.device_tokens == 2 * PAGE
    assert done.device_pages is not None
    np.testing.assert_array_equal(done.device_pages["full"], [3, 5])


# ----------------------------------------------------------------------------- real daemons


def test_cancelling_a_finished_prefetch_returns_the_tokens_it_brought(make_daemon: MakeDaemon,
                                                                        tmp_path: Path) -> None:
    """A second daemon on the same L3 prefetches a stored prompt; once its status says DONE
    with every token ready, `cancel_prefetch` (the unary call) returns that same count:
    what arrived stays usable, and the engine plans its reuse from that figure.
    Mutant: `cancel_prefetch` returning 0 rather than `r.tokens_ready`."""
    sets = ("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
            "write.l2_to_l3=write_through", "prefetch.policy=wait_complete",
            "prefetch.threshold_tokens=64")
    prompt = tokens(2 * PAGE, start=3_100_000)
    first = make_daemon(*sets)
    with first.client(engine_id="s31d-writer") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        c.flush(timeout_s=10)
    first.close()
    second = make_daemon(*sets)
    with second.client(engine_id="s31d-reader") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, prefetch=True)
        assert (m.storage_tokens, m.lock_id) == (2 * PAGE, 0) and m.prefetch_id
        assert eventually(lambda: c.prefetch_status(m.prefetch_id).state is PrefetchState.DONE)
        status = c.prefetch_status(m.prefetch_id)
        assert (status.tokens_ready, status.tokens_total) == (2 * PAGE, 2 * PAGE)
        assert c.cancel_prefetch(m.prefetch_id) == 2 * PAGE
        assert c.match(prompt).host_tokens + c.match(prompt).device_tokens == 2 * PAGE


def test_closing_a_session_returns_how_many_references_it_released(daemon: Daemon) -> None:
    """The unary `close_session` returns the number of page references the session held
    (one per page its requests inserted or matched), as its Batch twin does.
    Mutant: `close_session` returning 0 rather than `r.released_refs`."""
    prompt = tokens(2 * PAGE, start=3_200_000)
    with daemon.client(engine_id="s31d-session") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE, session_id="s31d-chat")
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="s31d-chat")
        (batched,) = c.batch([close_session_op("s31d-other")])
        assert isinstance(batched, NotFound)
        assert c.close_session("s31d-chat") == 2


def test_a_batch_holding_an_unsafe_op_is_never_sent_to_an_absent_daemon(tmp_path: Path) -> None:
    """A Batch mixing a Match (not safe to repeat) with a Release is sent once, after a
    health check: against a daemon that is not there, the engine is told the call was not
    sent (so it may send it again), whereas a Batch of Releases only is simply retried.
    Mutant: `repeatable = all(...)` as `any(...)` (the mixed Batch retried blindly, and its
    failure no longer says it was not sent)."""
    with Client(f"unix://{tmp_path / 'nobody.sock'}", engine_id="s31d-absent", retries=1,
                timeout_s=2) as c:
        with pytest.raises(Unavailable, match="the call was not sent"):
            c.batch([match_op(tokens(PAGE), lock=True), release_op(lock_id=5)], sync=False)
        with pytest.raises(Unavailable) as only_releases:
            c.batch([release_op(lock_id=5)], sync=False)
        assert "not sent" not in str(only_releases.value)


# ----------------------------------------------------------------------------- a junk daemon


@pytest.fixture
def junk() -> Iterator[_FakeDaemon]:
    """The junk-replies review's in-test gRPC server (short socket path)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="s31d", dir="/tmp"))
    d = _FakeDaemon(sock_dir)
    try:
        yield d
    finally:
        d.close()
        (sock_dir / "fake.sock").unlink(missing_ok=True)
        sock_dir.rmdir()


def test_a_refused_batch_growth_leaves_the_grown_allocation_to_its_owner(junk: _FakeDaemon) -> None:
    """A Batch Allocate growing an existing allocation, answered with a page id past the
    pool, is that op's FailedPrecondition; the client releases nothing (the allocation is
    the engine's, made earlier: releasing it would free pages the engine is writing). The
    same reply to a new allocation is released (nobody learns its id).
    Mutant: `self._checked(value, new=not op.allocate.HasField("allocation_id"))` as
    `new=True` (the grown allocation released behind the engine's back)."""
    client, _att = _attached(junk)
    bad = pb.AllocateResponse(allocation_id=7, pages=[pb.MemberPages(member="full",
                                                                     page_ids=_ids(1, NUM_PAGES))])
    junk.replies["Batch"] = pb.BatchResponse(results=[pb.BatchResult(allocate=bad)])
    (grown,) = client.batch([allocate_op(2 * JUNK_PAGE, allocation_id=7)])
    assert isinstance(grown, FailedPrecondition)
    assert junk.servicer.calls.get("Release", 0) == 0
    (new,) = client.batch([allocate_op(2 * JUNK_PAGE)])
    assert isinstance(new, FailedPrecondition)
    assert junk.servicer.calls.get("Release", 0) == 1


def test_a_client_of_the_daemons_previous_run_can_neither_use_nor_free_this_runs_handles(
        make_daemon: MakeDaemon) -> None:
    """Two Clients of one engine id; the daemon restarts and only one attaches again. The
    other (still naming the old run) gets, in a Batch: its match refused (its mapped pools
    are gone: "attach again"), its release of a handle NotFound ("its restart released
    it"), Stats served; and a plain Release NotFound too. The lock the re-attached Client
    holds stays held: the stale one's ids name handles of another run.
    Mutants: `_run_batch`'s `if stale: _stale_op(kind)` dropped; `_stale_op`'s release
    branch dropped; `Release`'s stale check dropped."""
    d = make_daemon()
    with d.client(engine_id="s31d-e") as old, d.client(engine_id="s31d-e") as new:
        old.attach(map_pools=False)
        old.match(tokens(PAGE, start=3_300_000), lock=True)
        assert d.stop() == 0
        d.start()
        new.attach(map_pools=False)
        held = new.match(tokens(PAGE, start=3_400_000), lock=True, allocate_tokens=PAGE)
        matched, released, stats = old.batch(
            [match_op(tokens(PAGE, start=3_500_000), lock=True, allocate_tokens=PAGE),
             release_op(lock_id=held.lock_id), pb.BatchOp(stats=pb.StatsRequest())], sync=False)
        assert isinstance(matched, FailedPrecondition) and "attach again" in str(matched)
        assert isinstance(released, NotFound) and "restart released it" in str(released)
        assert {p.tier for p in stats.pools} == {"device", "host"}
        with pytest.raises(NotFound, match="restart released it"):
            old.release(allocation_id=held.allocation_id, sync=False)
        hb = new.heartbeat()
        assert (hb.locks, hb.allocations) == (1, 1)
        new.release(lock_id=held.lock_id)
        new.release(allocation_id=held.allocation_id)


def test_a_flush_without_a_timeout_takes_the_daemons_default_and_writes_everything(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """`flush()` (timeout 0 on the wire: the daemon's `server.shutdown_flush_s`) on a
    write-back daemon with pages pending writes them all and answers how many; a second
    flush has nothing left to write. Not an error saying the pages were left behind.
    Mutant: `Flush` taking `timeout_ms / 1e3` even when it is 0 (a flush of 0 s)."""
    d = make_daemon("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
                    "write.l1_to_l2=write_through", "write.l2_to_l3=write_back",
                    "server.shutdown_flush_s=30")
    prompt = tokens(3 * PAGE, start=3_600_000)
    with d.client(engine_id="s31d-flush") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, lock=True, allocate_tokens=3 * PAGE)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert c.flush() == 3
        assert c.flush() == 0
