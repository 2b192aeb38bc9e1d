"""Review of the SIGHUP reload / SIGUSR1 / server.tokens_file change: adversarial checks
of a running daemon (real processes, real signals)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.errors import NotFound

from .daemonkit import PAGE, Daemon, eventually, free_port, run_cli, scrape, tokens
from .test_reload import (
    A,
    B,
    C,
    _catches,
    _config,
    _reaches,
    _reload,
    _serves,
    _token,
    _tokens_file_config,
)

MakeDaemon = Callable[..., Daemon]








# ------------------------------------------------------------------ TLS


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _rsa_cert(directory: Path, name: str) -> tuple[Path, Path]:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt))
    return crt, key


def _k1_cert(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate on secp256k1: OpenSSL (Python's ssl) loads it, BoringSSL (gRPC) has
    no such curve."""
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl("ecparam", "-name", "secp256k1", "-genkey", "-noout", "-out", str(key))
    _openssl("req", "-x509", "-new", "-key", str(key), "-days", "1", "-subj", f"/CN={name}",
             "-addext", "subjectAltName=IP:127.0.0.1", "-out", str(crt))
    return crt, key



def _tls_daemon(make_daemon: MakeDaemon, tmp_path: Path, *sets: str) -> tuple[Daemon, str, Path, Path, Path]:
    old_crt, old_key = _rsa_cert(tmp_path, "old")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(old_crt.read_bytes())
    key.write_bytes(old_key.read_bytes())
    key.chmod(0o600)
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server:\n  tls_cert: {crt}\n  tls_key: {key}\n")
    target = f"127.0.0.1:{free_port()}"
    d = make_daemon(*sets, listen=target, config=cfg, ca=old_crt.read_bytes())
    return d, target, crt, key, old_crt


def test_a_certificate_grpc_cannot_use_is_not_reported_applied(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    port = free_port()
    d, target, crt, key, old_crt = _tls_daemon(make_daemon, tmp_path, f"metrics.port={port}")
    new_crt, new_key = _k1_cert(tmp_path, "k1")
    crt.write_bytes(new_crt.read_bytes())
    key.write_bytes(new_key.read_bytes())
    _reload(d)
    log = d.log()
    served_new = _reaches(target, new_crt.read_bytes())
    served_old = _reaches(target, old_crt.read_bytes())
    # (what happens: "applied", the metric 1, gRPC logs "Handshaker factory creation
    # failed" at the next handshake and serves the old certificate on)
    assert served_old or served_new
    assert served_new or ("configuration reload failed" in log
                          and "hicache_config_last_reload_successful 0.0" in scrape(port))


def test_an_encrypted_key_fails_the_reload_without_prompting(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    d, target, crt, key, old_crt = _tls_daemon(make_daemon, tmp_path)
    new_crt, new_key = _rsa_cert(tmp_path, "new")
    _openssl("pkey", "-in", str(new_key), "-aes256", "-passout", "pass:secret", "-out", str(key))
    crt.write_bytes(new_crt.read_bytes())
    start = time.monotonic()
    _reload(d)
    assert time.monotonic() - start < 10
    assert "an encrypted private key (gRPC cannot use one)" in d.log()
    assert "configuration reload failed, nothing changed" in d.log()
    assert _reaches(target, old_crt.read_bytes())


def test_a_chain_file_is_rotated_whole(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """A renewal that serves leaf + intermediate: the client trusting only the root
    reaches it after the reload."""
    d, target, crt, key, old_crt = _tls_daemon(make_daemon, tmp_path)
    root_key, root_crt = tmp_path / "root.key", tmp_path / "root.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=root",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign",
             "-keyout", str(root_key), "-out", str(root_crt))
    mid_key, mid_csr, mid_crt = tmp_path / "mid.key", tmp_path / "mid.csr", tmp_path / "mid.crt"
    ext = tmp_path / "ext.cnf"
    ext.write_text("[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=keyCertSign\n"
                   "[leaf]\nsubjectAltName=IP:127.0.0.1\n")
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=mid",
             "-keyout", str(mid_key), "-out", str(mid_csr))
    _openssl("x509", "-req", "-in", str(mid_csr), "-CA", str(root_crt), "-CAkey", str(root_key),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-extensions", "ca",
             "-out", str(mid_crt))
    leaf_key, leaf_csr, leaf_crt = tmp_path / "leaf.key", tmp_path / "leaf.csr", tmp_path / "leaf.crt"
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=leaf",
             "-keyout", str(leaf_key), "-out", str(leaf_csr))
    _openssl("x509", "-req", "-in", str(leaf_csr), "-CA", str(mid_crt), "-CAkey", str(mid_key),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-extensions", "leaf",
             "-out", str(leaf_crt))
    crt.write_bytes(leaf_crt.read_bytes() + mid_crt.read_bytes())
    key.write_bytes(leaf_key.read_bytes())
    _reload(d)
    assert "applied server.tls_cert/tls_key" in d.log(), d.log()
    assert _reaches(target, root_crt.read_bytes())
    assert not _reaches(target, old_crt.read_bytes())


