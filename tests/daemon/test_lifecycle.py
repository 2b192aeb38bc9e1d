"""Daemon lifecycle: SIGTERM, a second daemon, a stale socket, leases, CLI exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.bench.oracle import KvOracle
from hicache.bench.services import RedisServer
from hicache.cli import main

from .daemonkit import PAGE, Daemon, free_port, load_and_verify, run_cli, tokens

MakeDaemon = Callable[..., Daemon]


def test_sigterm_flushes_exits_0_and_unlinks_shared_memory(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    with d.client() as c:
        att = c.attach(map_pools=False)
        segments = [Path("/dev/shm") / p.handle.decode() for p in att.info.pools]
        assert segments and all(s.exists() for s in segments)
        m = c.match(tokens(PAGE), lock=True, allocate_tokens=PAGE)
        c.insert(tokens(PAGE), lock_id=m.lock_id, allocation_id=m.allocation_id)
    assert d.stop(signal.SIGTERM) == 0
    assert not any(s.exists() for s in segments)
    assert not d.socket.exists()
    assert "flushed" in d.log() and "stopped" in d.log()


class TorchlessDaemon(Daemon):
    """A daemon in which `import torch` fails."""

    def argv(self) -> list[str]:
        argv = super().argv()
        at = argv.index("-m")
        code = ("import runpy, sys; sys.modules['torch'] = None; "
                "runpy.run_module('hicache.cli', run_name='__main__', alter_sys=True)")
        return [argv[0], "-c", code, *argv[at + 2 :]]


def test_a_cpu_daemon_serves_its_small_copies_without_torch(tmp_path: Path) -> None:
    """Importing torch is 1.5-3 s of a start: a CPU daemon makes its L1 and L2 views and
    copies a few pages (write-through to L2, Load back to L1) with numpy alone."""
    d = TorchlessDaemon(tmp_path).start()
    try:
        with d.client() as c:
            att = c.attach()
            oracle = KvOracle(att.info, att.pools)
            prompts = [tokens(4 * PAGE, 1000 * (i + 1)) for i in range(6)]
            for prompt in prompts:  # 24 pages through an L1 of 16: the first go to L2 only
                m = c.match(prompt, lock=True, allocate_tokens=len(prompt) // 4)
                oracle.write(prompt, m.pages, start_page=m.device_tokens // PAGE)
                c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
            assert c.match(prompts[0]).host_tokens == 4 * PAGE
            assert load_and_verify(c, oracle, prompts[0]) == 4 * PAGE
        assert d.stop(signal.SIGTERM) == 0
        assert "Traceback" not in d.log() and "torch" not in d.log()
    finally:
        d.close()


def test_a_started_daemon_freezes_its_startup_heap_out_of_the_collector(daemon: Daemon) -> None:
    """The libraries' objects would otherwise be walked by every full collection (85-100
    ms with the GIL held); the ready line says how many were frozen."""
    line = next(ln for ln in daemon.log().splitlines() if "hicache daemon ready" in ln)
    frozen = int(line.rsplit("gc_frozen=", 1)[1].split()[0])
    assert frozen > 50_000  # torch, grpc, numpy and the daemon itself


def test_freeze_startup_heap_leaves_a_full_collection_only_what_came_after() -> None:
    script = textwrap.dedent("""
        import gc
        from hicache.server import freeze_startup_heap
        junk = [[i] for i in range(20_000)]
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= 20_000, frozen
        tracked = len(gc.get_objects())
        assert tracked < 1_000, tracked  # the 20,000 lists are out of its reach
        later = [[i] for i in range(500)]
        assert len(gc.get_objects()) >= 500
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_sigterm_that_reaches_another_thread_still_stops_the_daemon(tmp_path: Path) -> None:
    """The kernel may hand a process's signal to any of its threads; Python runs the
    handler on the main thread only, so that thread must not sleep until another one."""
    script = textwrap.dedent("""
        import signal, sys, threading, time
        from pathlib import Path
        from hicache.config import load_config
        from hicache.server import serve
        sock = Path(sys.argv[1])
        cfg = load_config(None, [f"server.listen=unix://{sock}", "tiers.l1.tokens=1024",
                                 "tiers.l2.reserve_gb=0", "metrics.port=0"])
        sent = []
        def kick():
            while not sock.exists():
                time.sleep(0.05)
            time.sleep(0.5)
            sent.append(time.monotonic())
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # this thread only
        threading.Thread(target=kick, daemon=True).start()
        rc = serve(cfg)
        print(rc, round(time.monotonic() - sent[0], 2))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d.sock")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rc, seconds = out.stdout.split()
    assert rc == "0"
    assert float(seconds) < 10  # (it slept until killed before)


def test_second_daemon_on_the_same_socket_is_refused(make_daemon: MakeDaemon) -> None:
    first = make_daemon()
    second = make_daemon(start=False)
    second.start(wait=False)
    assert second.proc is not None and second.proc.wait(timeout=30) == 1
    assert "another hicache daemon" in second.log() and "refusing" in second.log()
    with first.client() as c:
        assert c.serving()


def test_socket_left_by_a_killed_daemon_is_replaced(make_daemon: MakeDaemon) -> None:
    first = make_daemon()
    first.stop(signal.SIGKILL)
    assert first.socket.exists()  # the killed daemon could not clean up
    second = make_daemon()
    with second.client() as c:
        c.attach(map_pools=False)
        assert c.serving()


def test_non_loopback_tcp_without_tls_refuses_to_start(make_daemon: MakeDaemon) -> None:
    d = make_daemon(listen=f"0.0.0.0:{free_port()}", start=False).start(wait=False)
    assert d.proc is not None and d.proc.wait(timeout=30) == 1
    assert "requires TLS" in d.log() and "server.tls_cert" in d.log()


@pytest.mark.parametrize("case", ["metrics port", "listen port", "tls pair", "socket parent"])
def test_a_daemon_that_cannot_bind_names_the_key_not_a_traceback(
        make_daemon: MakeDaemon, tmp_path, case: str) -> None:
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    (tmp_path / "afile").write_text("x")
    sets, listen, key = {
        "metrics port": ((f"metrics.port={taken}",), None, "metrics.port="),
        "listen port": ((), f"127.0.0.1:{taken}", "server.listen="),
        "tls pair": ((f"server.tls_cert={junk}", f"server.tls_key={junk}"), f"127.0.0.1:{free_port()}",
                     "server.tls_cert/tls_key: "),
        "socket parent": ((), f"unix://{tmp_path}/afile/x.sock", "server.listen=unix://"),
    }[case]
    try:
        d = make_daemon(*sets, listen=listen, start=False).start(wait=False)
        assert d.proc is not None and d.proc.wait(timeout=60) == 1
        log = d.log()
        assert key in log and "Traceback" not in log, log
    finally:
        blocker.close()


CRASHING_ENGINE = textwrap.dedent(
    """
    import os, sys, numpy as np
    from hicache.client import Client
    c = Client(sys.argv[1], engine_id="doomed")
    c.attach(map_pools=False)
    m = c.match(np.arange(1, 257, dtype="<u4").tobytes(), lock=True, allocate_tokens=256)
    assert m.device_tokens == 128 and m.lock_id and m.allocation_id
    os.kill(os.getpid(), 9)
    """
)


def test_locks_of_a_killed_engine_are_released_after_its_lease(make_daemon: MakeDaemon) -> None:
    # (3 s: the crash and the checks below fit in it on a loaded machine)
    d = make_daemon("server.lease_ms=3000")
    with d.client(engine_id="survivor") as c:
        c.attach(map_pools=False)
        m = c.match(tokens(2 * PAGE), lock=True, allocate_tokens=2 * PAGE)
        c.insert(tokens(2 * PAGE), lock_id=m.lock_id, allocation_id=m.allocation_id)
        out = subprocess.run([sys.executable, "-c", CRASHING_ENGINE, d.target],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == -signal.SIGKILL, out.stderr
        assert c.stats().counters["expired_leases"] == 0
        device = next(p for p in c.stats().pools if p.tier == "device")
        # The crashed engine's match lock (2 pages) and allocation (2 more pages): all held.
        assert (device.locked_pages, device.used_pages) == (4, 4)
        deadline = time.monotonic() + 20
        while c.stats().counters["expired_leases"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = c.stats()
        assert stats.counters["expired_leases"] == 1
        device = next(p for p in stats.pools if p.tier == "device")
        assert (device.locked_pages, device.used_pages) == (0, 2)
        assert c.heartbeat().lease_ms == 3000  # the live engine kept its lease
    assert "doomed" in d.log() and "lease lapsed" in d.log()


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_health_and_stats_cli_exit_codes(
    make_daemon: MakeDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_daemon()
    rc, out = cli(capsys, "health", "--target", d.target, "--json")
    assert rc == 0, out
    assert json.loads(out)["serving"] is True and json.loads(out)["backends"] == []
    rc, out = cli(capsys, "stats", "--target", d.target, "--json")
    assert rc == 0 and {p["tier"] for p in json.loads(out)["pools"]} == {"device", "host"}
    rc, out = cli(capsys, "stats", "--target", d.target)
    assert rc == 0 and "lookups:" in out
    nobody = f"unix://{tmp_path}/nobody.sock"
    rc, out = cli(capsys, "health", "--target", nobody)
    assert rc == 2 and "UNREACHABLE" in out
    assert cli(capsys, "stats", "--target", nobody)[0] == 2
    # The console script itself, once: exit codes survive the process boundary.
    assert run_cli("health", "--target", nobody).returncode == 2


@pytest.mark.timeout(120)
def test_health_cli_exits_1_while_a_backend_is_down(
    make_daemon: MakeDaemon,
    redis_factory: Callable[[], RedisServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis = redis_factory()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=1")
    assert cli(capsys, "health", "--target", d.target, "--deep")[0] == 0
    redis.stop()
    rc, out = cli(capsys, "health", "--target", d.target, "--deep", "--json")
    assert rc == 1, out
    (backend,) = json.loads(out)["backends"]
    assert backend["name"] == "redis" and backend["healthy"] is False
    with d.client() as c:
        assert c.serving("hicache.v1.HiCache")  # L1/L2 keep serving


@pytest.mark.timeout(120)
def test_health_cli_exits_1_not_2_when_a_hung_backend_holds_up_the_report(
    make_daemon: MakeDaemon,
    redis_factory: Callable[[], RedisServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The daemon answers its health check, but the deep report waits on a backend that
    hangs (SIGSTOP: no reply, no refusal) past the probe's deadline: that is a backend
    problem (1), not an unreachable daemon (2, what it used to say)."""
    redis = redis_factory()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=8")
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        rc, out = cli(capsys, "health", "--target", d.target, "--deep", "--json")
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    report = json.loads(out)
    assert rc == 1, out
    assert report["reachable"] is True and "backend report did not" in report["error"]


def test_a_release_that_cannot_reach_the_daemon_does_not_hide_the_body_error(
    make_daemon: MakeDaemon,
) -> None:
    d = make_daemon()
    with d.client(retries=0) as c:
        c.attach(map_pools=False)
        with pytest.raises(RuntimeError, match="engine failed"), \
                c.matched(tokens(PAGE), allocate_tokens=PAGE):
            assert d.stop(signal.SIGTERM) == 0  # the release at exit finds no daemon
            raise RuntimeError("engine failed")


def test_readiness_sees_a_required_backend_go_down_without_traffic(
    make_daemon: MakeDaemon, redis_factory: Callable[[], RedisServer]
) -> None:
    """An idle daemon makes no L3 calls, so its circuit breaker never trips: the periodic
    shallow probe must still turn the overall health (readiness) NOT_SERVING."""
    redis = redis_factory()
    d = make_daemon("storage.backend=redis", f"storage.redis.url={redis.url}",
                    "storage.timeout_s=1", "storage.required=true")
    with d.client() as c:
        assert c.serving()
        redis.stop()
        deadline = time.monotonic() + 20
        while c.serving():
            assert time.monotonic() < deadline, "still SERVING with its required L3 down"
            time.sleep(0.2)
        assert c.serving("hicache.v1.HiCache")  # L1/L2 keep serving (liveness)
