"""Review, round two: README.md's concrete claims against the real code.

tests/test_readme.py, tests/test_readme_truth_review.py and tests/test_operator_docs_review.py
check that the README's rows, flags, metric names and quoted constants are the code's.
Here: behaviours the README describes that no test checks yet, through the real loader,
controller, metrics exporter and daemon: how numbers are read ("as YAML 1.2 reads
them"), which counters are "exported from the start at 0", what `eviction.max_open_sessions`
closes first, `server.socket_mode`, the metrics address, the file backend's defaults,
and the `l3_key_seed` line of `config check`.

Tests marked xfail(strict=True) are places where the code breaks what the README says:
each fails now and passes once fixed (then the mark goes). The others pin the claim.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon.daemonkit import Daemon, free_port

from hicache.cli import describe
from hicache.config import build_config, load_config
from hicache.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent / "controller"))

ROOT = Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "README.md").read_text().split())  # (prose wraps lines anywhere)

_instances = itertools.count()


def _instance() -> str:
    return f"rcr{next(_instances)}x{os.getpid() % 10000}{int(time.time() * 1000) % 10000}"


def _tiny(tmp_path: Path, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"page_size": 4, "components": {"full": {"layers": 1, "bytes_per_token_per_layer": 8}}},
        "tiers": {"l1": {"tokens": 64}, "l2": {"ratio": 2, "reserve_gb": 0}},
        "prefetch": {"threshold_tokens": 4},
        "storage": {"backend": "none", "file": {"path": str(tmp_path / "l3")}, "timeout_s": 2},
        "metrics": {"port": 0},
    }
    for key, value in over.items():
        node = raw
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return raw


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("item", "yaml12"),
    [
        # YAML 1.2 (core schema): a leading zero is a decimal; PyYAML's 1.1 rules read octal.
        pytest.param("tiers.l1.tokens=0100", 100, id="leading-zero-is-decimal"),
        # YAML 1.2: `0o100` is octal 64; PyYAML 1.1 reads it as a string (refused).
        pytest.param("tiers.l1.tokens=0o100", 64, id="0o-octal"),
        # YAML 1.2: `1:30` is a string (refused for a number key); YAML 1.1 reads
        # base 60: 90, a timeout of a minute and a half from what looks like a typo.
        pytest.param("storage.timeout_s=1:30", None, id="sexagesimal-is-no-number"),
    ],
)
def test_numbers_are_read_as_yaml_1_2_reads_them(item: str, yaml12: int | None) -> None:
    """README Configuration: "Numbers are read as YAML 1.2 reads them"."""
    assert "Numbers are read as YAML 1.2 reads them: `1e3` is 1000.0, `0100` is 100" in README
    key = item.split("=", 1)[0]
    if yaml12 is None:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [item], env={})
        return
    cfg: Any = load_config(None, [item], env={})
    for part in key.split("."):
        cfg = getattr(cfg, part)
    assert cfg == yaml12


def test_the_yaml_1_2_forms_both_versions_agree_on_are_read_alike() -> None:
    """What does hold: `1e3` (the README's example), hex, and plain decimals."""
    assert load_config(None, ["storage.timeout_s=1e3"], env={}).storage.timeout_s == 1000.0
    assert load_config(None, ["tiers.l1.tokens=0x100"], env={}).tiers.l1.tokens == 256
    assert load_config(None, ["tiers.l1.tokens=100"], env={}).tiers.l1.tokens == 100


# --------------------------------------------------------------------------- metrics from the start


def _families(ctl: Any) -> set[str]:
    from hicache.metrics import Metrics

    return {f.name for f in Metrics(ctl).registry.collect()}


def test_l3_breaker_trips_is_exported_at_0_while_an_optional_backend_is_down_at_start(
    tmp_path: Path,
) -> None:
    from hicache.controller.controller import build_controller

    assert "all exported from the start at 0" in README and "`l3_breaker_trips`" in README
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the store's directory cannot be made under a file: ENOTDIR
    raw = _tiny(tmp_path, storage__backend="file", storage__file__path=str(blocker / "l3"))
    ctl = build_controller(build_config(raw), _instance())
    try:
        assert ctl.l3 is None, "the backend was expected to be down at start"
        families = _families(ctl)
        assert "hicache_l3_errors" in families  # (a canonical counter: there from the start)
        assert "hicache_l3_breaker_trips" in families
    finally:
        ctl.close()


def test_l3_breaker_trips_is_exported_at_0_with_a_healthy_backend(tmp_path: Path) -> None:
    from hicache.controller.controller import build_controller

    ctl = build_controller(build_config(_tiny(tmp_path, storage__backend="file")), _instance())
    try:
        assert "hicache_l3_breaker_trips" in _families(ctl)
        assert ctl.stats().counters["l3_breaker_trips"] == 0
    finally:
        ctl.close()


def test_the_metrics_server_binds_every_address() -> None:
    """`metrics.port`: "Prometheus HTTP port on 0.0.0.0; `0` disables"."""
    from hicache.metrics import Metrics

    assert "Prometheus HTTP port on 0.0.0.0; `0` disables" in README
    m = Metrics()
    try:
        assert m.serve(0) == 0 and m._server is None
        port = free_port()
        assert m.serve(port) == port
        assert m._server.server_address[0] == "0.0.0.0"
    finally:
        m.close()


# --------------------------------------------------------------------------- sessions


def test_max_open_sessions_closes_the_least_recently_used_one_and_a_request_renews_it(
    tmp_path: Path,
) -> None:
    """`eviction.max_open_sessions`: "past it the least recently used one (opened, or named
    by a request) is closed, as `CloseSession` would (counted `sessions_closed_for_room`)".
    s1 and s2 open, a request names s1 again, s3 opens: s2 goes, not s1; closing s2 again
    answers what its close did (a tombstone), and s1 is still open."""
    from engine_sim import built_controllers, seq

    from hicache.controller.base import MatchRequest

    assert "the least recently used one (opened, or named by a request) is closed" in README
    with built_controllers(tmp_path, "rcs") as make:
        ctl = make(backend="none", eviction__max_open_sessions=2)
        ctl.attach("e1", 0, 1)

        def request(sid: str, base: int) -> None:
            m = ctl.match("e1", MatchRequest("", seq(2, base), lock=True, session_id=sid))
            ctl.release("e1", m.lock_id, None)

        request("s1", 100)
        request("s2", 200)
        request("s1", 300)  # s1 named again: now the most recent
        request("s3", 400)
        counters = ctl.stats().counters
        assert counters["sessions_closed_for_room"] == 1
        with ctl._mu:
            open_ids = {sid for table in ctl.tree._sessions._open.values() for sid in table}
        assert open_ids == {"s1", "s3"}, open_ids
        assert ctl.close_session("s2") == 0  # closed for room: its close's answer again
        assert ctl.stats().counters["sessions_closed_for_room"] == 1


# --------------------------------------------------------------------------- file backend


def test_file_backend_defaults_on_a_local_filesystem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`storage.file.path` "(created)"; `storage.file.threads: null`: "on a local
    filesystem existence checks and reads in 1, writes in 2"; Deployment: "The daemon logs
    a warning at start when the directory is **not** on a shared filesystem"."""
    from hicache.controller.controller import build_controller
    from hicache.tiers.storage.mounts import fs_type_of, is_shared_fs

    path = tmp_path / "deep" / "er" / "l3"
    if is_shared_fs(fs_type_of(str(tmp_path))):
        pytest.skip("the test directory is on a shared filesystem")
    caplog.set_level(logging.WARNING)
    raw = _tiny(tmp_path, storage__backend="file", storage__file__path=str(path))
    ctl = build_controller(build_config(raw), _instance())
    try:
        assert path.is_dir()
        threads = ctl.l3.backend.threads
        assert (threads.exists, threads.read, threads.write) == (1, 1, 2)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "NOT shared" in r.getMessage()]
        assert warned and str(path) in warned[0].getMessage()
    finally:
        ctl.close()