# ------------------------------------------------------------------ tokens


def test_a_token_in_the_name_field_is_never_logged(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cfg, tokens_file = _tokens_file_config(tmp_path, _token(A))
    d = make_daemon(config=cfg)
    # base64 tokens (openssl rand -base64) hold '/', '+', '=': the name check refuses them.
    swapped = "q3Zx/9Kd+Lm2Pw8Rt1Vb4Nc6=="
    tokens_file.write_text(f"- {{name: '{swapped}', token: team-a, namespaces: [x]}}\n")
    _reload(d)
    assert "configuration reload failed" in d.log()
    assert swapped not in d.log()


def test_labels_never_move_between_tokens_over_named_unnamed_reloads(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """A token's handles are reachable by that token (or its name) only, after a sequence
    of reloads that names, unnames and renames tokens and reuses list places."""
    cfg = _config(tmp_path / "h.yaml", _token(A), _token(B, name="bee"))
    d = make_daemon(config=cfg)
    with d.client(token=A, engine_id="e") as a:
        a.attach(map_pools=False)
        ma = a.match(tokens(PAGE, start=40_000), "x", lock=True, allocate_tokens=PAGE)
    with d.client(token=B, engine_id="e") as b:
        b.attach(map_pools=False)
        mb = b.match(tokens(PAGE, start=41_000), "x", lock=True, allocate_tokens=PAGE)
    steps = [
        (_token(A, name="bee2"), _token(C)),      # A named, C where B was
        (_token(C, name="aa"), _token(B)),        # B unnamed, C named
        (_token(B, name="x1"), _token(C)),        # C unnamed again, B renamed
        (_token(C), _token(B)),                   # both unnamed, places swapped
    ]
    for entries in steps:
        _config(cfg, *entries)
        _reload(d)
        assert "configuration reload failed" not in d.log()
        with d.client(token=C, engine_id="e", retries=0) as c:
            c.attach(map_pools=False)  # (attached: a release is judged by owner, not run)
            assert c.heartbeat().locks == 0
            for m in (ma, mb):
                with pytest.raises(NotFound):
                    c.release(lock_id=m.lock_id)
    # B unnamed now: its first label (a name) is gone, it owns nothing; A comes back
    # unnamed and gets its own label (token#0) back.
    _config(cfg, _token(A), _token(B, name="bee"))
    _reload(d)
    with d.client(token=A, engine_id="e", retries=0) as a:
        a.attach(map_pools=False)
        assert a.heartbeat().locks == 1
        a.release(lock_id=ma.lock_id)
    with d.client(token=B, engine_id="e", retries=0) as b:
        b.attach(map_pools=False)
        assert b.heartbeat().locks == 1
        b.release(lock_id=mb.lock_id)


# ------------------------------------------------------------------ signals


def test_a_sighup_after_sigterm_is_no_reload_and_the_stop_is_clean(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon(config=cfg)
    assert d.proc is not None
    _config(cfg, _token(B))
    os.kill(d.proc.pid, signal.SIGTERM)
    for _ in range(3):
        os.kill(d.proc.pid, signal.SIGHUP)
    assert d.proc.wait(timeout=30) == 0
    assert "hicache daemon stopped" in d.log()
    assert "configuration reload" not in d.log()


def test_config_check_with_a_tokens_file_hides_the_tokens(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(f"- {_token(A, name='team-a')}\n")
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server:\n  tokens_file: {tokens_file}\n")
    out = run_cli("config", "check", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "team-a" in out.stdout and A not in out.stdout + out.stderr


def _unblock(fifo: Path) -> None:
    """Let a reader blocked opening `fifo` go on (it then reads an empty file)."""
    with contextlib.suppress(OSError):  # (no reader)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))



def test_a_reload_stuck_on_a_file_does_not_block_the_stop(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cfg, tokens_file = _tokens_file_config(tmp_path, _token(A))
    d = make_daemon(config=cfg)
    assert d.proc is not None
    tokens_file.unlink()
    os.mkfifo(tokens_file)
    os.kill(d.proc.pid, signal.SIGHUP)
    time.sleep(1.0)
    os.kill(d.proc.pid, signal.SIGTERM)
    try:
        stopped = eventually(lambda: d.proc is not None and d.proc.poll() is not None, timeout_s=6)
    finally:
        _unblock(tokens_file)
    assert stopped, d.log()


def test_sigusr1_dumps_the_stacks_of_a_daemon_stuck_in_its_start(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    cfg = tmp_path / "h.yaml"
    os.mkfifo(cfg)  # (a `--config <(...)` whose writer never comes: the start blocks reading it)
    d = make_daemon(config=cfg, start=False)
    d.start(wait=False)
    assert d.proc is not None
    pid = d.proc.pid
    # (SIGUSR1 is caught from before the server's imports; the start then imports them and
    # blocks reading the file: a loaded machine may take seconds to get there, so the dump
    # is asked for again until one shows it stuck there)
    assert eventually(lambda: _catches(pid, signal.SIGUSR1), timeout_s=30)

    def dumped_in_load_config() -> bool:
        if d.proc is None or d.proc.poll() is not None:
            return True  # (dead: told below)
        os.kill(pid, signal.SIGUSR1)
        return eventually(lambda: "thread 0x" in d.log() and "in load_config" in d.log(),
                          timeout_s=1)

    dumped = eventually(dumped_in_load_config, timeout_s=60)
    alive = d.proc.poll() is None
    log = d.log()
    d.proc.kill()
    d.proc.wait()
    _unblock(cfg)
    assert alive, f"exit {d.proc.returncode}: {log}"
    assert dumped, log


def test_the_daemons_own_files_must_be_regular_files(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """A FIFO (or a device) as tokens_file or TLS file would hold the reading thread for
    good: refused unread, naming the key."""
    tokens_file = tmp_path / "tokens.yaml"
    os.mkfifo(tokens_file)
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server:\n  tokens_file: {tokens_file}\n")
    d = make_daemon(config=cfg, start=False).start(wait=False)
    assert d.proc is not None and d.proc.wait(timeout=30) == 2
    assert "server.tokens_file=" in d.log() and "not a regular file" in d.log()


def _maps_grpc_or_numpy(pid: int) -> bool:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "cygrpc" in maps or "_multiarray_umath" in maps


def test_a_sighup_while_the_server_module_loads_is_no_stop(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cfg = _config(tmp_path / "h.yaml", _token(A))
    d = make_daemon(config=cfg, start=False)
    d.start(wait=False)
    assert d.proc is not None
    pid = d.proc.pid
    assert eventually(lambda: _maps_grpc_or_numpy(pid), timeout_s=30, poll_s=0.002)
    os.kill(pid, signal.SIGHUP)
    d.wait_ready()
    assert _serves(d, A)
