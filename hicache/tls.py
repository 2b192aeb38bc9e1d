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
    """The PEM (certificate chain, private key) at these paths, checked to be a pair gRPC
    serves; `FailedPrecondition` naming what is wrong otherwise. The bytes checked are
    the bytes served (a renewal half done fails the check, not a handshake)."""
    cert = read_named_file(cert_path, "server.tls_cert", FailedPrecondition, regular=True)
    key = read_named_file(key_path, "server.tls_key", FailedPrecondition, regular=True)
    if not _grpc_takes(cert, key):
        raise FailedPrecondition(f"server.tls_cert/tls_key: {_why_not(cert_path, key_path)}")
    return cert, key


def _grpc_takes(cert: bytes, key: bytes) -> bool:
    """Whether gRPC's TLS (BoringSSL) serves this pair: asked of a listener of a server
    never started, on a free loopback port. (It refuses a key that does not match, an
    encrypted one, and key types Python's OpenSSL takes, secp256k1 for one: served, such
    a pair failed every handshake.)"""
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        return bool(probe.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)])))
    except (RuntimeError, ValueError):
        return False
    finally:
        probe.stop(None)


def _why_not(cert_path: str, key_path: str) -> str:
    """What is wrong with a pair gRPC refused, as far as Python's OpenSSL can say."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path,
                                                                password=_no_passphrase)
    except FailedPrecondition as e:
        return f"{key_path}: {e}"
    except (ssl.SSLError, OSError) as e:
        reason = getattr(e, "reason", None) or str(e)
        return f"{cert_path} and {key_path} are not a matching PEM certificate and private key ({reason})"
    return (f"gRPC cannot serve {cert_path} with {key_path} (its TLS takes RSA, ECDSA "
            "P-256/P-384/P-521 and Ed25519 keys)")


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
