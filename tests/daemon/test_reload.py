"""SIGHUP reloads the configuration of a running daemon: tokens and the TLS certificate
change live and the cache stays; a file that fails changes nothing; other keys wait for a
restart and are named. SIGUSR1 dumps every thread's stack. Real daemon processes, real
signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.client import Client
from hicache.errors import NotFound, Unauthenticated, Unavailable

from .daemonkit import PAGE, Daemon, eventually, free_port, run_cli, scrape, tokens

MakeDaemon = Callable[..., Daemon]

A = "token-of-tenant-a-0123456789"
B = "token-of-tenant-b-0123456789"
C = "token-of-tenant-c-0123456789"


def _config(path: Path, *entries: str, extra: str = "") -> Path:
    """A config file whose server.tokens are `entries` (YAML flow mappings)."""
    # (whole, under its name at once: a daemon starting or reloading may be reading it)
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(f"server:\n  tokens: [{', '.join(entries)}]\n{extra}")
    tmp.chmod(0o600)
    os.replace(tmp, path)
    return path


def _tokens_file_config(directory: Path, *entries: str) -> tuple[Path, Path]:
    """A config naming `server.tokens_file`, and that file listing `entries` (YAML flow
    mappings): (the config, the tokens file)."""
    tokens_file = directory / "tokens.yaml"
    tokens_file.write_text("".join(f"- {e}\n" for e in entries))
    tokens_file.chmod(0o600)
    cfg = directory / "h.yaml"
    cfg.write_text(f"server:\n  tokens_file: {tokens_file}\n")
    return cfg, tokens_file


def _token(value: str, namespaces: str = "[x]", name: str | None = None) -> str:
    return f"{{token: {value}, namespaces: {namespaces}" + (f", name: {name}}}" if name else "}")


def _reload(d: Daemon, times: int = 1) -> None:
    """SIGHUP, and wait until the daemon logged that many more reload outcomes."""
    assert d.proc is not None
    before = _outcomes(d)
    for _ in range(times):
        os.kill(d.proc.pid, signal.SIGHUP)
    assert eventually(lambda: _outcomes(d) > before, timeout_s=15), d.log()


def _outcomes(d: Daemon) -> int:
    log = d.log()
    return log.count("configuration reloaded:") + log.count("configuration reload failed")


def _serves(d: Daemon, token: str, **kwargs: object) -> bool:
    with d.client(token=token, retries=0, timeout_s=5.0, **kwargs) as c:
        try:
            c.attach(map_pools=False)
            return True
        except Unauthenticated:
            return False


def test_sighup_rotates_tokens_live_and_keeps_the_cache(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon(config=cfg)
    prompt = tokens(2 * PAGE, start=10_000)
    with d.client(token=A, engine_id="e") as a:
        a.attach(map_pools=False)
        m = a.match(prompt, "x", lock=True, allocate_tokens=2 * PAGE)
        a.insert(prompt, "x", lock_id=m.lock_id, allocation_id=m.allocation_id)
    _config(cfg, _token(B))  # A revoked, B added
    _reload(d)
    assert "configuration reloaded: applied server.tokens (1 token)" in d.log()
    assert not _serves(d, A)
    with d.client(token=B, engine_id="e2") as b:
        b.attach(map_pools=False)
        assert b.match(prompt, "x").device_tokens == 2 * PAGE  # nothing was lost
    assert A not in d.log() and B not in d.log()
    assert d.stop() == 0


def test_a_new_token_never_gets_a_revoked_tokens_engines(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """Labels are not list places: B revoked and C listed where B was, C naming B's engine
    id reaches none of B's handles (by place, C would have been B's tenant)."""
    cfg = _config(tmp_path / "h.yaml", _token(A), _token(B))
    d = make_daemon(config=cfg)
    with d.client(token=B, engine_id="shared") as b:
        b.attach(map_pools=False)
        m = b.match(tokens(PAGE, start=20_000), "x", lock=True, allocate_tokens=PAGE)
        _config(cfg, _token(A), _token(C))
        _reload(d)
        with d.client(token=C, engine_id="shared", retries=0) as c:
            with pytest.raises(NotFound):
                c.release(lock_id=m.lock_id)
            c.attach(map_pools=False)
            assert c.heartbeat().locks == 0
    with d.client(token=A, engine_id="a") as a:  # A kept (and kept its own label)
        assert a.attach(map_pools=False) is not None


def test_a_named_tenant_keeps_its_engine_across_a_token_rotation(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """With a `name`, the tenant is the name: an engine moved to the new token value
    releases what it took under the old one (the overlap of a rotation: both listed)."""
    cfg = _config(tmp_path / "h.yaml", _token(A, name="team-a"))
    d = make_daemon(config=cfg)
    prompt = tokens(PAGE, start=30_000)
    with d.client(token=A, engine_id="engine-1") as old:
        old.attach(map_pools=False)
        m = old.match(prompt, "x", lock=True, allocate_tokens=PAGE)
    _config(cfg, _token(A, name="team-a"), _token(B, name="team-a"))
    _reload(d)
    with d.client(token=B, engine_id="engine-1") as new:  # (the same process: a renewal)
        new.attach(map_pools=False)
        assert new.heartbeat().locks == 1  # the same engine, the same tenant
        new.insert(prompt, "x", lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert new.match(prompt, "x").device_tokens == PAGE
    _config(cfg, _token(B, name="team-a"))  # the old value retired
    _reload(d)
    assert not _serves(d, A) and _serves(d, B)


def test_an_engine_rotates_its_token_in_place(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """`Client.set_token`: the same client, connection and heartbeat, the new value from
    the next call; under one `name` the engine's lock survives the old value's removal."""
    from hicache.errors import InvalidArgument

    cfg = _config(tmp_path / "h.yaml", _token(A, name="team-a"))
    d = make_daemon(config=cfg)
    prompt = tokens(PAGE, start=40_000)
    with d.client(token=A, engine_id="engine-r") as c:
        c.attach(map_pools=False)
        m = c.match(prompt, "x", lock=True, allocate_tokens=PAGE)
        _config(cfg, _token(A, name="team-a"), _token(B, name="team-a"))
        _reload(d)
        c.set_token(B)
        _config(cfg, _token(B, name="team-a"))
        _reload(d)
        assert c.heartbeat().locks == 1
        c.insert(prompt, "x", lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert c.match(prompt, "x").device_tokens == PAGE
        with pytest.raises(InvalidArgument, match="value hidden"):
            c.set_token("two\nlines-of-token-value")
        c.set_token(A)  # (the old value, no longer listed)
        with pytest.raises(Unauthenticated):
            c.heartbeat()
    assert not _serves(d, A)


def test_a_namespace_list_narrowed_live_is_enforced(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    from hicache.errors import PermissionDenied

    cfg = _config(tmp_path / "h.yaml", _token(A, "[x, y]"))
    d = make_daemon(config=cfg)
    with d.client(token=A, engine_id="e", retries=0) as a:
        a.match(tokens(PAGE), "y")
        _config(cfg, _token(A, "[x]"))
        _reload(d)
        with pytest.raises(PermissionDenied, match="namespace 'y' is not allowed"):
            a.match(tokens(PAGE), "y")
        a.match(tokens(PAGE), "x")


def _kubelet_update(secret_dir: Path, files: dict[str, str], generation: int) -> None:
    """Write `files` as the kubelet updates a mounted Secret: a new timestamped folder,
    then the `..data` link renamed over the old one (each file a link through it)."""
    folder = secret_dir / f"..2026_12_03_{generation}"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
        if not (secret_dir / name).is_symlink():
            (secret_dir / name).symlink_to(f"..data/{name}")
    (secret_dir / "..data_tmp").symlink_to(folder.name)
    (secret_dir / "..data_tmp").rename(secret_dir / "..data")


def test_a_tokens_file_mounted_from_a_secret_is_read_again(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """`server.tokens_file` keeps the tokens out of the ConfigMap (and the process list);
    the kubelet's update of the Secret, then SIGHUP, rotates them."""
    secret = tmp_path / "secret"
    secret.mkdir()
    _kubelet_update(secret, {"tokens.yaml": f"- {_token(A)}\n"}, 1)
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server:\n  tokens_file: {secret / 'tokens.yaml'}\n")
    d = make_daemon(config=cfg)
    assert _serves(d, A) and not _serves(d, B)
    # (the kubelet makes the files 0644 unless told otherwise: said at the start)
    assert "tokens.yaml is server.tokens_file and is readable by every local user" in d.log()
    _kubelet_update(secret, {"tokens.yaml": f"- {_token(B)}\n"}, 2)
    _reload(d)
    assert "configuration reloaded: applied server.tokens (1 token)" in d.log()
    assert _serves(d, B) and not _serves(d, A)
    _kubelet_update(secret, {"tokens.yaml": "[]\n"}, 3)  # emptied: refused, B kept
    _reload(d)
    assert "lists no token" in d.log() and _serves(d, B)
    assert A not in d.log() and B not in d.log()


