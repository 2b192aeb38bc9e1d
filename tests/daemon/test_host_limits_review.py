"""The daemon meeting the host's resource limits (a review), as an operator on a fresh
machine or in a container meets them: a small, full, read-only or inode-starved
`/dev/shm` (a private tmpfs mounted over it in a child mount namespace, `unshare -m`),
a full or read-only socket directory, an address-space limit (`RLIMIT_AS`) below the
tiers, a thread limit reached while serving, a low `RLIMIT_NOFILE` under many engine
connections, and `hicache config check` against `hicache serve` on what will not fit.

Each limit: the daemon refuses to start with a message naming the key and the limit (no
traceback, nothing left in `/dev/shm`), or starts and degrades; it never dies of SIGBUS
later. Confirmed bugs are strict xfails (they assert the correct behaviour).

Not produced here: `RLIMIT_MEMLOCK` (pinned L2 needs CUDA), `RLIMIT_NPROC` (the tests
run as root, whom the kernel exempts; a thread limit is produced with `RLIMIT_STACK` and
`RLIMIT_AS` instead: a thread that cannot get its stack fails as under `pids.max`), a
memory cgroup limit (the cgroups here belong to the machinery running the session)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest

from hicache.client import Client
from hicache.endpoint import parse_address
from hicache.errors import HicacheError

from .daemonkit import eventually

MiB = 1 << 20
GiB = 1 << 30
NO_MOUNT_NS = 97  # exit code of the namespace script when it may not mount
PY = sys.executable
BASE_SETS = ("metrics.port=0", "tiers.l2.reserve_gb=0")


def serve_argv(sock: Path, *sets: str) -> list[str]:
    argv = [PY, "-m", "hicache.cli", "serve", "--listen", f"unix://{sock}"]
    for item in (*BASE_SETS, *sets):
        argv += ["--set", item]
    return argv


def instance_of(sock: Path) -> str:
    return parse_address(f"unix://{sock}").instance_name()


def host_leftovers(sock: Path) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if instance_of(sock) in n)


def in_mount_ns(argv: list[str], mounts: list[tuple[str, str, str]], timeout_s: float = 90.0,
                ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `argv` in a child mount namespace where each (path, tmpfs options, shell
    preparation) is a fresh tmpfs; returns the process and what `/dev/shm` held after it
    ended (in that namespace). Skips the test where mounting is not allowed. The
    namespace, and every tmpfs in it, goes with the process: nothing to unmount."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    lines = ["set -u"]
    for path, opts, prep in mounts:
        lines.append(f"mkdir -p {shlex.quote(path)} || exit {NO_MOUNT_NS}")
        lines.append(f"mount -t tmpfs -o {shlex.quote(opts)} tmpfs {shlex.quote(path)} "
                     f"|| exit {NO_MOUNT_NS}")
        if prep:
            lines.append(prep)
    lines += ['"$@"', "rc=$?", 'echo "@@SHM:$(ls -A /dev/shm | tr "\\n" " ")"', "exit $rc"]
    try:
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh", *argv],
            capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if proc.returncode == NO_MOUNT_NS or "@@SHM:" not in proc.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[-300:]}")
    shm = proc.stdout.rpartition("@@SHM:")[2].split()
    return proc, shm


FILL = "dd if=/dev/zero of={p}/fill bs=4096 count=100000 2>/dev/null; true"
FILL_INODES = "i=0; while touch {p}/f$i 2>/dev/null; do i=$((i+1)); done"


def assert_refused_cleanly(proc: subprocess.CompletedProcess[str], codes: tuple[int, ...] = (1, 2)) -> str:
    err = proc.stderr
    assert proc.returncode in codes, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    return err


# --------------------------------------------------------------------------- /dev/shm


def test_l1_larger_than_a_small_dev_shm_refuses_naming_both_sizes_and_leaves_nothing(
        tmp_path: Path) -> None:
    """Docker's default /dev/shm (64 MiB) and smaller: the embedded default L1 (64 MiB)
    does not fit 16 MiB. Refused at start (posix_fallocate), no traceback, no segment,
    no lock file, no socket."""
    sock = tmp_path / "s.sock"
    proc, shm = in_mount_ns(serve_argv(sock), [("/dev/shm", "size=16m", "")])
    err = assert_refused_cleanly(proc)
    assert "/dev/shm" in err and "tiers.l1" in err, err
    assert str(16 * MiB) in err and str(64 * MiB) in err, err
    assert shm == [], shm
    assert not sock.exists()


def test_a_reserved_l1_survives_dev_shm_filling_up_afterwards(tmp_path: Path) -> None:
    """No SIGBUS later: once the daemon serves, something else fills /dev/shm to the last
    byte; an engine then writes KV into every L1 page, the daemon copies it to L2, and a
    second match reads every byte back from L1."""
    sock = tmp_path / "f.sock"
    engine = tmp_path / "engine.py"
    engine.write_text(textwrap.dedent(f"""
        import json, subprocess, sys, time
        import numpy as np, torch
        from hicache.client import Client
        argv = json.loads(sys.argv[1])
        d = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out = {{}}
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with Client("unix://{sock}", retries=0, timeout_s=1) as p:
                        if p.serving():
                            break
                except Exception:
                    if d.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            subprocess.run("dd if=/dev/zero of=/dev/shm/filler bs=65536 count=100000 2>/dev/null",
                           shell=True)
            out["shm_free"] = __import__("shutil").disk_usage("/dev/shm").free
            n = 16384  # all of L1: 256 pages of 64 tokens
            toks = np.arange(7, 7 + n, dtype="<u4").tobytes()
            with Client("unix://{sock}", engine_id="e", timeout_s=30) as c:
                att = c.attach()
                m = c.match(toks, lock=True, allocate_tokens=n)
                pages = torch.from_numpy(np.asarray(m.pages["full"], dtype=np.int64))
                for layer, rows in enumerate(att.pools["full"]):
                    rows[pages] = torch.full((len(pages), rows.shape[1]), layer + 1, dtype=torch.uint8)
                c.insert(toks, lock_id=m.lock_id, allocation_id=m.allocation_id)
                m2 = c.match(toks, lock=True)
                again = torch.from_numpy(np.asarray(m2.device_pages["full"], dtype=np.int64))
                out["device_tokens"] = m2.device_tokens
                out["intact"] = all(bool((rows[again] == layer + 1).all())
                                    for layer, rows in enumerate(att.pools["full"]))
                c.release(lock_id=m2.lock_id)
            out["alive"] = d.poll() is None
        finally:
            d.terminate()
            out["daemon_rc"] = d.wait(30)
            out["daemon_err"] = d.stderr.read()[-1500:]
            print("@@OUT" + json.dumps(out))
    """))
    argv = serve_argv(sock, "tiers.l1.tokens=16384")
    proc, shm = in_mount_ns([PY, str(engine), json.dumps(argv)], [("/dev/shm", "size=24m", "")])
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    out = json.loads(proc.stdout.split("@@OUT", 1)[1].split("\n", 1)[0])
    assert out["shm_free"] == 0, out
    assert out["alive"] and out["daemon_rc"] == 0, out
    assert out["device_tokens"] == 16384 and out["intact"], out
    assert "Traceback" not in out["daemon_err"], out
    assert shm == ["filler"], shm  # the daemon unlinked its segment and lock file


def test_a_refusal_of_several_pools_names_all_of_l1_and_the_key(tmp_path: Path) -> None:
    """FULL + SWA + a sidecar, 16 MiB each, in a 40 MiB /dev/shm: the operator must learn
    that L1 needs 48 MiB where 40 MiB are free, and which key sizes it."""
    sock = tmp_path / "m.sock"
    argv = serve_argv(
        sock, "tiers.l1.tokens=16384",
        "model.components={full: {layers: 4, bytes_per_token_per_layer: 256},"
        " swa: {layers: 4, bytes_per_token_per_layer: 256, window_tokens: 128}}",
        "model.sidecars={idx: {anchor: full, layers: 4, bytes_per_token_per_layer: 256}}")
    proc, shm = in_mount_ns(argv, [("/dev/shm", "size=40m", "")])
    err = assert_refused_cleanly(proc)
    assert shm == [], shm
    assert str(48 * MiB) in err and str(40 * MiB) in err, err
    assert "tiers.l1.tokens" in err or "tiers.l1.size_gb" in err, err


@pytest.mark.parametrize("case", ["read_only", "no_inodes"])
def test_an_unusable_dev_shm_is_a_clear_refusal(tmp_path: Path, case: str) -> None:
    sock = tmp_path / "u.sock"
    prep = {
        # (read-only: the lock file cannot be created)
        "read_only": ("size=64m", "mount -o remount,ro /dev/shm"),
        # (one inode left: the lock file takes it, the segment finds none)
        "no_inodes": ("size=64m,nr_inodes=16", FILL_INODES.format(p="/dev/shm") + "; rm /dev/shm/f0"),
    }[case]
    proc, shm = in_mount_ns(serve_argv(sock, "tiers.l1.tokens=1024"), [("/dev/shm", *prep)])
    err = assert_refused_cleanly(proc, (1,))
    assert "/dev/shm" in err, err
    assert [n for n in shm if n.startswith("hicache-")] == [], shm
    assert not sock.exists()


# --------------------------------------------------------------------------- the socket dir


def test_a_read_only_socket_directory_is_refused_naming_server_listen(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sock = run / "r.sock"
    proc, _ = in_mount_ns(serve_argv(sock, "tiers.l1.tokens=1024"),
                          [(str(run), "size=1m", f"mount -o remount,ro {shlex.quote(str(run))}")])
    err = assert_refused_cleanly(proc, (1,))
    assert "server.listen" in err and "Read-only" in err, err
    assert host_leftovers(sock) == []


def test_a_full_socket_directory_is_refused_naming_server_listen(tmp_path: Path) -> None:
    """A full /tmp (the default socket lives there): a clear refusal naming the key."""
    run = tmp_path / "run"
    sock = run / "f.sock"
    proc, _ = in_mount_ns(serve_argv(sock, "tiers.l1.tokens=1024"),
                          [(str(run), "size=64k", FILL.format(p=shlex.quote(str(run))))])
    err = assert_refused_cleanly(proc, (1,))
    assert "server.listen" in err and "No space left" in err, err
    assert host_leftovers(sock) == []


# --------------------------------------------------------------------------- memory limits


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("tier", ["l1", "l2"])
def test_a_tier_over_the_address_space_limit_is_a_clear_refusal(tmp_path: Path, tier: str) -> None:
    """`ulimit -v`: L1's mapping (device.py) or L2's (host.py) fails with ENOMEM. Refused
    naming the tier's key and the size, like an L2 over MemAvailable, and nothing left."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit(1) here")
    if _mem_available() < 6 * GiB:
        pytest.skip("needs 6 GiB of available memory")
    sock = tmp_path / f"{tier}.sock"
    if tier == "l1":  # 1.5 GiB of L1 (reserved in /dev/shm, then mapped) under 1.5 GiB
        limit, sets = 1536 * MiB, ("tiers.l1.tokens=1572864", "tiers.l2.ratio=1.01")
    else:  # 4 GiB of L2 under 3 GiB
        limit, sets = 3 * GiB, ("tiers.l1.tokens=4096", "tiers.l2.size_gb=4")
    proc = subprocess.run(["prlimit", f"--as={limit}", *serve_argv(sock, *sets)],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert host_leftovers(sock) == []  # (holds already: the pools are closed on the way out)
    err = assert_refused_cleanly(proc)
    assert f"tiers.{tier}" in err, err


def test_config_check_and_serve_agree_on_an_l2_that_does_not_fit(tmp_path: Path) -> None:
    sets = ["--set", "tiers.l1.tokens=1024", "--set", "tiers.l2.reserve_gb=1000000",
            "--set", "metrics.port=0"]
    sock = tmp_path / "c.sock"
    served = subprocess.run([PY, "-m", "hicache.cli", "serve", "--listen", f"unix://{sock}", *sets],
                            capture_output=True, text=True, timeout=90)
    assert served.returncode == 2 and "tiers.l2.reserve_gb" in served.stderr, served.stderr
    checked = subprocess.run([PY, "-m", "hicache.cli", "config", "check", *sets],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2 or "tiers.l2.reserve_gb" in checked.stderr, (
        checked.returncode, checked.stderr[-1000:])


# --------------------------------------------------------------------------- threads, fds


class _Proc:
    """A `hicache serve` process started by a test, stopped (and its segments removed)
    at the end whatever happened."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)

    def wait_ready(self, target: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with Client(target, retries=0, timeout_s=1.0) as probe:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                try:
                    if probe.serving():
                        return
                except HicacheError:
                    time.sleep(0.05)
        raise AssertionError(self.log.read_text()[-3000:])

    def close(self, wait_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `wait_s`; the exit code, None when killed."""
        rc = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for leftover in Path("/dev/shm").glob(f"hicache-*-{self.proc.pid}-*"):
            leftover.unlink(missing_ok=True)
        return rc


@pytest.fixture
def procs() -> Iterator[list[_Proc]]:
    made: list[_Proc] = []
    yield made
    for p in made:
        p.close(wait_s=10.0)


def _answers(target: str, timeout_s: float = 3.0) -> bool:
    try:
        with Client(target, engine_id="late", retries=0, timeout_s=timeout_s) as c:
            c.attach(map_pools=False)
            return bool(c.serving())
    except HicacheError:
        return False


def _health_burst(target: str, n: int, timeout_s: float) -> dict[str, int]:
    """`n` connections of their own (no shared subchannel), each a health Check at once."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(n)]

    def check(ch: grpc.Channel) -> str:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return "ok"
        except grpc.RpcError as e:
            return str(e.code().name)

    try:
        with futures.ThreadPoolExecutor(n) as pool:
            outcomes = list(pool.map(check, channels))
    finally:
        for ch in channels:
            ch.close()
    return {k: outcomes.count(k) for k in set(outcomes)}


def test_connections_past_a_low_nofile_limit_wait_and_the_daemon_recovers(
        tmp_path: Path, procs: list[_Proc]) -> None:
    """`ulimit -n 32` and 40 engine connections at once: those past the limit are not
    served (gRPC retries the accept once a second, no busy loop), the daemon stays up,
    and once they close a new engine attaches."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit(1) here")
    sock = tmp_path / "n.sock"
    target = f"unix://{sock}"
    d = _Proc(["prlimit", "--nofile=32", *serve_argv(sock, "tiers.l1.tokens=1024")], tmp_path / "n.log")
    procs.append(d)
    d.wait_ready(target)
    seen = _health_burst(target, 40, timeout_s=5.0)
    assert seen.get("ok", 0) >= 10, seen  # (the fds it had left served)
    assert d.proc.poll() is None
    assert eventually(lambda: _answers(target), timeout_s=10.0)
    assert d.close() == 0


def test_a_thread_limit_reached_while_serving_does_not_silence_the_daemon(
        tmp_path: Path, procs: list[_Proc]) -> None:
    """The server's pool starts its 32 threads on demand, under load. A limit on threads
    reached then (RLIMIT_NPROC, a pids cgroup; here RLIMIT_AS with 64 MiB stacks) must
    cost the calls that found no thread, not every call after them."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit(1) here")
    sock = tmp_path / "t.sock"
    target = f"unix://{sock}"
    d = _Proc(["prlimit", f"--stack={64 * MiB}", *serve_argv(sock, "tiers.l1.tokens=1024")],
              tmp_path / "t.log")
    procs.append(d)
    d.wait_ready(target)
    vm_kb = int(Path(f"/proc/{d.proc.pid}/status").read_text().split("VmSize:")[1].split()[0])
    # Room for about three more threads (stack and their malloc arena) from here on.
    limited = subprocess.run(["prlimit", "--pid", str(d.proc.pid), f"--as={vm_kb * 1024 + 200 * MiB}"],
                             capture_output=True, text=True)
    if limited.returncode != 0:
        pytest.skip(f"cannot set RLIMIT_AS of the daemon: {limited.stderr}")
    _health_burst(target, 24, timeout_s=3.0)
    assert d.proc.poll() is None, d.log.read_text()[-3000:]
    # Whatever the burst got: the daemon answers a new engine once the burst is over ...
    assert eventually(lambda: _answers(target, timeout_s=5.0), timeout_s=20.0), d.log.read_text()[-3000:]
    # ... and stops on SIGTERM. (Today it also logs "stopped" and then never exits: the
    # process waits at interpreter exit until it is killed.)
    assert d.close(wait_s=20.0) == 0, d.log.read_text()[-3000:]
