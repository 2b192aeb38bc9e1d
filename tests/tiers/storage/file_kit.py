"""Shared helpers of the file backend's race tests: a backend with room for so many
objects, what the store's directory holds, a call gated at a chosen point, a call run in a
thread."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.config import FileStorageConfig
from hicache.tiers.storage import HEADER_BYTES
from hicache.tiers.storage.file import FileBackend

WAIT = 10.0
OBJECT = HEADER_BYTES + 4096  # one stored page of `storage_pages.PAYLOAD` bytes


def sized_backend(root: Path, capacity_objects: int | None = None, *, timeout_s: float = 5.0,
                  threads: int | None = None, indexed: bool = False) -> FileBackend:
    """A started file backend at `root` with room for `capacity_objects` objects of
    OBJECT bytes (None: unbounded); `indexed`: returned once its start's walk is done."""
    cap = None if capacity_objects is None else capacity_objects * OBJECT / (1 << 30)
    backend = FileBackend(FileStorageConfig(path=str(root), capacity_gb=cap, threads=threads),
                          timeout_s=timeout_s)
    backend.start()
    if indexed:
        assert backend.wait_indexed(WAIT)
    return backend


def disk_objects(root: Path) -> dict[str, int]:
    """Digest -> bytes of each object file (`*.kv`) under `root` (one removed while it
    looked is not counted)."""
    out: dict[str, int] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".kv"):
                with contextlib.suppress(FileNotFoundError):
                    out[name[: -len(".kv")]] = os.path.getsize(os.path.join(folder, name))
    return out


def disk_bytes(root: Path) -> int:
    return sum(disk_objects(root).values())


def gate_call(monkeypatch: pytest.MonkeyPatch, owner: object, name: str,
              when: Callable[..., bool] = lambda *args: True, *, after: bool = False
              ) -> tuple[threading.Event, threading.Event]:
    """Wrap `owner.name`: the first call for which `when(*args)` holds sets `reached` and
    waits for `go` (before the real call, or `after` it). Returns (reached, go)."""
    real = getattr(owner, name)
    reached, go = threading.Event(), threading.Event()
    lock = threading.Lock()
    claimed: list[bool] = []

    def wrapper(*args: object, **kwargs: object) -> object:
        with lock:
            hit = not claimed and when(*args)
            if hit:
                claimed.append(True)
        if hit and not after:
            reached.set()
            assert go.wait(WAIT)
        out = real(*args, **kwargs)
        if hit and after:
            reached.set()
            assert go.wait(WAIT)
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return reached, go


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run `fn` in a daemon thread; its result (or the exception it raised) lands in the
    list returned with the thread."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # (reported by the test)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
