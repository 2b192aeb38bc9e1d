"""Frozen results the tree hands to its callers. Nodes appear only as opaque handles.

The two that every request gets (`MatchResult`, `InsertResult`) are named tuples: frozen
too, and built without an `object.__setattr__` per field as frozen dataclasses are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from hicache.types import ComponentKind, Tier

NodeHandle = object  # opaque to callers: pass it back to the tree, never inspect it
NOTHING: Mapping[ComponentKind, np.ndarray] = MappingProxyType({})  # an empty, read-only result


@dataclass(eq=False)
class TreeLock:
    """A lock on a matched path. Handed out by `match(lock=True)`, consumed by `unlock`
    (or by `insert(..., lock=...)` when not kept). Mutable only inside the tree."""

    namespace: str
    end: NodeHandle | None  # deepest locked boundary (None: nothing matched)
    mamba_nodes: tuple[NodeHandle, ...]
    prefix: bytes  # the request bytes the lock covers (tokens up to `end`)
    session_id: str | None
    session_gen: int
    device_end: NodeHandle | None = None  # deepest boundary resident in L1 (insert starts here)
    active: bool = True


class MatchResult(NamedTuple):
    """Page-aligned reuse lengths, each counted beyond the previous tier:
    `device_tokens` usable from L1 now; `host_tokens` more after a load from L2;
    `storage_tokens` more known (to the tree) to be in L3.

    `device_pages[kind]` are the L1 page ids of the device prefix: FULL and SWA one id per
    page (SWA: -1 before the window that ends at the boundary, which is all reuse reads,
    whether the tree holds those pages or they are tombstones), MAMBA the checkpoint
    slot at the device boundary (empty when the boundary is the root)."""

    device_tokens: int
    host_tokens: int
    storage_tokens: int
    matched_tokens: int  # tokens present in the topology (any tier, any component)
    device_pages: Mapping[ComponentKind, np.ndarray]
    lock: TreeLock | None
    path: tuple[NodeHandle, ...]  # nodes down to the storage boundary


class InsertResult(NamedTuple):
    inserted_tokens: int  # tokens new to the topology
    reused_tokens: int  # tokens the tree already held
    # Page ids the caller passed but the tree did not take (it held those pages already):
    # the caller frees them. FULL/SWA per page, MAMBA the checkpoint slot. They may be
    # views of the arrays the caller passed (the tree copies only what it keeps).
    released: Mapping[ComponentKind, np.ndarray]
    end: NodeHandle | None
    # Page ids of the OTHER paged tier (L2 for an insert into L1, L1 for one into L2) the
    # tree let go: an SWA tail there was shorter than the one this insert brought, and a
    # slot has one length per node. The caller frees them in that tier. Usually empty.
    dropped: Mapping[ComponentKind, np.ndarray] = NOTHING


@dataclass(frozen=True)
class Victim:
    """A slot about to leave `tier`: `pages[kind]` for the component and every other
    slot of that node in the same tier that leaves with it (a FULL eviction takes the
    node's SWA/MAMBA slots of that tier too)."""

    node: NodeHandle
    tier: Tier
    pages: Mapping[ComponentKind, np.ndarray]
    hashes: Callable[[], bytes]


@dataclass(frozen=True)
class EvictResult:
    evicted_pages: int  # pages of the requested component that left the tier
    freed: Mapping[ComponentKind, np.ndarray]  # every page id that left (to free)
    victims: int
    # Nodes kept because their slot in the tier is the last copy of a node with children
    # (a copy that found no room, or was never made): they stay until a copy is made.
    stranded: tuple[NodeHandle, ...] = ()
