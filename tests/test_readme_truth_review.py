"""Review: is the README true? Checked against the code, in the directions the existing
checks leave open.

tests/test_readme.py checks that every schema key has a row with its default, and
tests/test_operator_docs_review.py that every README row is a real key and every flag the
README's CLI synopsis shows is accepted. Here: the other directions (every command and
flag of the code in the README; every metric a fresh controller exports documented; every
RPC served in the API table), the allowed values of every enum key, the limits and
numbers the README quotes from the code, and the Quick start's script. Tests marked
xfail(strict=True) are places where the README and the code disagree: each fails now and
passes once the README is fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import itertools
import re
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache import config as config_mod
from hicache.cli import BENCHMARKS, build_parser
from hicache.config import HicacheConfig, build_config
from hicache.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README_TEXT = (ROOT / "README.md").read_text()
README = " ".join(README_TEXT.split())  # (prose wraps lines anywhere)


def section(title: str) -> str:
    """The README text from the heading `title` to the next heading of that level."""
    level = title.split(" ", 1)[0]
    body = README_TEXT.split(f"\n{title}\n", 1)[1]
    return re.split(rf"\n{level} ", body, maxsplit=1)[0]


# --------------------------------------------------------------------------- CLI: code -> README


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every leaf command of the code's parser: ('serve', p), ('config check', p), ..."""
    for name, p in _subparsers(build_parser()).items():
        subs = _subparsers(p)
        if not subs:
            yield name, p
        for sub, sp in subs.items():
            yield f"{name} {sub}", sp


def _synopsis() -> list[str]:
    return section("## CLI").split("```", 2)[1].strip().splitlines()


def _line_of(command: str) -> str:
    lines = [ln for ln in _synopsis()
             if re.match(rf"hicache (\[-v\] )?{re.escape(command)}(\s|$)", ln)]
    assert len(lines) == 1, (command, lines)
    return lines[0]


def _named(option_strings: list[str], text: str) -> bool:
    return any(re.search(re.escape(s) + r"(?![\w-])", text) for s in option_strings)


def test_every_command_of_the_code_has_its_line_in_the_readme_synopsis() -> None:
    commands = [c for c, _ in _commands()]
    assert {f"bench {b}" for b in BENCHMARKS} <= set(commands)
    assert {"serve", "health", "stats", "config check"} <= set(commands)
    for command in commands:
        _line_of(command)
    # and nothing more: every synopsis line is one of them
    assert len(_synopsis()) == len(commands), (_synopsis(), commands)


# The synopsis lines that claim to be complete (no `...`): every flag of the command on it.
COMPLETE_LINES = ("serve", "health", "stats", "config check", "bench tree", "bench controller",
                  "bench gpu", "bench rpc")


@pytest.mark.parametrize("command", COMPLETE_LINES)
def test_every_flag_of_a_command_is_on_its_synopsis_line(command: str) -> None:
    parser = dict(_commands())[command]
    line = _line_of(command)
    missing = [a.option_strings for a in parser._actions
               if a.option_strings and "-h" not in a.option_strings
               and not _named(a.option_strings, line)]
    assert not missing, (command, missing, line)
    positionals = [a.dest for a in parser._actions if not a.option_strings]
    if command == "config check":
        assert positionals == ["file"] and "[FILE]" in line


def test_the_top_level_flag_is_documented() -> None:
    top = [a for a in build_parser()._actions if a.option_strings and "-h" not in a.option_strings]
    assert [a.option_strings for a in top] == [["-v", "--verbose"]]
    assert "hicache [-v]" in _synopsis()[0] and "`-v` turns on debug logging" in README


def test_every_flag_of_every_command_is_named_somewhere_in_the_readme() -> None:
    missing = {
        command: [a.option_strings[-1] for a in parser._actions
                  if a.option_strings and "-h" not in a.option_strings
                  and not _named(a.option_strings, README_TEXT)]
        for command, parser in _commands()
    }
    assert not {c: m for c, m in missing.items() if m}


# --------------------------------------------------------------------------- configuration


