"""Mutation review, third round (daemon side): what a reload does that no other test
pinned. Each test names the mutant of the product code it kills and passes on the product
as it is. The real `Reloader` over real configuration loads (`load_config`), as the
daemon's SIGHUP runs it."""

from __future__ import annotations

from pathlib import Path

from hicache.auth import Authenticator
from hicache.config import load_config
from hicache.reload import Reloader
from hicache.tls import ServerCertificate

from .test_reload import _make_cert

TOKEN = "tok-s30c-aaaaaaaaaaaaaaaa"


def test_a_tokens_file_moved_to_another_path_with_the_same_tokens_is_taken_up(tmp_path: Path) -> None:
    """An operator moves the tokens to another file (a new Secret mount) holding the same
    token, and reloads. Only `server.tokens_file` changed: the reload applies it (it is
    live, not a restart's), the running configuration names the new file, and a second
    reload of the same finds nothing to apply and nothing needing a restart.
    Mutant killed: the reload applying tokens only when `server.tokens` changed (the new
    path never taken up: "nothing to apply", and the running configuration keeps naming
    the old file, which the operator may then delete)."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    for f in (old, new):
        f.write_text(f"- {{token: {TOKEN}, namespaces: [x]}}\n")
    base = load_config(None, [f"server.tokens_file={old}"])
    auth = Authenticator(base.server.tokens)
    reloader = Reloader(base, lambda: load_config(None, [f"server.tokens_file={new}"]), auth, None)
    first = reloader.reload()
    assert first.ok, first.error
    assert first.applied == ("server.tokens (1 token)",)
    assert first.restart_needed == ()
    assert reloader.running.server.tokens_file == str(new)
    assert [t.token for t in reloader.running.server.tokens] == [TOKEN]
    second = reloader.reload()
    assert (second.ok, second.applied, second.restart_needed) == (True, (), ())


def test_a_certificate_moved_to_new_files_is_rotated_and_asks_for_no_restart(tmp_path: Path) -> None:
    """A TLS daemon's certificate and key move to new files (a renewal written beside the
    old one) and it reloads: the reload rotates the certificate live and says so, and
    names no key as needing a restart (the operator would otherwise restart for nothing,
    emptying L1 and L2). The running configuration then names the new files.
    Mutant killed: `server.tls_cert`/`tls_key` listed as restart-only even when the reload
    rotated them (`if not rotate` dropped)."""
    old_crt, old_key = _make_cert(tmp_path, "old")
    new_crt, new_key = _make_cert(tmp_path, "new")
    base = load_config(None, [f"server.tls_cert={old_crt}", f"server.tls_key={old_key}"])
    certificate = ServerCertificate(str(old_crt), str(old_key))
    reloader = Reloader(base, lambda: load_config(None, [f"server.tls_cert={new_crt}",
                                                         f"server.tls_key={new_key}"]),
                        Authenticator(()), certificate)
    outcome = reloader.reload()
    assert outcome.ok, outcome.error
    assert outcome.applied == ("server.tls_cert/tls_key (to connections opened from now on)",)
    assert outcome.restart_needed == ()
    assert (reloader.running.server.tls_cert, reloader.running.server.tls_key) == (str(new_crt), str(new_key))
