"""The controller's contract with the daemon: typed requests and results, one method per RPC.

The gRPC servicers convert protobuf to these calls and back, nothing else. Every method is
thread-safe (gRPC calls arrive on many threads) and raises the typed errors of
`hicache.errors` for bad input; it never returns None or False to signal failure.

Ids (`lock_id`, `allocation_id`, `prefetch_id`) are positive integers, unique for the
daemon's life; 0 means "none" in results, and a request's 0 is NOT_FOUND (None is
"absent"). Every lock and allocation belongs to the engine
that made it (its `engine_id`, sent after `attach`); when the engine's lease lapses the
controller releases them and counts it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from hicache.config import MemberSpec
from hicache.tiers.base import PoolDescriptor
from hicache.tiers.storage.base import BackendHealth

PagesByMember = Mapping[str, np.ndarray]
"""L1 page ids per family member (a sidecar lists its anchor's ids)."""

NO_PAGES: PagesByMember = MappingProxyType({})

MAX_ENGINE_ID = 256  # characters of an engine id as sent (a metadata header on every call)
# As the daemon knows it: with bearer tokens, "<token label>/<id as sent>" (hicache.service).
MAX_SCOPED_ENGINE_ID = MAX_ENGINE_ID + 32


class PrefetchState(enum.Enum):
    RUNNING = "RUNNING"
    DONE = "DONE"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"


@dataclass(frozen=True)
class AttachInfo:
    page_size: int
    members: tuple[MemberSpec, ...]
    pools: tuple[PoolDescriptor, ...]
    lease_ms: int
    daemon_run: str = ""  # the serving daemon's run (set by the server, not the core)


@dataclass(frozen=True)
class HeartbeatInfo:
    lease_ms: int
    locks: int
    allocations: int


# The requests and outcomes of the two calls every request makes (MatchPrefix, Insert) are
# named tuples: frozen like the dataclasses of the other calls, and built without an
# `object.__setattr__` per field (~0.2 against ~1 us for eight fields).
class MatchRequest(NamedTuple):
    namespace: str
    tokens: bytes  # little-endian uint32 ids
    session_id: str = ""
    request_id: str = ""
    lock: bool = False
    prefetch: bool = False
    # The request's total tokens (prompt + what it will generate): also allocate L1 pages
    # for every token past the device match.
    allocate_tokens: int | None = None


class MatchOutcome(NamedTuple):
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    device_pages: PagesByMember
    lock_id: int = 0
    prefetch_id: int = 0
    allocation_id: int = 0
    pages: PagesByMember = NO_PAGES  # of the allocation, when asked


@dataclass(frozen=True)
class LoadProgress:
    layers_ready: int
    layers_total: int
    device_pages: PagesByMember | None = None  # on the last message only
    device_tokens: int | None = None  # on the last message only


@dataclass(frozen=True)
class PrefetchInfo:
    state: PrefetchState
    tokens_ready: int
    tokens_total: int


@dataclass(frozen=True)
class AllocateRequest:
    namespace: str
    num_tokens: int
    lock_id: int | None = None  # the match this allocation extends
    allocation_id: int | None = None  # extend this allocation (decode growth)


@dataclass(frozen=True)
class AllocationInfo:
    allocation_id: int
    pages: PagesByMember  # every page of the allocation, in token order


class InsertRequest(NamedTuple):
    namespace: str
    tokens: bytes
    lock_id: int | None = None
    allocation_id: int | None = None
    session_id: str = ""
    request_id: str = ""
    mamba_checkpoint: bool = False
    keep_lock: bool = False


class InsertOutcome(NamedTuple):
    inserted_tokens: int
    reused_tokens: int


@dataclass(frozen=True)
class PoolUsage:
    tier: str  # "device" | "host"
    member: str
    capacity_pages: int
    used_pages: int
    locked_pages: int


class L3Op(enum.Enum):
    """The L3 backend calls the controller makes (labels of the latency histograms)."""

    EXISTS = "exists"  # exists_prefix: how much of a prefix is stored
    GET = "get"  # get_into: read pages into L2 (prefetch)
    PUT = "put"  # put_from: write pages from L2 (backup)
    PROBE = "probe"  # shallow health check
    PROBE_DEEP = "probe_deep"  # health check with a canary round trip


class L3Outcome(enum.Enum):
    """How a whole L3 call ended. Per-key results (miss, corrupt, refused) are an `OK` call."""

    OK = "ok"
    UNAVAILABLE = "unavailable"  # BackendUnavailable: unreachable, timed out, disk full; or unhealthy
    ERROR = "error"  # any other exception (a bug or a malformed call)


# Upper bounds (seconds) of the L3 latency buckets, ascending; a last +Inf bucket is implied.
# 50 µs (a cached local file) to 10 s (past any sane storage.timeout_s), ~x2-2.5 apart.
L3_OP_BUCKETS: tuple[float, ...] = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(frozen=True)
class L3OpLatency:
    """Latency distribution of one (op, outcome) series of one backend."""

    op: L3Op
    outcome: L3Outcome
    bucket_counts: tuple[int, ...]  # per bucket, NOT cumulative; len(bounds) + 1 (+Inf last)
    sum_seconds: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    @property
    def cumulative_counts(self) -> tuple[int, ...]:
        """Calls at or below each bound (Prometheus `le` buckets); the last is `count`."""
        out: list[int] = []
        total = 0
        for c in self.bucket_counts:
            total += c
            out.append(total)
        return tuple(out)

    @property
    def mean_seconds(self) -> float:
        n = self.count
        return self.sum_seconds / n if n else 0.0


@dataclass(frozen=True)
class L3Stats:
    """One L3 backend as the controller saw it: call latencies (only series with at least
    one call) and the object bytes it moved (whole objects, header included)."""

    backend: str
    bounds: tuple[float, ...]  # bucket upper bounds in seconds, ascending (+Inf implied)
    ops: tuple[L3OpLatency, ...]
    bytes_read: int = 0  # objects read intact (GetStatus.HIT)
    bytes_written: int = 0  # objects stored (PutStatus.STORED)
    corrupt: int = 0  # objects read that failed verification (each a miss)
    corrupt_removed: int = 0  # of those, removed from the store (see tiers/storage/base.py)
    evicted: int = 0  # objects the backend removed to stay within its capacity
    evicted_pages: int = 0  # of those, pages (see BackendStats.evicted_pages)


@dataclass(frozen=True)
class StatsSnapshot:
    pools: tuple[PoolUsage, ...]
    counters: Mapping[str, int]  # lookups, hit_tokens_device/host/storage, evictions_*, ...
    l3: tuple[L3Stats, ...] = ()  # one per configured L3 backend (none without one)


class CacheService(abc.ABC):
    """What the daemon serves. Implemented by `HybridCacheController`."""

    @abc.abstractmethod
    def attach(self, engine_id: str, tp_rank: int, tp_size: int, instance_id: str = "") -> AttachInfo:
        """Register (or renew) an engine and return the geometry and L1 pool handles.
        InvalidArgument for an empty engine id or a tp_rank outside tp_size. A rank that
        attaches with another non-empty `instance_id` than before is a new process under
        the same engine id: its predecessor's locks and allocations are released."""

    @abc.abstractmethod
    def heartbeat(self, engine_id: str, tp_rank: int = 0, instance_id: str = "") -> HeartbeatInfo:
        """Renew the lease. NotFound for an engine that never attached or has expired.
        `tp_rank`/`instance_id`: the sending process (see `attach`)."""

    @abc.abstractmethod
    def match(self, engine_id: str, req: MatchRequest) -> MatchOutcome:
        """Longest safe reuse per tier; optionally lock, start a prefetch, allocate."""

    @abc.abstractmethod
    def load(self, engine_id: str, lock_id: int) -> Iterator[LoadProgress]:
        """Bring the host-resident part of a locked match into L1, yielding per-layer
        progress; the last message carries the device pages. NotFound for an unknown
        lock; ResourceExhausted (and nothing changed) when L1 has no room."""

    @abc.abstractmethod
    def prefetch_status(self, prefetch_id: int, engine_id: str | None = None) -> PrefetchInfo:
        """NotFound for an unknown prefetch or, given `engine_id`, one another engine
        started."""

    @abc.abstractmethod
    def cancel_prefetch(self, prefetch_id: int, engine_id: str | None = None) -> int:
        """Stop a prefetch (`engine_id` as for `prefetch_status`); returns tokens_ready.
        What arrived stays usable."""

    @abc.abstractmethod
    def allocate(self, engine_id: str, req: AllocateRequest) -> AllocationInfo: ...

    @abc.abstractmethod
    def insert(self, engine_id: str, req: InsertRequest) -> InsertOutcome: ...

    @abc.abstractmethod
    def release(self, engine_id: str, lock_id: int | None, allocation_id: int | None) -> None:
        """Unlock / free. NotFound when the handle is unknown or already released."""

    @abc.abstractmethod
    def close_session(self, session_id: str) -> int: ...

    @abc.abstractmethod
    def hold_background(self) -> Callable[[], None]:
        """Hold the background work that calls start from now on (write-through copies)
        until the returned function is called (the first call counts); then it goes in
        one flush. The server holds it for an Insert or Batch RPC and releases it once
        the response is on the wire, so the copies do not compete with sending it. One
        hold at a time (a hold asked for meanwhile is not granted: its release does
        nothing), so copies wait for one RPC at most. The release never waits for a busy
        controller (it runs on gRPC's poller thread).
        Nothing may wait for held work: an allocation that needs it releases it at once."""

    @abc.abstractmethod
    def stats(self) -> StatsSnapshot: ...

    @abc.abstractmethod
    def health(self, deep: bool) -> tuple[BackendHealth, ...]:
        """Per L3 backend; shallow: last known state, deep: a canary round trip now."""

    @abc.abstractmethod
    def serving(self) -> bool:
        """False while a required backend is down (grpc.health NOT_SERVING)."""

    @abc.abstractmethod
    def flush(self, timeout_s: float) -> int:
        """Write everything pending (write-back) to L3; returns pages written."""

    @abc.abstractmethod
    def unflushed_pages(self) -> int:
        """Pages L1/L2 hold that L3 lacks (0 without L3): after a flush, those it could
        not write (L3 down, or its deadline passed)."""

    @abc.abstractmethod
    def expire_leases(self, stalled_s: float = 0.0) -> int:
        """Release everything held by engines whose lease lapsed; returns engines expired.
        The daemon calls it periodically; `stalled_s`: time it found it did not run since
        the last call, which no lease counts (no engine could renew then)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop workers and release pools (the daemon flushes first)."""
