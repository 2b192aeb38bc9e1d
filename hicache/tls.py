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

import grpc

from hicache.config import read_named_file
from hicache.errors import FailedPrecondition


def _no_passphrase() -> str:
    # (without a callback, OpenSSL would prompt on the daemon's terminal for one)
    raise FailedPrecondition("an encrypted private key (gRPC cannot use one)")


def load_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """The PEM (certificate chain, private key) at these paths, checked to be a usable,
    matching pair; `FailedPrecondition` naming what is wrong otherwise."""
    cert = read_named_file(cert_path, "server.tls_cert", FailedPrecondition)
    key = read_named_file(key_path, "server.tls_key", FailedPrecondition)
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
    if (read_named_file(cert_path, "server.tls_cert", FailedPrecondition) != cert
            or read_named_file(key_path, "server.tls_key", FailedPrecondition) != key):
        raise FailedPrecondition(
            f"server.tls_cert/tls_key: {cert_path} or {key_path} changed while being read "
            "(a renewal under way?); reload again once it is done"
        )
    return cert, key


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