# --------------------------------------------------------------------------- config check


def _seed_line(raw: dict[str, Any]) -> str:
    lines = [ln for ln in describe(build_config(raw)).splitlines() if ln.startswith("l3_key_seed:")]
    assert len(lines) == 1
    return lines[0]


def test_l3_key_seed_line_differs_exactly_where_the_l3_keys_do(tmp_path: Path) -> None:
    """`config check` prints "`l3_key_seed`, what seeds every L3 key (daemons sharing an L3
    share pages only where it is the same)": for each variation of the model, the printed
    line differs exactly when the page-hash chain's seed does."""
    assert "`l3_key_seed`, what seeds every L3 key" in README
    base = _tiny(tmp_path)
    variations: list[dict[str, Any]] = [
        {},
        {"model__id": "other"},
        {"model__kv_dtype": "float16"},
        {"model__tp_size": 2},
        {"model__page_size": 8, "prefetch__threshold_tokens": 8},
        {"model__components": {"full": {"layers": 2, "bytes_per_token_per_layer": 8}}},
        {"model__components": {"full": {"layers": 1, "bytes_per_token_per_layer": 8},
                               "swa": {"layers": 1, "bytes_per_token_per_layer": 8, "window_tokens": 8}}},
        {"model__sidecars": {"idx": {"layers": 1, "bytes_per_token_per_layer": 2}}},
        # not part of the seed: sizes and policies
        {"tiers__l1__tokens": 128},
        {"storage__backend": "file"},
    ]
    seen: dict[str, bytes] = {}
    for over in variations:
        raw = json.loads(json.dumps(base))
        for key, value in over.items():
            node = raw
            *parents, last = key.split("__")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        cfg = build_config(raw)
        line = _seed_line(raw)
        seed = bytes(cfg.model.chain_seed("ns"))
        for other_line, other_seed in seen.items():
            assert (line == other_line) == (seed == other_seed), (over, line, other_line)
        seen.setdefault(line, seed)
    assert len(seen) == 8


# --------------------------------------------------------------------------- the daemon


def test_socket_mode_is_the_unix_sockets_permissions(tmp_path: Path) -> None:
    """`server.socket_mode`: "octal permissions of the unix socket (created without
    group/other access, then chmod-ed)": a daemon with 0600 serves a socket of mode 0600,
    and one with the default 0660 a socket of 0660."""
    assert "octal permissions of the unix socket" in README
    for mode in ("0600", "0660"):
        work = tmp_path / mode
        work.mkdir()
        d = Daemon(work, f"server.socket_mode={json.dumps(mode)}").start()
        try:
            bits = stat.S_IMODE(os.stat(d.socket).st_mode)
            assert stat.S_ISSOCK(os.stat(d.socket).st_mode)
            assert bits == int(mode, 8), (mode, oct(bits))
            with d.client() as c:
                assert c.serving()
        finally:
            d.close()
        assert not d.socket.exists()  # "the socket removed" on SIGTERM