def test_a_bad_file_changes_nothing_and_is_counted(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cfg = _config(tmp_path / "h.yaml", _token(A))
    port = free_port()
    d = make_daemon(f"metrics.port={port}", config=cfg)
    for broken in ("server: {tokens: [\n",                                     # not YAML
                   "server:\n  tokens: [{token: short, namespaces: [x]}]\n",   # invalid value
                   "server:\n  tokens: [{token: " + B + ", namespaces: [x], name: 'a/b'}]\n"):
        cfg.write_text(broken)
        _reload(d)
        assert _serves(d, A) and not _serves(d, B)
    log = d.log()
    assert log.count("configuration reload failed, nothing changed") == 3
    assert "not valid YAML" in log and "must be at least 16 characters" in log
    assert "server.tokens[0].name" in log
    metrics = scrape(port)
    assert 'hicache_config_reloads_total{outcome="failed"} 3.0' in metrics
    assert "hicache_config_last_reload_successful 0.0" in metrics
    cfg.unlink()  # a file gone: the same
    _reload(d)
    assert "cannot read configuration file" in d.log() and _serves(d, A)
    _config(cfg, _token(B))
    _reload(d)
    assert _serves(d, B) and not _serves(d, A)
    metrics = scrape(port)
    assert 'hicache_config_reloads_total{outcome="applied"} 1.0' in metrics
    assert "hicache_config_last_reload_successful 1.0" in metrics


def test_keys_a_reload_cannot_apply_are_named_at_every_reload(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon(config=cfg)
    _config(cfg, _token(A), extra="  lease_ms: 45000\neviction:\n  policy: lfu\n")
    _reload(d)
    _reload(d)
    log = d.log()
    assert log.count("configuration reload: eviction.policy, server.lease_ms changed but take "
                     "effect only at a restart") == 2, log
    assert log.count("configuration reloaded: nothing to apply") == 2
    with d.client(token=A) as a:  # the lease in effect is still the one it started with
        assert a.attach(map_pools=False).info.lease_ms == 30000


def test_authentication_is_not_turned_on_by_a_reload(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """Engines' ids are scoped by token: turning tokens on or off live would give every
    engine another identity. It waits for a restart, and says so."""
    cfg = tmp_path / "h.yaml"
    cfg.write_text("server: {}\n")
    d = make_daemon(config=cfg)
    _config(cfg, _token(A))
    _reload(d)
    assert "server.tokens (authentication is turned on or off at a restart)" in d.log()
    with d.client(retries=0) as anyone:  # still no authentication
        anyone.attach(map_pools=False)


def test_sighups_never_stop_the_daemon(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """SIGHUP's default action ended the process at once (no flush, its socket and shared
    memory left behind). Several at once are one reload (or more), never a stop."""
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon(config=cfg)
    _reload(d, times=5)
    assert _serves(d, A)
    assert d.proc is not None and d.proc.poll() is None
    assert d.stop() == 0
    assert "hicache daemon stopped" in d.log()
    assert not list(Path("/dev/shm").glob(f"hicache-*-{d.proc.pid}-*"))


def _catches(pid: int, sig: int = signal.SIGHUP) -> bool:
    """Whether the process has a handler for `sig` (its caught-signals mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (sig - 1)))


def test_a_sighup_during_the_start_is_a_reload_once_ready(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`serve` catches SIGHUP before it reads the file: one that comes while the pools are
    being built (the file changed meanwhile) is a reload once the daemon is ready."""
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon("tiers.l1.tokens=262144", config=cfg, start=False)  # (a longer start)
    d.start(wait=False)
    assert d.proc is not None
    pid = d.proc.pid
    assert eventually(lambda: _catches(pid), timeout_s=30)
    _config(cfg, _token(B))
    os.kill(pid, signal.SIGHUP)
    d.wait_ready()
    assert eventually(lambda: _outcomes(d) == 1, timeout_s=10), d.log()
    assert _serves(d, B)


# ------------------------------------------------------------------ TLS


def _make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )
    return crt, key


def _reaches(target: str, ca: bytes) -> bool:
    with Client(target, root_certificates=ca, retries=0, timeout_s=3.0) as c:
        try:
            return c.serving()
        except Unavailable:
            return False


def test_sighup_rotates_the_tls_certificate_for_new_connections(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    old_crt, old_key = _make_cert(tmp_path, "old")
    new_crt, new_key = _make_cert(tmp_path, "new")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(old_crt.read_bytes())
    key.write_bytes(old_key.read_bytes())
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server:\n  tls_cert: {crt}\n  tls_key: {key}\n")
    target = f"127.0.0.1:{free_port()}"
    d = make_daemon(listen=target, config=cfg, ca=old_crt.read_bytes())
    with d.client(engine_id="held") as held:
        held.attach(map_pools=False)
        # A renewal in place (as cert-manager or certbot leaves it), then SIGHUP.
        crt.write_bytes(new_crt.read_bytes())
        key.write_bytes(new_key.read_bytes())
        _reload(d)
        assert "applied server.tls_cert/tls_key (to connections opened from now on)" in d.log()
        assert _reaches(target, new_crt.read_bytes())
        assert not _reaches(target, old_crt.read_bytes())
        assert held.heartbeat() is not None  # an open connection keeps its session
        # A half-done renewal (the new certificate with the old key) changes nothing.
        crt.write_bytes(old_crt.read_bytes())
        _reload(d)
        assert "are not a matching PEM certificate and private key" in d.log()
        assert _reaches(target, new_crt.read_bytes())
    # The CLI probe reaches it with the new certificate.
    out = run_cli("health", "--target", target, "--ca-file", str(new_crt), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["serving"] is True, out.stderr


# ------------------------------------------------------------------ other signals


def test_sigusr1_writes_every_threads_stack_and_the_daemon_serves_on(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGUSR1)
    # (read while being written: wait for the main thread's frames, waiting for signals)
    assert eventually(lambda: "Thread 0x" in d.log() and "in serve" in d.log()), d.log()
    assert "hicache/server.py" in d.log()
    with d.client(retries=0) as c:
        assert c.serving()
    assert d.stop() == 0


def test_a_native_crash_writes_every_threads_stack_before_the_process_dies(
    make_daemon: MakeDaemon,
) -> None:
    """`faulthandler.enable`: a fault in native code (here SIGSEGV sent, as a bad pointer
    in a CUDA or Mooncake library would raise it) leaves where each thread was."""
    d = make_daemon()
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSEGV)
    assert d.proc.wait(timeout=30) == -signal.SIGSEGV
    log = d.log()
    assert "Fatal Python error: Segmentation fault" in log, log
    assert "in serve" in log and "Thread 0x" in log
