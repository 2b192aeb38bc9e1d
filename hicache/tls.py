"""The server's TLS certificate: read, checked, and rotated without a restart.

gRPC asks `ServerCertificate` for a replacement before each new connection's handshake
(`grpc.dynamic_ssl_server_credentials`); a reload (`hicache.reload`, on SIGHUP) hands it
one. Connections already open keep the certificate they were opened with, so a rotation
drops no engine: certificates that cert-manager or an operator renews are taken up
without losing the cache a restart would.
"""

from __future__ import annotations

import ssl
import threading
from concurrent import futures

import grpc

from hicache.config import read_named_file
from hicache.errors import FailedPrecondition


def _no_passphrase() -> str:
    # (without a callback, OpenSSL would prompt on the daemon's terminal for one)
    raise FailedPrecondition("an encrypted private key (gRPC cannot use one)")


def load_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """The PEM (certificate chain, private key) at these paths, checked to be a usable,
    matching pair; `FailedPrecondition` naming what is wrong otherwise."""
    cert = read_named_file(cert_path, "server.tls_cert", FailedPrecondition, regular=True)
    key = read_named_file(key_path, "server.tls_key", FailedPrecondition, regular=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path, password=_no_passphrase)
    except FailedPrecondition as e:
        raise FailedPrecondition(f"server.tls_key={key_path}: {e}") from None
    except (ssl.SSLError, OSError) as e:
        reason = getattr(e, "reason", None) or str(e)
        raise FailedPrecondition(
            f"server.tls_cert/tls_key: {cert_path} and {key_path} are not a matching PEM "
            f"certificate and private key ({reason})"
        ) from None
    # Checked from the paths, served from the bytes: the same only if nothing replaced
    # the files in between (a renewal half done).
    if (read_named_file(cert_path, "server.tls_cert", FailedPrecondition, regular=True) != cert
            or read_named_file(key_path, "server.tls_key", FailedPrecondition, regular=True) != key):
        raise FailedPrecondition(
            f"server.tls_cert/tls_key: {cert_path} or {key_path} changed while being read "
            "(a renewal under way?); reload again once it is done"
        )
    _check_grpc_takes(cert, key, cert_path, key_path)
    return cert, key


def _check_grpc_takes(cert: bytes, key: bytes, cert_path: str, key_path: str) -> None:
    """gRPC's TLS (BoringSSL) takes fewer key types than Python's OpenSSL (no secp256k1,
    for one): a pair only OpenSSL takes would fail every handshake (served, it kept the
    old certificate). A listener of a server never started, on a free loopback port, is
    where gRPC says whether it takes the pair."""
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        port = probe.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError:
        port = 0
    finally:
        probe.stop(None)
    if not port:
        raise FailedPrecondition(
            f"server.tls_cert/tls_key: gRPC cannot serve {cert_path} with {key_path} (its TLS "
            "takes RSA, ECDSA P-256/P-384/P-521 and Ed25519 keys)"
        )


class ServerCertificate:
    """The certificate a TLS listener serves, replaceable while it serves."""

    def __init__(self, cert_path: str, key_path: str) -> None:
        cert, key = load_pair(cert_path, key_path)
        self._initial = grpc.ssl_server_certificate_configuration([(key, cert)])
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._mu = threading.Lock()
        self.paths = (cert_path, key_path)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._replacement, require_client_authentication=False
        )

    def rotate(self, cert_path: str, key_path: str) -> None:
        """Serve the pair at these paths to every connection opened from now on; raises
        `FailedPrecondition` (and keeps serving the current one) when it is not usable."""
        cert, key = load_pair(cert_path, key_path)
        with self._mu:
            self._pending = grpc.ssl_server_certificate_configuration([(key, cert)])
            self.paths = (cert_path, key_path)

    def _replacement(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC's callback before a handshake: a new configuration once, then None (no change).
        with self._mu:
            pending, self._pending = self._pending, None
        return pending
