"""Bearer-token authentication and per-namespace authorisation.

`server.tokens` maps each token to the namespaces it may use (`*` = all). With no tokens
configured every caller may use every namespace (a unix socket's file mode is the guard).
A caller presents `authorization: Bearer <token>` metadata; a missing or unknown token is
`Unauthenticated`, a namespace outside the token's list `PermissionDenied`.

Tokens are compared in constant time and never appear in messages, logs or metrics: an
authenticated caller is known by its `Principal.label` (the token's `name`, or
`token#<index>`) only.
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
    """Maps the `authorization` metadata of a call to a `Principal`.

    A principal's label is who the core's scoped ids (engines, sessions, locks) belong to,
    so it holds across `replace` (a configuration reload): a token's `name` when it has
    one (a tenant keeps its engines while it moves to a new token value), else the label
    that token value already had, else a label never used before in this process
    (`token#<n>`, numbered on from the start's, which follow the list). A reload can thus
    never hand a token another tenant's engines, sessions or locks."""

    def __init__(self, tokens: Sequence[TokenConfig]) -> None:
        # Every unnamed token value seen: its label (at the start, its place in the list).
        self._labels = {cfg.token.encode(): f"token#{i}" for i, cfg in enumerate(tokens)
                        if cfg.name is None}
        self._next = len(tokens)
        self._entries: list[tuple[bytes, Principal]] = []
        self.replace(tokens)

    def replace(self, tokens: Sequence[TokenConfig]) -> None:
        """Serve `tokens` from the next call on (calls under way finish with the old)."""
        entries = []
        for cfg in tokens:
            value = cfg.token.encode()
            if cfg.name is not None:
                label = cfg.name
            elif value in self._labels:
                label = self._labels[value]
            else:
                label = self._labels[value] = f"token#{self._next}"
                self._next += 1
            entries.append((value, Principal(label=label, namespaces=frozenset(cfg.namespaces))))
        self._entries = entries  # (one assignment: a call reads either list whole)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The caller's principal; `Unauthenticated` when tokens are configured and the
        call carries none or an unknown one."""
        entries = self._entries
        if not entries:
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
        for token, principal in entries:
            if hmac.compare_digest(token, presented):
                found = principal
        if found is None:
            raise Unauthenticated("invalid bearer token")
        return found
