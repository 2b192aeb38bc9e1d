"""Property-based fuzzing of the `hicache` command line and what its commands do.

Random argv for every subcommand (unknown flags, missing values, repeated flags, odd
addresses, files that are missing, directories, binary, empty, huge or YAML bombs) is run
through `hicache.cli.main` in process; a few runs go through the console script where the
exit status and stderr are what matter. The invariants:

- never a Python exception out of `main` (argparse's own exit 2 and --help's 0 aside),
  never "Traceback" on stderr of the console script;
- `health` and `stats` exit 2 whenever nothing answers at the target (no daemon exists in
  the no-daemon properties: every address there is dead, malformed, or a listener that is
  not a gRPC server), within a bounded time (the probe's deadline);
- `--json` output (and `stats`' output on an error) is valid JSON (no NaN) with the
  documented keys: health `target`, `reachable`, `serving`, `backends[]` (`name`,
  `healthy`, `latency_ms`, `detail`, `capacity_bytes`, `used_bytes`), plus `error` or
  `note`;
- hicache's own error messages are one line, and a bearer token is never printed;
- against a real daemon with `server.tokens` (one per module) and against a fake gRPC
  daemon answering random Health/Stats replies: exit 0 iff SERVING and every backend
  healthy, else 1.

The configuration's keys and values are fuzzed by tests/test_config_fuzz.py; here only the
file as a whole (and `--set`'s shape on the command line) is.

The bugs it found are fixed; their regression tests are at the end. Knobs for a longer
hunt:

    HICACHE_FUZZ_EXAMPLES=2000   examples per property (default 30)
    HICACHE_FUZZ_RANDOM=1        a new seed each run (derandomize=False)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon.daemonkit import Daemon, free_port
from fuzzing import fuzz_examples, fuzz_settings
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hicache import cli, ops
from hicache.cli import main
from hicache.endpoint import MAX_SOCKET_PATH_BYTES, parse_address
from hicache.errors import HicacheError
from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import admin_pb2_grpc as apb_grpc
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

EXAMPLES = fuzz_examples(30)
FUZZ = fuzz_settings(30, HealthCheck.function_scoped_fixture)

SECRET = "cli-fuzz-SECRET-token-0123456789"  # the daemon's token (and never in any output)
WRONG = "cli-fuzz-WRONG-token-9876543210ab"
HICACHE = str(Path(sys.executable).with_name("hicache"))
HEALTH_KEYS = {"target", "reachable", "serving", "backends"}
BACKEND_KEYS = {"name", "healthy", "latency_ms", "detail", "capacity_bytes", "used_bytes"}
STATS_KEYS = {"target", "reachable"}
# A probe answers within its deadline; the slack covers channel set-up on a busy machine.
SLACK_S = 3.0


# --------------------------------------------------------------------------- running main

@dataclass(frozen=True)
class Run:
    rc: int
    out: str
    err: str
    seconds: float


def serve_without_a_server(argv: list[str]) -> tuple[Run, list[Any]]:
    """`hicache serve argv` in process with `hicache.server.serve` replaced: what it
    exited with, and the configurations it would have served."""
    started: list[Any] = []
    fake_server = types.ModuleType("hicache.server")
    fake_server.serve = lambda cfg, **_: started.append(cfg) or 0  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "hicache.server", fake_server)
        # (the test process's own signals stay as they are)
        mp.setattr("hicache.cli.watch_hangups", list)
        mp.setattr("hicache.cli.watch_stack_dumps", lambda: None)
        mp.setattr("hicache.allocator.tune", lambda: None)
        return run_main(argv), started


def run_main(argv: Sequence[str]) -> Run:
    """`main(argv)` in process; any exception but argparse's SystemExit propagates (a bug)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: Any = main(list(argv))
        except SystemExit as e:  # argparse: 2 for a usage error, 0 for --help
            rc = e.code
    assert isinstance(rc, int), rc
    return Run(rc, out.getvalue(), err.getvalue(), time.monotonic() - t0)


