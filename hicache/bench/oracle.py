"""Content oracle for test engines: KV bytes that are a deterministic function of
(namespace, page hash, layer, member), written into mapped L1 pages and checked byte for
byte wherever a page comes back from, whatever tier it went through."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from hicache.config import MemberSpec
from hicache.controller.base import AttachInfo
from hicache.keys import chain_hashes, chain_seed, split_hashes
from hicache.types import ComponentKind

if TYPE_CHECKING:
    import torch  # (the pools' type only: a driver that never maps pools need not load it)


class KvOracle:
    def __init__(self, info: AttachInfo, pools: Mapping[str, tuple[torch.Tensor, ...]],
                 namespace: str = "") -> None:
        self.info = info
        self.pools = pools
        self.page_size = info.page_size
        self.seed = chain_seed(namespace, "oracle", "", "")
        self.pages_checked = 0  # (counted per page and layer, and per member)
        self.wrong_bytes = 0
        # Pages the reply should have listed and did not (each counted as wrong bytes too,
        # a whole row per layer): a short or missing list would otherwise be checked less.
        self.pages_missing = 0
        # Each component's window (its own member, named after it, carries it).
        self._windows = {m.component: m.window_tokens for m in info.members
                         if m.name == m.component.value}

    def _hashes(self, tokens: bytes) -> list[bytes]:
        blob = chain_hashes(self.seed, tokens, self.page_size * 4)
        return list(split_hashes(blob))

    @staticmethod
    def _expected(keys: list[bytes], tag: bytes, width: int) -> np.ndarray:
        """Each page's row: its digest repeated, plus each byte's position (so a row moved
        by a multiple of the digest's 32 bytes reads wrong too)."""
        digests = b"".join(hashlib.sha256(k + tag).digest() for k in keys)
        rows = np.frombuffer(digests, dtype=np.uint8).reshape(len(keys), 32)
        reps = -(-width // 32)
        position = (np.arange(width) // 32 % 251).astype(np.uint8)
        return np.tile(rows, (1, reps))[:, :width] + position

    def _rows(self, member: str, layer: int) -> np.ndarray:
        return self.pools[member][layer].numpy()

    def write(self, tokens: bytes, pages: Mapping[str, np.ndarray], start_page: int) -> None:
        """KV of every whole page from `start_page` on (into `pages`, one id per page from
        there), and the recurrent state at the end (into the MAMBA slot)."""
        hs = self._hashes(tokens)
        for m in self.info.members:
            ids = np.asarray(pages[m.name], dtype=np.int64)
            for layer in range(m.layers):
                rows = self._rows(m.name, layer)
                tag = m.name.encode() + bytes([layer])
                if m.component is ComponentKind.MAMBA:
                    if len(ids) and hs:
                        rows[int(ids[0])] = self._expected([hs[-1]], b"state" + tag, rows.shape[1])[0]
                    continue
                n = len(hs) - start_page
                if n > 0:
                    rows[ids[:n]] = self._expected(hs[start_page:], tag, rows.shape[1])

    def _missing(self, m: MemberSpec, ids: np.ndarray, n_pages: int) -> int:
        """Pages of member `m` a reuse of `n_pages` must list and `ids` lacks: every page
        (FULL and its sidecars), the window before the boundary (SWA: earlier ones may be
        -1), the checkpoint at the boundary (MAMBA)."""
        if m.component is ComponentKind.MAMBA:
            return 0 if len(ids) else 1
        listed = ids[:n_pages]
        # (a sidecar follows its anchor's window; Attach reports the window on the anchor)
        window_tokens = self._windows.get(m.component, 0)
        if m.component is ComponentKind.SWA and window_tokens:
            need = min(n_pages, -(-window_tokens // self.page_size))
            window = listed[-need:] if len(listed) == n_pages else listed[:0]
            return need - int((window >= 0).sum())
        return n_pages - int((listed >= 0).sum())

    def verify(self, tokens: bytes, pages: Mapping[str, np.ndarray], n_pages: int) -> None:
        """Check the first `n_pages` reused pages (SWA tombstones, -1, are skipped) and the
        checkpoint at the boundary; counts page-layers checked and wrong bytes (a page the
        reply should list and does not counts as wrong: `_missing`)."""
        if n_pages == 0:
            return
        hs = self._hashes(tokens)[:n_pages]
        for m in self.info.members:
            ids = np.asarray(pages.get(m.name, np.empty(0)), dtype=np.int64)
            missing = self._missing(m, ids, n_pages)
            for layer in range(m.layers):
                rows = self._rows(m.name, layer)
                self.pages_missing += missing
                self.wrong_bytes += missing * rows.shape[1]
                tag = m.name.encode() + bytes([layer])
                if m.component is ComponentKind.MAMBA:
                    if len(ids):
                        want = self._expected([hs[-1]], b"state" + tag, rows.shape[1])[0]
                        self.wrong_bytes += int((rows[int(ids[0])] != want).sum())
                        self.pages_checked += 1
                    continue
                keep = ids[:n_pages] >= 0
                got = rows[ids[:n_pages][keep]]
                want = self._expected([h for h, k in zip(hs, keep, strict=False) if k], tag, rows.shape[1])
                self.wrong_bytes += int((got != want).sum())
                self.pages_checked += int(keep.sum())
