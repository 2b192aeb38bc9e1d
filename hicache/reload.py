"""Reloading a running daemon's configuration (SIGHUP, `systemctl reload`).

A restart empties L1 and L2, so what operators change routinely is taken up live:
`server.tokens` (a token added, revoked or rotated, a tenant's namespaces; or the file
`server.tokens_file` names, read again, or another one) and the TLS
certificate and key (a renewal). The file (and the command line's `--set`s, applied again)
is read and validated whole; a configuration that fails changes nothing, and the daemon
goes on with the one it has. Any other key that changed is named in the log as taking
effect at the next restart, at every reload until then. Turning authentication on or off,
or TLS, is such a change too: engines' ids are scoped by token, and a listener's
credentials are fixed when it binds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hicache.auth import Authenticator
from hicache.config import ConfigError, HicacheConfig
from hicache.errors import FailedPrecondition
from hicache.tls import ServerCertificate

log = logging.getLogger(__name__)

TOKENS = "server.tokens"
TOKENS_FILE = "server.tokens_file"
TLS_KEYS = ("server.tls_cert", "server.tls_key")


@dataclass(frozen=True)
class ReloadOutcome:
    """What one reload did: `applied` keys now live, `restart_needed` keys changed but
    not live (both dotted paths); `error` (nothing applied) when it failed."""

    applied: tuple[str, ...] = ()
    restart_needed: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def changed_keys(old: Any, new: Any, prefix: str = "") -> Iterator[str]:
    """The dotted paths of the settings that differ between two configurations (a list
    of records, such as `server.tokens`, is one setting)."""
    for field in dataclasses.fields(old):
        path = f"{prefix}{field.name}"
        a, b = getattr(old, field.name), getattr(new, field.name)
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
            yield from changed_keys(a, b, f"{path}.")
        elif a != b:
            yield path


class Reloader:
    """Re-reads the configuration and applies what can change live. Reloads run one at
    a time (`_mu`; the daemon starts each on a thread of its own, off the main thread
    that handles a stop); `running` is the configuration in effect."""

    def __init__(self, running: HicacheConfig, load: Callable[[], HicacheConfig],
                 auth: Authenticator, certificate: ServerCertificate | None) -> None:
        self.running = running
        self._load = load
        self._auth = auth
        self._certificate = certificate
        self._mu = threading.Lock()  # (one reload at a time)

    def reload(self) -> ReloadOutcome:
        with self._mu:
            try:
                outcome = self._reload()
            except (ConfigError, FailedPrecondition) as e:
                outcome = ReloadOutcome(error=str(e))
            except Exception as e:  # (a bug: the daemon serves on, as after any failed reload)
                log.exception("configuration reload: unexpected error")
                outcome = ReloadOutcome(error=f"unexpected error: {type(e).__name__}: {e}")
        if outcome.error is not None:
            log.error("configuration reload failed, nothing changed (still serving with the "
                      "configuration in effect): %s", outcome.error)
            return outcome
        if outcome.restart_needed:
            log.warning("configuration reload: %s changed but take%s effect only at a restart",
                        ", ".join(outcome.restart_needed),
                        "s" if len(outcome.restart_needed) == 1 else "")
        log.info("configuration reloaded: %s",
                 ("applied " + ", ".join(outcome.applied)) if outcome.applied else "nothing to apply")
        return outcome

    def _reload(self) -> ReloadOutcome:
        new = self._load()
        old = self.running
        changed = list(changed_keys(old, new))
        applied: list[str] = []
        server = old.server
        restart: list[str] = []
        # The certificate first: it is the one step that may still fail, and a failed
        # reload applies nothing. (Its files are read again even at the same paths: a
        # renewal replaces them there.)
        rotate = self._certificate is not None and new.server.tls_cert is not None
        if rotate:
            assert self._certificate is not None and new.server.tls_key is not None
            self._certificate.rotate(new.server.tls_cert, new.server.tls_key)  # type: ignore[arg-type]
            server = dataclasses.replace(server, tls_cert=new.server.tls_cert,
                                         tls_key=new.server.tls_key)
            applied.append("server.tls_cert/tls_key (to connections opened from now on)")
        tokens_live = bool(old.server.tokens) == bool(new.server.tokens)
        if (TOKENS in changed or TOKENS_FILE in changed) and tokens_live:
            self._auth.replace(new.server.tokens)
            server = dataclasses.replace(server, tokens=new.server.tokens,
                                         tokens_file=new.server.tokens_file)
            n = len(new.server.tokens)
            applied.append(f"{TOKENS} ({n} token{'' if n == 1 else 's'})")
        for key in changed:
            if key in TLS_KEYS:
                if not rotate:
                    restart.append(f"{key} (TLS is set up when the listener binds)")
            elif key in (TOKENS, TOKENS_FILE):
                if not tokens_live:
                    restart.append(f"{key} (authentication is turned on or off at a restart)")
            else:
                restart.append(key)
        self.running = dataclasses.replace(old, server=server)
        return ReloadOutcome(applied=tuple(applied), restart_needed=tuple(restart))