def run_script(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([HICACHE, *args], capture_output=True, text=True, timeout=timeout_s, env=env)


def strict_json(text: str) -> Any:
    """JSON as the standard has it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_own_message(err: str) -> None:
    """hicache's own messages on stderr (not argparse's usage text): one line."""
    assert "Traceback" not in err, err
    if err.startswith("hicache: "):
        assert len(err.strip().splitlines()) == 1, err


def check_health_json(report: Any, target: str | None = None) -> None:
    assert isinstance(report, dict) and set(report) >= HEALTH_KEYS, report
    assert isinstance(report["reachable"], bool) and isinstance(report["serving"], bool)
    assert isinstance(report["backends"], list)
    for b in report["backends"]:
        assert set(b) == BACKEND_KEYS, b
    if target is not None:
        assert report["target"] == target


def check_stats_json(report: Any) -> None:
    assert isinstance(report, dict) and set(report) >= STATS_KEYS, report
    if "error" not in report:
        assert {"pools", "counters"} <= set(report), report


# --------------------------------------------------------------------------- a world without a daemon

def _serve_forever(sock: socket.socket, mode: str) -> None:
    """A listener that is not a gRPC server: `close` at once, `junk` bytes, `http` an
    HTTP/1.1 answer, `rst` a reset, `silent` accepts and says nothing."""
    held: list[socket.socket] = []
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        try:
            if mode == "close":
                conn.close()
            elif mode == "junk":
                conn.sendall(b"\x00\xffjunk\r\n" * 64)
                conn.close()
            elif mode == "http":
                conn.settimeout(1.0)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                conn.close()
            elif mode == "rst":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            else:  # silent
                held.append(conn)
        except OSError:
            conn.close()


@dataclass
class World:
    """Dead and odd targets, and the files the commands are given."""

    root: Path
    dead_targets: list[str]  # parse, but nothing answers: exit 2
    silent_target: str  # accepts and never answers: exit 2 at the deadline
    dead_config: Path  # server.listen: a socket nobody serves
    files: dict[str, Path]  # kind -> path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("clifz")
    sockets: list[socket.socket] = []

    def listener(mode: str, family: int = socket.AF_INET, address: Any = ("127.0.0.1", 0)) -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(64)
        sockets.append(s)
        threading.Thread(target=_serve_forever, args=(s, mode), daemon=True).start()
        return s

    closed = socket.socket()  # bound, never listening: connections are refused
    closed.bind(("127.0.0.1", 0))
    sockets.append(closed)
    closed_port = closed.getsockname()[1]
    (root / "regular").write_text("not a socket\n")
    (root / "adir").mkdir()
    dead = [
        f"unix://{root}/nobody.sock",
        f"unix://{root}/regular",
        f"unix://{root}/adir",
        f"unix://{root}/é ünïcode.sock",
        f"127.0.0.1:{closed_port}",
        f"localhost:{closed_port}",
        f"[::1]:{closed_port}",
    ]
    for mode in ("close", "junk", "http", "rst"):
        dead.append(f"127.0.0.1:{listener(mode).getsockname()[1]}")
    for mode in ("close", "junk"):
        listener(mode, socket.AF_UNIX, str(root / f"{mode}.sock"))
        dead.append(f"unix://{root}/{mode}.sock")
    silent = f"127.0.0.1:{listener('silent').getsockname()[1]}"

    dead_config = root / "dead.yaml"
    dead_config.write_text(f"server: {{listen: 'unix://{root}/dead.sock'}}\n")
    files = {
        "missing": root / "missing.txt",
        "dir": root / "adir",
        "empty": root / "empty.txt",
        "blank": root / "blank.txt",
        "binary": root / "binary.bin",
        "token": root / "token.txt",
        "token_padded": root / "token_padded.txt",
        "wrong_token": root / "wrong_token.txt",
        "pem_junk": root / "junk.pem",
        "config_ok": root / "ok.yaml",
        "config_list": root / "list.yaml",
        "config_tabs": root / "tabs.yaml",
        "config_unknown_bomb": root / "bomb_unknown.yaml",
        "config_huge": root / "huge.yaml",
        "config_bad": root / "bad.yaml",
        "devnull": Path(os.devnull),
    }
    files["empty"].write_text("")
    files["blank"].write_text("\n  \n# only a comment\n---\n")
    files["binary"].write_bytes(bytes(range(256)) * 4)
    files["token"].write_text(SECRET)
    files["token_padded"].write_text(f"  {SECRET}\n\n")
    files["wrong_token"].write_text(WRONG)
    files["pem_junk"].write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    files["config_ok"].write_text(f"tiers: {{l1: {{tokens: 6400}}}}\nserver: {{listen: 'unix://{root}/dead.sock'}}\n")
    files["config_list"].write_text("- a\n- b\n")
    files["config_tabs"].write_text("tiers:\n\tl1: 1\n")
    files["config_unknown_bomb"].write_text(f"bomb: {laughs(9)}\n")
    files["config_huge"].write_text(("# " + "x" * 200 + "\n") * 2500 + "tiers: {l1: {tokens: 6400}}\n")
    files["config_bad"].write_text("tiers: {l2: {ratio: 1}}\n")
    yield World(root, dead, silent, dead_config, files)
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def laughs(depth: int) -> str:
    """A YAML flow list whose last element expands to 9**(depth + 1) strings (billion laughs)."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, depth + 1)]
    return "[" + ", ".join(parts) + "]"


# --------------------------------------------------------------------------- addresses

LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "0.0.0.0", "[::]"}


