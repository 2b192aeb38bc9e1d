"""Operator review of configuration and CLI edge cases: YAML quirks, `--set`, the Mooncake
environment, cross-key rules, secrets in output and errors, and `serve` / `health` /
`stats` exit codes on mistakes.

Tests marked xfail(strict=True) are bugs found by this review: each fails the suite once
fixed, so the mark is then removed. The others pin behaviour an operator relies on.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.config import load_config, parse_yaml, redact_url
from hicache.endpoint import parse_address
from hicache.errors import ConfigError

HICACHE = str(Path(sys.executable).with_name("hicache"))
TOKEN = "s3cretTOKENvalue1234"
PASSWORD = "hunter2pw"
MOONCAKE = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.1:8080/metadata"}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def config_error(overrides: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, env={} if env is None else env)
    return str(e.value)


# --------------------------------------------------------------------------- secrets


def test_a_redis_password_with_a_question_mark_is_not_printed() -> None:
    """Unescaped, redis-py would read it as the port (and never connect): refused, with
    the key named, the URL not shown and the cure said."""
    url = f"redis://:{PASSWORD}?x@10.0.0.5:6379/0"
    assert PASSWORD not in redact_url(url)
    rc, out, err = run_cli(["config", "check", "--set", f"storage.redis.url={url}"])
    assert rc == 2 and "storage.redis.url" in err and "percent-encoded" in err, err
    assert PASSWORD not in out + err


def test_a_redis_password_with_other_url_characters_is_not_printed() -> None:
    for url, rc_wanted in ((f"redis://user:{PASSWORD}@h:1/0", 0), (f"redis://:{PASSWORD}#x@h:1/0", 2),
                           (f"redis://:{PASSWORD}/x@h:1/0", 2),
                           (f"rediss://h:1/0?db=1&Password={PASSWORD}", 0),
                           (f"unix:///run/redis.sock?password={PASSWORD}&db=0", 0)):
        rc, out, err = run_cli(["config", "check", "--set", f"storage.redis.url={url}"])
        assert rc == rc_wanted, (url, err)
        assert PASSWORD not in out + err, url


def test_metadata_server_credentials_are_not_printed_by_config_check() -> None:
    url = f"http://admin:{PASSWORD}@10.0.0.1:8080/metadata"
    rc, out, err = run_cli(["config", "check", "--set", f"storage.mooncake.metadata_server={url}"])
    assert rc == 0, err
    assert PASSWORD not in out + err


@pytest.mark.parametrize("item", [
    f'server.token=[{{token: "{TOKEN}, namespaces: ["*"]}}]',
    f'storage.redis.URL="redis://:{PASSWORD}@h:6379/0',
    f'storage.Redis.url="redis://:{PASSWORD}@h:6379/0',
])
def test_a_malformed_secret_under_a_mistyped_key_is_not_echoed(item: str) -> None:
    rc, out, err = run_cli(["config", "check", "--set", item])
    assert rc == 2
    assert item.split("=", 1)[0] in err  # (the key is named) ...
    assert TOKEN not in out + err and PASSWORD not in out + err  # ... its value is not


def test_a_malformed_secret_under_the_right_key_is_not_echoed() -> None:
    for item in (f'server.tokens=[{{token: "{TOKEN}, namespaces: ["*"]}}]',
                 f'storage.redis.url="redis://:{PASSWORD}@h:6379/0'):
        rc, out, err = run_cli(["config", "check", "--set", item])
        assert rc == 2 and "not valid YAML" in err
        assert TOKEN not in out + err and PASSWORD not in out + err


# --------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("text", ["model:\n  id: a\x00b\n", "model:\n  id: a\x07b\n"])
def test_a_control_character_in_the_file_is_named_with_its_position(text: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_yaml(text, "hicache.yaml")
    message = str(e.value)
    assert "character" in message and ("position" in message or "line" in message), message


@pytest.mark.parametrize("value", ["1e3", "1.0e3"])
def test_a_number_in_scientific_notation(value: str) -> None:
    """Read as YAML 1.2 reads it (PyYAML's 1.1 rules made it a string)."""
    cfg = load_config(None, [f"storage.timeout_s={value}"], env={})
    assert cfg.storage.timeout_s == 1000.0
    assert parse_yaml(f"a: {value}\nb: 1e3x\n") == {"a": 1000.0, "b": "1e3x"}


@pytest.mark.parametrize(("item", "attr", "expected"), [
    ("storage.required=yes", ("storage", "required"), True),
    ("storage.required=on", ("storage", "required"), True),
    ("storage.required=True", ("storage", "required"), True),
    ("storage.file.fsync=off", ("storage", "file", "fsync"), False),
    ("tiers.l1.tokens=0x10000", ("tiers", "l1", "tokens"), 65536),
    ("tiers.l1.tokens=131_072", ("tiers", "l1", "tokens"), 131072),
    ("storage.timeout_s=1.0e+3", ("storage", "timeout_s"), 1000.0),
    ("tiers.l2.ratio=3", ("tiers", "l2", "ratio"), 3.0),
    ("model.id=null", ("model", "id"), "demo-model"),
    ("tiers=null", ("tiers", "l1", "tokens"), 65536),
])
def test_yaml_scalars_an_operator_writes_are_read_as_meant(item: str, attr: tuple[str, ...], expected: object) -> None:
    value: object = load_config(None, [item], env={})
    for name in attr:
        value = getattr(value, name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("item", "says"), [
    ("storage.required=1", "storage.required: expected true or false, got 1"),
    ("storage.file.fsync=y", "storage.file.fsync: expected true or false, got 'y'"),
    ("tiers.l1.tokens=65536.0", "tiers.l1.tokens: expected an integer, got 65536.0"),
    ("tiers.l1.size_gb=4GiB", "tiers.l1.size_gb: expected a number, got '4GiB'"),
    ("tiers.l2.ratio=.nan", "tiers.l2.ratio: nan is not a finite number"),
    ("storage.file.capacity_gb=-1", "storage.file.capacity_gb: -1.0 must be > 0"),
    ("storage.mooncake.global_segment_size=-1", "storage.mooncake.global_segment_size: -1 must be > 0"),
    ("metrics.port=65536", "metrics.port: 65536 must be in [0, 65535]"),
    ("model.Page_size=32", "model.Page_size: unknown key"),
    ("model.components.FULL.layers=2", "model.components: 'FULL' (str) is not one of"),
    ("tiers.l1=", "tiers.l1: expected a mapping, got ''"),
    ("server.tokens.0.token=x", "server.tokens is not a section"),
])
def test_each_bad_value_names_key_value_and_rule(item: str, says: str) -> None:
    assert says in config_error([item])


@pytest.mark.parametrize(("data", "page_size"), [
    (b"\xef\xbb\xbfmodel:\n  page_size: 32\n", 32),  # a UTF-8 BOM (Windows editors)
    (b"model:\r\n  page_size: 32\r\n", 32),  # CRLF
    (b"model: {page_size: 32}\n...\n", 32),  # an explicit document end
    (b"# only a comment\n", 64),
    (b"", 64),
])
def test_files_as_editors_write_them_load(tmp_path: Path, data: bytes, page_size: int) -> None:
    path = tmp_path / "hicache.yaml"
    path.write_bytes(data)
    assert load_config(path, env={}).model.page_size == page_size


@pytest.mark.parametrize(("data", "says"), [
    ("model:\n  page_size: 32\n".encode("utf-16"), "not UTF-8 (byte 0)"),
    (b"model:\n\tpage_size: 32\n", "(line 2, column 1)"),
    (b"model: {page_size: 32}\n---\nmodel: {page_size: 16}\n", "expected a single document"),
    (b"- model\n", "the top level must be a mapping, got list"),
    (b"model: !!python/object:os.system {}\n", "could not determine a constructor"),
])
def test_files_that_cannot_be_a_configuration_are_one_error(tmp_path: Path, data: bytes, says: str) -> None:
    path = tmp_path / "hicache.yaml"
    path.write_bytes(data)
    rc, out, err = run_cli(["config", "check", str(path)])
    assert rc == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- cross-key rules


@pytest.mark.parametrize("overrides", [
    ["server.listen=127.0.0.1:9400", "metrics.port=9400"],
    ["server.listen=127.0.0.1:50051", "server.probe_listen=127.0.0.1:50051", "metrics.port=0"],
    ["server.probe_listen=127.0.0.1:9400", "metrics.port=9400"],
])
def test_listeners_on_the_same_port_are_a_configuration_error(overrides: list[str]) -> None:
    message = config_error(overrides)
    assert "port" in message


def test_listeners_on_different_ports_are_fine() -> None:
    cfg = load_config(None, ["server.listen=127.0.0.1:50051", "server.probe_listen=127.0.0.1:50052",
                             "metrics.port=9400"], env={})
    assert cfg.metrics.port == 9400


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(("var", "value"), [("MOONCAKE_PROTOCOL", "RDMA"),
                                            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "-1")])
