"""The `hicache` command line as ops use it: the real console script (`.venv/bin/hicache`)
run as a subprocess against a real daemon (tests/daemon/daemonkit.py), checked against
README "CLI": exit codes (health/stats 0/1/2, serve 0/1/2, config check 0/2, bench 2
before anything runs), `--json` shapes, one-line errors without tracebacks, and
`config check` agreeing with what `serve` refuses.

What tests/test_cli.py, tests/test_cli_fuzz.py, tests/test_operator_config_review.py,
tests/test_operator_docs_review.py and tests/daemon/test_operator_paths.py already cover
is not repeated here (malformed targets, dead listeners, tokens, TLS without certs, the
fake daemon's replies, bench counts of 0, `--compare` names).

Tests marked xfail(strict=True) are bugs found by this review: each fails now and passes
once fixed (then the mark goes). The others pin behaviour an operator relies on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon.daemonkit import Daemon, free_port
from services import freeze

from hicache import ops

HICACHE = str(Path(sys.executable).with_name("hicache"))
HEALTH_KEYS = {"target", "reachable", "serving", "backends"}
SLACK_S = 3.0  # channel set-up and the start-up's variance on a busy 2-core machine
TINY_SERVE = ("--set", "metrics.port=0", "--set", "tiers.l1.tokens=1024", "--set", "tiers.l2.reserve_gb=0")


def hicache(*args: str, timeout_s: float = 60.0, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([HICACHE, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=env, **kwargs)  # type: ignore[call-overload]


def timed(*args: str, timeout_s: float = 60.0) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = hicache(*args, timeout_s=timeout_s)
    return out, time.monotonic() - t0


def start_up_s() -> float:
    """What a `hicache health` run costs here before any wait (the interpreter and its
    imports: seconds on a loaded machine): one against a socket that is not there."""
    out, seconds = timed("health", "--target", "unix:///nonexistent/none.sock", "--json")
    assert out.returncode == 2, out
    return seconds


def strict_json(text: str) -> dict[str, object]:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    value = json.loads(text, parse_constant=refuse)
    assert isinstance(value, dict), text
    return value


def one_line_error(err: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]


# --------------------------------------------------------------------------- a live daemon on localhost:PORT


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """`hicache serve --listen localhost:PORT` (a host name, not an IP: a `--listen` form
    the README allows), with the file backend."""
    root = tmp_path_factory.mktemp("cliux")
    d = Daemon(root, "storage.backend=file", f"storage.file.path={root / 'l3'}",
               listen=f"localhost:{free_port()}").start()
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def stopped(live: Daemon) -> Iterator[Daemon]:
    """The live daemon frozen (SIGSTOP): its kernel still accepts connections, nothing
    answers. A hung daemon, as an exec probe meets one."""
    assert live.proc is not None and live.proc.poll() is None
    freeze(live.proc.pid)
    try:
        yield live
    finally:
        os.kill(live.proc.pid, signal.SIGCONT)
        live.wait_ready(timeout_s=30)


def test_health_and_stats_of_a_daemon_listening_on_a_host_name(live: Daemon) -> None:
    """`--listen localhost:PORT` serves; `--target localhost:PORT` reaches it in plaintext
    (loopback), exit 0, and every documented key is in the JSON."""
    out = hicache("health", "--target", live.target, "--json")
    assert out.returncode == 0, out
    report = strict_json(out.stdout)
    assert set(report) >= HEALTH_KEYS and "error" not in report, report
    assert report["reachable"] is True and report["serving"] is True
    assert [b["name"] for b in report["backends"]] == ["file"]  # type: ignore[union-attr, index]
    out = hicache("stats", "--target", live.target, "--json")
    assert out.returncode == 0, out
    report = strict_json(out.stdout)
    assert report["reachable"] is True and {"pools", "counters"} <= set(report)
    text = hicache("health", "--target", live.target, "--deep")
    assert text.returncode == 0 and text.stdout.startswith(f"daemon at {live.target}: SERVING\n"), text
    assert "  file: healthy " in text.stdout


def test_health_of_a_hung_daemon_is_unreachable_within_the_probe_deadline(stopped: Daemon) -> None:
    """A daemon that accepts and never answers: exit 2 once the probe's 5 s pass (not a
    hang), `--json` valid with `reachable: false` and the error."""
    start_up = start_up_s()
    out, seconds = timed("health", "--target", stopped.target, "--json", "--deep")
    assert out.returncode == 2, out
    assert seconds < ops.PROBE_TIMEOUT_S + start_up + SLACK_S, (seconds, start_up)
    report = strict_json(out.stdout)
    assert set(report) >= HEALTH_KEYS | {"error"}, report
    assert report["reachable"] is False and report["serving"] is False and report["backends"] == []
    assert out.stderr == ""


def test_stats_of_a_hung_daemon_is_unreachable_within_the_probe_deadline(stopped: Daemon) -> None:
    start_up = start_up_s()
    out, seconds = timed("stats", "--target", stopped.target, "--json")
    assert out.returncode == 2, out
    report = strict_json(out.stdout)
    assert report["reachable"] is False and report["error"], report
    assert seconds < ops.PROBE_TIMEOUT_S + start_up + SLACK_S, (
        f"{seconds:.1f} s against a hung daemon (start-up {start_up:.1f} s)")


# --------------------------------------------------------------------------- output into a closed pipe


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """`hicache ARGS | reader` where the reader has already gone (`| head -0`, a probe
    wrapper that stopped reading)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([HICACHE, *args], stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)


