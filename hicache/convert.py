"""Protobuf <-> the core's frozen request/result types, both directions.

The servicers use the `*_to_pb` / `*_from_pb` pairs on the daemon side; the engine client
uses the opposite ones, so both sides agree by construction. Page ids are int64 numpy
arrays in the core and little-endian int32 `bytes` on the wire (`PAGE_ID_DTYPE`): one
`tobytes()` into the message, one `frombuffer()` out of it, however many ids. Token ids
stay `bytes` end to end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from hicache.config import MemberSpec
from hicache.controller.base import (
    AllocateRequest,
    AllocationInfo,
    AttachInfo,
    HeartbeatInfo,
    InsertOutcome,
    InsertRequest,
    LoadProgress,
    MatchOutcome,
    MatchRequest,
    PagesByMember,
    PoolUsage,
    PrefetchInfo,
    PrefetchState,
    StatsSnapshot,
)
from hicache.errors import FailedPrecondition, InvalidArgument
from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.tiers.base import PoolDescriptor, PoolKind
from hicache.tiers.storage.base import BackendHealth
from hicache.types import ComponentKind

TOKEN_DTYPE = np.dtype("<u4")
PAGE_ID_DTYPE = np.dtype("<i4")  # MemberPages.page_ids on the wire (-1: an SWA page outside the window)
_T = TypeVar("_T")
TIERS = {"device": pb.DEVICE, "host": pb.HOST, "storage": pb.STORAGE}
TIER_NAMES = {v: k for k, v in TIERS.items()}
_POOL_KINDS = {PoolKind.SHM: pb.SHM, PoolKind.CUDA_IPC: pb.CUDA_IPC}
_POOL_KIND_NAMES = {v: k for k, v in _POOL_KINDS.items()}
_STATES = {s: getattr(pb, s.value) for s in PrefetchState}
_STATE_NAMES = {v: k for k, v in _STATES.items()}
_TIER_COUNTS = ("hit_tokens", "evictions", "backups")
_PREFETCH_OUTCOMES = ("running", "done", "cancelled", "timed_out", "failed")
_SINGLE_COUNTS = ("lookups", "l3_errors", "expired_leases")
# Counter keys the core may use for the same figure (first one canonical).
_TIER_ALIASES = {"device": ("device", "l1"), "host": ("host", "l2"), "storage": ("storage", "l3")}
_ALIASES: dict[str, tuple[str, ...]] = {
    **{f"{n}_{t}": tuple(f"{n}_{a}" for a in al) for n in _TIER_COUNTS for t, al in _TIER_ALIASES.items()},
    **{f"prefetches_{o}": (f"prefetches_{o}",) for o in _PREFETCH_OUTCOMES},
    "lookups": ("lookups",),
    "l3_errors": ("l3_errors",),
    "expired_leases": ("expired_leases", "leases_expired"),
}


def _known(names: Mapping[Any, _T], value: int | str, what: str) -> _T:
    """An enum value the daemon sent, by name; one this client does not know (a newer
    daemon's) is a clear error rather than a KeyError."""
    try:
        return names[value]
    except KeyError:
        raise FailedPrecondition(
            f"the daemon sent {what} {value}, which this client does not know "
            "(a newer daemon? update hicache on this side)"
        ) from None


# --------------------------------------------------------------------------- tokens, pages


def check_tokens(tokens: bytes, limit: int) -> bytes:
    """Validate the wire form of token ids (4 bytes each, at most `limit` tokens)."""
    if len(tokens) % 4:
        raise InvalidArgument(
            f"tokens: {len(tokens)} bytes is not a multiple of 4 (little-endian uint32 ids)"
        )
    if len(tokens) > 4 * limit:
        raise InvalidArgument(
            f"tokens: {len(tokens) // 4} tokens exceed server.max_tokens_per_request ({limit})"
        )
    return tokens


MAX_NAME_CHARS = 1024  # a namespace, session or request id: kept in the daemon's tables


def check_name(field: str, value: str) -> str:
    """A caller's name (namespace, session_id, request_id), at most MAX_NAME_CHARS: the
    daemon keeps them (a namespace's root, a session's record) for as long as they last."""
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{field}: {len(value)} characters; at most {MAX_NAME_CHARS}")
    return value


def tokens_to_bytes(tokens: bytes | bytearray | memoryview | np.ndarray | Iterable[int]) -> bytes:
    """Client side: any sequence of token ids as little-endian uint32 bytes. Bytes-like
    objects are taken as that form already (iterating one would read a token per byte)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, bytearray | memoryview):
        return bytes(tokens)
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        items = list(tokens)
        if not items:
            return b""
        try:  # (Python ints past 64 bits make an object array: refused below)
            arr = np.asarray(items)
        except (OverflowError, ValueError):
            arr = np.asarray(items, dtype=object)
    if arr.dtype.kind not in "iu":  # a float or other id would be cut to some other token
        raise InvalidArgument(f"tokens: ids must be integers that fit in uint32 (got {arr.dtype} values)")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidArgument("tokens: ids must fit in uint32")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def add_pages(field: Any, pages: PagesByMember) -> None:
    """`pages` appended to a `repeated MemberPages` field in place (no message copy)."""
    for name, ids in pages.items():
        field.add(member=name, page_ids=ids.astype(PAGE_ID_DTYPE).tobytes())


def page_ids_from_bytes(member: str, data: bytes) -> np.ndarray:
    """One member's page ids from the wire (little-endian int32) as a writable int64 array."""
    if len(data) % 4:
        raise InvalidArgument(
            f"pages[{member}]: {len(data)} bytes of page ids is not a multiple of 4 "
            "(little-endian int32 ids)"
        )
    return np.frombuffer(data, dtype=PAGE_ID_DTYPE).astype(np.int64)


def pages_from_pb(pages: Iterable[pb.MemberPages]) -> dict[str, np.ndarray]:
    return {p.member: page_ids_from_bytes(p.member, p.page_ids) for p in pages}


def _opt(msg: object, name: str) -> int | None:
    return getattr(msg, name) if msg.HasField(name) else None  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- Attach, Heartbeat


def member_to_pb(m: MemberSpec) -> pb.Member:
    return pb.Member(
        name=m.name,
        component=m.component.value,
        anchor=m.anchor.value,
        layers=m.layers,
        bytes_per_page_per_layer=m.bytes_per_page_per_layer,
        window_tokens=m.window_tokens,
    )


_COMPONENTS = {k.value: k for k in ComponentKind}


def member_from_pb(m: pb.Member) -> MemberSpec:
    return MemberSpec(
        name=m.name,
        component=_known(_COMPONENTS, m.component, f"member {m.name!r} of component"),
        anchor=_known(_COMPONENTS, m.anchor, f"member {m.name!r} anchored to"),
        layers=m.layers,
        bytes_per_page_per_layer=m.bytes_per_page_per_layer,
        window_tokens=m.window_tokens,
    )


def pool_to_pb(d: PoolDescriptor, tp_rank: int) -> pb.Pool:
    return pb.Pool(
        member=d.member,
        tp_rank=tp_rank,
        kind=_POOL_KINDS[d.kind],
        handle=d.handle,
        device=d.device,
        num_pages=d.num_pages,
        layer_stride_bytes=d.layer_stride_bytes,
        page_stride_bytes=d.page_stride_bytes,
        layers=d.layers,
        offset_bytes=d.offset_bytes,
        size_bytes=d.size_bytes,
        ref_counter_handle=d.ref_counter_handle,
        ref_counter_offset=d.ref_counter_offset,
        event_handle=d.event_handle,
        event_sync_required=d.event_sync_required,
        device_uuid=d.device_uuid,
    )


def pool_from_pb(p: pb.Pool) -> PoolDescriptor:
    return PoolDescriptor(
        member=p.member,
        kind=_known(_POOL_KIND_NAMES, p.kind, "pool kind"),
        handle=p.handle,
        device=p.device,
        num_pages=p.num_pages,
        layer_stride_bytes=p.layer_stride_bytes,
        page_stride_bytes=p.page_stride_bytes,
        layers=p.layers,
        offset_bytes=p.offset_bytes,
        size_bytes=p.size_bytes,
        ref_counter_handle=p.ref_counter_handle,
        ref_counter_offset=p.ref_counter_offset,
        event_handle=p.event_handle,
        event_sync_required=p.event_sync_required,
        device_uuid=p.device_uuid,
    )


def attach_to_pb(info: AttachInfo, tp_rank: int, daemon_run: str) -> pb.AttachResponse:
    return pb.AttachResponse(
        page_size=info.page_size,
        members=[member_to_pb(m) for m in info.members],
        pools=[pool_to_pb(d, tp_rank) for d in info.pools],
        lease_ms=info.lease_ms,
        daemon_run=daemon_run,
    )


def attach_from_pb(r: pb.AttachResponse) -> AttachInfo:
    return AttachInfo(
        page_size=r.page_size,
        members=tuple(member_from_pb(m) for m in r.members),
        pools=tuple(pool_from_pb(p) for p in r.pools),
        lease_ms=r.lease_ms,
        daemon_run=r.daemon_run,
    )


def heartbeat_to_pb(h: HeartbeatInfo) -> pb.HeartbeatResponse:
    return pb.HeartbeatResponse(lease_ms=h.lease_ms, locks=h.locks, allocations=h.allocations)


def heartbeat_from_pb(r: pb.HeartbeatResponse) -> HeartbeatInfo:
    return HeartbeatInfo(lease_ms=r.lease_ms, locks=r.locks, allocations=r.allocations)


# --------------------------------------------------------------------------- MatchPrefix, Load


def match_request_from_pb(r: pb.MatchPrefixRequest, limit: int) -> MatchRequest:
    return MatchRequest(
        namespace=check_name("namespace", r.namespace),
        tokens=check_tokens(r.tokens, limit),
        session_id=check_name("session_id", r.session_id),
        request_id=check_name("request_id", r.request_id),
        lock=r.lock,
        prefetch=r.prefetch,
        allocate_tokens=_opt(r, "allocate_tokens"),
    )


def match_to_pb(m: MatchOutcome, r: pb.MatchPrefixResponse | None = None) -> pb.MatchPrefixResponse:
    """`r`: fill this (empty) message in place, e.g. a Batch result's field, instead of a
    new one that would then be copied there."""
    if r is None:
        r = pb.MatchPrefixResponse()
    else:
        r.SetInParent()
    r.device_tokens = m.device_tokens
    r.host_tokens = m.host_tokens
    r.storage_tokens = m.storage_tokens
    r.lock_id = m.lock_id
    r.prefetch_id = m.prefetch_id
    r.allocation_id = m.allocation_id
    add_pages(r.device_pages, m.device_pages)
    add_pages(r.pages, m.pages)
    return r


def match_from_pb(r: pb.MatchPrefixResponse) -> MatchOutcome:
    return MatchOutcome(
        device_tokens=r.device_tokens,
        host_tokens=r.host_tokens,
        storage_tokens=r.storage_tokens,
        device_pages=pages_from_pb(r.device_pages),
        lock_id=r.lock_id,
        prefetch_id=r.prefetch_id,
        allocation_id=r.allocation_id,
        pages=pages_from_pb(r.pages),
    )


def load_to_pb(p: LoadProgress) -> pb.LoadProgress:
    msg = pb.LoadProgress(layers_ready=p.layers_ready, layers_total=p.layers_total)
    if p.device_pages is not None:
        add_pages(msg.device_pages, p.device_pages)
    if p.device_tokens is not None:
        msg.device_tokens = p.device_tokens
    return msg


def load_from_pb(r: pb.LoadProgress) -> LoadProgress:
    last = r.layers_ready >= r.layers_total
    return LoadProgress(
        layers_ready=r.layers_ready,
        layers_total=r.layers_total,
        device_pages=pages_from_pb(r.device_pages) if last else None,
        device_tokens=r.device_tokens if last else None,
    )


# --------------------------------------------------------------------------- prefetch


def prefetch_to_pb(p: PrefetchInfo) -> pb.PrefetchStatusResponse:
    return pb.PrefetchStatusResponse(
        state=_STATES[p.state], tokens_ready=p.tokens_ready, tokens_total=p.tokens_total
    )


def prefetch_from_pb(r: pb.PrefetchStatusResponse) -> PrefetchInfo:
    return PrefetchInfo(
        state=_known(_STATE_NAMES, r.state, "prefetch state"),
        tokens_ready=r.tokens_ready,
        tokens_total=r.tokens_total,
    )


# --------------------------------------------------------------------------- Allocate, Insert


def allocate_request_from_pb(r: pb.AllocateRequest) -> AllocateRequest:
    return AllocateRequest(
        namespace=check_name("namespace", r.namespace),
        num_tokens=r.num_tokens,
        lock_id=_opt(r, "lock_id"),
        allocation_id=_opt(r, "allocation_id"),
    )


def allocation_to_pb(a: AllocationInfo) -> pb.AllocateResponse:
    r = pb.AllocateResponse(allocation_id=a.allocation_id)
    add_pages(r.pages, a.pages)
    return r


def allocation_from_pb(r: pb.AllocateResponse) -> AllocationInfo:
    return AllocationInfo(allocation_id=r.allocation_id, pages=pages_from_pb(r.pages))


def insert_request_from_pb(r: pb.InsertRequest, limit: int) -> InsertRequest:
    return InsertRequest(
        namespace=check_name("namespace", r.namespace),
        tokens=check_tokens(r.tokens, limit),
        lock_id=_opt(r, "lock_id"),
        allocation_id=_opt(r, "allocation_id"),
        session_id=check_name("session_id", r.session_id),
        request_id=check_name("request_id", r.request_id),
        mamba_checkpoint=r.mamba_checkpoint,
        keep_lock=r.keep_lock,
    )


def insert_to_pb(o: InsertOutcome, r: pb.InsertResponse | None = None) -> pb.InsertResponse:
    """`r` as for `match_to_pb`."""
    if r is None:
        return pb.InsertResponse(inserted_tokens=o.inserted_tokens, reused_tokens=o.reused_tokens)
    r.SetInParent()
    r.inserted_tokens = o.inserted_tokens
    r.reused_tokens = o.reused_tokens
    return r


def insert_from_pb(r: pb.InsertResponse) -> InsertOutcome:
    return InsertOutcome(inserted_tokens=r.inserted_tokens, reused_tokens=r.reused_tokens)


def release_target(r: pb.ReleaseRequest) -> tuple[int | None, int | None]:
    """(lock_id, allocation_id): exactly one is set."""
    which = r.WhichOneof("target")
    if which is None:
        raise InvalidArgument("Release: set exactly one of lock_id or allocation_id")
    return (r.lock_id, None) if which == "lock_id" else (None, r.allocation_id)


# --------------------------------------------------------------------------- Stats, Health


def canonical_counters(raw: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Split the core's counters into the figures the wire carries (canonical keys such
    as `hit_tokens_device`, `backups_storage`, `prefetches_done`, `expired_leases`) and
    the rest (the core's own extras, e.g. `backups_l3_failed`)."""
    used: set[str] = set()
    canonical: dict[str, int] = {}
    for key, aliases in _ALIASES.items():
        canonical[key] = sum(raw.get(a, 0) for a in aliases)
        used.update(aliases)
    return canonical, {k: v for k, v in raw.items() if k not in used}


def stats_to_pb(s: StatsSnapshot) -> pb.StatsResponse:
    c, _extras = canonical_counters(s.counters)
    tiers = {
        name: pb.TierCounts(**{t: c.get(f"{name}_{t}", 0) for t in TIERS}) for name in _TIER_COUNTS
    }
    counters = pb.Counters(
        prefetches=pb.PrefetchCounts(
            **{o: c.get(f"prefetches_{o}", 0) for o in _PREFETCH_OUTCOMES}
        ),
        **tiers,
    )
    for key in _SINGLE_COUNTS:
        setattr(counters, key, c.get(key, 0))
    pools = [
        pb.PoolStats(
            tier=TIERS[p.tier],
            member=p.member,
            capacity_pages=p.capacity_pages,
            used_pages=p.used_pages,
            locked_pages=p.locked_pages,
        )
        for p in s.pools
    ]
    return pb.StatsResponse(pools=pools, counters=counters)


def stats_from_pb(r: pb.StatsResponse) -> StatsSnapshot:
    counters: dict[str, int] = {k: getattr(r.counters, k) for k in _SINGLE_COUNTS}
    for name in _TIER_COUNTS:
        group = getattr(r.counters, name)
        counters.update({f"{name}_{t}": getattr(group, t) for t in TIERS})
    counters.update(
        {f"prefetches_{o}": getattr(r.counters.prefetches, o) for o in _PREFETCH_OUTCOMES}
    )
    pools = tuple(
        PoolUsage(
            tier=TIER_NAMES.get(p.tier, f"tier{p.tier}"),  # (a newer daemon's tier: shown as such)
            member=p.member,
            capacity_pages=p.capacity_pages,
            used_pages=p.used_pages,
            locked_pages=p.locked_pages,
        )
        for p in r.pools
    )
    return StatsSnapshot(pools=pools, counters=counters)


def health_to_pb(backends: Iterable[BackendHealth]) -> apb.HealthResponse:
    return apb.HealthResponse(
        backends=[
            apb.BackendHealth(
                name=b.name,
                healthy=b.healthy,
                latency_ms=b.latency_ms,
                detail=b.detail,
                capacity_bytes=b.capacity_bytes or 0,
                used_bytes=b.used_bytes or 0,
            )
            for b in backends
        ]
    )


def health_from_pb(r: apb.HealthResponse) -> tuple[BackendHealth, ...]:
    return tuple(
        BackendHealth(
            name=b.name,
            healthy=b.healthy,
            latency_ms=b.latency_ms,
            detail=b.detail,
            capacity_bytes=b.capacity_bytes or None,
            used_bytes=b.used_bytes or None,
        )
        for b in r.backends
    )

