from __future__ import annotations

import subprocess
import sys

import pytest
from unprivileged import as_nobody

from hicache.cli import main


def test_config_check_prints_resolved_sizes(capsys) -> None:
    assert main(["config", "check", "--set", "tiers.l1.tokens=6400"]) == 0
    out = capsys.readouterr().out
    assert "l1_pages: 100 (6400 tokens)" in out
    assert "l1_bytes: 6.2 MiB" in out


def test_config_check_reports_mistakes_with_exit_2(tmp_path, capsys) -> None:
    f = tmp_path / "h.yaml"
    f.write_text("tiers: {l2: {ratio: 1}}\n")
    assert main(["config", "check", str(f)]) == 2
    assert "tiers.l2.ratio: 1.0 must be > 1" in capsys.readouterr().err


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "config", "check"], capture_output=True, text=True, check=True
    )
    assert "page_size: 64 tokens" in out.stdout


def test_process_defaults_set_passive_openmp_wait_unless_the_operator_chose() -> None:
    from hicache.cli import process_defaults

    env: dict[str, str] = {}
    process_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    process_defaults(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
    # main() sets it first thing: that only works while importing the CLI loads no torch.
    out = subprocess.run(
        [sys.executable, "-c", "import sys, hicache.cli; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "False"


def test_probe_commands_do_not_import_torch(tmp_path) -> None:
    """`hicache health` runs as a Kubernetes exec probe: importing torch (the benchmarks,
    pool mapping) would cost seconds of a probe's timeout. Unreachable daemon: exit 2."""
    script = (
        "import sys\nfrom hicache import cli\n"
        f"rc = cli.main(['health', '--target', 'unix://{tmp_path}/none.sock'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "torch imported" not in out.stderr


def test_bench_options_are_there_when_the_command_is_bench() -> None:
    from hicache.cli import _command_of, build_parser

    assert _command_of(["-v", "bench", "tree"]) == "bench"
    assert _command_of(["health", "--json"]) == "health"
    args = build_parser().parse_args(["bench", "tree", "--rounds", "2"])
    assert args.rounds == 2


@pytest.mark.parametrize("target", ["bad", "unix://relative.sock", "localhost:abc", "[::1]:99999"])
@pytest.mark.parametrize("command", ["health", "stats"])
def test_a_malformed_target_is_a_usage_error_not_an_unhealthy_daemon(
    command: str, target: str, capsys
) -> None:
    # Exit 1 means "the daemon answered, a backend is unhealthy": a probe must not read
    # a typo in its own address that way.
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--target", target])
    assert exit_info.value.code == 2
    assert "--target" in capsys.readouterr().err


def test_serve_listen_is_taken_literally() -> None:
    """`--listen` is an address, not YAML: an IPv6 literal and a '#' survive."""
    import argparse

    from hicache.cli import _serve_overrides
    from hicache.config import load_config

    for address in ("[::1]:50199", "unix:///tmp/my #1.sock"):
        args = argparse.Namespace(set=[], listen=address)
        assert load_config(None, _serve_overrides(args)).server.listen == address


def test_config_check_sizes_come_from_the_pools_own_sizing() -> None:
    """Per member L1 and L2 figures; MAMBA's L2 slots are ceil(mamba_slots x ratio) like
    the host pools allocate (it printed twice the L1 slots), page_first slots include the
    object header."""
    from hicache.cli import describe
    from hicache.config import load_config

    cfg = load_config(None, ["model.components.mamba={layers: 2, state_bytes_per_layer: 64}",
                             "tiers.l2.ratio=4", "tiers.l1.mamba_slots=100", "tiers.l2.layout=page_first"],
                      env={})
    text = describe(cfg)
    assert "member mamba: component=mamba" in text and "l2=400 x 192 B" in text
    assert "member full: component=full" in text and "l1=1024 x 64.0 KiB" in text
    # What daemons sharing an L3 compare: everything that seeds the L3 keys.
    assert (f"l3_key_seed: model=demo-model kv_dtype=bfloat16 geometry={cfg.model.geometry}\n"
            in text)
    assert cfg.model.geometry == "page64;full=full:4x16384w0;mamba=mamba:2x64w0"


def test_config_check_hides_bearer_tokens() -> None:
    from hicache.cli import describe
    from hicache.config import build_config

    secret = "tenant-secret-token-0123456789"
    text = describe(build_config({"server": {"tokens": [{"token": secret, "namespaces": ["a"]}]}}))
    assert secret not in text and "(hidden)" in text


def test_health_json_has_every_key_when_the_daemon_is_unreachable(tmp_path) -> None:
    from hicache.ops import EXIT_UNREACHABLE, health_report

    report, rc = health_report(f"unix://{tmp_path}/nobody.sock", deep=False)
    assert rc == EXIT_UNREACHABLE
    assert {"target", "reachable", "serving", "backends", "error"} <= set(report)
    assert report["serving"] is False and report["backends"] == []


@pytest.mark.parametrize(("listen", "dialled"), [("0.0.0.0:50051", "127.0.0.1:50051"),
                                                  ("[::]:50051", "[::1]:50051"),
                                                  ("10.0.0.5:50051", "10.0.0.5:50051")])
def test_a_wildcard_listen_address_is_dialled_on_loopback(tmp_path, listen: str, dialled: str) -> None:
    import argparse

    from hicache.cli import _target

    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server: {{listen: '{listen}'}}\n")
    assert _target(argparse.Namespace(target=None, config=str(cfg))) == dialled


def test_a_ca_file_for_a_unix_socket_is_a_usage_error(tmp_path, capsys) -> None:
    """TLS is for TCP: --ca-file with a unix socket target contradicts itself (exit 2, a
    usage error), where it used to read as an unhealthy daemon (exit 1)."""
    from hicache.cli import main

    ca = tmp_path / "ca.pem"
    ca.write_text("not used")
    for command in ("health", "stats"):
        assert main([command, "--target", f"unix://{tmp_path}/d.sock", "--ca-file", str(ca)]) == 2
        assert "a unix socket is never TLS" in capsys.readouterr().err


# Every flag naming a file a benchmark writes when it ends.
OUTPUT_FLAGS = [("tree", "--json"), ("tiers", "--json"), ("tiers", "--l3-json"),
                ("controller", "--json"), ("gpu", "--json"), ("rpc", "--json"),
                ("multiturn", "--json"), ("multiturn", "--plot")]


@pytest.mark.parametrize(("bench", "flag"), OUTPUT_FLAGS)
def test_a_benchmark_output_file_that_cannot_be_written_is_refused_before_it_runs(
    bench: str, flag: str, tmp_path, capsys
) -> None:
    """A benchmark of minutes (multiturn 64 x 30) used to run to its end and only then fail
    writing its figures (exit 2, the figures lost). The path is checked first: exit 2
    naming the flag and what is wrong, nothing run, nothing created."""
    for bad, why in [(str(tmp_path / "no-such-folder" / "out.json"), "no folder"),
                     (str(tmp_path), "is a directory"), ("", "empty path")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", bench, flag, bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and why in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("bench", "flag"), OUTPUT_FLAGS)
def test_a_benchmark_output_file_in_an_existing_folder_is_taken_and_not_created_yet(
    bench: str, flag: str, tmp_path
) -> None:
    from hicache.cli import build_parser

    for path in (tmp_path / "new.json", tmp_path / "old.json"):
        if path.name == "old.json":
            path.write_text("earlier figures")
        args = build_parser().parse_args(["bench", bench, flag, str(path)])
        assert getattr(args, flag.lstrip("-").replace("-", "_")) == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "earlier figures"


def _refusal_as_another_user(value: str) -> str:
    """`output_file(value)`'s refusal ('' when taken) as `nobody` (root passes every
    permission check)."""
    import argparse

    from hicache.argtypes import output_file

    def check() -> str:
        try:
            output_file(value)
        except argparse.ArgumentTypeError as e:
            return str(e)
        return ""

    return as_nobody(check)


def test_a_benchmark_output_file_this_user_cannot_write_is_refused_saying_why() -> None:
    import os
    import shutil
    import tempfile
    from pathlib import Path

    home = Path(tempfile.mkdtemp(prefix="hicache-out-"))  # (in /tmp: the other user reaches it)
    try:
        (home / "ro").mkdir()
        (home / "priv").mkdir()
        (home / "theirs.json").write_text("keep")
        for path, mode in ((home, 0o755), (home / "ro", 0o555), (home / "priv", 0o700),
                           (home / "theirs.json", 0o444)):
            os.chmod(path, mode)  # (mkdir's mode would lose what the umask takes)
        said = _refusal_as_another_user(str(home / "ro" / "x.json"))
        assert f"the folder '{home / 'ro'}' is not writable" in said, said
        said = _refusal_as_another_user(str(home / "theirs.json"))
        assert "exists and is not writable" in said, said
        if os.geteuid() == 0:  # (an owner can always enter its own 0700 folder)
            said = _refusal_as_another_user(str(home / "priv" / "x.json"))
            assert "Permission denied" in said, said
        assert (home / "theirs.json").read_text() == "keep"
    finally:
        shutil.rmtree(home)
