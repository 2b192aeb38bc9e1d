"""Review: the DAEMON killed with SIGKILL (a crash, an OOM kill) at bad moments, and what a
daemon restarted on the same socket and the same L3 finds.

Real `hicache serve` processes, real redis-server / mooncake_master (tests/services.py),
engines in this process writing KV with `KvOracle`: every page served after a restart is
checked byte for byte against what was computed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache.bench.oracle import KvOracle
from hicache.client import Client
from hicache.controller.base import PrefetchState
from hicache.endpoint import parse_address
from hicache.errors import FailedPrecondition, HicacheError, Unavailable

from .daemonkit import PAGE, Daemon, computed_into_l3, eventually, load_and_verify, tokens

MakeDaemon = Callable[..., Daemon]
PAGES = 4  # 256 tokens: the prefetch threshold, within L1 (16 pages)
WRITE_THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through",
                 "prefetch.policy=wait_complete")
SHM = Path("/dev/shm")


def _instance(d: Daemon) -> str:
    return parse_address(d.listen).instance_name()


def _segments(d: Daemon) -> list[str]:
    """This daemon instance's L1 segments in /dev/shm (other tests' daemons run beside)."""
    return sorted(p.name for p in SHM.glob(f"hicache-{_instance(d)}-*"))


def _own_segments(d: Daemon, pid: int) -> set[str]:
    """The segments daemon `pid` of instance `d` may have left."""
    return {f"hicache-{_instance(d)}-{pid}-full"}


def _kill(d: Daemon) -> None:
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL


def _prefetched_and_verified(c: Client, oracle: KvOracle, prompt: bytes) -> int:
    """Prefetch `prompt` from L3 (waiting for it), then load it and check every page."""
    with c.matched(prompt, prefetch=True) as m:
        if m.prefetch_id:
            deadline = time.monotonic() + 15
            while (c.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING
                   and time.monotonic() < deadline):
                time.sleep(0.02)
    return load_and_verify(c, oracle, prompt)


# ---------------------------------------------------------------------- L1 shared memory


@pytest.mark.timeout(120)  # (four daemon starts: 3-6 s each on a loaded machine)
def test_a_daemon_killed_during_its_start_leaves_no_segments_across_restarts(
        make_daemon: MakeDaemon) -> None:
    """Killed after it created its L1 segment, before it was ready (twice), then killed
    once serving: each restart on the same socket starts, and only the live daemon's one
    segment (and one lock file) of the instance is in /dev/shm; a clean stop leaves none."""
    d = make_daemon(start=False)
    for _ in range(2):
        d.start(wait=False)
        assert d.proc is not None
        pid = d.proc.pid
        proc, mine = d.proc, _own_segments(d, pid)
        assert eventually(lambda p=proc, m=mine: bool(m & set(_segments(d))) or p.poll() is not None,
                          30, 0.005)
        _kill(d)
        assert set(_segments(d)) <= mine
    d.start()
    assert d.proc is not None
    pid = d.proc.pid
    assert _segments(d) == [f"hicache-{_instance(d)}-{pid}-full"]
    _kill(d)
    # A SIGKILL unlinks nothing, but a daemon of another test starting meanwhile sweeps the
    # segments of every dead instance (`sweep_dead_instances`): the killed daemon's segment
    # is there or swept, and no other.
    assert set(_segments(d)) <= _own_segments(d, pid)
    d.start()
    assert d.proc is not None
    assert _segments(d) == [f"hicache-{_instance(d)}-{d.proc.pid}-full"]
    locks = list(SHM.glob(f"hicache-{_instance(d)}.lock"))
    assert len(locks) == 1
    with d.client() as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        prompt = tokens(2 * PAGE, start=5_000)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        oracle.write(prompt, m.pages, start_page=0)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert load_and_verify(c, oracle, prompt) == 2 * PAGE
    assert d.stop() == 0
    assert _segments(d) == []


# ---------------------------------------------------------------------- L3 under load


def _file_sets(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, ...]:
    # ~65 objects: the store evicts while the load writes.
    return ("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
            "storage.file.capacity_gb=0.004")


def _redis_sets(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, ...]:
    server = request.getfixturevalue("redis_factory")()
    return ("storage.backend=redis", f"storage.redis.url={server.url}")


L3_SETS = {"file": _file_sets, "redis": _redis_sets}


def _load_until_killed(d: Daemon, start: int, done: list[bytes], errors: list[BaseException],
                       stop: threading.Event) -> None:
    """An engine storing prompt after prompt (each flushed to L3) until its daemon dies."""
    try:
        with d.client(engine_id="writer", retries=0, timeout_s=10) as c:
            att = c.attach()
            oracle = KvOracle(att.info, att.pools)
            i = 0
            while not stop.is_set():
                prompt = tokens(PAGES * PAGE, start=start + 1000 * i)
                i += 1
                computed_into_l3(c, oracle, prompt)
                done.append(prompt)
    except BaseException as e:  # (the daemon died: the error the engine sees)
        errors.append(e)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", sorted(L3_SETS))
def test_killed_mid_write_through_a_restart_serves_only_the_computed_bytes(
        backend: str, request: pytest.FixtureRequest, make_daemon: MakeDaemon,
        tmp_path: Path) -> None:
    """SIGKILL while an engine writes through to L3 (flushing each prompt; the file store
    evicting meanwhile): the engine gets Unavailable; a daemon restarted on the same socket
    and store starts, removes the dead writer's temp files (file), counts exactly the
    objects on disk, passes a deep check, and every page it serves from L3 of the prompts
    flushed before the kill is byte-identical to what was computed."""
    sets = (*WRITE_THROUGH, *L3_SETS[backend](request, tmp_path))
    d = make_daemon(*sets)
    done: list[bytes] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    start = 10_000 + (uuid.uuid4().int % 1000) * 100_000  # (a shared store outlives this test)
    t = threading.Thread(target=_load_until_killed, args=(d, start, done, errors, stop))
    t.start()
    try:
        assert eventually(lambda: len(done) >= 8 or not t.is_alive(), 20)
        assert d.proc is not None
        dead_pid = d.proc.pid
        _kill(d)
    finally:
        stop.set()
        t.join(timeout=30)
    assert len(done) >= 8, errors
    assert len(errors) == 1 and isinstance(errors[0], Unavailable), errors
    root = tmp_path / "l3"
    if backend == "file":
        # A temp file the dead writer left (were the kill a moment earlier): a torn object
        # under the name its writer (this host, the dead pid) gives it.
        obj = next(root.rglob("*.kv"))
        leftover = obj.with_name(f"{obj.name}.{_host_tag()}.{dead_pid}.1234.tmp")
        leftover.write_bytes(obj.read_bytes()[:1000])
    d.start()
    with d.client(engine_id="reader") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        (health,) = c.health(deep=True)
        assert health.healthy, health.detail
        if backend == "file":
            assert not list(root.rglob("*.tmp"))
            on_disk = sum(p.stat().st_size for p in root.rglob("*.kv"))
            assert health.used_bytes == on_disk
            assert health.capacity_bytes is not None and on_disk <= health.capacity_bytes
        served = 0
        for prompt in done[-4:]:  # (the most recent: the file store evicted older ones)
            served += _prefetched_and_verified(c, oracle, prompt)
        assert served >= PAGES * PAGE * 3
        assert oracle.wrong_bytes == 0 and oracle.pages_missing == 0


def _host_tag() -> str:
    name = socket.gethostname() or "host"
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:64]


# ---------------------------------------------------------------------- deep health canary


def _spam_deep_checks(d: Daemon, stop: threading.Event, count: list[int]) -> None:
    with d.client(retries=0, timeout_s=5) as c:
        while not stop.is_set():
            try:
                c.health(deep=True)
            except HicacheError:
                return
            count[0] += 1


@pytest.mark.timeout(90)
def test_canaries_of_a_daemon_killed_during_deep_checks_do_not_stay_in_redis(
        make_daemon: MakeDaemon, redis_factory: Callable[[], object]) -> None:
    """Deep health checks write, read and delete a page-sized canary object: a daemon
    killed between the write and the delete leaves it. They piled up, one per crash, with
    no TTL: each is written with one (`CANARY_TTL_S`), so a leftover goes by itself."""
    import redis

    from hicache.tiers.storage.redis import CANARY_TTL_S

    server = redis_factory()
    r = redis.Redis.from_url(server.url)  # type: ignore[attr-defined]
    d = make_daemon("storage.backend=redis", f"storage.redis.url={server.url}")  # type: ignore[attr-defined]
    left: list[bytes] = []
    for _ in range(5):  # (until a kill lands between a canary's write and its delete)
        stop, count = threading.Event(), [0]
        spammers = [threading.Thread(target=_spam_deep_checks, args=(d, stop, count))
                    for _ in range(3)]
        for t in spammers:
            t.start()
        assert eventually(lambda count=count: count[0] >= 20, 20)
        _kill(d)
        stop.set()
        for t in spammers:
            t.join(timeout=10)
        left = list(r.scan_iter(match="*canary*"))
        if left:
            break
        d.start()
    if not left:
        pytest.skip("no kill landed inside a canary round trip")
    assert all(int(k.split(b"/")[3]) != os.getpid() for k in left)
    d.start()
    with d.client() as c:
        (health,) = c.health(deep=True)
        assert health.healthy
    assert all(0 < r.ttl(k) <= CANARY_TTL_S for k in left), [(k, r.ttl(k)) for k in left]


# ---------------------------------------------------------------------- mooncake


def _mooncake_sets(master: object) -> tuple[str, ...]:
    return (
        "storage.backend=mooncake",
        f"storage.mooncake.master={master.master}",  # type: ignore[attr-defined]
        f"storage.mooncake.metadata_server={master.metadata_server}",  # type: ignore[attr-defined]
        f"storage.mooncake.global_segment_size={64 << 20}",
        f"storage.mooncake.local_buffer_size={16 << 20}",
    )


CLIENT_TTL_S = 12  # mooncake_master --client_ttl: a dead client's segment goes after this (9 s: a loaded CI snapshot restarted the daemon too late, and skipped)


@pytest.fixture
def short_ttl_master(mooncake_factory: Callable[..., object]) -> Iterator[object]:
    yield mooncake_factory(f"--client_ttl={CLIENT_TTL_S}")


@pytest.mark.timeout(150)
def test_a_restarted_daemon_stores_again_what_the_killed_one_held_in_mooncake(
        make_daemon: MakeDaemon, short_ttl_master: object, tmp_path: Path) -> None:
    """A Mooncake object lives in the segment of the daemon that stored it. Daemon A stores
    P and is killed; the master still lists P's objects until A's client TTL lapses. The
    restarted daemon B (same socket) first finds them unreadable (its prefetch fails, no
    wrong byte), then its engine computes P again and flushes it to L3: B must store its own
    copy. It does not (the put finds the dead objects `batch_is_exist`, answers PRESENT), so
    once the master drops A's segment a third daemon C on the same L3 finds nothing of P,
    though B wrote it through and still serves."""
    sets = (*WRITE_THROUGH, *_mooncake_sets(short_ttl_master))
    prompt = tokens(PAGES * PAGE, start=90_000)
    a = make_daemon(*sets)
    with a.client(engine_id="first") as c:
        att = c.attach()
        computed_into_l3(c, KvOracle(att.info, att.pools), prompt)
        assert c.stats().counters["backups_storage"] == PAGES
    _kill(a)
    killed = time.monotonic()
    a.start()  # B: the same socket, the same master
    with a.client(engine_id="second") as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        # The dead daemon's objects are listed, unreadable: a miss, never wrong bytes.
        assert _prefetched_and_verified(c, oracle, prompt) == 0
        # The engine computes P again. Its flush may leave pages unwritten: a put the
        # master places in the dead segment fails (-800) until A's client TTL lapses.
        with contextlib.suppress(FailedPrecondition):
            computed_into_l3(c, oracle, prompt)
        if time.monotonic() - killed > CLIENT_TTL_S - 1:
            pytest.skip("the restart outlasted the dead client's TTL (a slow machine)")
        time.sleep(max(0.0, killed + CLIENT_TTL_S + 2 - time.monotonic()))
        # What failed meanwhile (and ran out of retries) lands now, once the master has
        # dropped A's segment (its client monitor runs every few seconds).
        deadline = time.monotonic() + 20
        while True:
            try:
                c.flush(timeout_s=10)
                break
            except FailedPrecondition:
                assert time.monotonic() < deadline, "B's flush never landed"
                time.sleep(1)
        stored = c.stats().counters["backups_storage"]
    third = make_daemon(*sets, listen=f"unix://{tmp_path}/third.sock")
    try:
        with third.client(engine_id="third") as c:
            att = c.attach()
            probe = c.match(prompt)
            assert stored > 0  # (it wrote its own copies, not trusting "present")
            assert probe.storage_tokens == PAGES * PAGE
            reader = KvOracle(att.info, att.pools)
            assert _prefetched_and_verified(c, reader, prompt) == PAGES * PAGE
        assert a.proc is not None and a.proc.poll() is None
    finally:  # (a Mooncake client takes ~7 s to close: the fixtures' SIGTERM would wait)
        _kill(third)
        _kill(a)
