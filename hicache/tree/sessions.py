"""Session bookkeeping: which boundary each open session last finished at.

Generations come from one counter for the whole tree, so a session closed and reopened
never sees the generation it had before: a late request (matched under the old
generation) cannot restore references after close/reopen. A bounded set of closed
sessions makes a second CloseSession of a recently closed session a no-op rather than
NOT_FOUND.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from hicache.tree.node import Node


@dataclass
class Session:
    generation: int
    end: Node | None = None  # the boundary its last finished request reached


class SessionTable:
    def __init__(self, max_closed: int) -> None:
        self._open: dict[str, Session] = {}
        self._closed: OrderedDict[str, int] = OrderedDict()
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

    def close(self, session_id: str) -> Session | None:
        """Remove an open session and return it; None if it was closed recently.
        Raises KeyError when the session is unknown."""
        session = self._open.pop(session_id, None)
        if session is None:
            if session_id in self._closed:
                return None
            raise KeyError(session_id)
        self._closed[session_id] = session.generation
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)
        return session

    def sessions(self) -> list[Session]:
        return list(self._open.values())
