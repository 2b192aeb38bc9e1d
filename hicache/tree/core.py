"""HiRadixTree: one radix topology over page-aligned token ids, one slot per component.

Threading: the tree has one owner (the controller's serving thread); it takes no locks.
Hot paths (match, insert) cost O(nodes on the path), not O(tokens): token spans are
compared as bytes (memcmp), pages are keyed by their bytes, and numpy is used only where a
node must be split.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from hicache.arrays import any_negative, any_of, negative_mask
from hicache.errors import FailedPrecondition, InvalidArgument, NotFound
from hicache.keys import PAGE_HASH_BYTES, chain_hashes, chain_seed
from hicache.tree.components import FULL_INDEX, Component, build_components
from hicache.tree.eviction import EvictionQueue
from hicache.tree.node import LOW_TIERS, PAGED_TIERS, PARTIAL, Node
from hicache.tree.results import NOTHING, EvictResult, InsertResult, MatchResult, TreeLock, Victim
from hicache.tree.sessions import Session, SessionTable
from hicache.types import ComponentKind, EvictionPolicy, Tier

_EMPTY = np.empty(0, dtype=np.int64)
# Checkpoint slots below this get their one-id arrays as views of one shared arange.
_POINT_IDS_MAX = 1 << 20
_PAGED_MASK = (1 << PAGED_TIERS) - 1
_INT64 = np.dtype(np.int64)


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _grown(shared: np.ndarray, size: int, make: Callable[[int], np.ndarray]) -> np.ndarray:
    """`shared` (a read-only array views are handed out of) when it has `size` entries,
    else a read-only `make(n)`, `n` its length doubled until it is enough (views handed
    out earlier keep the old one alive)."""
    if len(shared) >= size:
        return shared
    n = len(shared)
    while n < size:
        n *= 2
    return _read_only(make(n))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# Below this many page ids comparing as lists costs less than a numpy comparison (a
# page-64 node holds about 16 ids).
_SMALL = 32
# Window walks owed (`_moved`) run without an eviction when this many gather.
_WINDOW_WALKS_AT = 4096


def _present_tail(n: int, absent: bytes | None) -> int:
    """How many of `n` given ids at the end are present (`absent`: their absent mask, one
    byte per id, None when none is absent)."""
    return n if absent is None else n - 1 - absent.rfind(b"\x01")


def _any_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Does some position hold the same id in both (same-length) arrays?"""
    if len(a) <= _SMALL:
        return any(map(operator.eq, a.tolist(), b.tolist()))
    return any_of(a == b)


class _KeepTheRest(int):
    """`KEEP_THE_REST`: a `before_drop` answer (truthy: keeps this victim too)."""


#: What `before_drop` returns to keep this victim and end the eviction there (every
#: later victim would be kept too: they rank after it).
KEEP_THE_REST = _KeepTheRest(1)

# What must happen before a slot leaves a tier (a write-back); True keeps it there for
# now (its copy could not be made yet): it stays queued for the next eviction.
BeforeDrop = Callable[[Victim], "bool | int | None"]


def _common_ancestor(a: Node | None, b: Node | None) -> Node | None:
    """The deepest node on both paths (None when either is None or the roots differ)."""
    while a is not b:
        if a is None or b is None:
            return None
        if a.depth >= b.depth:
            a = a.parent
        else:
            b = b.parent
    return a


class _RootInfo:
    __slots__ = ("namespace", "seed")

    def __init__(self, namespace: str, seed: bytes) -> None:
        self.namespace = namespace
        self.seed = seed