def _leaves(tp: Any = HicacheConfig, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, type hint) of every setting of the schema."""
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        key = f"{path}.{f.name}" if path else f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            yield from _leaves(hint, key)
        else:
            yield key, hint


def _rows() -> dict[str, str]:
    """README configuration rows: key -> the whole row."""
    return {m.group(1): m.group(0)
            for m in re.finditer(r"^\| `([a-z0-9_.<>]+)` \|.*$", README_TEXT, re.MULTILINE)}


def test_every_enum_key_row_names_every_allowed_value() -> None:
    rows = _rows()
    checked = 0
    previous = ""
    for key, hint in _leaves():
        if not (isinstance(hint, type) and issubclass(hint, enum.Enum)):
            continue
        row = rows[key]
        meaning = row.split(" | ", 2)[2]
        if meaning.startswith("the same choice"):  # (write.l2_to_l3: as the row above)
            meaning = rows[previous].split(" | ", 2)[2]
        previous = key
        named = set(re.findall(r"`([a-z_]+)`", meaning))
        values = {m.value for m in hint}
        assert values <= named, (key, values - named, row)
        checked += 1
    assert checked == 7  # backend, policies (eviction, prefetch, 2 x write), layout, l1.device


def test_storage_mooncake_protocol_row_names_the_allowed_protocols() -> None:
    assert "| `storage.mooncake.protocol` | `tcp` | `tcp` / `rdma`" in README_TEXT
    build_config({"storage": {"mooncake": {"protocol": "rdma"}}})
    with pytest.raises(ConfigError, match="protocol"):
        build_config({"storage": {"mooncake": {"protocol": "udp"}}})


def _refused(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_config(raw)
    assert key in str(e.value), str(e.value)


def _at(key: str, value: Any, **more: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for k, v in {key: value, **more}.items():
        node = raw
        *parents, last = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return raw


def test_number_ranges_the_readme_states_are_the_loaders() -> None:
    """"integers within 64 bits, durations (`*_s`) at most 86,400 s (`storage.redis.ttl_s`,
    whole seconds, at most 2^31-1), `*_gb` sizes at most 1,048,576 GiB (1 PiB), any other
    number at most 10^12"."""
    assert "integers within 64 bits, durations (`*_s`) at most 86,400 s" in README
    assert "`*_gb` sizes at most 1,048,576 GiB (1 PiB), any other number at most 10^12" in README
    build_config(_at("prefetch.timeout_max_s", 86400))
    _refused(_at("prefetch.timeout_max_s", 86400.5), "prefetch.timeout_max_s")
    build_config(_at("storage.redis.ttl_s", 2**31 - 1))
    _refused(_at("storage.redis.ttl_s", 2**31), "storage.redis.ttl_s")
    build_config(_at("storage.file.capacity_gb", 1 << 20))
    _refused(_at("storage.file.capacity_gb", (1 << 20) + 1), "storage.file.capacity_gb")
    build_config(_at("tiers.l2.ratio", 1e12))
    _refused(_at("tiers.l2.ratio", 1.5e12), "tiers.l2.ratio")
    build_config(_at("storage.redis.batch", 2**63 - 1))
    _refused(_at("storage.redis.batch", 2**63), "storage.redis.batch")
    _refused(_at("tiers.l2.ratio", float("nan")), "tiers.l2.ratio")


