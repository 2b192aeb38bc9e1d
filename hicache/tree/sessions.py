"""Session bookkeeping: which boundary each open session last finished at.

Generations come from one clock for the whole tree, so a session closed and reopened
never sees the generation it had before: a late request (matched under the old
generation) cannot restore references after close/reopen. A request that names its
session only when it ends (an Insert without the match's lock) says when it began
(`since`, the clock then): closed after that, the session stays closed. A bounded record
of closed sessions makes CloseSession idempotent: closing a recently closed session again
changes nothing and returns what the first close returned (a caller that retries after a
lost answer gets that answer, not 0 or NOT_FOUND).
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


class SessionTable:
    def __init__(self, max_closed: int, max_open: int = 1 << 16) -> None:
        # Least recently used first: past `max_open` the tree closes the oldest (an engine
        # that never calls CloseSession would grow the table, and the references it keeps,
        # without bound).
        self._open: OrderedDict[str, Session] = OrderedDict()
        self.max_open = max_open
        # Open sessions by the node they end at (id): a node deleted under a session moves
        # its end up, so no session keeps a deleted path (and its tokens) alive.
        self._by_end: dict[int, dict[str, Session]] = {}
        # session id -> (what its close returned, the clock at the close)
        self._closed: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.clock = 0  # ticks at every open and close
        self._max_closed = max_closed

    def __len__(self) -> int:
        return len(self._open)

    def open(self, session_id: str, since: int | None = None) -> int:
        """The session's current generation, opening (or reopening) it if needed; 0 (no
        session) for a request that began at clock `since` when the session was closed
        after that: a late request of the closed session, not a new one's."""
        session = self._open.get(session_id)
        if session is not None:
            self._open.move_to_end(session_id)
            return 0 if since is not None and session.reopened_at > since else session.generation
        closed = self._closed.get(session_id)
        if since is not None and closed is not None and closed[1] > since:
            return 0
        self._closed.pop(session_id, None)
        self.clock += 1
        session = self._open[session_id] = Session(self.clock, reopened_at=closed[1] if closed else 0)
        return session.generation

    def current(self, session_id: str, generation: int) -> Session | None:
        """The open session if it still has `generation`, else None (closed since)."""
        session = self._open.get(session_id)
        if session is None or session.generation != generation:
            return None
        return session

    def close(self, session_id: str, drop: Callable[[Session], int]) -> int | None:
        """Close an open session: `drop(session)` releases its references and says how
        many; that answer is remembered and returned again for a recently closed session.
        None when the session is neither open nor recently closed."""
        session = self._open.pop(session_id, None)
        if session is None:
            closed = self._closed.get(session_id)
            return None if closed is None else closed[0]
        released = drop(session)
        self.set_end(session_id, session, None)
        self.clock += 1
        self._closed[session_id] = (released, self.clock)
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)
        return released

    def sessions(self) -> list[Session]:
        return list(self._open.values())

    def least_recent(self) -> str | None:
        """The open session used longest ago (opened, or named by a request)."""
        return next(iter(self._open), None)

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
