"""Session bookkeeping: which boundary each open session last finished at.

Generations come from one clock for the whole tree, so a session closed and reopened
never sees the generation it had before: a late request (matched under the old
generation) cannot restore references after close/reopen. A request that names its
session only when it ends (an Insert without the match's lock) says when it began
(`since`, the clock then): closed after that, the session stays closed. A bounded record
of closed sessions makes CloseSession idempotent: closing a recently closed session again
changes nothing and returns what the first close returned (a caller that retries after a
lost answer gets that answer, not 0 or NOT_FOUND).

Both bounds (open sessions, closed records) hold per tenant (`tenant_of` a session id;
one tenant without tokens): a tenant opening sessions past the cap closes its own least
recently used one, and its closes push out its own records, never another tenant's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hicache.tree.node import Node


@dataclass
class Session:
    generation: int
    end: Node | None = None  # the boundary its last finished request reached
    reopened_at: int = 0  # the clock at the close this generation follows (0: none known)
    # Where (depth in pages) the trailing window its windowed references cover begins
    # (SWA's); kept when `end` moves up, so the references shrink with the path.
    window_top: int = 0


def _one_tenant(_session_id: str) -> str:
    return ""


class SessionTable:
    def __init__(self, max_closed: int, max_open: int = 1 << 16,
                 tenant_of: Callable[[str], str] | None = None) -> None:
        # Per tenant, least recently used first: past `max_open` the tree closes the
        # tenant's oldest (an engine that never calls CloseSession would grow the table,
        # and the references it keeps, without bound).
        self._open: dict[str, OrderedDict[str, Session]] = {}
        self._count = 0
        self.max_open = max_open
        self._tenant_of = tenant_of or _one_tenant
        # Open sessions by the node they end at (id): a node deleted under a session moves
        # its end up, so no session keeps a deleted path (and its tokens) alive.
        self._by_end: dict[int, dict[str, Session]] = {}
        # Per tenant: session id -> (what its close returned, the clock at the close)
        self._closed: dict[str, OrderedDict[str, tuple[int, int]]] = {}
        self.clock = 0  # ticks at every open and close
        self._max_closed = max_closed

    def __len__(self) -> int:
        return self._count

    def _get(self, session_id: str) -> Session | None:
        table = self._open.get(self._tenant_of(session_id))
        return table.get(session_id) if table else None

    def _closed_record(self, session_id: str) -> tuple[int, int] | None:
        records = self._closed.get(self._tenant_of(session_id))
        return records.get(session_id) if records else None

    def open(self, session_id: str, since: int | None = None) -> int:
        """The session's current generation, opening (or reopening) it if needed; 0 (no
        session) for a request that began at clock `since` when the session was closed
        after that: a late request of the closed session, not a new one's."""
        tenant = self._tenant_of(session_id)
        table = self._open.get(tenant)
        session = table.get(session_id) if table else None
        if session is not None:
            assert table is not None
            table.move_to_end(session_id)
            return 0 if since is not None and session.reopened_at > since else session.generation
        records = self._closed.get(tenant)
        closed = records.get(session_id) if records else None
        if since is not None and closed is not None and closed[1] > since:
            return 0
        if closed is not None:
            assert records is not None
            del records[session_id]
            if not records:
                del self._closed[tenant]
        self.clock += 1
        session = Session(self.clock, reopened_at=closed[1] if closed else 0)
        self._open.setdefault(tenant, OrderedDict())[session_id] = session
        self._count += 1
        return session.generation

    def current(self, session_id: str, generation: int) -> Session | None:
        """The open session if it still has `generation`, else None (closed since)."""
        session = self._get(session_id)
        if session is None or session.generation != generation:
            return None
        return session

    def close(self, session_id: str, drop: Callable[[Session], int]) -> int | None:
        """Close an open session: `drop(session)` releases its references and says how
        many; that answer is remembered and returned again for a recently closed session.
        None when the session is neither open nor recently closed."""
        tenant = self._tenant_of(session_id)
        table = self._open.get(tenant)
        session = table.pop(session_id, None) if table else None
        if session is None:
            closed = self._closed_record(session_id)
            return None if closed is None else closed[0]
        assert table is not None
        if not table:
            del self._open[tenant]
        self._count -= 1
        released = drop(session)
        self.set_end(session_id, session, None)
        self.clock += 1
        records = self._closed.setdefault(tenant, OrderedDict())
        records[session_id] = (released, self.clock)
        while len(records) > self._max_closed:
            records.popitem(last=False)
        return released

    def sessions(self) -> list[Session]:
        return [session for table in self._open.values() for session in table.values()]

    def over_cap(self, session_id: str) -> str | None:
        """When the tenant of `session_id` has more than `max_open` sessions open, its
        least recently used one (opened, or named by a request), else None."""
        table = self._open.get(self._tenant_of(session_id))
        if table is None or len(table) <= self.max_open:
            return None
        return next(iter(table))

    def set_end(self, session_id: str, session: Session, end: Node | None) -> None:
        """`session.end = end`, kept in the by-node index."""
        if session.end is not None:
            at = self._by_end.get(id(session.end))
            if at is not None:
                at.pop(session_id, None)
                if not at:
                    del self._by_end[id(session.end)]
        session.end = end
        if end is not None:
            self._by_end.setdefault(id(end), {})[session_id] = session

    def ended_at(self, node: Node) -> list[tuple[str, Session]]:
        """The open sessions ending at `node` (a copy: `set_end` may move them)."""
        at = self._by_end.get(id(node))  # (every node deleted asks: usually none)
        return list(at.items()) if at else []