def test_limits_quoted_in_configuration_rows_are_the_codes() -> None:
    rows = {k: " ".join(v.split()) for k, v in _rows().items()}
    c = config_mod
    assert "at most 2^31 - 1: page ids travel as int32" in rows["tiers.l1.tokens"]
    assert c.MAX_L1_PAGES == 2**31 - 1
    assert "at least 2 with a `mamba` component" in rows["tiers.l1.mamba_slots"]
    mamba = {"model": {"components": {"full": {"layers": 1, "bytes_per_token_per_layer": 8},
                                      "mamba": {"layers": 1, "state_bytes_per_layer": 8}}}}
    build_config({**mamba, "tiers": {"l1": {"mamba_slots": 2}}})
    _refused({**mamba, "tiers": {"l1": {"mamba_slots": 1}}}, "tiers.l1.mamba_slots")
    assert "its 64-byte header and padding to 64 bytes" in rows["tiers.l2.size_gb"]
    assert c.L2_PAGE_HEADER_BYTES == 64 and c.L2_SLOT_ALIGN == 64
    assert "in (0, 1]" in rows["tiers.l2.prefetch_fraction"]
    build_config(_at("tiers.l2.prefetch_fraction", 1.0))
    _refused(_at("tiers.l2.prefetch_fraction", 0), "tiers.l2.prefetch_fraction")
    assert "in [0, 1000]" in rows["write.l1_to_l2_batch_ms"] and c.MAX_BATCH_MS == 1000
    build_config(_at("write.l1_to_l2_batch_ms", 0))
    _refused(_at("write.l1_to_l2_batch_ms", 1000.5), "write.l1_to_l2_batch_ms")
    assert "threads per call, 1-64" in rows["storage.file.threads"] and c.MAX_FILE_THREADS == 64
    assert "at most 107 bytes" in rows["server.listen"]
    from hicache.endpoint import MAX_SOCKET_PATH_BYTES

    assert MAX_SOCKET_PATH_BYTES == 107
    assert "a token is 16 to 4,096 characters" in rows["server.tokens"]
    assert c.MAX_TOKEN_CHARS == 4096
    for n, ok in ((15, False), (16, True), (4096, True), (4097, False)):
        raw = _at("server.tokens", [{"token": "t" * n, "namespaces": ["*"]}])
        if ok:
            build_config(raw)
        else:
            _refused(raw, "server.tokens[0].token")
    assert "at most 4294967295 (a uint32 on the wire)" in rows["server.lease_ms"]
    build_config(_at("server.lease_ms", 4294967295))
    _refused(_at("server.lease_ms", 4294967296), "server.lease_ms")
    assert "at most 268435456" in rows["server.max_tokens_per_request"]
    assert c.MAX_TOKENS_PER_REQUEST == 268435456
    for positive in ("eviction.max_open_sessions", "eviction.closed_session_tombstones",
                     "write.selective_threshold", "write.l1_to_l2_batch_pages"):
        _refused(_at(positive, 0), positive)


