"""Client side: what the daemon's replies may hand an engine, checked before it has them.

The engine writes KV wherever a reply's page ids point, into the pools it mapped at
Attach: the client is the last barrier before that memory. A correct daemon never sends a
page id outside its pool, a member the engine did not map, a count past the prompt or a
Load stream that goes backwards; a buggy or newer daemon, a proxy or a flipped bit could.
Such a reply is `FailedPrecondition` naming what was wrong, never an out-of-bounds write
or another request's pages overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hicache.controller.base import AttachInfo, LoadProgress, MatchOutcome
from hicache.errors import FailedPrecondition
from hicache.types import ComponentKind

_SWA = ComponentKind.SWA


def _bad(what: str) -> FailedPrecondition:
    return FailedPrecondition(f"the daemon's reply is not one this client can use: {what}")


class ReplyBounds:
    """The attached geometry: each member's pool size (pages, or MAMBA slots) and which
    members' device pages may hold -1 (an SWA page outside the window)."""

    def __init__(self, info: AttachInfo) -> None:
        self.page_size = info.page_size
        self._pages = {d.member: d.num_pages for d in info.pools}
        self._holes = frozenset(m.name for m in info.members if _SWA in (m.component, m.anchor))
        self._full = tuple(m.name for m in info.members if m.component is ComponentKind.FULL
                           and m.name in self._pages)

    def pages(self, pages: Mapping[str, np.ndarray], field: str, holes: bool = False) -> None:
        """Every id names a page of its member's pool (`holes`: SWA members may say -1)."""
        for member, ids in pages.items():
            limit = self._pages.get(member)
            if limit is None:
                raise _bad(f"{field}[{member}]: a member this engine has no pool of")
            if not len(ids):
                continue
            # One reduction: shifted by the hole value (-1 where allowed), a negative id
            # reads as a huge unsigned one (two reductions cost twice, on every match).
            floor = -1 if holes and member in self._holes else 0
            shifted = ids - floor if floor else ids
            if int(shifted.view(np.uint64).max()) >= limit - floor:
                low, high = int(ids.min()), int(ids.max())
                bad = low if low < floor else high
                raise _bad(f"{field}[{member}]: page id {bad} outside its pool of {limit} pages")

    def match(self, m: MatchOutcome, prompt_tokens: int) -> None:
        """A match's counts are whole pages within the prompt, its device pages as many
        as `device_tokens` says, and every page id within its pool."""
        ps = self.page_size
        counts = (("device_tokens", m.device_tokens), ("host_tokens", m.host_tokens),
                  ("storage_tokens", m.storage_tokens))
        for name, n in counts:
            if n < 0 or n % ps:
                raise _bad(f"{name}={n} is not a whole number of {ps}-token pages")
        total = m.device_tokens + m.host_tokens + m.storage_tokens
        if total > prompt_tokens:
            raise _bad(f"device_tokens + host_tokens + storage_tokens ({total}) exceed the "
                       f"prompt's {prompt_tokens} tokens")
        self._device(m.device_pages, m.device_tokens, "device_pages")
        self.pages(m.pages, "pages")

    def load(self, p: LoadProgress, before: LoadProgress | None) -> None:
        """A Load stream counts its layers up to a fixed total, and its last message's
        device pages are within their pools."""
        if p.layers_total < 1 or not 0 <= p.layers_ready <= p.layers_total:
            raise _bad(f"Load: layers_ready {p.layers_ready} of layers_total {p.layers_total}")
        if before is not None:
            if before.device_pages is not None:
                raise _bad("Load: a message after the last one")
            if p.layers_total != before.layers_total or p.layers_ready < before.layers_ready:
                raise _bad(f"Load: layers_ready {p.layers_ready} of {p.layers_total} after "
                           f"{before.layers_ready} of {before.layers_total}")
        if p.device_pages is not None:
            tokens = p.device_tokens or 0
            if tokens < 0 or tokens % self.page_size:
                raise _bad(f"Load: device_tokens={tokens} is not a whole number of pages")
            self._device(p.device_pages, tokens, "Load device_pages")

    def _device(self, pages: Mapping[str, np.ndarray], tokens: int, field: str) -> None:
        self.pages(pages, field, holes=True)
        want = tokens // self.page_size
        for member in self._full:
            got = len(pages.get(member, ()))
            if got != want:
                raise _bad(f"{field}[{member}]: {got} pages for {tokens} tokens")
