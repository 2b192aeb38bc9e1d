"""What `hicache health` and `hicache stats` report, as plain data plus an exit code.

Exit codes (made for cron and Kubernetes exec probes): 0 all healthy, 1 the daemon answers
but a backend is unhealthy (or the daemon is NOT_SERVING, or its backend report does not
come in time), 2 the daemon is unreachable. Without the token a daemon with tokens asks
for, the standard health check alone decides (its per-backend report is not shown).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from hicache.client import Client
from hicache.errors import HicacheError, NoAnswer, Unauthenticated, Unavailable, Unimplemented

EXIT_OK, EXIT_UNHEALTHY, EXIT_UNREACHABLE = 0, 1, 2
PROBE_TIMEOUT_S = 5.0


def _client(target: str, token: str | None, ca: bytes | None) -> Client:
    return Client(target, token=token, root_certificates=ca, timeout_s=PROBE_TIMEOUT_S, retries=0)


def health_report(target: str, deep: bool, token: str | None = None,
                  ca: bytes | None = None) -> tuple[dict[str, Any], int]:
    """`ca`: PEM root certificates of a TLS daemon (None: the system's, for TLS)."""
    # Every key always present (JSON consumers need not test for them).
    report: dict[str, Any] = {"target": target, "reachable": False, "serving": False, "backends": []}
    with _client(target, token, ca) as client:
        try:
            serving = client.serving()  # the standard check: no credentials needed
        except Unavailable as e:
            report["error"] = str(e)
            return report, EXIT_UNREACHABLE
        except HicacheError as e:
            report.update(reachable=True, error=str(e))
            return report, EXIT_UNHEALTHY
        report.update(reachable=True, serving=serving)
        try:
            backends = client.health(deep)
        except Unauthenticated as e:
            # The per-backend report needs a token; the standard check (NOT_SERVING while a
            # required backend is down) stands for the daemon, as for a kubelet probe.
            report["note"] = (f"backends not reported: {e}; their report needs a valid "
                              f"--token-file (the status above needs none)")
            return report, EXIT_OK if serving else EXIT_UNHEALTHY
        except Unimplemented:
            # A probe listener (`server.probe_listen`) serves only the standard check,
            # which then stands for the daemon, as for a kubelet probe.
            report["note"] = ("backends not reported: this endpoint serves only the standard "
                              "health check (a probe listener); the status above is the daemon's")
            return report, EXIT_OK if serving else EXIT_UNHEALTHY
        except Unavailable as e:  # it answered the check just now: a backend hangs
            report["error"] = f"the daemon answered, its backend report did not: {e}"
            return report, EXIT_UNHEALTHY
        except HicacheError as e:
            report["error"] = str(e)
            return report, EXIT_UNHEALTHY
    report["backends"] = [_backend(b) for b in backends]
    healthy = serving and all(b.healthy for b in backends)
    return report, EXIT_OK if healthy else EXIT_UNHEALTHY


def _backend(b: Any) -> dict[str, Any]:
    """One backend's report; a latency that is no number (NaN, infinite: from a daemon
    that sent junk) is null, so that `--json` stays JSON."""
    out = asdict(b)
    if not math.isfinite(out["latency_ms"]):
        out["latency_ms"] = None
    return out


def stats_report(target: str, token: str | None = None,
                 ca: bytes | None = None) -> tuple[dict[str, Any], int]:
    try:
        with _client(target, token, ca) as client:
            try:
                snap = client.stats()
            except NoAnswer:
                raise  # hung: another question would wait as long again (a probe's deadline)
            except Unavailable as e:
                # A daemon that is stopping refuses Stats but still answers the standard
                # check: it is reachable (exit 1, as `health` says), not gone.
                try:
                    client.serving()
                except HicacheError:
                    raise e from None
                return {"target": target, "reachable": True, "error": str(e)}, EXIT_UNHEALTHY
    except Unavailable as e:
        return {"target": target, "reachable": False, "error": str(e)}, EXIT_UNREACHABLE
    except Unauthenticated as e:
        return {"target": target, "reachable": True,
                "error": f"{e}; stats need a valid --token-file"}, EXIT_UNHEALTHY
    except HicacheError as e:
        return {"target": target, "reachable": True, "error": str(e)}, EXIT_UNHEALTHY
    return {
        "target": target,
        "reachable": True,
        "pools": [asdict(p) for p in snap.pools],
        "counters": dict(snap.counters),
    }, EXIT_OK