def test_max_tokens_per_request_message_limits_are_the_readme_formula() -> None:
    """"a request 4 bytes x this + 1 MiB, a reply up to 8 bytes per page for every member
    (a match's matched and allocated page ids; at most an L1 pool's pages) + 1 MiB"."""
    row = " ".join(_rows()["server.max_tokens_per_request"].split())
    assert "a request 4 bytes x this + 1 MiB, a reply up to 8 bytes per page for every member" in row
    cfg = build_config(_at("server.max_tokens_per_request", 4096, **{"model.page_size": 16}))
    assert cfg.max_request_bytes == 4 * 4096 + (1 << 20)
    pages = min(4096 // 16, cfg.l1_pages)
    assert cfg.max_reply_bytes == 8 * pages * len(cfg.model.members) + (1 << 20)


def test_cross_key_rules_the_readme_lists_are_enforced() -> None:
    assert ("Cross-key rules: `model.page_size <= prefetch.threshold_tokens <= "
            "server.max_tokens_per_request`") in README
    _refused(_at("prefetch.threshold_tokens", 32), "prefetch.threshold_tokens")
    _refused(_at("server.max_tokens_per_request", 32), "server.max_tokens_per_request")
    _refused(_at("server.max_tokens_per_request", 128, **{"prefetch.threshold_tokens": 256}),
             "prefetch.threshold_tokens")
    _refused(_at("storage.backend", "mooncake"), "storage.mooncake.master")
    _refused(_at("tiers.l2.layout", "layer_first", **{"storage.backend": "file"}), "tiers.l2.layout")
    _refused(_at("tiers.l1.size_gb", 1e-9), "tiers.l1.size_gb")
    _refused(_at("server.listen", "127.0.0.1:9400"), "metrics.port")
    _refused(_at("server.listen", "127.0.0.1:5000", **{"server.probe_listen": "0.0.0.0:5000"}),
             "server.probe_listen")


def test_tiers_l1_device_cuda_refuses_to_start_without_cuda(tmp_path: Path) -> None:
    """README `tiers.l1.device`: `cuda` refuses to start without CUDA (`serve` exit 1: it
    cannot start), `shm` is shared memory."""
    import torch

    from hicache.errors import FailedPrecondition, HicacheError
    from hicache.tiers.device import build_device_pools

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    cfg = build_config(_at("tiers.l1.device", "cuda", **{"tiers.l1.tokens": 256}))
    with pytest.raises(FailedPrecondition, match=r"tiers\.l1\.device=cuda"):
        build_device_pools(cfg, f"rt{int(time.time() * 1000) % 100000}", shm_dir=tmp_path)
    assert issubclass(FailedPrecondition, HicacheError)  # `hicache serve`: exit 1


# --------------------------------------------------------------------------- metrics

_instances = itertools.count()


def _fresh_metrics(tmp_path: Path, backend: str) -> tuple[set[str], dict[str, int]]:
    """The `hicache_*` family names and the raw counters of a fresh controller."""
    from hicache.controller.controller import build_controller
    from hicache.metrics import Metrics

    raw = {
        "model": {"page_size": 4, "components": {"full": {"layers": 1, "bytes_per_token_per_layer": 8}}},
        "tiers": {"l1": {"tokens": 64}, "l2": {"ratio": 2, "reserve_gb": 0}},
        "prefetch": {"threshold_tokens": 4},
        "storage": {"backend": backend, "file": {"path": str(tmp_path / "l3")}, "timeout_s": 2},
        "metrics": {"port": 0},
    }
    instance = f"rtr{next(_instances)}x{int(time.time() * 1000) % 100000}"
    ctl = build_controller(build_config(raw), instance)
    try:
        families = {f.name for f in Metrics(ctl).registry.collect()}
        counters = dict(ctl.stats().counters)
    finally:
        ctl.close()
    return families, counters


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], dict[str, int]]:
    tmp = tmp_path_factory.mktemp("metrics")
    fams_none, counters_none = _fresh_metrics(tmp, "none")
    fams_file, counters_file = _fresh_metrics(tmp, "file")
    return fams_none | fams_file, {**counters_none, **counters_file}


def _readme_metric_names() -> set[str]:
    """Every `hicache_*` name the README gives, brace groups expanded, sample suffixes off."""
    names: set[str] = set()
    # (a brace group inside a name is alternatives; one after it, its labels)
    for m in re.finditer(r"\bhicache_(?:[a-z0-9_]|\{[a-z0-9_,]+\}(?=[a-z0-9_]))+", README_TEXT):
        text = m.group(0).rstrip("_")
        parts = re.split(r"\{([a-z0-9_,]+)\}", text)
        for combo in itertools.product(*[p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]):
            name = "".join(combo)
            name = re.sub(r"_(total|bucket|sum|count)$", "", name)
            if name.startswith("hicache_") and not name.endswith("_"):
                names.add(name)
    return names


def test_every_metric_the_readme_names_is_exported_by_a_fresh_daemon(
    exported: tuple[set[str], dict[str, int]],
) -> None:
    families, _ = exported
    named = _readme_metric_names()
    assert {"hicache_pool_locked_pages", "hicache_l3_op_seconds", "hicache_rpc_seconds"} <= named
    assert len(named) >= 15, named
    assert named <= families, named - families


# Counters the README names by their core key ("counted `X`"), and the phrase naming them.
README_COUNTERS = {
    "sessions_closed_for_room": "(counted `sessions_closed_for_room`)",
    "l1_evictions_deferred": "(counted `l1_evictions_deferred`)",
    "backups_dropped": "counted in `backups_dropped` (FULL pages)",
    "prefetch_refused_budget": "no prefetch (`prefetch_refused_budget`)",
    "prefetch_deferred_room": "counted `prefetch_deferred_room`",
    "prefetch_refused_room": "and `prefetch_refused_room` when none came",
    "expired_leases": "counts `expired_leases`",
    "engine_restarts": "(counted as `engine_restarts`)",
    "l2_flushes": "`l2_flushes` counts a flush when it lands",
}


