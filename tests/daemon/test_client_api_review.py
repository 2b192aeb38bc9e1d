"""The engine client as an engine developer uses it (a review): token inputs of every
shape, `load()` iterators left mid-way, the lock context managers around restarts and
in-block releases, Batch typing and size limits, the mapped pools outliving `close()`,
and deadlines. Real daemons; each test uses its own token range."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hicache.client import Client, allocate_op, close_session_op, insert_op, match_op, release_op
from hicache.controller.base import (
    AllocationInfo,
    HeartbeatInfo,
    InsertOutcome,
    LoadProgress,
    MatchOutcome,
    StatsSnapshot,
)
from hicache.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import PAGE, Daemon, free_port, kv_pattern, tokens
from .faultproxy import FaultProxy

MakeDaemon = Callable[..., Daemon]
# 32 layers of 128 KiB a page: a Load of 8 pages streams several progress messages.
DEEP = ("model.components.full.layers=32", "model.components.full.bytes_per_token_per_layer=2048")


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of the DEEP geometry shared by the load tests (own token ranges each)."""
    d = Daemon(tmp_path_factory.mktemp("deep"), *DEEP).start()
    yield d
    d.close()


def pools_of(c: Client) -> dict[str, tuple[int, int]]:
    """tier -> (used, locked) pages."""
    return {p.tier: (p.used_pages, p.locked_pages) for p in c.stats().pools}


def held(c: Client) -> tuple[int, int]:
    hb = c.heartbeat()
    return hb.locks, hb.allocations


