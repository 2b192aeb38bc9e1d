"""Bearer-token authentication and per-namespace authorisation.

`server.tokens` maps each token to the namespaces it may use (`*` = all). With no tokens
configured every caller may use every namespace (a unix socket's file mode is the guard).
A caller presents `authorization: Bearer <token>` metadata; a missing or unknown token is
`Unauthenticated`, a namespace outside the token's list `PermissionDenied`.

Tokens are compared in constant time and never appear in messages, logs or metrics: an
authenticated caller is known by its `Principal.label` (`token#<index>`) only.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hicache.config import HicacheConfig, TokenConfig
from hicache.errors import PermissionDenied, Unauthenticated

AUTHORIZATION = "authorization"
BEARER = "bearer "
ALL_NAMESPACES = "*"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the index of their token (never the token) and what it allows."""

    label: str
    namespaces: frozenset[str]

    @property
    def unrestricted(self) -> bool:
        return ALL_NAMESPACES in self.namespaces

    def require_for(self, request: object) -> None:
        """`require` the namespace of a request that names one (a call or a Batch op)."""
        namespace = getattr(request, "namespace", None)
        if isinstance(namespace, str):
            self.require(namespace)

    def require(self, namespace: str) -> None:
        """Raise `PermissionDenied` unless this caller may use `namespace`."""
        if self.unrestricted or namespace in self.namespaces:
            return
        # The namespace is the caller's own input, so echoing it leaks nothing.
        raise PermissionDenied(
            f"namespace {namespace!r} is not allowed for this token ({self.label})"
        )


ANONYMOUS = Principal(label="anonymous", namespaces=frozenset({ALL_NAMESPACES}))

SCOPE = "/"  # a scoped engine or session id: "<token label>/<the id the caller sent>"


def scoped(principal: Principal, name: str) -> str:
    """An engine or session id as the core knows it: with bearer tokens, prefixed by the
    caller's token label, so that two tenants sending the same id never share it. Without
    tokens (one trust domain), or an empty id, the id as sent."""
    if principal is ANONYMOUS or not name:
        return name
    return f"{principal.label}{SCOPE}{name}"


def tenant_of(scoped_name: str) -> str:
    """The token label a `scoped` id carries: whose it is, for per-tenant bounds."""
    return scoped_name.partition(SCOPE)[0]


def one_tenant(_name: str) -> str:
    """Without tokens every caller is one tenant (one trust domain)."""
    return ""


def tenant_of_config(cfg: HicacheConfig) -> Callable[[str], str]:
    """Whose a scoped engine or session id is under `cfg`, for bounds that hold per tenant
    (open sessions, finished prefetches kept): with bearer tokens its token's
    (`tenant_of`), else `one_tenant`."""
    return tenant_of if cfg.server.tokens else one_tenant


_current: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "hicache_principal", default=ANONYMOUS
)


def current_principal() -> Principal:
    """The caller of the RPC running on this thread (set by the interceptor)."""
    return _current.get()


def set_current_principal(principal: Principal) -> contextvars.Token[Principal]:
    return _current.set(principal)


def reset_current_principal(token: contextvars.Token[Principal]) -> None:
    _current.reset(token)


class Authenticator:
    """Maps the `authorization` metadata of a call to a `Principal`."""

    def __init__(self, tokens: Sequence[TokenConfig]) -> None:
        self._entries = [
            (
                cfg.token.encode(),
                Principal(label=f"token#{i}", namespaces=frozenset(cfg.namespaces)),
            )
            for i, cfg in enumerate(tokens)
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The caller's principal; `Unauthenticated` when tokens are configured and the
        call carries none or an unknown one."""
        if not self._entries:
            return ANONYMOUS
        presented: bytes | None = None
        for key, value in metadata:
            if key == AUTHORIZATION:
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if text[: len(BEARER)].lower() == BEARER:
                    presented = text[len(BEARER) :].strip().encode()
                break
        if presented is None:
            raise Unauthenticated(
                "missing credentials: send metadata 'authorization: Bearer <token>'"
            )
        found: Principal | None = None
        # Compare with every entry (no early exit) so timing does not reveal which matched.
        for token, principal in self._entries:
            if hmac.compare_digest(token, presented):
                found = principal
        if found is None:
            raise Unauthenticated("invalid bearer token")
        return found