def test_every_counter_the_readme_names_is_exported_from_the_start(
    exported: tuple[set[str], dict[str, int]],
) -> None:
    """The added counters are exported at 0 on a fresh daemon (an alert reads 0, not "no
    data"), under `hicache_<key>` (`expired_leases` is the canonical name of the core's
    `leases_expired`)."""
    families, counters = exported
    for key, phrase in README_COUNTERS.items():
        assert phrase in README, (key, phrase)
        assert f"hicache_{key}" in families, key
        assert key in counters or key == "expired_leases", key


def test_every_metric_a_fresh_daemon_exports_is_documented(
    exported: tuple[set[str], dict[str, int]],
) -> None:
    families, _ = exported
    named = _readme_metric_names()
    undocumented = sorted(
        f for f in families
        if f not in named and f"`{f.removeprefix('hicache_')}`" not in README_TEXT
    )
    assert not undocumented, undocumented


# --------------------------------------------------------------------------- API overview


def _api_rows() -> dict[str, str]:
    table = section("## API overview")
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^\| `([A-Za-z0-9]+(?:\.[A-Za-z0-9]+)+)` \| (.*)$", table,
                                 re.MULTILINE)}


def test_the_api_table_lists_exactly_the_rpcs_each_service_serves() -> None:
    from hicache.pb.hicache.v1 import admin_pb2, hicache_pb2

    rows = _api_rows()
    assert set(rows) == {"hicache.v1.HiCache", "hicache.v1.Admin", "grpc.health.v1.Health",
                         "grpc.reflection"}
    for pb, name in ((hicache_pb2, "HiCache"), (admin_pb2, "Admin")):
        service = pb.DESCRIPTOR.services_by_name[name]
        rpcs = rows[service.full_name].split(" | ")[0]
        listed = re.findall(r"`([A-Z][A-Za-z]+)`", rpcs)
        served = [m.name for m in service.methods]
        assert sorted(listed) == sorted(served), (service.full_name, listed, served)
        for m in service.methods:
            streams = f"`{m.name}` (server stream)" in rpcs
            assert streams == m.server_streaming, m.name
    assert "`Check`, `Watch`" in rows["grpc.health.v1.Health"]


def test_the_daemon_serves_the_four_services_of_the_table() -> None:
    """"A daemon serves four gRPC services on `server.listen`": those reflection lists."""
    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection

    from hicache import server

    assert "A daemon serves four gRPC services on `server.listen`" in README
    served = {server.HICACHE_SERVICE, server.ADMIN_SERVICE, health.SERVICE_NAME,
              reflection.SERVICE_NAME}
    assert len(served) == 4
    names = set(_api_rows())
    for s in served:
        assert s in names or s.startswith("grpc.reflection"), s


def test_stream_caps_and_worker_count_are_the_servers() -> None:
    from hicache import server

    rows = _api_rows()
    watch = re.search(r"At most (\d+) `Watch` streams at once, `RESOURCE_EXHAUSTED` past that",
                      rows["grpc.health.v1.Health"])
    assert watch is not None and int(watch.group(1)) == server.MAX_HEALTH_WATCHES
    refl = re.search(r"At most (\d+) streams at once, `RESOURCE_EXHAUSTED` past that",
                     rows["grpc.reflection"])
    assert refl is not None and int(refl.group(1)) == server.MAX_REFLECTION_STREAMS
    assert (f"(`hicache.server.WORKERS` = {server.WORKERS} started, growing to `MAX_WORKERS` = "
            f"{server.MAX_WORKERS})") in README
    # the caps are what the servicers are built with by default
    assert server.HealthServicer()._max_watches == server.MAX_HEALTH_WATCHES
    assert server.ReflectionServicer(())._max_streams == server.MAX_REFLECTION_STREAMS


