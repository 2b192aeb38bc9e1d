"""Shared helpers of the L3 write-path tests: hold the backend's writes, wait for a
condition, and ask what L3 holds and what the tree would still write."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine_sim import Engine

from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

WAIT = 10.0


class Held:
    """Holds the backend's `_write_from` calls whose keys match `pick` (all by default)
    until `open()`; records every key each call was given (held or not)."""

    def __init__(self, ctl, pick=None) -> None:  # type: ignore[no-untyped-def]
        self.ctl = ctl
        self.backend = ctl.l3.backend
        self.original = self.backend._write_from
        self.real = self.original  # (what a held call goes on to: a test may wrap it)
        self.gate = threading.Event()
        self.reached = threading.Event()
        self.pick = pick or (lambda keys: True)
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

        def held(keys, buffers):  # type: ignore[no-untyped-def]
            with self.lock:
                self.calls.append(list(keys))
            if self.pick(keys):
                self.reached.set()
                assert self.gate.wait(WAIT), "write gate never opened"
            return self.real(keys, buffers)

        self.backend._write_from = held

    def put_keys(self) -> list[str]:
        with self.lock:
            return [k for call in self.calls for k in call]

    def wait_reached(self) -> None:
        assert self.reached.wait(WAIT), "no L3 write reached the backend"

    def open(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        self.backend._write_from = self.original


def wait_for(cond: Callable[[], bool], timeout_s: float = WAIT) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def resident(ctl, node, kind: ComponentKind, tier: Tier) -> bool:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return bool(ctl.tree.is_resident(node, kind, tier))


def in_l3(ctl, eng: Engine, tokens: bytes, kind: ComponentKind, lo: int, hi: int) -> int:  # type: ignore[no-untyped-def]
    """How many of pages [lo, hi) of `tokens` have every object of `kind`'s family in L3."""
    family = ctl.cfg.model.family(kind)
    n = 0
    for h in eng.hashes(tokens)[lo:hi]:
        ks = ctl.l3.keys("", [h], family)
        n += ctl.l3.backend.exists_prefix(ks) == len(ks)
    return n


def quiet_and_unwritten(ctl) -> list[tuple[int, list[ComponentKind]]]:  # type: ignore[no-untyped-def]
    """(depth in pages, kinds) of every node with slots an L3 write would still add."""
    with ctl._mu:
        out = []
        for node in ctl.tree.iter_nodes():
            kinds = ctl.tree.slots_for_storage(node)
            if kinds:
                out.append((ctl.tree.depth_tokens(node) // ctl.cfg.model.page_size, kinds))
        return out


def storage_tokens(ctl, tokens: bytes) -> int:  # type: ignore[no-untyped-def]
    return int(ctl.match("e1", MatchRequest("", tokens)).storage_tokens)