def odd_addresses(root: str) -> st.SearchStrategy[str]:
    """Malformed or odd-but-valid addresses (never one that resolves through DNS)."""
    port = st.sampled_from(["0", "65536", "-1", "abc", "", "99999", "1", "65535", "\u00b2", "\u0663",
                            " 1", "1 ", "0x10", "+1", "1e3", "00001", "123456"])
    host = st.sampled_from(["127.0.0.1", "localhost", "[::1]", "::1", "[::1", "::1]", "[]", "[::]",
                            "0.0.0.0", "", " ", "127.0.0.1:1", "[fe80::1%eth0]", "[127.0.0.1]",
                            "localhost.", "-localhost", "loc host"])
    tcp = st.builds(lambda h, p, sep: f"{h}{sep}{p}", host, port, st.sampled_from([":", "::", "", " :"]))
    long_path = st.integers(MAX_SOCKET_PATH_BYTES - 8, MAX_SOCKET_PATH_BYTES + 40).map(
        lambda n: "unix://" + "/" + "x" * (n - 1))
    unix = st.one_of(
        st.sampled_from(["unix://", "unix:///", "unix://relative.sock", "unix://./r.sock", "unix://~/r.sock",
                         f"unix://{root}/", f"unix://{root}/adir/", "unix:/abs.sock", "unix:abs.sock",
                         "UNIX:///tmp/x.sock", "unix:////double.sock", f"unix://{root}/new/dir/s.sock",
                         f"unix://{root}/x\x00y.sock", f"unix://{root}/é.sock", f"unix://{root}/\u202e.sock"]),
        long_path,
        st.text(min_size=0, max_size=20).map(lambda t: f"unix://{root}/{t}"),
    )
    junk = st.text(max_size=30)
    return st.one_of(tcp, unix, junk, st.sampled_from(["http://127.0.0.1:1", "dns:///localhost:1", "ipv4:127.0.0.1:1"]))


def _dialled_far(address: str) -> bool:
    """Whether dialling `address` would leave this machine (DNS, another host)."""
    try:
        ep = parse_address(address)
    except HicacheError:
        return False
    return not ep.is_unix and ep.host not in LOCAL_HOSTS


# --------------------------------------------------------------------------- health / stats: nothing answers

def probe_argv(world: World, command: str) -> st.SearchStrategy[list[str]]:
    root = str(world.root)
    target = st.one_of(st.sampled_from(world.dead_targets), odd_addresses(root))
    file_kinds = sorted(world.files)
    a_file = st.sampled_from(file_kinds).map(lambda k: str(world.files[k]))
    piece = st.one_of(
        st.tuples(st.just("--target"), target).map(list),
        target.map(lambda t: [f"--target={t}"]),
        st.tuples(st.just("--config"), st.one_of(st.just(str(world.dead_config)), a_file)).map(list),
        st.tuples(st.just("--token-file"), a_file).map(list),
        st.tuples(st.just("--ca-file"), a_file).map(list),
        st.sampled_from([["--json"], ["--deep"], ["--js"], ["--tar"], ["--json=1"], ["--bogus"], ["-x"],
                         ["extra"], ["--target"], ["--token-file"], ["--config"], ["--"], ["-"], ["--set", "a=1"]]),
    )
    head = st.sampled_from([[], ["-v"], ["--verbose"]])
    # The dead config first: a later --target/--config wins, and the default target (the
    # embedded /tmp/hicache.sock) is never dialled, where another daemon might live.
    return st.builds(lambda h, ps: [*h, command, "--config", str(world.dead_config), *(x for p in ps for x in p)],
                     head, st.lists(piece, max_size=6))


def _probe_property(world: World, argv: list[str]) -> None:
    assume(not any(_dialled_far(a.removeprefix("--target=")) for a in argv))
    r = run_main(argv)
    # Nothing answers anywhere: a usage error, a file that cannot be read, or unreachable.
    assert r.rc == 2, (argv, r)
    assert r.seconds < ops.PROBE_TIMEOUT_S + SLACK_S, (argv, r.seconds)
    check_own_message(r.err)
    assert SECRET not in r.out + r.err and WRONG not in r.out + r.err
    if r.out:  # a report: the daemon was asked
        assert not r.err, r
        command = next(a for a in argv if not a.startswith("-"))
        if command == "stats" or r.out.lstrip().startswith("{"):
            report = strict_json(r.out)
            (check_stats_json if command == "stats" else check_health_json)(report)
            assert report["reachable"] is False and report["error"], report
        else:
            assert r.out.startswith("daemon at ") and ": UNREACHABLE (" in r.out, r.out
            assert len(r.out.strip().splitlines()) == 1, r.out
    else:
        assert r.err.strip(), r  # a usage error says why


@FUZZ
@given(data=st.data())
def test_health_with_nothing_answering_exits_2(world: World, data: st.DataObject) -> None:
    _probe_property(world, data.draw(probe_argv(world, "health")))


@FUZZ
@given(data=st.data())
def test_stats_with_nothing_answering_exits_2(world: World, data: st.DataObject) -> None:
    _probe_property(world, data.draw(probe_argv(world, "stats")))


@pytest.mark.parametrize("command", ["health", "stats"])
def test_every_dead_target_is_unreachable_with_valid_json(world: World, command: str) -> None:
    """Each kind of dead target once, deterministically: a closed port, a unix path that is
    a regular file or a directory, listeners that close, send junk, answer HTTP/1.1 or reset."""
    for target in world.dead_targets:
        r = run_main([command, "--target", target, "--json"])
        assert r.rc == 2, (target, r)
        report = strict_json(r.out)
        (check_stats_json if command == "stats" else check_health_json)(report)
        assert report["reachable"] is False and report["target"] == target