def wait_unlocked(c: Client, timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
    """Pools once no page is locked (a load the engine walked away from lands on a daemon
    thread; the write-through copies of recent inserts pin pages for a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = pools_of(c)
        if all(locked == 0 for _, locked in pools.values()) or time.monotonic() > deadline:
            return pools
        time.sleep(0.05)


def write_pages(pools: dict, pages: np.ndarray, seed: int) -> None:
    import torch

    for layer, view in enumerate(pools["full"]):
        rows = np.stack([kv_pattern(seed + i, layer, view.shape[1]) for i in range(len(pages))])
        view[torch.from_numpy(np.asarray(pages))] = torch.from_numpy(rows)


def pages_hold(pools: dict, pages: np.ndarray, seed: int) -> bool:
    return all(
        np.array_equal(view[int(p)].numpy(), kv_pattern(seed + i, layer, view.shape[1]))
        for layer, view in enumerate(pools["full"])
        for i, p in enumerate(pages)
    )


def commit(c: Client, pools: dict, prompt: bytes, seed: int) -> None:
    n = len(prompt) // 4
    m = c.match(prompt, lock=True, allocate_tokens=n)
    write_pages(pools, m.pages["full"], seed)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)


# --------------------------------------------------------------------------- token inputs


def test_every_documented_token_form_sends_the_same_ids(daemon: Daemon) -> None:
    """bytes, bytearray, memoryview, uint32/int64/big-endian/strided arrays, lists and
    generators all name the same sequence: a match of each finds what one form inserted."""
    ids = np.arange(80_000, 80_000 + 2 * PAGE, dtype="<u4")
    with daemon.client(engine_id="forms") as c:
        c.attach(map_pools=False)
        m = c.match(ids.tobytes(), lock=True, allocate_tokens=2 * PAGE)
        c.insert(ids.tobytes(), lock_id=m.lock_id, allocation_id=m.allocation_id)
        strided = np.repeat(ids, 2)[::2]
        assert not strided.flags.c_contiguous
        forms = {
            "bytearray": bytearray(ids.tobytes()),
            "memoryview": memoryview(ids.tobytes()),
            "int64 array": ids.astype(np.int64),
            "big-endian array": ids.astype(">u4"),
            "strided view": strided,
            "list": [int(t) for t in ids],
            "generator": (int(t) for t in ids),
            "numpy scalars": list(ids),
        }
        for name, form in forms.items():
            assert c.match(form).device_tokens == 2 * PAGE, name


def test_ids_outside_uint32_are_refused_before_anything_is_sent(daemon: Daemon) -> None:
    with daemon.client(engine_id="range") as c:
        c.attach(map_pools=False)
        before = c.stats().counters["lookups"]
        for bad in (
            np.array([1, -1], dtype=np.int64),
            np.array([1, 1 << 32], dtype=np.int64),
            np.array([1 << 63], dtype=np.uint64),
            [5, -2],
            [1, 1 << 40],
        ):
            with pytest.raises(InvalidArgument, match="uint32"):
                c.match(bad, lock=True, allocate_tokens=PAGE)
            with pytest.raises(InvalidArgument, match="uint32"):
                match_op(bad)
        assert c.stats().counters["lookups"] == before
        assert held(c) == (0, 0)


@pytest.mark.parametrize("form", ["float64 array", "float list", "nan array"])
def test_non_integer_token_ids_are_refused(daemon: Daemon, form: str) -> None:
    ids = np.arange(81_000, 81_000 + PAGE, dtype="<u4")
    with daemon.client(engine_id=f"floats-{form.replace(' ', '-')}") as c:
        c.attach(map_pools=False)
        m = c.match(ids.tobytes(), lock=True, allocate_tokens=PAGE)
        c.insert(ids.tobytes(), lock_id=m.lock_id, allocation_id=m.allocation_id)
        bad = {
            "float64 array": ids + 0.5,
            "float list": [float(t) + 0.5 for t in ids],
            "nan array": np.where(np.arange(PAGE) == 3, np.nan, ids.astype(np.float64)),
        }[form]
        try:
            got = c.match(bad)
        except InvalidArgument:
            return
        pytest.fail(f"sent as other ids, not refused: matched {got.device_tokens} tokens")


def test_a_huge_python_int_token_is_invalid_argument(daemon: Daemon) -> None:
    with daemon.client(engine_id="huge-int") as c:
        c.attach(map_pools=False)
        with pytest.raises(InvalidArgument, match="uint32"):
            c.match([1, 2, 1 << 64])


# --------------------------------------------------------------------------- load()


def test_a_load_left_mid_way_keeps_the_lock_and_loads_again_byte_exact(deep: Daemon) -> None:
    """The engine breaks out of the progress loop: the stream is cancelled, the copy lands
    anyway, the lock stays the engine's; a second Load on it ends with every page, bytes
    intact, and its release leaves nothing locked or held."""
    with deep.client(engine_id="quitter") as c:
        att = c.attach()
        first = tokens(8 * PAGE, start=1_000)
        commit(c, att.pools, first, seed=1)
        commit(c, att.pools, tokens(8 * PAGE, start=20_000), seed=50)
        commit(c, att.pools, tokens(8 * PAGE, start=40_000), seed=90)  # first: L2 only
        m = c.match(first, lock=True)
        assert (m.device_tokens, m.host_tokens) == (0, 8 * PAGE)
        for step in c.load(m.lock_id):
            assert isinstance(step, LoadProgress)
            break
        assert held(c) == (1, 0)
        steps = list(c.load(m.lock_id))
        last = steps[-1]
        assert last.layers_ready == last.layers_total == 32
        assert last.device_tokens == 8 * PAGE and last.device_pages is not None
        assert pages_hold(att.pools, last.device_pages["full"], seed=1)
        c.release(lock_id=m.lock_id)
        assert held(c) == (0, 0)
        assert {t: locked for t, (_, locked) in wait_unlocked(c).items()} == {
            "device": 0,
            "host": 0,
        }
        again = c.match(first)
        assert again.device_tokens == 8 * PAGE  # what the first load copied stays cached


def test_an_error_inside_the_load_loop_of_a_matched_block_releases_the_lock(deep: Daemon) -> None:
    with deep.client(engine_id="crasher") as c:
        att = c.attach()
        first = tokens(8 * PAGE, start=100_000)
        commit(c, att.pools, first, seed=3)
        commit(c, att.pools, tokens(8 * PAGE, start=120_000), seed=30)
        commit(c, att.pools, tokens(8 * PAGE, start=140_000), seed=60)
        with pytest.raises(RuntimeError, match="forward failed"), c.matched(first) as m:
            assert m.host_tokens == 8 * PAGE
            for _ in c.load(m.lock_id):
                raise RuntimeError("forward failed at layer 0")
        assert held(c) == (0, 0)
        assert {t: locked for t, (_, locked) in wait_unlocked(c).items()} == {
            "device": 0,
            "host": 0,
        }
        # The daemon serves the next request on the same prefix normally.
        with c.matched(first) as m2:
            final = list(c.load(m2.lock_id))[-1]
            assert final.device_tokens == 8 * PAGE
            assert final.device_pages is not None
            assert pages_hold(att.pools, final.device_pages["full"], seed=3)
        assert held(c) == (0, 0)


# --------------------------------------------------------------------------- context managers


def test_a_matched_block_ends_quietly_when_the_daemon_restarted_inside_it(
    make_daemon: MakeDaemon,
) -> None:
    """The restarted daemon knows neither the engine nor its handles: the exit's release
    answers NotFound, which is 'already released', so a body that went well ends well."""
    d = make_daemon()
    with d.client(engine_id="restarted", timeout_s=10) as c:
        c.attach(map_pools=False)
        prompt = tokens(2 * PAGE, start=3_000)
        with c.matched(prompt, allocate_tokens=2 * PAGE) as m:
            assert m.lock_id and m.allocation_id
            assert d.stop() == 0
            d.start()
        c.attach(map_pools=False)
        assert held(c) == (0, 0)
        with c.matched(prompt, allocate_tokens=2 * PAGE) as m:
            c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert held(c) == (0, 0)
        assert c.match(prompt).device_tokens == 2 * PAGE


def test_blocks_whose_handles_the_body_consumed_or_released_nest_cleanly(daemon: Daemon) -> None:
    """Inner and outer blocks on one prefix; a mid-request Insert with keep_lock, a grown
    allocation in an `allocation()` block, an explicit release in the body: no exit raises,
    and nothing stays held."""
    prompt = tokens(3 * PAGE, start=84_000)
    with daemon.client(engine_id="nested") as c:
        c.attach(map_pools=False)
        with c.matched(prompt[: 4 * PAGE], allocate_tokens=PAGE) as m:
            out = c.insert(
                prompt[: 4 * PAGE], lock_id=m.lock_id, allocation_id=m.allocation_id, keep_lock=True
            )
            assert out == InsertOutcome(inserted_tokens=PAGE, reused_tokens=0)
            assert held(c) == (1, 1)  # both kept (the allocation, empty now, for decode growth)
        assert held(c) == (0, 0)
        with c.matched(prompt) as outer:
            assert outer.device_tokens == PAGE
            with c.matched(prompt, allocate_tokens=2 * PAGE) as inner:
                assert len(inner.pages["full"]) == 1
                with c.allocation(PAGE, allocation_id=inner.allocation_id) as grown:
                    assert grown.allocation_id == inner.allocation_id
                    assert len(grown.pages["full"]) == 2
                assert held(c) == (2, 1)  # growing released nothing
                c.insert(prompt, lock_id=inner.lock_id, allocation_id=inner.allocation_id)
            c.release(lock_id=outer.lock_id)
        assert held(c) == (0, 0)
        assert c.match(prompt).device_tokens == 3 * PAGE


# --------------------------------------------------------------------------- batch


def test_batch_results_are_typed_per_op_and_failures_are_values(daemon: Daemon) -> None:
    prompt = tokens(PAGE, start=86_000)
    with daemon.client(engine_id="typed") as c:
        c.attach(map_pools=False)
        assert c.batch([]) == []
        r = c.batch(
            [
                match_op(prompt, lock=True, allocate_tokens=PAGE, session_id="chat"),
                pb.BatchOp(heartbeat=pb.HeartbeatRequest(engine_id="typed")),
                allocate_op(PAGE),
                pb.BatchOp(prefetch_status=pb.PrefetchStatusRequest(prefetch_id=12345)),
                close_session_op("never-opened"),
                pb.BatchOp(stats=pb.StatsRequest()),
            ]
        )
        m, hb, a, prefetch, session, stats = r
        assert isinstance(m, MatchOutcome) and m.lock_id and m.allocation_id
        assert hb == HeartbeatInfo(lease_ms=hb.lease_ms, locks=1, allocations=1)
        assert isinstance(a, AllocationInfo) and len(a.pages["full"]) == 1
        assert isinstance(prefetch, NotFound) and "12345" in str(prefetch)
        assert isinstance(session, NotFound) and "never-opened" in str(session)
        assert isinstance(stats, StatsSnapshot)
        done = c.batch(
            [
                insert_op(
                    prompt, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id="chat"
                ),
                release_op(allocation_id=a.allocation_id),
                release_op(allocation_id=a.allocation_id),
                close_session_op("chat"),
            ]
        )
        assert done[:2] == [InsertOutcome(inserted_tokens=PAGE, reused_tokens=0), None]
        assert isinstance(done[2], NotFound)
        assert isinstance(done[3], int) and done[3] >= 1
        assert held(c) == (0, 0)


def test_a_batch_over_the_daemons_message_limits_fails_whole_and_holds_nothing(
    daemon: Daemon,
) -> None:
    """A request over `max_request_bytes` is refused before any op runs. A reply larger
    than one op's (20,000 Allocates, most failing with a message) is sent whole (a Batch's
    reply is bounded by gRPC's message limit only): the engine learns every allocation
    its ops made, and releases them."""
    with daemon.client(engine_id="oversized", retries=0) as c:
        c.attach(map_pools=False)
        before = c.stats().counters["lookups"]
        with pytest.raises(ResourceExhausted):
            c.batch([match_op(tokens(8192, start=1), lock=True) for _ in range(40)])
        assert c.stats().counters["lookups"] == before
        assert held(c) == (0, 0)
        results = c.batch([allocate_op(PAGE) for _ in range(20_000)])
        made = [r for r in results if not isinstance(r, Exception)]
        assert made and any(isinstance(r, ResourceExhausted) for r in results)
        assert held(c) == (0, len(made))
        c.batch([release_op(allocation_id=a.allocation_id) for a in made])
        assert held(c) == (0, 0)
        assert len(c.allocate(4 * PAGE).pages["full"]) == 4  # the pages came back


# --------------------------------------------------------------------------- mapped pools

POOLS_OUTLIVE_CLOSE = textwrap.dedent(
    """
    import sys
    import numpy as np, torch
    from hicache.client import Client
    c = Client(sys.argv[1], engine_id="mapper")
    att = c.attach()
    view = att.pools["full"][3]
    ids = np.arange(7, 7 + 64, dtype="<u4").tobytes()
    m = c.match(ids, lock=True, allocate_tokens=64)
    page = int(m.pages["full"][0])
    view[page] = torch.arange(view.shape[1]) % 251
    c.insert(ids, lock_id=m.lock_id, allocation_id=m.allocation_id)
    c.close()
    print("closed", flush=True)
    sys.stdin.readline()  # the daemon is gone now (its segments unlinked)
    assert bool((view[page] == torch.arange(view.shape[1]) % 251).all())
    view[page] = 9
    assert int(att.pools["full"][0].sum()) >= 0 and int(view[page].sum()) == 9 * view.shape[1]
    print("ok", flush=True)
    """
)


def test_mapped_pools_outlive_close_and_the_daemon(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    proc = subprocess.Popen(
        [sys.executable, "-c", POOLS_OUTLIVE_CLOSE, d.target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "closed", proc.stderr.read() if proc.stderr else ""
        assert d.stop() == 0
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "ok"


# --------------------------------------------------------------------------- deadlines


def test_an_answer_later_than_timeout_s_is_unavailable_and_the_client_goes_on(
    make_daemon: MakeDaemon,
) -> None:
    port = free_port()
    make_daemon(listen=f"127.0.0.1:{port}")
    proxy = FaultProxy(port)
    try:
        with Client(f"127.0.0.1:{proxy.port}", engine_id="slow-net", timeout_s=0.5) as c:
            c.attach(map_pools=False)
            proxy.hold_answers_s = 1.5
            with pytest.raises(Unavailable, match="no answer in time"):
                c.stats()
            with pytest.raises(Unavailable, match="no answer in time"):
                list(c.load(424242))
            proxy.disarm()
            c.timeout_s = 10.0  # (a busy machine: no deadline from here on)
            time.sleep(1.2)  # the held answers drain
            assert held(c) == (0, 0)
            with c.matched(tokens(PAGE, start=88_000), allocate_tokens=PAGE) as m:
                assert m.allocation_id
            assert held(c) == (0, 0)
    finally:
        proxy.close()