class HiRadixTree:
    """See DESIGN §1. Public methods validate their input and raise InvalidArgument /
    NotFound; internal invariants are asserted and verified by `check_integrity()`."""

    def __init__(
        self,
        page_size: int,
        components: Mapping[ComponentKind, int] | None = None,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        model_id: str = "model",
        kv_dtype: str = "",
        closed_session_tombstones: int = 4096,
        geometry: str = "",
        backed_up_tiers: Collection[Tier] = (),
        max_open_sessions: int = 1 << 16,
        tenant_of: Callable[[str], str] | None = None,
    ) -> None:
        """`backed_up_tiers`: tiers whose evictions first copy each slot to the other paged
        tier (write-back L1 -> L2): the last copy of a node with children is a candidate
        there (`evict` keeps it when its `before_drop` made no copy). `tenant_of`: whose a
        session id is; the open-session cap and the closed records hold per tenant (None:
        one tenant)."""
        if page_size <= 0:
            raise ValueError("page_size must be > 0")
        self.page_size = page_size
        self.backed_up_tiers = frozenset(int(t) for t in backed_up_tiers)
        # Called as `on_split(tail, head)` when a node is split (the original object stays
        # the tail): for a caller that keeps per-node state outside the tree.
        self.on_split: Callable[[Node, Node], None] | None = None
        self._pb = page_size * 4  # bytes of one page of token ids
        self.components: list[Component] = build_components(
            components or {ComponentKind.FULL: 0}, page_size
        )
        self._by_kind = {c.kind: c for c in self.components}
        # What most inserts hand back: nothing, one shared read-only mapping.
        self._nothing_released: Mapping[ComponentKind, np.ndarray] = MappingProxyType(
            {c.kind: _EMPTY for c in self.components})
        self._ncomp = len(self.components)
        self._path_comps = [c for c in self.components if c.path_scoped]
        self._path_idx = [c.index for c in self._path_comps]
        # Session references (DESIGN §1): a windowed component's (SWA's) cover the trailing
        # window of the session's path only, the other path-scoped ones the whole path.
        self._window_comps = [c for c in self._path_comps if c.window_pages]
        assert len(self._window_comps) <= 1, "one windowed component (one window per session)"
        self._whole_path_comps = [c for c in self._path_comps if not c.window_pages]
        # Where each component's lock count lives: path-scoped ones share FULL's.
        self._lock_idx = [FULL_INDEX if c.path_scoped else c.index for c in self.components]
        assert all(c.per_page for c in self._path_comps), "path-scoped slots hold a page per page"
        self._point_comps = [c for c in self.components if not c.path_scoped]
        self._point_idx = [c.index for c in self._point_comps]
        self._others = self.components[1:]
        self._page_comps = [c for c in self.components if c.per_page]
        # Components that vote on boundaries besides FULL; unwindowed ones answer from
        # one node, so they are asked first.
        self._voters = sorted(self._others, key=lambda c: c.window_pages)
        self._child_sensitive = [c.index for c in self._others if c.child_sensitive]
        # Components whose L1/L2 slot may hold only its node's tail (SWA).
        self._tails = frozenset(c.index for c in self.components if c.partial_tail)
        self._points = [c.index for c in self.components if not c.per_page]
        assert not any(c.child_sensitive for c in self.components if not c.per_page)
        # Per-page slots a new node offers at once (a child-sensitive one waits for a child).
        self._offered_new = frozenset(c.index for c in self._page_comps if not c.child_sensitive)
        # Child-sensitive slots (SWA) of a new leaf longer than its window: the pages
        # before the window may go alone (a tombstone), so the leaf is offered too.
        self._leaf_windows = {c.index: c.window_pages for c in self._page_comps if c.child_sensitive}
        assert all(c.per_page and c.path_scoped for c in self.components if c.partial_tail)
        self._seed_parts = (model_id, kv_dtype, geometry)  # see `keys.chain_seed`
        self._point_ids = _read_only(np.arange(1024, dtype=np.int64))  # see `_point`
        self._minus = _read_only(np.full(1024, -1, dtype=np.int64))  # see `_window_ids`
        self._roots: dict[str, Node] = {}
        self._tick = 0
        self._lfu = policy is EvictionPolicy.LFU
        self._resident = [[0] * self._ncomp for _ in Tier]
        self._locked = [[0] * self._ncomp for _ in Tier]
        self._locks: set[TreeLock] = set()
        self._sessions = SessionTable(closed_session_tombstones, max_open_sessions, tenant_of)
        self.sessions_closed_for_room = 0  # least recently used sessions closed past the cap
        self._queues = [
            [self._make_queue(tier, comp) for comp in self.components] for tier in range(PAGED_TIERS)
        ]
        self._queue_bits = [(q.bit, q) for tier_queues in self._queues for q in tier_queues]
        # Per tier, parents whose FULL children changed there since the last eviction: the
        # window walks of `_offer_windows` they owe, run (once per parent) when an eviction
        # next needs the queues. An insert then costs one append, not a walk per new node.
        self._moved: list[list[Node]] = [[] for _ in range(PAGED_TIERS)]

    def _make_queue(self, tier: int, comp: Component) -> EvictionQueue:
        ci = comp.index
        li = self._lock_idx[ci]
        return EvictionQueue(
            1 << (tier * self._ncomp + ci),
            comp.rank_key(self._lfu),
            comp.candidate_test(tier, tier in self.backed_up_tiers),
            lambda n: n.lock[li] > 0,
        )

    # ------------------------------------------------------------------ queries

    @property
    def kinds(self) -> tuple[ComponentKind, ...]:
        return tuple(c.kind for c in self.components)

    def resident_pages(self, tier: Tier, kind: ComponentKind) -> int:
        return self._resident[tier][self._by_kind[kind].index]

    def locked_pages(self, tier: Tier, kind: ComponentKind) -> int:
        return self._locked[tier][self._by_kind[kind].index]

    @property
    def session_clock(self) -> int:
        """Now, on the sessions' clock: what a request that names its session only when
        it ends passes to `insert` as `session_since` (when it began)."""
        return self._sessions.clock

    @property
    def active_locks(self) -> int:
        return len(self._locks)

    def match(
        self,
        namespace: str,
        tokens: bytes,
        *,
        lock: bool = False,
        session_id: str | None = None,
    ) -> MatchResult:
        """Find the deepest safe reuse boundary of `tokens` per tier (DESIGN §1).

        Mutates: splits the node a match ends inside; updates access time and hit count of
        every node on the matched path; with `lock`, locks the path down to the host
        boundary (and the MAMBA checkpoints at the device and host boundaries)."""
        tokens = self._check_tokens(tokens)
        path = self._walk(self._roots.get(namespace), tokens, len(tokens) - len(tokens) % self._pb)
        self._tick += 1
        tick = self._tick
        for node in path:
            node.last_access = tick
            node.hits += 1
        i0 = self._boundary(path, LOW_TIERS[0])
        i1 = self._boundary(path, LOW_TIERS[1], i0) if len(path) > i0 else i0
        i2 = self._boundary(path, LOW_TIERS[2], i1) if len(path) > i1 else i1
        # (plain expressions: a generator here took ~3 us of a match in the daemon, where
        # every request meets cold caches; measured under a line profiler)
        d0 = path[i0 - 1].depth if i0 else 0
        d1 = path[i1 - 1].depth if i1 else 0
        d2 = path[i2 - 1].depth if i2 else 0
        device_pages = self._device_pages(path, i0)
        tree_lock = None
        if lock:
            gen = self._open_session(session_id) if session_id else 0
            end = path[i1 - 1] if i1 else None
            # The device and host boundaries' nodes, once each (i0 <= i1).
            points = (path[i0 - 1], end) if 0 < i0 < i1 else (end,) if end is not None else ()
            tree_lock = TreeLock(
                namespace=namespace,
                end=end,
                mamba_nodes=points,
                prefix=tokens[: d1 * self._pb],
                session_id=session_id,
                session_gen=gen,
                device_end=path[i0 - 1] if i0 else None,
            )
            self._lock(tree_lock)
        ps = self.page_size
        return MatchResult(
            device_tokens=d0 * ps,
            host_tokens=(d1 - d0) * ps,
            storage_tokens=(d2 - d1) * ps,
            matched_tokens=(path[-1].depth if path else 0) * ps,
            device_pages=device_pages,
            lock=tree_lock,
            path=tuple(path[:i2]),
        )

    def _check_tokens(self, tokens: bytes) -> bytes:
        if not isinstance(tokens, bytes):
            tokens = bytes(tokens)
        if len(tokens) % 4:
            raise InvalidArgument(
                f"tokens: {len(tokens)} bytes is not a multiple of 4 (little-endian uint32 ids)"
            )
        return tokens

    def served_tokens(self, namespace: str, tokens: bytes) -> int:
        """How many of `tokens` (whole pages) a match would serve from L1 or L2 (its host
        boundary), without counting an access or a hit: for a prefetch asking whether
        another brought its pages. Splits the node it ends in, as a match does."""
        tokens = self._check_tokens(tokens)
        path = self._walk(self._roots.get(namespace), tokens, len(tokens) - len(tokens) % self._pb)
        i0 = self._boundary(path, LOW_TIERS[0])
        i1 = self._boundary(path, LOW_TIERS[1], i0) if len(path) > i0 else i0
        return (path[i1 - 1].depth if i1 else 0) * self.page_size

    def _walk(self, root: Node | None, tokens: bytes, limit: int) -> list[Node]:
        """Nodes matching `tokens[:limit]` (whole pages), splitting the one a match ends in."""
        path: list[Node] = []
        if root is None:
            return path
        pb = self._pb
        children = root.children
        pos = 0
        while pos < limit:
            child = children.get(tokens[pos : pos + pb])
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end <= limit and tokens.startswith(key, pos):  # (no copy of the span)
                path.append(child)
                children = child.children
                pos = end
                continue
            k = self._common_pages(key, tokens, pos, limit)
            path.append(self._split(child, k))
            break
        return path

    def _common_pages(self, key: bytes, tokens: bytes, pos: int, limit: int) -> int:
        n = min(len(key), limit - pos) // 4
        a = np.frombuffer(key, dtype=np.uint32, count=n)
        b = np.frombuffer(tokens, dtype=np.uint32, count=n, offset=pos)
        diff = np.flatnonzero(a != b)
        first = int(diff[0]) if len(diff) else n
        return first // self.page_size

    def _boundary(self, path: Sequence[Node], tiers: int, known: int = 0) -> int:
        """How many nodes of `path` lie above the deepest boundary every component accepts
        (deepest first: a rejection moves one boundary up, it does not end the walk).
        `known`: a boundary accepted with fewer tiers, so accepted here too (validity only
        grows with the tiers allowed): the search stops there."""
        n = self.components[FULL_INDEX].valid_prefix(path, tiers, known)
        voters = self._voters
        if not voters:
            return n
        for i in range(n, known, -1):
            for comp in voters:
                if not comp.valid_at(path, i, tiers):
                    break
            else:
                return i
        return known

    def _device_pages(self, path: Sequence[Node], n: int) -> dict[ComponentKind, np.ndarray]:
        if not n:
            return {c.kind: _EMPTY for c in self.components}
        out: dict[ComponentKind, np.ndarray] = {}
        top = path[:n]
        depth = top[-1].depth
        for comp in self.components:
            slot = comp.index * PAGED_TIERS
            if not comp.per_page:
                value = top[-1].res[slot]
                out[comp.kind] = value if value is not None else _EMPTY
                continue
            # A windowed component: reuse reads only the window before the boundary, so
            # the ids before it are -1 (neither copied nor sent), held or not.
            w = comp.window_pages if comp.window_pages < depth else 0
            if w and (windowed := self._window_ids(top, slot, w)) is not None:
                out[comp.kind] = windowed
                continue
            parts = [node.res[slot] for node in top]
            if n == 1 and parts[0] is not None and len(parts[0]) == depth:  # type: ignore[arg-type]
                out[comp.kind] = parts[0]  # type: ignore[assignment]
                continue
            # Usually every slot is held whole: one concatenation, which fails on a
            # tombstone (None) and comes out short on a partial slot, both rarer than
            # scanning the path for them first (one pass each, every match).
            joined: np.ndarray | None
            try:
                joined = np.concatenate(parts)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                joined = None
            if joined is not None and len(joined) == depth:
                out[comp.kind] = joined
                continue
            # Tombstones (SWA outside the window) read as -1: fill in what is held (a
            # partial slot is its node's tail).
            ids = np.full(depth, -1, dtype=np.int64)
            for node, held in zip(top, parts, strict=True):
                if held is not None:
                    ids[node.depth - len(held) : node.depth] = held
            out[comp.kind] = ids
        return out

    def _window_ids(self, top: Sequence[Node], slot: int, w: int) -> np.ndarray | None:
        """A windowed component's ids for the prefix ending at `top[-1]` (deeper than `w`
        pages): the held ids of its last `w` pages, -1 before them. None when some page of
        the window is not held in that slot: a boundary the component does not accept, which
        a match or load never hands out (the caller then fills in what is held)."""
        parts: list[np.ndarray] = []
        need = w
        j = len(top) - 1
        while need > 0:
            node = top[j]
            held = node.res[slot]
            take = need if need < node.npages else node.npages
            if held is None or len(held) < take:
                return None
            parts.append(held if take == len(held) else held[len(held) - take :])
            need -= take
            j -= 1
        before = top[-1].depth - w
        self._minus = _grown(self._minus, before, lambda size: np.full(size, -1, dtype=np.int64))
        parts.append(self._minus[:before])
        parts.reverse()
        return np.concatenate(parts)

    # ------------------------------------------------------------------ locks

    def _lock(self, lock: TreeLock) -> None:
        self._locks.add(lock)
        self._apply_lock(lock, +1)

    def pin(self, node: object, namespace: str = "") -> TreeLock:
        """Lock the path from the root down to `node` (and its point slots) while a
        transfer reads or writes its pages; release with `unlock`."""
        assert isinstance(node, Node) and node.parent is not None
        lock = TreeLock(
            namespace=node.root.namespace,
            end=node,
            mamba_nodes=(node,),
            prefix=b"",
            session_id=None,
            session_gen=0,
            device_end=node if node.mask[FULL_INDEX] & 1 else None,
        )
        self._lock(lock)
        return lock

    def eviction_rank(self, tier: Tier, kind: ComponentKind, node: object, locks: int = 0) -> int | None:
        """Where `node`'s slot of `kind` stands in `tier`'s eviction order (lower goes
        first), were it held by no more than `locks` locks; None when it is no candidate
        now (not live, structurally kept, or locked more)."""
        assert isinstance(node, Node)
        comp = self._by_kind[kind]
        if node.lock[self._lock_idx[comp.index]] > locks or not self.is_live(node):
            return None
        return self._queues[tier][comp.index].rank_of(node)

    def lock_path(self, lock: TreeLock) -> tuple[object, ...]:
        """The nodes a lock covers, root first (for the controller's load plan)."""
        return self.path_to(lock.end)

    def path_to(self, node: object) -> tuple[object, ...]:
        """Nodes from the root (exclusive) down to `node`, root first."""
        out: list[Node] = []
        current = node
        while isinstance(current, Node) and current.parent is not None:
            out.append(current)
            current = current.parent
        return tuple(reversed(out))

    def nodes_lacking(self, node: object, kind: ComponentKind, tier: Tier) -> list[object]:
        """Nodes on the path to `node` (root first) whose `kind` slot is not in `tier`."""
        bit = 1 << tier
        ci = self._by_kind[kind].index
        out: list[object] = []
        current = node
        while isinstance(current, Node) and current.parent is not None:
            if not current.mask[ci] & bit:
                out.append(current)
            current = current.parent
        out.reverse()
        return out

    def is_leaf(self, node: object) -> bool:
        assert isinstance(node, Node)
        return not node.children

    def parent_of(self, node: object) -> object | None:
        """The node above `node` (None at a namespace root)."""
        assert isinstance(node, Node)
        parent = node.parent
        return parent if parent is not None and parent.parent is not None else None

    def pages_of(self, node: object, kind: ComponentKind, tier: Tier) -> np.ndarray | None:
        """Page ids of `node`'s `kind` slot in DEVICE/HOST (None when not resident)."""
        assert isinstance(node, Node)
        return node.res[self._by_kind[kind].index * PAGED_TIERS + tier]

    def is_resident(self, node: object, kind: ComponentKind, tier: Tier) -> bool:
        assert isinstance(node, Node)
        return bool(node.mask[self._by_kind[kind].index] & (1 << tier))

    def slots_for_storage(self, node: object, stale_before: float | None = None) -> list[ComponentKind]:
        """Kinds of `node` whose slot an L3 write would add, FULL first: with FULL going
        down (in L2, not recorded in L3), every slot L2 holds that L3 has not recorded;
        with FULL recorded in L3 already, only whole ones (a checkpoint or window committed
        since): a partial slot, an SWA tail, is never recorded in L3, and offering it again
        would write it on every call. Nothing while FULL is in neither. `stale_before` (a
        store whose objects expire): a record of FULL older than this (`stored_at`) may
        name expired objects, so every slot L2 holds is offered again."""
        assert isinstance(node, Node)
        host, storage = 1 << Tier.HOST, 1 << Tier.STORAGE
        mask = node.mask
        skip = storage
        if mask[FULL_INDEX] & storage:
            if (stale_before is not None and mask[FULL_INDEX] & host
                    and self.storage_stale(node, stale_before)):
                skip = 0
            else:
                skip |= PARTIAL
        elif not mask[FULL_INDEX] & host:
            return []
        return [c.kind for c in self.components if mask[c.index] & host and not mask[c.index] & skip]

    def storage_stale(self, node: object, stale_before: float) -> bool:
        """Whether `node`'s FULL slot is recorded in STORAGE since before `stale_before`."""
        assert isinstance(node, Node)
        return bool(node.mask[FULL_INDEX] & (1 << Tier.STORAGE)) and node.stored_at < stale_before

    def storage_renewed(self, node: object) -> None:
        """`node`'s objects were written to L3 again, or found there (renewing their expiry):
        its record of FULL in STORAGE dates from now (see `slots_for_storage`)."""
        assert isinstance(node, Node)
        if node.mask[FULL_INDEX] & (1 << Tier.STORAGE):
            node.stored_at = time.monotonic()

    def is_live(self, node: object) -> bool:
        """Whether `node` is still part of the tree (not evicted from every tier)."""
        assert isinstance(node, Node)
        parent = node.parent
        return parent is not None and parent.children.get(node.key[: self._pb]) is node

    def hits(self, node: object) -> int:
        assert isinstance(node, Node)
        return node.hits

    def namespace_of(self, node: object) -> str:
        assert isinstance(node, Node)
        return str(node.root.namespace)

    def depth_tokens(self, node: object | None) -> int:
        return node.depth * self.page_size if isinstance(node, Node) else 0

    def full_pages_only_above(self, tier: Tier) -> int:
        """FULL pages the tree holds in a tier above `tier` and not in `tier` (O(tree)):
        for L3, what a flush would still have to write."""
        above, there = (1 << tier) - 1, 1 << tier
        total = 0
        for node in self.iter_nodes():
            assert isinstance(node, Node)
            mask = node.mask[FULL_INDEX]
            if mask & above and not mask & there:
                total += node.npages
        return total

    def iter_nodes(self) -> list[object]:
        """Every node of every namespace (for flush and audits; O(tree))."""
        out: list[object] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def chain_prev(self, namespace: str, node: object | None) -> bytes:
        """The hash the chain of pages after `node` continues from (the root of `namespace`
        when None): `keys.chain_hashes(chain_prev(...), tokens, ...)` are the L3 keys of
        pages beyond the tree, computed without the tree (outside the caller's lock)."""
        if isinstance(node, Node) and node.parent is not None:
            return self.page_hashes(node)[-PAGE_HASH_BYTES:]
        return chain_seed(namespace, *self._seed_parts)

    def mark_loaded(self, lock: TreeLock) -> dict[ComponentKind, np.ndarray]:
        """After a load brought the lock's whole path into L1: inserts with this lock now
        start at its end; returns the path's L1 pages (as a match's `device_pages`).
        Raises InvalidArgument if some node is still not in L1, and
        FailedPrecondition if the end is reusable from L1 and L2 but L1 alone lacks
        something a component needs there (an SWA window, a MAMBA checkpoint): an engine
        told otherwise would compute with KV that is not there."""
        path = self.lock_path(lock)
        for node in path:
            assert isinstance(node, Node)
            if not node.mask[FULL_INDEX] & 1:
                raise InvalidArgument("the locked path is not in L1 yet")
        last = len(path)
        if (path and self._boundary(path, LOW_TIERS[0], last - 1) != last  # type: ignore[arg-type]
                and self._boundary(path, LOW_TIERS[1], last - 1) == last):  # type: ignore[arg-type]
            raise FailedPrecondition(
                "the load did not bring everything the matched boundary needs into L1 "
                "(its pages changed meanwhile); match again"
            )
        lock.device_end = lock.end
        return self._device_pages(path, last)  # type: ignore[arg-type]

    def full_in_host(self, node: object) -> bool:
        """Whether every FULL page on the path to `node` is in L1 or L2 (what else the
        prefix needs at its end may not be: see `reusable_from_host`)."""
        path = self.path_to(node)
        return self.components[FULL_INDEX].valid_prefix(path, LOW_TIERS[1]) == len(path)  # type: ignore[arg-type]

    def reusable_from_host(self, node: object) -> bool:
        """Whether the prefix ending at `node` is reusable from L1 and L2 alone: every page
        of its path in one of them, and what each component needs at its end (an SWA
        window, a MAMBA checkpoint). What a prefetch may count as ready."""
        path = self.path_to(node)
        return bool(path) and self._boundary(path, LOW_TIERS[1]) == len(path)  # type: ignore[arg-type]

    def unlock(self, lock: TreeLock) -> None:
        """Release a lock. Raises NotFound when it was released already."""
        if not lock.active:
            raise NotFound("lock was already released")
        lock.active = False
        self._locks.discard(lock)
        self._apply_lock(lock, -1)

    def _apply_lock(self, lock: TreeLock, delta: int) -> None:
        if isinstance(lock.end, Node):
            self._lock_path(lock.end, delta)
        points = self._point_idx
        if not points:
            return
        locked = self._locked
        for point in lock.mamba_nodes:  # per point slot, inlined (hot: every request)
            node: Node = point  # type: ignore[assignment]
            lk = node.lock
            for ci in points:
                before = lk[ci]
                after = before + delta
                assert after >= 0, f"lock underflow at {node}"
                lk[ci] = after
                if node.lparked and not after:
                    self._reoffer(node)
                mask = node.mask[ci]
                if mask and not (before and after):
                    if mask & 1:
                        locked[0][ci] += delta
                    if mask & 2:
                        locked[1][ci] += delta
                    if mask & 4:
                        locked[2][ci] += delta

    def _lock_path(self, end: Node, delta: int) -> None:
        # Hot: runs twice per request over the whole path, hence the inlined counters.
        # Path-scoped slots of a node are always locked together: they share one count,
        # FULL's (`_lock_idx`), which also says whether the node's lock state flips.
        indices = self._path_idx
        locked = self._locked
        node: Node | None = end
        while node is not None and node.parent is not None:
            lk = node.lock
            before = lk[FULL_INDEX]
            after = before + delta
            lk[FULL_INDEX] = after
            if not (before and after):
                if node.lparked and not after:
                    self._reoffer(node)
                n = node.npages * delta
                mask = node.mask
                for ci in indices:
                    m = mask[ci]
                    if m & PARTIAL:  # the paged slot is the node's tail: its length counts
                        res = node.res
                        if m & 1:
                            locked[0][ci] += len(res[ci * PAGED_TIERS]) * delta  # type: ignore[arg-type]
                        if m & 2:
                            locked[1][ci] += len(res[ci * PAGED_TIERS + 1]) * delta  # type: ignore[arg-type]
                        continue  # (never recorded in L3)
                    if m & 1:
                        locked[0][ci] += n
                    if m & 2:
                        locked[1][ci] += n
                    if m & 4:
                        locked[2][ci] += n
            node = node.parent

    def _reoffer(self, node: Node) -> None:
        """`node` is unlocked: offer it again to the queues it left while locked."""
        bits, node.lparked = node.lparked, 0
        for bit, queue in self._queue_bits:
            if bits & bit:
                queue.offer(node)

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        namespace: str,
        tokens: bytes,
        pages: Mapping[ComponentKind, np.ndarray],
        *,
        lock: TreeLock | None = None,
        keep_lock: bool = False,
        mamba_slot: int | None = None,
        session_id: str | None = None,
        session_since: int | None = None,
        tier: Tier = Tier.DEVICE,
    ) -> InsertResult:
        """Commit `tokens` (whole pages; a partial last page is ignored) with its L1 pages.

        `pages[kind]` (FULL, SWA) hold one L1 page id per page of `tokens` after the
        lock's device boundary (from the start when there is no lock); SWA may hold -1
        for pages already freed outside the window. `mamba_slot` is the checkpoint at the
        end. Pages the tree already holds are returned in `released` for the caller to
        free. Consumes `lock` unless `keep_lock`, in which case the lock moves to the new
        end. Raises InvalidArgument for mismatched lengths or a lock that does not cover
        a prefix of `tokens`, NotFound for a released lock.

        `tier=HOST` commits pages that arrived in L2 (a prefetch): they continue the
        lock's whole path rather than its device part. `session_since`: when the request
        began (`session_clock`), for a session it names that its lock does not carry: a
        session closed since stays closed (the insert references nothing)."""
        tokens = self._check_tokens(tokens)
        if tier is Tier.STORAGE:
            raise InvalidArgument("L3 residency is recorded with set_resident, not insert")
        pb = self._pb
        total = len(tokens) // pb
        had_root = namespace in self._roots
        start = self._start_node(namespace, tokens, lock, tier)
        begin = start.depth
        try:
            provided, gapped = self._check_pages(pages, total - begin)
        except BaseException:
            if not had_root and start.parent is None and not start.children:
                del self._roots[namespace]  # (refused: it changes nothing, keeps no root)
            raise
        released: list[list[np.ndarray]] = [[] for _ in self.components]
        dropped: list[tuple[int, np.ndarray]] = []  # (component index, ids): rare
        self._tick += 1
        tick = self._tick
        node, pos = start, begin
        while pos < total:
            child = node.children.get(tokens[pos * pb : (pos + 1) * pb])
            if child is None:
                break
            end = pos + child.npages
            if end <= total and tokens.startswith(child.key, pos * pb):
                k = child.npages
            else:
                k = self._common_pages(child.key, tokens, pos * pb, total * pb)
                child = self._split(child, k)
            self._reconcile(child, provided, gapped, pos - begin, released, tier, dropped)
            child.last_access = tick
            node, pos = child, pos + k
        reused = pos
        if pos < total:  # a new end gets its checkpoint with the rest of its family
            node = self._add_suffix(node, tokens, pos, total, provided, gapped, begin, tick, tier,
                                    mamba_slot)
        elif mamba_slot is not None:
            self._place_checkpoint(node, mamba_slot, released, tier)
        if lock is not None:
            if keep_lock:
                self._move_lock(lock, node, tokens)
            else:
                self.unlock(lock)
        if node.parent is None and not node.children and self._roots.get(namespace) is node:
            # Nothing committed into a namespace that holds nothing: no root is kept for
            # it (a root each for an empty Insert's namespace would grow without bound).
            del self._roots[namespace]
        sid = session_id if session_id is not None else (lock.session_id if lock else None)
        if sid and not keep_lock:
            gen = (lock.session_gen if lock is not None and lock.session_id == sid
                   else self._open_session(sid, session_since))
            self._reference_session(sid, gen, node if node.parent is not None else None)
        ps = self.page_size
        return InsertResult(
            inserted_tokens=(total - reused) * ps,
            reused_tokens=reused * ps,
            released={
                c.kind: _cat(r) if (r := released[c.index]) else _EMPTY for c in self.components
            } if any(released) else self._nothing_released,
            end=node if node.parent is not None else None,
            dropped=self._by_component(dropped) if dropped else NOTHING,
        )

    def _start_node(self, namespace: str, tokens: bytes, lock: TreeLock | None,
                    tier: Tier = Tier.DEVICE) -> Node:
        if lock is None:
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = Node(b"", 0, None, self._ncomp)
                root.root = _RootInfo(namespace, chain_seed(namespace, *self._seed_parts))
            return root
        if not lock.active:
            raise NotFound("lock was already released")
        if lock.namespace != namespace:
            raise InvalidArgument(
                f"namespace {namespace!r} does not match the lock's namespace {lock.namespace!r}"
            )
        if not tokens.startswith(lock.prefix):
            raise InvalidArgument(
                "tokens do not start with the prefix the lock was matched on "
                f"({len(lock.prefix) // 4} tokens)"
            )
        start = lock.device_end if tier is Tier.DEVICE else lock.end
        if start is None:
            start = self._roots.get(namespace)
        if start is None:
            return self._start_node(namespace, tokens, None)
        return start  # type: ignore[return-value]

    def _check_pages(self, pages: Mapping[ComponentKind, np.ndarray],
                     n: int) -> tuple[dict[int, np.ndarray], dict[int, bytes]]:
        """The given page ids per component index, in component order (FULL first), and
        for each index whose ids have gaps (-1: pages already freed, e.g. SWA out of
        window) the absent mask, one byte per page (1: absent), searched as bytes."""
        out: dict[int, np.ndarray] = {}
        gapped: dict[int, bytes] = {}
        known = 0
        for comp in self._page_comps:
            given = pages.get(comp.kind)
            if given is not None:
                known += 1
            else:
                if n:
                    self._refuse_unknown(pages)
                    raise InvalidArgument(f"pages[{comp.kind.value}]: missing ({n} pages expected)")
                out[comp.index] = _EMPTY
                continue
            # The tree never aliases the caller's array: an int64 array (the usual case) is
            # read here and only the parts the tree keeps are copied, where it keeps them
            # (`_add_suffix`, `_reconcile`): of an SWA array mostly -1, only the window.
            arr = given if type(given) is np.ndarray and given.dtype is _INT64 else np.array(given, dtype=np.int64)
            if arr.ndim != 1 or len(arr) != n:
                raise InvalidArgument(
                    f"pages[{comp.kind.value}]: {len(arr)} page ids for {n} new pages of tokens"
                )
            if n and (arr.item(0) < 0 or any_negative(arr)):  # (SWA's gaps usually lead)
                if comp.index == FULL_INDEX:
                    raise InvalidArgument("pages[full]: page ids must be >= 0")
                gapped[comp.index] = negative_mask(arr)  # (the absent pages)
            out[comp.index] = arr
        if len(pages) != known:
            self._refuse_unknown(pages)
        return out, gapped

    def _refuse_unknown(self, pages: Mapping[ComponentKind, np.ndarray]) -> None:
        for kind in pages:
            comp = self._by_kind.get(kind)
            if comp is None:
                raise InvalidArgument(f"pages for {kind.value!r}, which this model does not have")
            if not comp.per_page:
                raise InvalidArgument(f"pages[{kind.value}]: pass the checkpoint as mamba_slot instead")

    def _reconcile(self, node: Node, provided: dict[int, np.ndarray], gapped: dict[int, bytes], off: int,
                   released: list[list[np.ndarray]], tier: int, dropped: list[tuple[int, np.ndarray]]) -> None:
        """Pages given for a span the tree already holds: keep the tree's own, adopt the
        given ones into an empty slot of `tier` (or in front of a partial slot shorter
        than what they bring), hand the rest back."""
        n = node.npages
        res = node.res
        for ci, arr in provided.items():
            ids = arr[off : off + n]
            held = res[ci * PAGED_TIERS + tier]
            gaps = gapped.get(ci)
            absent = gaps[off : off + n] if gaps is not None else None
            if held is not None:
                m = len(held)
                if m < n and self._longer_tail(node, ci, tier, absent, m, dropped):
                    # A tail shorter than the present pages given (e.g. a split left it
                    # less than a window): the given ones in front of it extend it.
                    present = _present_tail(n, absent)
                    keep = ids[n - m :] != held
                    if any_of(keep):
                        released[ci].append(ids[n - m :][keep])
                    self._release_present(ids[: n - present], released[ci])
                    self._drop(node, self.components[ci], tier, {self.components[ci].kind: []})
                    self._set(node, self.components[ci], tier, np.concatenate([ids[n - present : n - m], held]))
                    continue
                mine = ids if m == n else ids[n - m :]  # a partial slot is the node's tail
                if ci not in gapped and not _any_equal(mine, held):
                    released[ci].append(ids)  # the usual case: freshly computed pages
                    continue
                keep = mine != held
                if ci in gapped:
                    keep &= mine >= 0
                if any_of(keep):
                    released[ci].append(mine[keep])
                if m < n:
                    self._release_present(ids[: n - m], released[ci])
                continue
            take = 0
            if ci == FULL_INDEX or res[FULL_INDEX * PAGED_TIERS + tier] is not None:
                take = self._adoptable(node, ci, tier, absent, dropped)
            if take:
                self._set(node, self.components[ci], tier, (ids if take == n else ids[n - take :]).copy())
            self._release_present(ids[: n - take], released[ci])

    def _by_component(self, pairs: list[tuple[int, np.ndarray]]) -> dict[ComponentKind, np.ndarray]:
        joined: dict[ComponentKind, list[np.ndarray]] = {}
        for ci, ids in pairs:
            joined.setdefault(self.components[ci].kind, []).append(ids)
        return {kind: _cat(parts) for kind, parts in joined.items()}

    @staticmethod
    def _release_present(ids: np.ndarray, out: list[np.ndarray]) -> None:
        present = ids[ids >= 0]
        if len(present):
            out.append(present)

    def _adoptable(self, node: Node, ci: int, tier: int, absent: bytes | None,
                   dropped: list[tuple[int, np.ndarray]]) -> int:
        """How many trailing pages of the ids given for `node` (whose `ci` slot `tier`
        lacks; `absent`: their absent mask, None when all are present) the slot may take:
        all of them, or for a `partial_tail` component the present tail, or 0. A slot
        has one length per node and an L3 copy is whole: the other paged tier's copy
        sets the length, unless it is a shorter tail that `_longer_tail` lets go."""
        n = node.npages
        present = _present_tail(n, absent)
        if ci not in self._tails:
            return n if present == n else 0
        mask = node.mask[ci]
        if mask & (1 << Tier.STORAGE):
            return n if present == n else 0
        other = node.res[ci * PAGED_TIERS + (1 - tier)] if mask & _PAGED_MASK else None
        if other is not None and not self._longer_tail(node, ci, tier, absent, len(other), dropped):
            return len(other) if present >= len(other) else 0
        return present

    def _longer_tail(self, node: Node, ci: int, tier: int, absent: bytes | None, m: int,
                     dropped: list[tuple[int, np.ndarray]]) -> bool:
        """May `tier` hold a longer tail of `ci` at `node` than the `m` pages it or the
        other paged tier holds, given ids whose absent mask is `absent`? Only for
        `partial_tail` components, and only while the node is unlocked: a pinned L1->L2
        copy, a load or a prefetch reads its slots as they are (and an engine uses them).
        Then the other tier's copy, if any, is dropped (its ids into `dropped`, for the
        caller to free there)."""
        if ci not in self._tails or _present_tail(node.npages, absent) <= m:
            return False
        if node.lock[self._lock_idx[ci]]:
            return False
        other_tier = 1 - tier
        other = node.res[ci * PAGED_TIERS + other_tier]
        if other is not None:
            freed: dict[ComponentKind, list[np.ndarray]] = {self.components[ci].kind: []}
            self._drop(node, self.components[ci], other_tier, freed)
            dropped.extend((ci, ids) for ids in freed[self.components[ci].kind])
        return True

    def _add_suffix(self, parent: Node, tokens: bytes, pos: int, total: int,
                    provided: dict[int, np.ndarray], gapped: dict[int, bytes], begin: int, tick: int,
                    tier: int, checkpoint: int | None = None) -> Node:
        """New nodes for tokens[pos:total] below `parent`, each with its whole family set
        in one pass (nothing locked, no other tier, no children yet; the MAMBA checkpoint
        on the last one): the bookkeeping of `_set`, done once per node."""
        cuts = [pos, total]
        # Per gapped component, where its present pages start in the single piece (offset
        # into the given ids; -1: a tombstone), found here once for the usual case.
        firsts: dict[int, int] = {}
        if gapped:
            breaks: list[int] = []
            a, b = pos - begin, total - begin
            for ci, absent in gapped.items():
                # One node can store the whole span already (usually: one run of absent
                # pages, then the window), so no breaks: every page absent or present, or
                # for a `partial_tail` component absent pages then present ones.
                first = absent.find(b"\x00", a, b)
                if first < 0 or (absent.find(b"\x01", first, b) < 0
                                 and (first == a or ci in self._tails)):
                    firsts[ci] = first
                    continue
                breaks.extend(self.components[ci].split_breaks(absent[a:b]))
            if breaks:
                cuts = [pos, *sorted({x + pos for x in breaks}), total]
                firsts = {}
        pb = self._pb
        ncomp = self._ncomp
        bit = 1 << tier
        resident = self._resident[tier]
        queues = self._queues[tier]
        tails = self._tails
        offered = self._offered_new
        leaf_windows = self._leaf_windows
        moved = self._moved[tier] if self._child_sensitive else None
        node = parent
        for p in range(len(cuts) - 1):
            lo, hi = cuts[p], cuts[p + 1]
            n = hi - lo
            child = Node(tokens[lo * pb : hi * pb], n, node, ncomp)
            child.last_access = tick
            node.children[child.key[:pb]] = child
            mask, res = child.mask, child.res
            a, b = lo - begin, hi - begin
            for ci, arr in provided.items():
                if gapped and ci in gapped:
                    # A piece is absent pages, then present ones: keep the present tail.
                    first = firsts[ci] if ci in firsts else gapped[ci].find(b"\x00", a, b)
                    if first < 0 or (first != a and ci not in tails):
                        continue  # a tombstone (SWA pages freed out of window)
                    ids = arr[first:b]
                    if first != a:
                        mask[ci] = PARTIAL
                else:
                    ids = arr[a:b]
                mask[ci] |= bit
                resident[ci] += len(ids)
                res[ci * PAGED_TIERS + tier] = ids.copy()
                if ci == FULL_INDEX:  # `_full_arrived`, inlined
                    node.nres[tier] += 1
                    if moved is not None and node.parent is not None:  # `_window_moved`
                        moved.append(node)
                        if len(moved) >= _WINDOW_WALKS_AT:
                            self._offer_moved(tier)
                            moved = self._moved[tier]
                if ci in offered:  # (a new node has no children: child-sensitive slots
                    queues[ci].offer(child)  # wait, but for what lies before its window)
                elif n > leaf_windows.get(ci, n):
                    queues[ci].offer(child)
            if checkpoint is not None and hi == total:
                # (`_point`, inlined for slots it holds already: the call measured 0.02-0.03x
                # on the hybrid/FULL insert ratio under eviction, three alternating runs)
                known = self._point_ids
                point = known[checkpoint : checkpoint + 1] if 0 <= checkpoint < len(known) else self._point(checkpoint)
                for ci in self._points:  # (one page each; never child-sensitive)
                    mask[ci] |= bit
                    resident[ci] += 1
                    res[ci * PAGED_TIERS + tier] = point
                    queues[ci].offer(child)
            node = child
        return node

    def _point(self, slot: int) -> np.ndarray:
        """The one-id array of a checkpoint slot: a read-only view into `_point_ids`
        (grown by doubling up to _POINT_IDS_MAX ids), a fresh array past that. A view costs
        one numpy call where a new array costs two, in every insert that keeps one."""
        if not 0 <= slot < _POINT_IDS_MAX:
            return np.array([slot], dtype=np.int64)
        self._point_ids = _grown(self._point_ids, slot + 1, lambda size: np.arange(size, dtype=np.int64))
        return self._point_ids[slot : slot + 1]

    def _place_checkpoint(self, node: Node, slot: int, released: list[list[np.ndarray]],
                          tier: int) -> None:
        ids = self._point(slot)
        for comp in self._point_comps:
            ci = comp.index
            held = node.res[ci * PAGED_TIERS + tier]
            if held is None and node.parent is not None and node.mask[FULL_INDEX] & (1 << tier):
                self._set(node, comp, tier, ids)
            elif held is None or int(held[0]) != slot:
                released[ci].append(ids)

    def _move_lock(self, lock: TreeLock, end: Node, tokens: bytes) -> None:
        """keep_lock: the request goes on using what it inserted, so the lock follows."""
        old_end, old_points = lock.end, lock.mamba_nodes
        at = end if end.parent is not None else None
        lock.end = lock.device_end = at
        lock.mamba_nodes = (end,) if at is not None else ()
        lock.prefix = tokens[: end.depth * self._pb]
        self._apply_lock(lock, +1)
        lock.end, lock.mamba_nodes = old_end, old_points
        self._apply_lock(lock, -1)
        lock.end, lock.mamba_nodes = at, ((end,) if at is not None else ())

    # ------------------------------------------------------------------ topology

    def _split(self, node: Node, k: int) -> Node:
        """Split `node` after its first `k` pages; returns the new head. The original
        object stays the tail, so handles to a node's end (locks, sessions) stay valid."""
        assert 0 < k < node.npages, (k, node.npages)
        pb = self._pb
        parent = node.parent
        assert parent is not None
        head = Node(node.key[: k * pb], k, parent, self._ncomp)
        parent.children[node.key[:pb]] = head
        node.key = node.key[k * pb :]
        node.npages -= k
        node.parent = head
        head.children[node.key[:pb]] = node
        rest = node.npages
        for comp in self.components:
            ci = comp.index
            if comp.per_page:
                head.mask[ci] = node.mask[ci]
                for tier in range(PAGED_TIERS):
                    arr = node.res[ci * PAGED_TIERS + tier]
                    if arr is None:
                        continue
                    cut = len(arr) - rest  # the head's share (a partial slot is a tail)
                    if cut > 0:
                        head.res[ci * PAGED_TIERS + tier] = arr[:cut]
                        node.res[ci * PAGED_TIERS + tier] = arr[cut:]
                    else:  # all of it lies in the tail
                        head.mask[ci] &= ~(1 << tier)
                if node.mask[ci] & PARTIAL:  # a tail: the head keeps what reached it, if any
                    if not head.mask[ci] & _PAGED_MASK:
                        head.mask[ci] &= ~PARTIAL
                    held = node.res[ci * PAGED_TIERS] if node.mask[ci] & 1 else node.res[ci * PAGED_TIERS + 1]
                    if held is not None and len(held) == rest:
                        node.mask[ci] &= ~PARTIAL  # the tail object's slot is whole now
            if comp.path_scoped:
                head.lock[ci] = node.lock[ci]
                head.sref[ci] = node.sref[ci]
        for tier in range(PAGED_TIERS):
            head.nres[tier] = 1 if node.mask[FULL_INDEX] & (1 << tier) else 0
        if node.hashes is not None:
            head.hashes = node.hashes[: k * PAGE_HASH_BYTES]
            node.hashes = node.hashes[k * PAGE_HASH_BYTES :]
        head.hits, head.last_access, head.stored_at = node.hits, node.last_access, node.stored_at
        for tier in range(PAGED_TIERS):
            for comp in self._others:
                self._queues[tier][comp.index].offer(head)
        if self.on_split is not None:
            self.on_split(node, head)
        return head

    def _delete(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        for comp in self.components:
            if node.mask[comp.index]:
                raise AssertionError(f"deleting {node} with resident {comp.kind.value} data")
        del parent.children[node.key[: self._pb]]
        node.qmask = node.lparked = 0
        # Sessions that ended here end at the deepest live node of their path now: its
        # path references are theirs already; its point slots (a checkpoint) gain theirs.
        for session_id, session in self._sessions.ended_at(node):
            up = parent if parent.parent is not None else None
            self._sessions.set_end(session_id, session, up)
            if up is not None:
                for comp in self._point_comps:
                    up.sref[comp.index] += 1
        if parent.parent is not None:
            for tier in range(PAGED_TIERS):
                self._queues[tier][FULL_INDEX].offer(parent)
        elif not parent.children:
            # A namespace left empty: its root goes too (namespaces carry tenants' salts:
            # one root each, kept, would grow without bound). Nothing holds a root: locks
            # and sessions end at a node or at None, which is looked up again.
            namespace = parent.root.namespace
            if self._roots.get(namespace) is parent:
                del self._roots[namespace]

    # ------------------------------------------------------------------ residency

    def set_resident(self, node: object, kind: ComponentKind, tier: Tier,
                     pages: np.ndarray | None = None) -> None:
        """Record that `node`'s `kind` slot now also lives in `tier` (after a backup or a
        load). DEVICE/HOST need the page ids; STORAGE takes none."""
        assert isinstance(node, Node)
        comp = self._by_kind[kind]
        ci = comp.index
        if node.mask[ci] & (1 << tier):
            raise InvalidArgument(f"{kind.value} slot already resident in {tier.name}")
        if tier is Tier.STORAGE and comp.partial_tail:
            held = [a for a in node.res[ci * PAGED_TIERS : (ci + 1) * PAGED_TIERS] if a is not None]
            if any(len(a) < node.npages for a in held):
                return  # a partial slot's L3 copy is not recorded (only whole ones are)
        if tier is not Tier.STORAGE:
            want = comp.slot_pages(node)
            if comp.partial_tail and pages is not None:
                other = node.res[ci * PAGED_TIERS + (1 - tier)]
                if other is not None:
                    want = len(other)  # one length per node, whichever tier holds it
                elif not node.mask[ci] and 0 < len(pages) <= want:
                    want = len(pages)  # a tail: the window before the node's end
            if pages is None or len(pages) != want:
                raise InvalidArgument(
                    f"{kind.value} slot of {want} pages given "
                    f"{0 if pages is None else len(pages)} page ids"
                )
            if comp.index != FULL_INDEX and not node.mask[FULL_INDEX] & (1 << tier):
                raise InvalidArgument(f"{kind.value} slot in {tier.name} needs FULL there first")
            pages = np.asarray(pages, dtype=np.int64)
        if tier is Tier.STORAGE and ci == FULL_INDEX:
            node.stored_at = time.monotonic()
        self._set(node, comp, tier, pages)

    def _set(self, node: Node, comp: Component, tier: int, pages: np.ndarray | None) -> None:
        ci = comp.index
        mask = node.mask[ci] | (1 << tier)
        n = comp.slot_pages(node)
        if pages is not None and len(pages) != n:
            n = len(pages)  # (a `partial_tail` slot: checked by the callers)
            mask |= PARTIAL
        node.mask[ci] = mask
        self._resident[tier][ci] += n
        if node.lock[self._lock_idx[ci]]:
            self._locked[tier][ci] += n
        if tier < PAGED_TIERS:
            node.res[ci * PAGED_TIERS + tier] = pages
            queues = self._queues
            if ci == FULL_INDEX and node.parent is not None:
                self._full_arrived(node.parent, tier)
            # Candidacy changes in this tier, and in another only where the slot is resident
            # there (a second copy makes the other one evictable).
            queues[tier][ci].offer(node)
            other = mask & _PAGED_MASK & ~(1 << tier)
            if other:
                for t in range(PAGED_TIERS):
                    if other & (1 << t):
                        queues[t][ci].offer(node)

    @staticmethod
    def _slot_len(node: Node, comp: Component, tier: int) -> int:
        """Pages `node`'s slot of `comp` occupies in `tier` (a partial slot: its length)."""
        if tier < PAGED_TIERS and node.mask[comp.index] & PARTIAL:
            held = node.res[comp.index * PAGED_TIERS + tier]
            if held is not None:
                return len(held)
        return comp.slot_pages(node)

    def _drop(self, node: Node, comp: Component, tier: int,
              freed: dict[ComponentKind, list[np.ndarray]]) -> None:
        comps = [comp] if comp.index != FULL_INDEX else [*self._others, comp]
        for c in comps:
            ci = c.index
            if not node.mask[ci] & (1 << tier):
                continue
            n = self._slot_len(node, c, tier)
            node.mask[ci] &= ~(1 << tier)
            if not node.mask[ci] & _PAGED_MASK:
                node.mask[ci] &= ~PARTIAL
            self._resident[tier][ci] -= n
            if node.lock[self._lock_idx[ci]]:
                self._locked[tier][ci] -= n
            if tier < PAGED_TIERS:
                arr = node.res[ci * PAGED_TIERS + tier]
                assert arr is not None
                freed[c.kind].append(arr)
                node.res[ci * PAGED_TIERS + tier] = None
                if ci == FULL_INDEX and node.parent is not None:
                    node.parent.nres[tier] -= 1
                    self._after_full_left(node.parent, tier)
            for t in range(PAGED_TIERS):
                self._queues[t][ci].offer(node)
        if comp.index == FULL_INDEX and not node.mask[FULL_INDEX] & _PAGED_MASK:
            # An L3 copy alone does not keep a node in the tree: the controller finds L3
            # data beyond the tree by key. The candidate rule guarantees a leaf here.
            assert not node.children, f"last copy of {node} left while it has children"
            for c in self.components:
                if node.mask[c.index]:
                    n = c.slot_pages(node)
                    self._resident[Tier.STORAGE][c.index] -= n
                    if node.lock[self._lock_idx[c.index]]:
                        self._locked[Tier.STORAGE][c.index] -= n
                    node.mask[c.index] = 0
            self._delete(node)

    def _full_arrived(self, parent: Node, tier: int) -> None:
        """A child's FULL slot arrived in `tier`: the parent's other slots may now drop
        data the child covers (SWA outside the kept window)."""
        parent.nres[tier] += 1
        if parent.parent is not None and self._child_sensitive:
            self._window_moved(parent, tier)

    def _after_full_left(self, parent: Node, tier: int) -> None:
        """A child's FULL slot left `tier`: the parent may now be a FULL candidate, and
        SWA data above may have fallen out of every kept window."""
        if parent.parent is None:
            return
        self._queues[tier][FULL_INDEX].offer(parent)
        if self._child_sensitive:
            self._window_moved(parent, tier)

    def _window_moved(self, parent: Node, tier: int) -> None:
        moved = self._moved[tier]
        moved.append(parent)
        if len(moved) >= _WINDOW_WALKS_AT:  # bounded memory where evictions are rare
            self._offer_moved(tier)

    def _offer_moved(self, tier: int) -> None:
        """Run the window walks owed since the last call, once per parent. A parent
        deleted meanwhile has no slots left (its walk offers only live ancestors, and
        extra offers are dropped when drained); a split one walks through its new head,
        so the same ancestors are reached."""
        moved = self._moved[tier]
        if moved:
            self._moved[tier] = []
            for parent in dict.fromkeys(moved):
                self._offer_windows(parent, tier)

    def _offer_windows(self, parent: Node, tier: int) -> None:
        """The path below `parent` changed in `tier`: for child-sensitive components every
        node within a window above it may now hold data outside every kept window (a slot
        popped earlier as wholly kept lost its queue mark and must be offered again).
        Nodes without the slot in `tier` are skipped: a slot that arrives later is offered
        by `_set`."""
        queues = self._queues[tier]
        bit = 1 << tier
        for ci in self._child_sensitive:
            window = self.components[ci].window_pages
            queue = queues[ci]
            marked = queue.bit
            node = parent
            dist = 0
            while node.parent is not None:
                if node.mask[ci] & bit and not node.qmask & marked:  # (marked: queued already)
                    queue.offer(node)
                dist += node.npages
                if dist >= window:
                    break
                node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, tier: Tier, kind: ComponentKind, num_pages: int,
              before_drop: BeforeDrop | None = None) -> EvictResult:
        """Evict at least `num_pages` pages of `kind` from `tier` (DEVICE or HOST), lowest
        rank first; fewer when nothing else is evictable (evicting 0 is always safe).

        FULL takes leaves of the tier with their whole family; SWA tombstones data outside
        every kept window (splitting a node at the retention boundary first); MAMBA drops
        checkpoints. `before_drop(victim)` runs before a slot leaves, e.g. to back it up
        with `set_resident` (write-back); the slot leaves after it returns."""
        if tier is Tier.STORAGE:
            raise InvalidArgument("the L3 backend manages its own eviction")
        comp = self._by_kind[kind]
        queue = self._queues[tier][comp.index]
        self._offer_moved(tier)
        queue.unpark()
        freed: dict[ComponentKind, list[np.ndarray]] = {c.kind: [] for c in self.components}
        evicted = victims = 0
        stranded: list[Node] = []
        while evicted < num_pages:
            node = queue.pop()
            if node is None:
                break
            target = node
            keep = comp.retained_pages(node, tier)
            if keep >= self._slot_len(node, comp, tier):
                continue  # re-offered when the window below it moves
            if keep:
                target = self._split(node, node.npages - keep)
            if before_drop is not None:
                kept = before_drop(self._victim(target, comp, tier))
                if kept:
                    queue.park(target)  # kept for now (its copy comes later)
                    if kept is KEEP_THE_REST:
                        break
                    continue
            if not target.mask[comp.index] & (1 << tier):
                continue  # the callback already moved it
            if (comp.index == FULL_INDEX and target.children
                    and not target.mask[FULL_INDEX] & _PAGED_MASK & ~(1 << tier)):
                # The last copy of a node with children (a `backed_up_tiers` candidate
                # whose copy could not be made: no room, a failed copy) stays; the next
                # eviction tries it again. The caller is told: it may copy it.
                queue.park(target)
                stranded.append(target)
                continue
            before = self._resident[tier][comp.index]
            self._drop(target, comp, tier, freed)
            evicted += before - self._resident[tier][comp.index]
            victims += 1
        self._bound_queue(tier, comp.index)
        return EvictResult(
            evicted_pages=evicted,
            freed={k: _cat(v) for k, v in freed.items()},
            victims=victims,
            stranded=tuple(stranded),
        )

    def _bound_queue(self, tier: int, ci: int) -> None:
        """Drop the stale entries of a queue grown past 4x what its tier holds (forced
        offers add entries; only a compaction removes the stale ones)."""
        queue = self._queues[tier][ci]
        if len(queue) > 4 * (self._resident[tier][ci] + 64):
            queue.compact()

    def _victim(self, node: Node, comp: Component, tier: int) -> Victim:
        comps = [comp] if comp.index != FULL_INDEX else self.components
        pages = {
            c.kind: node.res[c.index * PAGED_TIERS + tier]
            for c in comps
            if node.res[c.index * PAGED_TIERS + tier] is not None
        }
        return Victim(node=node, tier=Tier(tier), pages=pages, hashes=lambda: self.page_hashes(node))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ hashes

    def page_hashes(self, node: object) -> bytes:
        """Chained hashes of `node`'s pages (PAGE_HASH_BYTES each), computed once, lazily."""
        assert isinstance(node, Node)
        chain: list[Node] = []
        current: Node | None = node
        while current is not None and current.parent is not None and current.hashes is None:
            chain.append(current)
            current = current.parent
        for n in reversed(chain):
            parent = n.parent
            assert parent is not None
            prev = parent.hashes[-PAGE_HASH_BYTES:] if parent.parent is not None and parent.hashes else n.root.seed
            n.hashes = chain_hashes(prev, n.key, self._pb)
        assert node.hashes is not None
        return node.hashes

    # ------------------------------------------------------------------ sessions

    def _open_session(self, session_id: str, since: int | None = None) -> int:
        """`SessionTable.open`, closing the least recently used sessions past the cap."""
        gen = self._sessions.open(session_id, since)
        while (oldest := self._sessions.over_cap(session_id)) is not None:
            if oldest == session_id:
                break
            self.close_session(oldest)
            self.sessions_closed_for_room += 1
        return gen

    def _reference_session(self, session_id: str, gen: int, end: Node | None) -> None:
        session = self._sessions.current(session_id, gen)
        if session is None:
            return  # closed (and maybe reopened) since this request matched
        old, old_top = session.end, session.window_top
        top = self._window_top(end)
        self._sessions.set_end(session_id, session, end)
        session.window_top = top
        # A session's next end usually continues its last one: the shared prefix keeps
        # its references, only the two branches below their common ancestor change.
        shared = _common_ancestor(old, end)
        if end is not None:
            self._session_refs(end, +1, top, shared)
        if old is not None:  # after: its re-offers rank the new references
            self._session_refs(old, -1, old_top, shared)

    def _window_top(self, end: Node | None) -> int:
        """The depth (pages) where the trailing window of a session ending at `end`
        begins; the node that straddles it is split there, so that the window's references
        cover whole nodes and the pages before it stay unreferenced (DESIGN §1)."""
        if end is None or not self._window_comps:
            return 0
        top = max(0, end.depth - self._window_comps[0].window_pages)
        node = end
        while node.parent is not None and node.depth - node.npages > top:
            node = node.parent
        if node.parent is not None and node.depth - node.npages < top:
            self._split(node, top - (node.depth - node.npages))
        return top

    def _session_refs(self, end: Node, delta: int, top: int, stop: Node | None = None) -> None:
        """The references of a session ending at `end`: whole-path components' up to (not
        including) `stop`, windowed components' on the nodes from depth `top` down (all of
        them, however far `stop` is), and its point slots'."""
        node: Node | None = end
        while node is not stop and node is not None and node.parent is not None:
            for comp in self._whole_path_comps:
                node.sref[comp.index] += delta
            if delta < 0:
                for tier in range(PAGED_TIERS):
                    for comp in self._whole_path_comps:
                        self._queues[tier][comp.index].offer(node, force=True)
            node = node.parent
        node = end
        while node is not None and node.parent is not None and node.depth - node.npages >= top:
            for comp in self._window_comps:
                node.sref[comp.index] += delta
                if delta < 0:
                    for tier in range(PAGED_TIERS):
                        self._queues[tier][comp.index].offer(node, force=True)
            node = node.parent
        for comp in self._point_comps:
            end.sref[comp.index] += delta
            if delta < 0:
                for tier in range(PAGED_TIERS):
                    self._queues[tier][comp.index].offer(end, force=True)
        if delta < 0:
            # A queue whose tier never evicts (a large one, MAMBA's) is compacted here:
            # every session's turn or close re-queues its old path (sessions churning
            # over 20 nodes left 8,420 entries after 4,200 closes, growing).
            for tier in range(PAGED_TIERS):
                for comp in self.components:
                    self._bound_queue(tier, comp.index)

    def close_session(self, session_id: str) -> int:
        """Drop the session's references (not its data); returns how many pages deep the
        path it referenced was. Idempotent: a recently closed session returns that number
        again and changes nothing; an unknown one is NotFound."""

        def drop(session: Session) -> int:
            if session.end is None:
                return 0
            self._session_refs(session.end, -1, session.window_top)
            return session.end.depth

        released = self._sessions.close(session_id, drop)
        if released is None:
            raise NotFound(f"session {session_id!r} is not open")
        return released

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Verify every invariant and counter; raises AssertionError naming the first
        violation. O(tree); for tests and idle-time checks."""
        from hicache.tree.integrity import check_tree

        for tier in range(PAGED_TIERS):  # (the offers an eviction would make first)
            self._offer_moved(tier)
        check_tree(self)