def test_unauthenticated_services_are_health_alone() -> None:
    """"only `grpc.health.v1` needs none" (a token)."""
    from hicache.interceptor import UNAUTHENTICATED_SERVICES

    assert "only `grpc.health.v1` needs none" in README
    assert frozenset({"grpc.health.v1.Health"}) == UNAUTHENTICATED_SERVICES


def test_numbers_quoted_from_the_controller_are_its_constants() -> None:
    from hicache.controller import controller, prefetch, storage_io, transfers
    from hicache.tiers.storage import file as file_backend

    assert "connects it in the background (every 5 s)" in README
    assert controller.L3_CONNECT_RETRY_S == 5.0
    assert "waits at most 0.1 s for that room" in README and transfers.L1_VICTIM_WAIT_S == 0.1
    assert "(at most `2 x l1_to_l2_batch_ms`)" in README and transfers.IDLE_FLUSH_FACTOR == 2
    assert "waits for the write (at most 5 s" in README and prefetch.WRITES_WAIT_S == 5.0
    assert "counts as absent in L3 for 60 s" in README and storage_io.CORRUPT_ABSENT_S == 60.0
    assert "anyone's older than 10 minutes" in README and file_backend.STALE_TEMP_S == 600.0


# --------------------------------------------------------------------------- Quick start


def _bootstrap() -> str:
    return (ROOT / "scripts" / "bootstrap.sh").read_text()


def test_quick_start_test_command_runs_what_the_readme_says() -> None:
    """"pytest on three workers, a test file each ...; `HICACHE_TEST_WORKERS=N` sets the
    workers, 0 none; `.ci/run` calls exactly this"; ruff and mypy via scripts/typecheck.py."""
    qs = " ".join(section("## Quick start").split())
    script = _bootstrap()
    assert "pytest on three workers, a test file each" in qs
    assert re.search(r"workers=\$\{HICACHE_TEST_WORKERS:-3\}", script)
    assert re.search(r'pytest -n "\$workers" --dist loadfile', script)
    assert "`HICACHE_TEST_WORKERS=N` sets the workers, 0 none" in qs
    zero = re.search(r'if \[ "\$workers" = 0 \]; then\s*\n\s*"\$VENV/bin/python" -m pytest "\$@"',
                     script)
    assert zero is not None
    assert "ruff" in qs and "`scripts/typecheck.py`" in qs
    assert '"$VENV/bin/ruff" check .' in script and "scripts/typecheck.py" in script
    assert (ROOT / "scripts" / "typecheck.py").exists()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert ci[-1].strip() == "./scripts/bootstrap.sh test"
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pytest-xdist") for d in project["optional-dependencies"]["dev"])
    assert project["requires-python"] == ">=3.11" and "Python 3.11" in qs


def test_quick_start_serve_runs_the_embedded_defaults() -> None:
    """`./scripts/bootstrap.sh serve` runs `hicache serve` with no config: the embedded file."""
    script = _bootstrap()
    assert re.search(r'serve\) exec "\$VENV/bin/hicache" serve "\$@";;', script)
    assert "The first runs the daemon on the embedded defaults of `hicache.yaml`" in README
    assert "virtual environment in `.venv/`" in README and "VENV=$ROOT/.venv" in script


def _script_debs() -> set[str]:
    script = _bootstrap()
    debs = set(re.findall(r"need_debs\+=\(([a-z0-9.+-]+)\)", script))
    assert {"libcurl4", "libcurl4t64"} <= debs  # (libcurl4t64: its name on Debian 13)
    return debs - {"libcurl4t64"}


def test_quick_start_names_every_debian_package_the_script_installs() -> None:
    listed = re.search(r"Debian packages `([^`]+)` when missing", README)
    assert listed is not None
    names = set(listed.group(1).split())
    assert names >= {"redis-server", "libibverbs1", "librdmacm1", "libnuma1", "libcurl4"}
    assert _script_debs() <= names, _script_debs() - names