@pytest.mark.parametrize("command", ["health", "stats"])
def test_a_listener_that_never_answers_is_unreachable_at_the_probe_deadline(
    world: World, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP peer that accepts and says nothing: exit 2 once the probe's deadline passes
    (shortened here; the real one must suit an exec probe's timeout)."""
    assert ops.PROBE_TIMEOUT_S <= 10
    monkeypatch.setattr(ops, "PROBE_TIMEOUT_S", 0.5)
    r = run_main([command, "--target", world.silent_target, "--json"])
    assert r.rc == 2 and 0.4 < r.seconds < 0.5 + SLACK_S, r
    assert strict_json(r.out)["reachable"] is False


def test_the_console_script_exits_2_quickly_with_one_line_when_nothing_answers(world: World) -> None:
    for args in (["health", "--target", world.dead_targets[0]],
                 ["health", "--target", world.dead_targets[4], "--deep"],
                 ["stats", "--config", str(world.dead_config)]):
        t0 = time.monotonic()
        out = run_script(*args)
        # (not a retry loop: an interpreter's start-up alone takes seconds on a loaded
        # machine; retrying would take the client's whole 60 s)
        assert out.returncode == 2 and time.monotonic() - t0 < 30, out
        assert "Traceback" not in out.stderr
        text = out.stdout.strip()
        assert len(text.splitlines()) == 1 or strict_json(text)["reachable"] is False, out
    for bad in ("[::1]:65536", "::1:50051", "unix://rel.sock", "localhost:-1", "unix:///" + "x" * 200):
        out = run_script("health", "--target", bad, "--json")
        assert out.returncode == 2 and out.stdout == "" and "--target" in out.stderr, out
        assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- config check

@FUZZ
@given(data=st.data())
def test_config_check_of_any_file_and_argv(world: World, data: st.DataObject) -> None:
    kinds = sorted(world.files)
    file_arg = data.draw(st.one_of(
        st.just([]),
        st.sampled_from(kinds).map(lambda k: [str(world.files[k])]),
        st.sampled_from([["-"], ["--"], [""], [str(world.root)], [str(world.root / "nope" / "x.yaml")]]),
        st.text(max_size=12).filter(lambda t: not t.startswith("-")).map(lambda t: [str(world.root / t)]),
    ))
    piece = st.one_of(
        st.sampled_from([["--set", "tiers.l1.tokens=6400"], ["--set", "tiers.l1.tokens=abc"], ["--set", "a=1"],
                         ["--set", "="], ["--set", "tiers.l1.tokens"], ["--set"], ["--set="], ["--bogus"],
                         ["--json"], ["--target", "x"], ["extra.yaml"], ["-v"], ["--se", "tiers.l2.ratio=3"]]),
        st.text(max_size=20).map(lambda t: ["--set", t]),
    )
    argv = ["config", "check", *file_arg, *(x for p in data.draw(st.lists(piece, max_size=4)) for x in p)]
    r = run_main(argv)
    assert r.rc in (0, 2), (argv, r)
    check_own_message(r.err)
    if r.rc == 0:
        assert "\n# derived\n" in r.out and "l1_pages: " in r.out and not r.err, r
    else:
        assert r.out == "" and r.err.strip(), (argv, r)
        if r.err.startswith("hicache: "):
            assert r.err.startswith("hicache: configuration error: "), r.err
    assert r.seconds < 10, (argv, r.seconds)


@pytest.mark.parametrize(("kind", "rc", "says"), [
    ("missing", 2, "No such file"),
    ("dir", 2, "Is a directory"),
    ("binary", 2, "not UTF-8"),
    ("empty", 0, None),
    ("blank", 0, None),
    ("devnull", 0, None),
    ("config_list", 2, "top level must be a mapping"),
    ("config_tabs", 2, "not valid YAML"),
    ("config_unknown_bomb", 2, "bomb: unknown key"),
    ("config_huge", 0, None),
    ("config_bad", 2, "tiers.l2.ratio"),
])
def test_config_check_of_each_kind_of_file(world: World, kind: str, rc: int, says: str | None) -> None:
    r = run_main(["config", "check", str(world.files[kind])])
    assert r.rc == rc, r
    if says is not None:
        assert says in r.err and r.err.count("\n") == 1, r.err
    else:
        assert "l1_pages: " in r.out


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file")
def test_config_check_of_an_unreadable_file(tmp_path: Path) -> None:
    f = tmp_path / "secret.yaml"
    f.write_text("tiers: {}\n")
    f.chmod(0)
    r = run_main(["config", "check", str(f)])
    assert r.rc == 2 and "Permission denied" in r.err, r


def test_config_check_console_script_of_bad_files(world: World) -> None:
    for kind in ("missing", "dir", "binary", "config_unknown_bomb"):
        out = run_script("config", "check", str(world.files[kind]))
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.startswith("hicache: configuration error: ") and out.stderr.count("\n") == 1, out


# --------------------------------------------------------------------------- serve (nothing starts)

@FUZZ
@given(data=st.data())
def test_serve_listen_and_set_are_validated_before_anything_starts(world: World, data: st.DataObject) -> None:
    """`serve` with a stub server: a valid configuration reaches it with `--listen` taken
    literally; anything else exits 2 on one line before the daemon would start."""
    listen = data.draw(st.one_of(st.none(), odd_addresses(str(world.root)), st.sampled_from(world.dead_targets)))
    sets = data.draw(st.lists(st.sampled_from(["metrics.port=0", "tiers.l1.tokens=abc", "bogus=1",
                                               f"server.listen=unix://{world.root}/s.sock", "server.lease_ms=0"]),
                              max_size=2))
    extra = data.draw(st.sampled_from([[], ["--bogus"], ["--listen"], ["--config", str(world.files["missing"])],
                                       ["--config", str(world.files["config_ok"])]]))
    argv = ["serve", *(["--listen", listen] if listen is not None else []),
            *(x for s in sets for x in ("--set", s)), *extra]
    r, started = serve_without_a_server(argv)
    check_own_message(r.err)
    assert r.rc in (0, 2), (argv, r)
    if r.rc == 0:
        (cfg,) = started
        if listen is not None and "--listen" not in extra:
            assert cfg.server.listen == listen
        parse_address(cfg.server.listen)  # what the daemon binds parses
    else:
        assert not started and r.err.strip(), (argv, r)


def test_serve_on_a_path_that_is_a_regular_file_or_a_directory_refuses(tmp_path: Path) -> None:
    """A real `hicache serve`: exit 1, one line, and the file or directory left alone."""
    (tmp_path / "file").write_text("keep me\n")
    (tmp_path / "dir").mkdir()
    for name in ("file", "dir", "file/below.sock"):
        out = run_script("serve", "--listen", f"unix://{tmp_path}/{name}", "--set", "metrics.port=0",
                         "--set", "tiers.l1.tokens=1024", "--set", "tiers.l2.reserve_gb=0")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith("hicache: "), out.stderr[-2000:]
    assert (tmp_path / "file").read_text() == "keep me\n" and (tmp_path / "dir").is_dir()


# --------------------------------------------------------------------------- bench (nothing runs)

@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(argv=st.lists(st.sampled_from(["tree", "tiers", "nope", "", "--rounds", "-1", "x", "--json", "--quick",
                                      "--pages", "2.5", "--help-me", "gpu", "rpc", "--target", "bad"]),
                     max_size=5))
def test_bench_argv_is_parsed_or_refused(argv: list[str]) -> None:
    """Nothing is run (a stub stands in for every benchmark): only the parsing is fuzzed."""
    ran: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "_cmd_bench", lambda args: ran.append(args) or 0)
        r = run_main(["bench", *argv])
    check_own_message(r.err)
    assert r.rc in (0, 2), (argv, r)
    assert (r.rc == 0) == bool(ran) or "cannot run here" in r.err, (argv, r)


def test_no_command_or_only_flags_is_a_usage_error() -> None:
    for argv in ([], ["-v"], ["--bogus"], ["nope"], ["config"], ["config", "nope"], ["--", "health"]):
        r = run_main(argv)
        assert r.rc == 2 and r.out == "" and "usage:" in r.err, (argv, r)


# --------------------------------------------------------------------------- a real daemon with tokens

@dataclass
class Live:
    daemon: Daemon
    l3_dir: Path
    files: dict[str, Path]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("clifz-live")
    l3 = root / "l3"
    l3.mkdir()
    d = Daemon(root, f"server.tokens=[{{token: {SECRET}, namespaces: ['*']}}]", "storage.backend=file",
               f"storage.file.path={l3}", listen=f"127.0.0.1:{free_port()}").start()
    files = {"good": root / "good", "padded": root / "padded", "wrong": root / "wrong", "empty": root / "empty",
             "missing": root / "missing"}
    files["good"].write_text(SECRET)
    files["padded"].write_text(f"\n  {SECRET}  \n")
    files["wrong"].write_text(WRONG)
    files["empty"].write_text("   \n")
    try:
        yield Live(d, l3, files)
    finally:
        d.close()


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(data=st.data())
def test_health_and_stats_against_a_daemon_with_tokens(live: Live, data: st.DataObject) -> None:
    command = data.draw(st.sampled_from(["health", "stats"]))
    token = data.draw(st.sampled_from([None, *sorted(live.files)]))
    flags = data.draw(st.lists(st.sampled_from(["--json", "--deep", "--json"] if command == "health" else ["--json"]),
                               max_size=3))
    pieces = [["--target", live.daemon.target], *([f] for f in flags)]
    if token is not None:
        pieces.append(["--token-file", str(live.files[token])])
    argv = [command, *(x for p in data.draw(st.permutations(pieces)) for x in p)]
    r = run_main(argv)
    check_own_message(r.err)
    assert SECRET not in r.out + r.err and WRONG not in r.out + r.err
    authorized = token in ("good", "padded")
    if token == "missing":
        assert r.rc == 2 and r.out == "" and str(live.files["missing"]) in r.err, r
        return
    as_json = "--json" in argv or (command == "stats" and r.rc)
    report = strict_json(r.out) if as_json else None
    if command == "health":
        assert r.rc == 0, r  # SERVING; the file backend is healthy (or not reported without a token)
        if report is not None:
            check_health_json(report, live.daemon.target)
            assert report["serving"] is True and report["reachable"] is True
            if authorized:
                assert [b["name"] for b in report["backends"]] == ["file"] and report["backends"][0]["healthy"]
                assert "note" not in report
            else:
                assert report["backends"] == [] and "--token-file" in report["note"]
                assert ("invalid bearer token" if token == "wrong" else "missing credentials") in report["note"]
        else:
            assert r.out.startswith(f"daemon at {live.daemon.target}: SERVING\n"), r.out
            assert ("  file: healthy " in r.out) == authorized, r.out
    else:
        assert r.rc == (0 if authorized else 1), r
        if report is not None:
            check_stats_json(report)
            assert report["reachable"] is True
            if authorized:
                assert {p["tier"] for p in report["pools"]} == {"device", "host"}
                assert all(isinstance(v, int) for v in report["counters"].values())
            else:
                assert ("invalid bearer token" if token == "wrong" else "missing credentials") in report["error"]
        else:
            assert r.out.startswith("tier ") and "lookups: " in r.out, r.out


def test_the_console_script_against_a_daemon_with_tokens(live: Live) -> None:
    target = live.daemon.target
    ok = run_script("health", "--target", target, "--token-file", str(live.files["good"]), "--json")
    assert ok.returncode == 0, ok
    report = strict_json(ok.stdout)
    check_health_json(report, target)
    assert report["backends"][0]["name"] == "file" and report["backends"][0]["healthy"] is True
    for args in (["health", "--target", target], ["health", "--target", target, "--token-file", str(live.files["wrong"])],
                 ["stats", "--target", target, "--token-file", str(live.files["wrong"])],
                 ["stats", "--target", target]):
        out = run_script("-v", *args)  # (debug logging shows no token either)
        assert out.returncode == (0 if args[0] == "health" else 1), out
        assert "Traceback" not in out.stderr and SECRET not in out.stdout + out.stderr
        assert WRONG not in out.stdout + out.stderr


def test_health_exits_1_while_a_backend_is_unhealthy(live: Live) -> None:
    """The file backend's directory replaced by a regular file: exit 1 with the token
    (--deep probes now; then the shallow report is that last probe), 0 without (not
    `required`: the standard check stays SERVING); back to 0 once the directory is back."""
    target, good = live.daemon.target, str(live.files["good"])
    moved = live.l3_dir.with_name("l3.moved")
    live.l3_dir.rename(moved)
    live.l3_dir.write_text("not a directory\n")
    try:
        r = run_main(["health", "--target", target, "--token-file", good, "--json", "--deep"])
        assert r.rc == 1, r
        report = strict_json(r.out)
        check_health_json(report, target)
        assert report["serving"] is True and report["backends"][0]["healthy"] is False
        assert report["backends"][0]["detail"]
        text = run_main(["health", "--target", target, "--token-file", good])
        assert text.rc == 1 and "  file: UNHEALTHY " in text.out, text
        assert run_main(["health", "--target", target]).rc == 0
    finally:
        live.l3_dir.unlink()
        moved.rename(live.l3_dir)
    assert run_main(["health", "--target", target, "--token-file", good, "--deep"]).rc == 0


# --------------------------------------------------------------------------- a fake daemon with random replies

class _FakeDaemon:
    """grpc.health.v1, Admin.Health and HiCache.Stats answering whatever the test sets."""

    def __init__(self, listen: str = "127.0.0.1:0") -> None:
        """`listen`: bound the way the daemon binds it (`Endpoint.target`)."""
        self.health = apb.HealthResponse()
        self.stats = pb.StatsResponse()
        self.abort: grpc.StatusCode | None = None
        self.delay_s = 0.0  # Admin.Health answers this late (a hung backend)
        self.status = health.HealthServicer()
        fake = self

        class Admin(apb_grpc.AdminServicer):
            def Health(self, request: Any, context: Any) -> Any:
                time.sleep(fake.delay_s)
                if fake.abort is not None:
                    context.abort(fake.abort, "fake failure")
                return fake.health

        class Cache(pb_grpc.HiCacheServicer):
            def Stats(self, request: Any, context: Any) -> Any:
                if fake.abort is not None:
                    context.abort(fake.abort, "fake failure")
                return fake.stats

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        apb_grpc.add_AdminServicer_to_server(Admin(), self.server)
        pb_grpc.add_HiCacheServicer_to_server(Cache(), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.status, self.server)
        port = self.server.add_insecure_port(listen if listen.endswith(":0") else parse_address(listen).target)
        self.target = f"127.0.0.1:{port}" if listen.endswith(":0") else listen
        self.server.start()


@pytest.fixture(scope="module")
def fake() -> Iterator[_FakeDaemon]:
    f = _FakeDaemon()
    yield f
    f.server.stop(0)


SERVING = health_pb2.HealthCheckResponse
backend_st = st.builds(
    apb.BackendHealth,
    name=st.sampled_from(["file", "redis", "mooncake", "", "x" * 300, "é\n\t"]),
    healthy=st.booleans(),
    latency_ms=st.floats(min_value=0, max_value=1e12, allow_nan=False),
    detail=st.text(max_size=40),
    capacity_bytes=st.integers(0, 2**64 - 1),
    used_bytes=st.integers(0, 2**64 - 1),
)
pool_st = st.builds(pb.PoolStats, tier=st.sampled_from([pb.DEVICE, pb.HOST, pb.STORAGE]), member=st.text(max_size=12),
                    capacity_pages=st.integers(0, 2**64 - 1), used_pages=st.integers(0, 2**64 - 1),
                    locked_pages=st.integers(0, 2**64 - 1))


@FUZZ
@given(backends=st.lists(backend_st, max_size=4),
       status=st.sampled_from([SERVING.SERVING, SERVING.NOT_SERVING, SERVING.UNKNOWN, SERVING.SERVICE_UNKNOWN]),
       pools=st.lists(pool_st, max_size=4), lookups=st.integers(0, 2**64 - 1),
       abort=st.sampled_from([None, None, None, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED]),
       as_json=st.booleans(), deep=st.booleans())
def test_health_and_stats_of_any_daemon_reply(fake: _FakeDaemon, backends: list[Any], status: int, pools: list[Any],
                                              lookups: int, abort: grpc.StatusCode | None, as_json: bool,
                                              deep: bool) -> None:
    fake.health = apb.HealthResponse(backends=backends)
    fake.stats = pb.StatsResponse(pools=pools, counters=pb.Counters(lookups=lookups))
    fake.abort = abort
    fake.status.set("", status)
    flags = [*(["--json"] if as_json else []), *(["--deep"] if deep else [])]

    h = run_main(["health", "--target", fake.target, *flags])
    check_own_message(h.err)
    serving = status == SERVING.SERVING
    if abort is None:
        assert h.rc == (0 if serving and all(b.healthy for b in backends) else 1), h
    elif abort in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):
        # (no token for the report; a probe listener, which serves only the check)
        assert h.rc == (0 if serving else 1), h  # the standard check alone decides
    else:
        assert h.rc == 1, h  # it answered the standard check: reachable, not healthy
    if as_json:
        report = strict_json(h.out)
        check_health_json(report, fake.target)
        assert report["reachable"] is True and report["serving"] is serving
        if abort is None:
            assert [b["name"] for b in report["backends"]] == [b.name for b in backends]
    else:
        assert h.out.startswith(f"daemon at {fake.target}: "), h.out

    s = run_main(["stats", "--target", fake.target, *(["--json"] if as_json else [])])
    check_own_message(s.err)
    if abort is None:
        assert s.rc == 0, s
    else:  # (UNAVAILABLE from a daemon that answers the standard check: a stopping one)
        assert s.rc == 1, s
    if as_json or s.rc:
        report = strict_json(s.out)
        check_stats_json(report)
        if s.rc == 0:
            assert report["counters"]["lookups"] == lookups and len(report["pools"]) == len(pools)
    else:
        assert s.out.count("\n") >= len(pools) + 2


