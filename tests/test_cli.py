from __future__ import annotations

import subprocess
import sys

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
