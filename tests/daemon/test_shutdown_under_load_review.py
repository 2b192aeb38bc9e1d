"""Review: stopping the daemon while it works (SIGTERM / SIGINT, a second signal during the
stop) with calls in flight, a hung L3 (a SIGSTOPped redis-server) and write-back data in
L1 and L2 (README, Deployment: Shutdown; `server.shutdown_flush_s`).

What test_sigterm_flush.py and test_lifecycle.py check already (an idle daemon's SIGTERM,
5 FULL pages flushed to a file store, a second daemon refused while the first serves) is
not repeated here: these tests stop a daemon that is busy, whose L3 hangs, whose data sits
in L1, L2 and L3 at once, and a hybrid (FULL+SWA+MAMBA) model's."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache.bench.oracle import KvOracle
from hicache.bench.services import RedisServer
from hicache.client import insert_op
from hicache.config import load_config
from hicache.controller.base import PrefetchState
from hicache.errors import Unavailable
from hicache.ops import health_report, stats_report
from hicache.server import longest_stop_s

from .daemonkit import FULL_SWA_MAMBA, PAGE, Daemon, free_port, scrape, tokens
from .test_hybrid_e2e import PB, PS, SMALL, Engine, toks

MakeDaemon = Callable[..., Daemon]
WRITE_BACK = ("write.l1_to_l2=write_back", "write.l2_to_l3=write_back")


def _insert_pages(c: Any, n: int, start: int) -> None:
    """`n` one-page prompts, each its own tree node (no KV written: only counts matter)."""
    for i in range(n):
        p = tokens(PAGE, start=start + 1_000 * i)
        m = c.match(p, lock=True, allocate_tokens=PAGE)
        c.insert(p, lock_id=m.lock_id, allocation_id=m.allocation_id)


def _objects(store: Path) -> int:
    return sum(1 for p in store.rglob("*") if p.is_file())


def _settled_objects(c: Any, store: Path) -> int:
    """The store's objects (one a page here) once the background writes (L2 evictions under
    write-back) have all landed and been counted: a batch under way at the stop is the
    flush's, counted by it, while some of its objects could already be on disk."""
    deadline = time.monotonic() + 15
    last = -1
    while time.monotonic() < deadline:
        n = _objects(store)
        if n == last and c.stats().counters["backups_storage"] == n:
            return n
        last = n
        time.sleep(0.2)
    raise AssertionError(f"L3 writes still under way after 15 s ({last} objects)")


def _wait_prefetch(c: Any, prefetch_id: int) -> None:
    if not prefetch_id:
        return
    deadline = time.monotonic() + 15
    while (c.prefetch_status(prefetch_id).state is PrefetchState.RUNNING
           and time.monotonic() < deadline):
        time.sleep(0.02)
    assert c.prefetch_status(prefetch_id).state is PrefetchState.DONE