def test_a_backend_report_that_does_not_come_in_time_is_exit_1(
    fake: _FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon answers the standard check, its backend report hangs: exit 1 (not 2)
    at the probe's deadline, with an error saying so."""
    monkeypatch.setattr(ops, "PROBE_TIMEOUT_S", 0.5)
    fake.abort, fake.delay_s = None, 1.5
    fake.status.set("", SERVING.SERVING)
    try:
        r = run_main(["health", "--target", fake.target, "--json"])
    finally:
        fake.delay_s = 0.0
    assert r.rc == 1 and r.seconds < 0.5 + SLACK_S, r
    report = strict_json(r.out)
    check_health_json(report, fake.target)
    assert report["reachable"] is True and "backend report did not" in report["error"]


# --------------------------------------------------------------------------- found by the fuzzing (fixed)

def test_a_billion_laughs_config_is_refused_with_a_short_message(tmp_path: Path) -> None:
    # depth 4 expands to 59,049 strings (a 400 KB message); depth 9 (a 2 KB file) never
    # finishes and takes gigabytes.
    f = tmp_path / "bomb.yaml"
    f.write_text(f"model: {{id: {laughs(4)}}}\n")
    r = run_main(["config", "check", str(f)])
    assert r.rc == 2 and "model.id" in r.err
    assert len(r.err) < 2000, f"{len(r.err)} bytes of error message"


def test_a_binary_token_file_is_exit_2_not_a_traceback(world: World) -> None:
    r = run_main(["health", "--target", world.dead_targets[0], "--token-file", str(world.files["binary"])])
    assert r.rc == 2 and r.err.startswith("hicache: ")


@pytest.mark.parametrize("token", ["abcdefghijklmnop\nqrstuvwxyz", "tökén-abcdefghijklmnop"])
def test_a_token_that_cannot_be_sent_is_not_an_unhealthy_daemon(world: World, tmp_path: Path, token: str) -> None:
    f = tmp_path / "token"
    f.write_text(token)
    r = run_main(["health", "--target", world.dead_targets[4], "--token-file", str(f), "--json"])
    assert r.rc == 2, r  # nothing listens there: never "reachable" (exit 1)
    assert not r.out or strict_json(r.out)["reachable"] is False


def test_a_unix_target_that_is_not_utf8_is_a_usage_error(tmp_path: Path) -> None:
    # What `hicache health --target $'unix:///tmp/\xff.sock'` hands Python (surrogateescape).
    target = f"unix://{tmp_path}/\udcff.sock"
    for command in ("health", "stats"):
        r = run_main([command, "--target", target])
        assert r.rc == 2 and r.err.strip(), r


def test_a_nul_in_server_listen_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "h.yaml"
    f.write_text(f'server: {{listen: "unix://{tmp_path}/a\\0b.sock"}}\n')
    r = run_main(["config", "check", str(f)])
    assert r.rc == 2 and "server.listen" in r.err, r


def test_a_nul_in_a_file_name_is_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "h.yaml"
    f.write_text(f'server: {{listen: "127.0.0.1:1", tls_cert: "{tmp_path}/a\\0b", tls_key: "{tmp_path}/a\\0b"}}\n')
    out = run_script("health", "--config", str(f))  # (a real shell can pass this one)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-500:]
    for argv in (["config", "check", f"{tmp_path}/a\x00b"],
                 ["health", "--target", "127.0.0.1:1", "--token-file", f"{tmp_path}/a\x00b"],
                 ["health", "--target", "127.0.0.1:1", "--ca-file", f"{tmp_path}/a\x00b"]):
        assert run_main(argv).rc == 2


@pytest.mark.parametrize("latency", [math.nan, math.inf])
def test_health_json_stays_json_for_a_non_finite_latency(fake: _FakeDaemon, latency: float) -> None:
    fake.abort = None
    fake.status.set("", SERVING.SERVING)
    fake.health = apb.HealthResponse(backends=[apb.BackendHealth(name="file", healthy=True, latency_ms=latency)])
    r = run_main(["health", "--target", fake.target, "--json"])
    strict_json(r.out)


@pytest.mark.parametrize("tier", [pb.TIER_UNSPECIFIED, 7])
def test_stats_of_a_pool_in_an_unknown_tier(fake: _FakeDaemon, tier: int) -> None:
    fake.abort = None
    fake.stats = pb.StatsResponse(pools=[pb.PoolStats(tier=tier, member="full", capacity_pages=1)])
    r = run_main(["stats", "--target", fake.target, "--json"])
    assert r.rc in (0, 1)
    check_stats_json(strict_json(r.out))


def test_stats_without_a_token_says_to_give_the_token_file(live: Live) -> None:
    for extra in ([], ["--token-file", str(live.files["wrong"])]):
        r = run_main(["stats", "--target", live.daemon.target, *extra])
        assert r.rc == 1 and "--token-file" in r.out + r.err, r


@pytest.mark.parametrize("command", ["config", "health"])
def test_a_file_name_with_a_line_break_gives_a_one_line_error(tmp_path: Path, command: str) -> None:
    missing = f"{tmp_path}/two\nlines.yaml"
    argv = (["config", "check", missing] if command == "config"
            else ["health", "--target", "127.0.0.1:1", "--token-file", missing])
    r = run_main(argv)
    assert r.rc == 2 and len(r.err.strip().splitlines()) == 1, r.err


def test_serve_listen_empty_is_refused() -> None:
    r, started = serve_without_a_server(["serve", "--listen", "", "--set", "metrics.port=0"])
    assert r.rc == 2 and not started, [cfg.server.listen for cfg in started]


@pytest.mark.parametrize("name", ["my #1.sock", "a?b.sock", "dead?é.sock"])
def test_a_unix_target_with_uri_characters_is_dialled_as_written(tmp_path: Path, name: str) -> None:
    listen = f"unix://{tmp_path}/{name}"
    daemon = None if name.startswith("dead") else _FakeDaemon(listen)
    try:
        r = run_main(["health", "--target", listen, "--json"])
    finally:
        if daemon is not None:
            daemon.server.stop(0)
    report = strict_json(r.out)
    if daemon is None:
        assert r.rc == 2 and report["reachable"] is False, r
    else:
        assert r.rc == 0 and report["serving"] is True, r  # (SERVING, no backends)


def test_a_target_with_a_control_character_gives_a_one_line_report(tmp_path: Path) -> None:
    """Found by a longer hunt (HICACHE_FUZZ_EXAMPLES=300, random seed): a unix path holding
    '\\x1e' (a record separator, which `splitlines` breaks at) was printed raw, so the
    text report took two lines."""
    r = run_main(["health", "--target", f"unix://{tmp_path}/\x1e"])
    assert r.rc == 2 and r.out.startswith("daemon at ") and ": UNREACHABLE (" in r.out, r
    assert len(r.out.strip().splitlines()) == 1, r.out
