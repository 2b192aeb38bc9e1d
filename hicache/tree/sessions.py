"""Session bookkeeping: which boundary each open session last finished at.

Generations come from one counter for the whole tree, so a session closed and reopened
never sees the generation it had before: a late request (matched under the old
generation) cannot restore references after close/reopen. A bounded record of closed
sessions makes CloseSession idempotent: closing a recently closed session again changes
nothing and returns what the first close returned (a caller that retries after a lost
answer gets that answer, not 0 or NOT_FOUND).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hicache.tree.node import Node


@dataclass
class Session:
    generation: int
    end: Node | None = None  # the boundary its last finished request reached


class SessionTable:
    def __init__(self, max_closed: int) -> None:
        self._open: dict[str, Session] = {}
        self._closed: OrderedDict[str, int] = OrderedDict()  # session id -> what its close returned
        self._gens = itertools.count(1)
        self._max_closed = max_closed

    def __len__(self) -> int:
        return len(self._open)

    def open(self, session_id: str) -> int:
        """The session's current generation, opening (or reopening) it if needed."""
        session = self._open.get(session_id)
        if session is None:
            self._closed.pop(session_id, None)
            session = self._open[session_id] = Session(next(self._gens))
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
            return self._closed.get(session_id)
        released = self._closed[session_id] = drop(session)
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)
        return released

    def sessions(self) -> list[Session]:
        return list(self._open.values())