@pytest.mark.timeout(120)
def test_a_stop_with_l3_hung_and_a_call_stuck_on_it_refuses_newcomers_and_ends_in_its_bound(
        make_daemon: MakeDaemon, redis_factory: Callable[[], RedisServer]) -> None:
    """Redis SIGSTOPped (no answer, no refusal), write-back pages only L1/L2 hold, and a
    Match stuck on an L3 lookup when SIGTERM comes. While that call runs (the 5 s grace):
    health answers NOT_SERVING (reachable, exit 1), stats exit 1, and every other call,
    the Load stream and Batch included, is refused UNAVAILABLE "shutting down". The stuck
    call ends UNAVAILABLE (not INTERNAL, not a hang). A second SIGTERM and a SIGINT during
    the flush change nothing; a second `hicache serve` on the socket is refused meanwhile.
    The daemon exits 0 within `longest_stop_s` (+ the 0.2 s signal poll and the exit),
    says it flushed 0 pages and that the 6 pages it could not write leave with it, logs no
    traceback, unlinks its shared memory and socket; a new daemon starts right after."""
    redis = redis_factory()
    assert redis.pid is not None
    sets = (*WRITE_BACK, "storage.backend=redis", f"storage.redis.url={redis.url}",
            "storage.timeout_s=6", "server.shutdown_flush_s=1")
    d = make_daemon(*sets)
    bound = longest_stop_s(load_config(None, list(d.sets)))
    assert bound == 5 + 1 + 1 + 6 + 5
    stuck: dict[str, BaseException | object] = {}
    with d.client() as c:
        att = c.attach(map_pools=False)
        segments = [Path("/dev/shm") / p.handle.decode() for p in att.info.pools]
        _insert_pages(c, 6, start=1)
        held = c.match(tokens(PAGE, start=1), lock=True)
        assert held.device_tokens == PAGE
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            attached = threading.Event()

            def stuck_match() -> None:
                with d.client(retries=0, timeout_s=60) as c2:
                    c2.attach(map_pools=False)
                    attached.set()
                    try:
                        stuck["result"] = c2.match(tokens(4 * PAGE, start=900_000), lock=True)
                    except BaseException as e:  # (what the caller sees)
                        stuck["result"] = e

            thread = threading.Thread(target=stuck_match)
            thread.start()
            assert attached.wait(30)
            time.sleep(0.5)  # the match waits on the hung store (6 s)
            sent = time.monotonic()
            os.kill(d.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            time.sleep(0.5)
            report, rc = health_report(d.target, deep=False)
            assert (rc, report["reachable"], report["serving"]) == (1, True, False), report
            report, rc = stats_report(d.target)
            assert rc == 1 and report["reachable"] is True, report
            assert "shutting down" in report["error"], report
            with d.client(retries=0) as fresh:
                calls: dict[str, Callable[[], object]] = {
                    "stats": fresh.stats,
                    "match": lambda: fresh.match(tokens(PAGE, start=1)),
                    "load": lambda: list(c.load(held.lock_id)),
                    "batch": lambda: c.batch([insert_op(tokens(PAGE, start=1))]),
                    "heartbeat": c.heartbeat,
                }
                for call in calls.values():
                    with pytest.raises(Unavailable, match="shutting down"):
                        call()
            time.sleep(max(0.0, sent + 6.5 - time.monotonic()))  # past the grace: flushing
            assert d.proc.poll() is None  # type: ignore[union-attr]
            os.kill(d.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            os.kill(d.proc.pid, signal.SIGINT)  # type: ignore[union-attr]
            second = make_daemon(*sets, start=False).start(wait=False)
            assert second.proc is not None and second.proc.wait(timeout=30) == 1
            assert "another hicache daemon" in second.log()
            rc = d.proc.wait(timeout=60)  # type: ignore[union-attr]
            took = time.monotonic() - sent
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        thread.join(timeout=30)
    assert rc == 0
    assert took <= bound + 1.0, (took, bound, d.log())
    assert isinstance(stuck.get("result"), Unavailable), stuck
    log = d.log()
    assert "Traceback" not in log, log
    assert "flushed 0 pages to L3" in log, log
    assert re.search(r"WARNING hicache.server: 6 pages L3 lacks were not flushed", log), log
    assert log.count("hicache daemon stopping") == 1 and "hicache daemon stopped" in log
    assert not any(s.exists() for s in segments)
    assert not d.socket.exists()
    after = make_daemon(*sets)  # the same socket, at once
    with after.client() as c:
        assert c.serving()
        # Nothing the stopped daemon counted reached L3 while it lived; a write it had
        # already sent to the stopped Redis runs once Redis goes on (SIGCONT), so the
        # store may hold that page now, whole and checksummed, or not at all.
        assert c.match(tokens(PAGE, start=1)).storage_tokens in (0, PAGE)


def test_sigint_with_pages_in_l1_l2_and_l3_and_handles_held_flushes_every_page_byte_exact(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """Write-back at both tiers, 30 prompts of 1-3 pages (62 pages): L1 holds the newest,
    L2 those evicted from L1, L3 those evicted from L2. An engine holds a lock and an
    uncommitted allocation when SIGINT comes. The flush writes every page L3 lacks and says
    how many (exactly the objects that appeared); a new daemon on the same store finds all
    62 and serves them byte-exact."""
    store = tmp_path / "l3"
    sets = (*WRITE_BACK, "storage.backend=file", f"storage.file.path={store}",
            "prefetch.policy=wait_complete", "prefetch.threshold_tokens=64")
    rng = np.random.default_rng(7)
    prompts = [tokens(int(rng.integers(1, 4)) * PAGE, start=100_000 * (i + 1)) for i in range(30)]
    total = sum(len(p) // 4 // PAGE for p in prompts)
    d = make_daemon(*sets)
    with d.client() as c:
        att = c.attach()
        segments = [Path("/dev/shm") / p.handle.decode() for p in att.info.pools]
        oracle = KvOracle(att.info, att.pools)
        for p in prompts:
            m = c.match(p, lock=True, allocate_tokens=len(p) // 4)
            oracle.write(p, m.pages, start_page=0)
            c.insert(p, lock_id=m.lock_id, allocation_id=m.allocation_id)
        counters = c.stats().counters
        assert counters["evictions_device"] > 0 and counters["evictions_host"] > 0
        c.match(prompts[-1], lock=True)  # held at the stop
        c.allocate(PAGE)  # never committed
        before = _settled_objects(c, store)
        assert 0 < before < total
        assert d.stop(signal.SIGINT) == 0
    log = d.log()
    assert "Traceback" not in log and "not flushed" not in log, log
    written = int(re.search(r"flushed (\d+) pages to L3", log).group(1))  # type: ignore[union-attr]
    assert written == _objects(store) - before == total - before, log
    assert not any(s.exists() for s in segments) and not d.socket.exists()

    after = make_daemon(*sets, listen=f"unix://{tmp_path}/after.sock")
    with after.client() as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        for p in prompts:
            n = len(p) // 4 // PAGE
            with c.matched(p, prefetch=True) as m:
                assert m.storage_tokens == n * PAGE, (prompts.index(p), m)
                _wait_prefetch(c, m.prefetch_id)
            with c.matched(p) as hit:
                last = list(c.load(hit.lock_id))[-1]
                assert last.device_pages is not None and last.device_tokens == n * PAGE
                oracle.verify(p, last.device_pages, n)
        assert oracle.wrong_bytes == 0 and oracle.pages_missing == 0
        assert oracle.pages_checked == total * att.info.members[0].layers


def test_sigterm_of_a_hybrid_model_flushes_every_member_window_and_checkpoint(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """FULL+SWA+MAMBA with sidecars, write-back at both tiers, prompts branching off one
    prefix (tree splits) and unrelated ones, more than L1 holds: after SIGTERM a new daemon
    on the same file store serves every prompt whole (FULL and sidecars on every page, the
    SWA window, the MAMBA checkpoint at its end), byte-exact."""
    store = tmp_path / "l3"
    port = free_port()
    sets = (*FULL_SWA_MAMBA, *SMALL, *WRITE_BACK, "storage.backend=file",
            f"storage.file.path={store}", f"metrics.port={port}")
    rng = np.random.default_rng(3)
    base = toks(6 * PS, start=10_000)
    prompts = [base]
    for i in range(8):  # (at most 8 pages: a quarter of L2, the prefetch budget)
        head = int(rng.integers(1, 6))
        prompts.append(base[: head * PB] + toks(int(rng.integers(2, 9 - head)) * PS,
                                                 start=50_000 + 1_000 * i))
    prompts += [toks(int(rng.integers(2, 7)) * PS, start=200_000 + 1_000 * i) for i in range(6)]
    d = make_daemon(*sets)
    with d.client(engine_id="writer") as c:
        eng = Engine(c)
        for p in prompts:
            eng.request(p)
        counters = c.stats().counters
        assert counters["evictions_host"] > 0
        # A write-back victim whose L2 room L3 writes held for longer than an allocation
        # waits (0.1 s: a loaded machine) leaves the cache, counted (README, write.l1_to_l2).
        found = re.search(r"^hicache_backups_dropped_total (\S+)$", scrape(port), re.MULTILINE)
        assert found, "hicache_backups_dropped_total not exported"
        dropped = float(found.group(1))
        assert d.stop(signal.SIGTERM) == 0
    log = d.log()
    assert "Traceback" not in log and "not flushed" not in log, log
    assert int(re.search(r"flushed (\d+) pages to L3", log).group(1)) > 0, log  # type: ignore[union-attr]

    sets = (*sets[:-1], f"metrics.port={free_port()}")
    after = make_daemon(*sets, listen=f"unix://{tmp_path}/after.sock")
    with after.client(engine_id="reader") as c:
        eng = Engine(c)
        for i, p in enumerate(prompts):
            n = len(p) // PB
            with c.matched(p, prefetch=True) as m:
                if dropped and m.storage_tokens < n * PS:
                    continue  # (lost before the stop, and counted)
                assert m.storage_tokens == n * PS, (i, m)
                _wait_prefetch(c, m.prefetch_id)
            m = c.match(p, lock=True)
            try:
                got, pages = eng.load(m) if m.host_tokens else (m.device_tokens, m.device_pages)
                assert got == n * PS, (i, m)
                eng.verify(pages, p, n)
            finally:
                c.release(lock_id=m.lock_id)
        assert all(eng.checked[name] > 0 for name in eng.members), eng.checked
