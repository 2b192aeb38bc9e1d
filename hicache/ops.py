"""What `hicache health` and `hicache stats` report, as plain data plus an exit code.

Exit codes (made for cron and Kubernetes exec probes): 0 all healthy, 1 the daemon answers
but a backend is unhealthy (or the daemon is NOT_SERVING), 2 the daemon is unreachable.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hicache.client import Client
from hicache.errors import HicacheError, Unavailable

EXIT_OK, EXIT_UNHEALTHY, EXIT_UNREACHABLE = 0, 1, 2
PROBE_TIMEOUT_S = 5.0


def _client(target: str, token: str | None, ca: bytes | None) -> Client:
    return Client(target, token=token, root_certificates=ca, timeout_s=PROBE_TIMEOUT_S, retries=0)


def health_report(target: str, deep: bool, token: str | None = None,
                  ca: bytes | None = None) -> tuple[dict[str, Any], int]:
    """`ca`: PEM root certificates of a TLS daemon (None: the system's, for TLS)."""
    # Every key always present (JSON consumers need not test for them).
    report: dict[str, Any] = {"target": target, "reachable": False, "serving": False, "backends": []}
    try:
        with _client(target, token, ca) as client:
            serving = client.serving()
            backends = client.health(deep)
    except Unavailable as e:
        report["error"] = str(e)
        return report, EXIT_UNREACHABLE
    except HicacheError as e:  # e.g. refused credentials: it answers, but not healthy to us
        report.update(reachable=True, error=str(e))
        return report, EXIT_UNHEALTHY
    report.update(reachable=True, serving=serving, backends=[asdict(b) for b in backends])
    healthy = serving and all(b.healthy for b in backends)
    return report, EXIT_OK if healthy else EXIT_UNHEALTHY


def stats_report(target: str, token: str | None = None,
                 ca: bytes | None = None) -> tuple[dict[str, Any], int]:
    try:
        with _client(target, token, ca) as client:
            snap = client.stats()
    except Unavailable as e:
        return {"target": target, "reachable": False, "error": str(e)}, EXIT_UNREACHABLE
    except HicacheError as e:
        return {"target": target, "reachable": True, "error": str(e)}, EXIT_UNHEALTHY
    return {
        "target": target,
        "reachable": True,
        "pools": [asdict(p) for p in snap.pools],
        "counters": dict(snap.counters),
    }, EXIT_OK