def test_a_bad_environment_value_names_the_variable(var: str, value: str) -> None:
    message = config_error(["storage.backend=mooncake"], {**MOONCAKE, var: value})
    assert var in message, message


def test_a_segment_size_in_non_ascii_digits_is_refused() -> None:
    message = config_error(["storage.backend=mooncake"], {**MOONCAKE, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "٣"})
    assert "MOONCAKE_GLOBAL_SEGMENT_SIZE" in message


def test_a_segment_size_that_is_not_an_integer_names_the_variable() -> None:
    for value in ("4GiB", "1e9", ""):
        message = config_error(["storage.backend=mooncake"], {**MOONCAKE, "MOONCAKE_GLOBAL_SEGMENT_SIZE": value})
        assert message.startswith("MOONCAKE_GLOBAL_SEGMENT_SIZE: ") and "integer" in message


def test_the_environment_fills_null_keys_and_a_yaml_value_wins() -> None:
    env = {**MOONCAKE, "MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "33554432"}
    cfg = load_config(None, ["storage.backend=mooncake", "storage.mooncake.protocol=tcp"], env=env)
    assert cfg.storage.mooncake.protocol == "tcp"  # YAML wins
    assert cfg.storage.mooncake.global_segment_size == 33554432  # null in the file: from the env
    assert cfg.storage.mooncake.master == MOONCAKE["MOONCAKE_MASTER"]
    # a `storage:` or `storage.mooncake:` left null still takes the environment
    for item in ("storage=null", "storage.mooncake=null"):
        assert load_config(None, [item], env=env).storage.mooncake.global_segment_size == 33554432
    assert "storage.mooncake: expected a mapping" in config_error(["storage.mooncake=abc"], env)


def test_mooncake_without_a_master_says_which_variable_supplies_it() -> None:
    message = config_error(["storage.backend=mooncake"], {"MOONCAKE_TE_META_DATA_SERVER": "http://h/m"})
    assert message == ("storage.mooncake.master: required with storage.backend=mooncake "
                       "(or set MOONCAKE_MASTER)")


# --------------------------------------------------------------------------- serve, health, stats


def test_serve_with_a_bad_key_exits_2_naming_it_and_creates_no_socket(tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    rc, _out, err = run_cli(["serve", "--listen", f"unix://{sock}", "--set", "metrics.port=70000"])
    assert rc == 2
    assert "metrics.port: 70000 must be in [0, 65535]" in err
    assert not sock.exists() and not sock.with_name("d.sock.lock").exists()


def test_serve_plaintext_tcp_off_loopback_exits_1_before_anything_starts() -> None:
    # (a process of its own: `serve` tunes the C allocator of the process it runs in)
    proc = subprocess.run([HICACHE, "serve", "--listen", "10.255.255.1:50051", "--set", "metrics.port=0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "server.listen=10.255.255.1:50051 is not a loopback address" in proc.stderr
    assert "TLS" in proc.stderr


def test_serve_whose_l2_exceeds_memory_exits_2_and_leaves_no_socket_or_segment(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/r.sock"
    instance = parse_address(address).instance_name()
    proc = subprocess.run(
        [HICACHE, "serve", "--listen", address, "--set", "tiers.l2.reserve_gb=1000000",
         "--set", "metrics.port=0", "--set", "tiers.l1.tokens=4096"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "tiers.l2.reserve_gb" in proc.stderr
    assert not (tmp_path / "r.sock").exists()
    assert not [n for n in os.listdir("/dev/shm") if instance in n]


@pytest.mark.parametrize("target", ["", "localhost", "[::1]:0", "host:65536", "http://127.0.0.1:1",
                                    " 127.0.0.1:1", "unix://", "unix://relative.sock"])
@pytest.mark.parametrize("command", ["health", "stats"])
def test_a_malformed_target_is_a_usage_error_naming_the_flag(command: str, target: str) -> None:
    rc, out, err = run_cli([command, "--target", target, "--json"])
    assert rc == 2 and out == ""
    assert "argument --target:" in err and "Traceback" not in err


def test_health_and_stats_with_a_bad_config_exit_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "hicache.yaml"
    path.write_text("server:\n  listen: 127.0.0.1:99999\n")
    for command in ("health", "stats"):
        rc, out, err = run_cli([command, "--config", str(path), "--json"])
        assert rc == 2 and out == ""
        assert "server.listen: '127.0.0.1:99999' is neither unix:///path nor host:port" in err


def test_an_empty_kv_dtype_is_refused_like_an_empty_model_id() -> None:
    with pytest.raises(ConfigError, match=r"model.kv_dtype: must be a non-empty string"):
        load_config(None, ["model.kv_dtype="], env={})