def test_health_into_a_closed_pipe_keeps_its_exit_code_without_a_traceback(tmp_path: Path) -> None:
    out = _into_a_closed_pipe("health", "--target", f"unix://{tmp_path}/nobody.sock")
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == 2, out


# --------------------------------------------------------------------------- config check vs serve


def test_serve_refuses_a_main_listener_and_a_probe_listener_on_one_port(tmp_path: Path) -> None:
    """`server.listen: localhost:P` binds 127.0.0.1:P (and [::1]:P); a probe listener on
    127.0.0.1:P then cannot bind: serve exits 1, one line, no traceback."""
    port = free_port()
    out = hicache("serve", "--listen", f"localhost:{port}", "--set", f"server.probe_listen=127.0.0.1:{port}",
                  *TINY_SERVE, timeout_s=90)
    assert out.returncode in (1, 2), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("hicache: ") and "probe_listen" in last, last


def test_config_check_refuses_listeners_that_serve_cannot_bind_together() -> None:
    port = free_port()
    out = hicache("config", "check", "--set", f"server.listen=localhost:{port}",
                  "--set", f"server.probe_listen=127.0.0.1:{port}", "--set", "metrics.port=0")
    assert out.returncode == 2, out.stdout[-500:]
    assert "port" in out.stderr and out.stdout == ""
    one_line_error(out.stderr)


def test_config_check_accepts_separate_ports_for_a_host_name_and_an_ip(tmp_path: Path) -> None:
    """The other side of the rule: different ports, whatever the host spelling, are fine."""
    port = free_port()
    out = hicache("config", "check", "--set", f"server.listen=localhost:{port}",
                  "--set", f"server.probe_listen=127.0.0.1:{port + 1 if port < 65535 else port - 1}",
                  "--set", "metrics.port=0")
    assert out.returncode == 0, out.stderr
    assert f"listen: localhost:{port}" in out.stdout


@pytest.mark.parametrize(("item", "key"), [
    ("tiers.l1.tokens", "--set tiers.l1.tokens: expected KEY=VALUE"),
    ("tiers.l1.tokens={", "--set tiers.l1.tokens: value '{' is not valid YAML"),
    ("tiers.l2.ratio=.nan", "tiers.l2.ratio: nan is not a finite number"),
])
@pytest.mark.parametrize("command", ["config", "serve"])
def test_a_bad_set_is_one_line_naming_the_key_and_exit_2_for_serve_and_config_check(
    tmp_path: Path, command: str, item: str, key: str
) -> None:
    """Through the console script: `serve` refuses exactly what `config check` refuses,
    with the same line, before it creates its socket."""
    sock = tmp_path / "s.sock"
    argv = (["config", "check", "--set", item] if command == "config"
            else ["serve", "--listen", f"unix://{sock}", "--set", item, "--set", "metrics.port=0"])
    out = hicache(*argv)
    assert out.returncode == 2 and out.stdout == "", out
    one_line_error(out.stderr)
    assert out.stderr.startswith("hicache: configuration error: ") and key in out.stderr, out.stderr
    assert not sock.exists()


# --------------------------------------------------------------------------- bench arguments


def _bench(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`hicache bench ARGS` in a session of its own: a multiturn run spawns a daemon and
    engine processes, all killed if it overruns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    proc = subprocess.Popen([HICACHE, "bench", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"hicache bench {' '.join(args)}: still running after {timeout_s} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_bench_controller_negative_seed_is_a_usage_error() -> None:
    out = _bench("controller", "--seed", "-1", "--tokens", "64", "--repeat", "1", "--requests", "1")
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert out.returncode == 2 and "--seed" in out.stderr, out


def test_bench_multiturn_negative_seed_is_a_usage_error() -> None:
    out = _bench("multiturn", "--seed", "-1", "--l3", "none", "--clients", "1", "--rounds", "1",
                 "--no-progress")
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert out.returncode == 2 and "--seed" in out.stderr, out


def test_bench_multiturn_l2_ratio_of_one_is_a_usage_error() -> None:
    out = _bench("multiturn", "--l2-ratio", "1", "--l3", "none", "--clients", "1", "--rounds", "1",
                 "--no-progress")
    assert out.returncode == 2 and "--l2-ratio" in out.stderr, out
    assert "daemon exited" not in out.stderr, out.stderr[-1500:]

