"""TCP with TLS, end to end: a real daemon with a self-signed certificate, the engine
client and the probe CLI."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.client import Client
from hicache.errors import InvalidArgument, Unavailable

from .daemonkit import PAGE, Daemon, free_port, run_cli, tokens

MakeDaemon = Callable[..., Daemon]


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl, as an operator would make one)."""
    key, crt = tmp_path / "tls.key", tmp_path / "tls.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )
    return crt, key


def test_tls_daemon_serves_requests_to_clients_that_trust_it(make_daemon: MakeDaemon, cert, tmp_path) -> None:
    crt, key = cert
    target = f"127.0.0.1:{free_port()}"
    d = make_daemon(f"server.tls_cert={crt}", f"server.tls_key={key}", listen=target,
                    ca=crt.read_bytes())
    with d.client(engine_id="tls-engine") as c:
        c.attach(map_pools=False)
        m = c.match(tokens(2 * PAGE), lock=True, allocate_tokens=2 * PAGE)
        c.insert(tokens(2 * PAGE), lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert c.match(tokens(2 * PAGE)).device_tokens == 2 * PAGE
    # A plaintext client gets no answer from a TLS port.
    with Client(target, tls=False, retries=0, timeout_s=2.0) as plain, pytest.raises(Unavailable):
        plain.serving()
    # The probe CLI: --ca-file, or the certificate of the config it reads the address from.
    out = run_cli("health", "--target", target, "--ca-file", str(crt), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["serving"] is True
    cfg = tmp_path / "h.yaml"
    cfg.write_text(f"server: {{listen: '{target}', tls_cert: '{crt}', tls_key: '{key}'}}\n")
    out = run_cli("health", "--config", str(cfg))
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
    # Without the certificate there is no trusted TLS (and no plaintext) here: unreachable.
    out = run_cli("health", "--target", target)
    assert out.returncode == 2, out.stdout + out.stderr


def test_client_tls_choice_follows_the_address() -> None:
    with pytest.raises(InvalidArgument, match="unix socket is never TLS"):
        Client("unix:///tmp/x.sock", tls=True)
    with pytest.raises(InvalidArgument, match="unix socket is never TLS"):
        Client("unix:///tmp/x.sock", root_certificates=b"pem")


def test_unreadable_ca_file_is_a_clear_error(tmp_path) -> None:
    out = run_cli("health", "--target", "127.0.0.1:1", "--ca-file", str(tmp_path / "missing.pem"))
    assert out.returncode == 2
    assert "missing.pem" in out.stderr and "No such file" in out.stderr


def test_probe_of_a_unix_socket_daemon_ignores_the_configs_certificate(
    make_daemon: MakeDaemon, cert, tmp_path
) -> None:
    """TLS is for TCP: a config that names a certificate but listens on a unix socket is
    probed in plaintext over the socket."""
    crt, key = cert
    d = make_daemon()
    cfg = tmp_path / "unix.yaml"
    cfg.write_text(f"server: {{listen: '{d.target}', tls_cert: '{crt}', tls_key: '{key}'}}\n")
    out = run_cli("health", "--config", str(cfg))
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
