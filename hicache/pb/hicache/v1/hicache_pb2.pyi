from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_KIND_UNSPECIFIED: _ClassVar[PoolKind]
    SHM: _ClassVar[PoolKind]
    CUDA_IPC: _ClassVar[PoolKind]

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATE_UNSPECIFIED: _ClassVar[PrefetchState]
    RUNNING: _ClassVar[PrefetchState]
    DONE: _ClassVar[PrefetchState]
    CANCELLED: _ClassVar[PrefetchState]
    TIMED_OUT: _ClassVar[PrefetchState]
    FAILED: _ClassVar[PrefetchState]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DEVICE: _ClassVar[Tier]
    HOST: _ClassVar[Tier]
    STORAGE: _ClassVar[Tier]
POOL_KIND_UNSPECIFIED: PoolKind
SHM: PoolKind
CUDA_IPC: PoolKind
PREFETCH_STATE_UNSPECIFIED: PrefetchState
RUNNING: PrefetchState
DONE: PrefetchState
CANCELLED: PrefetchState
TIMED_OUT: PrefetchState
FAILED: PrefetchState
TIER_UNSPECIFIED: Tier
DEVICE: Tier
HOST: Tier
STORAGE: Tier

class MemberPages(_message.Message):
    __slots__ = ("member", "page_ids")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    member: str
    page_ids: bytes
    def __init__(self, member: _Optional[str] = ..., page_ids: _Optional[bytes] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size", "instance_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    instance_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("name", "component", "anchor", "layers", "bytes_per_page_per_layer", "window_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    component: str
    anchor: str
    layers: int
    bytes_per_page_per_layer: int
    window_tokens: int
    def __init__(self, name: _Optional[str] = ..., component: _Optional[str] = ..., anchor: _Optional[str] = ..., layers: _Optional[int] = ..., bytes_per_page_per_layer: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("member", "tp_rank", "kind", "handle", "device", "num_pages", "layer_stride_bytes", "page_stride_bytes", "layers", "offset_bytes", "size_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    member: str
    tp_rank: int
    kind: PoolKind
    handle: bytes
    device: int
    num_pages: int
    layer_stride_bytes: int
    page_stride_bytes: int
    layers: int
    offset_bytes: int
    size_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, member: _Optional[str] = ..., tp_rank: _Optional[int] = ..., kind: _Optional[_Union[PoolKind, str]] = ..., handle: _Optional[bytes] = ..., device: _Optional[int] = ..., num_pages: _Optional[int] = ..., layer_stride_bytes: _Optional[int] = ..., page_stride_bytes: _Optional[int] = ..., layers: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("page_size", "members", "pools", "lease_ms", "daemon_run")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_RUN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    lease_ms: int
    daemon_run: str
    def __init__(self, page_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., daemon_run: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "instance_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    instance_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ms", "locks", "allocations")
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    locks: int
    allocations: int
    def __init__(self, lease_ms: _Optional[int] = ..., locks: _Optional[int] = ..., allocations: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "session_id", "request_id", "lock", "prefetch", "allocate_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOCK_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: bytes
    session_id: str
    request_id: str
    lock: bool
    prefetch: bool
    allocate_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., lock: _Optional[bool] = ..., prefetch: _Optional[bool] = ..., allocate_tokens: _Optional[int] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("device_tokens", "host_tokens", "storage_tokens", "device_pages", "lock_id", "prefetch_id", "allocation_id", "pages")
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    device_pages: _containers.RepeatedCompositeFieldContainer[MemberPages]
    lock_id: int
    prefetch_id: int
    allocation_id: int
    pages: _containers.RepeatedCompositeFieldContainer[MemberPages]
    def __init__(self, device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., storage_tokens: _Optional[int] = ..., device_pages: _Optional[_Iterable[_Union[MemberPages, _Mapping]]] = ..., lock_id: _Optional[int] = ..., prefetch_id: _Optional[int] = ..., allocation_id: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[MemberPages, _Mapping]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("lock_id",)
    LOCK_ID_FIELD_NUMBER: _ClassVar[int]
    lock_id: int
    def __init__(self, lock_id: _Optional[int] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("layers_ready", "layers_total", "device_pages", "device_tokens")
    LAYERS_READY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layers_ready: int
    layers_total: int
    device_pages: _containers.RepeatedCompositeFieldContainer[MemberPages]
    device_tokens: int
    def __init__(self, layers_ready: _Optional[int] = ..., layers_total: _Optional[int] = ..., device_pages: _Optional[_Iterable[_Union[MemberPages, _Mapping]]] = ..., device_tokens: _Optional[int] = ...) -> None: ...

class PrefetchStatusRequest(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class PrefetchStatusResponse(_message.Message):
    __slots__ = ("state", "tokens_ready", "tokens_total")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_READY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    state: PrefetchState
    tokens_ready: int
    tokens_total: int
    def __init__(self, state: _Optional[_Union[PrefetchState, str]] = ..., tokens_ready: _Optional[int] = ..., tokens_total: _Optional[int] = ...) -> None: ...

class CancelPrefetchRequest(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class CancelPrefetchResponse(_message.Message):
    __slots__ = ("tokens_ready",)
    TOKENS_READY_FIELD_NUMBER: _ClassVar[int]
    tokens_ready: int
    def __init__(self, tokens_ready: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("namespace", "num_tokens", "lock_id", "allocation_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    num_tokens: int
    lock_id: int
    allocation_id: int
    def __init__(self, namespace: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lock_id: _Optional[int] = ..., allocation_id: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("allocation_id", "pages")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    allocation_id: int
    pages: _containers.RepeatedCompositeFieldContainer[MemberPages]
    def __init__(self, allocation_id: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[MemberPages, _Mapping]]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "lock_id", "allocation_id", "session_id", "request_id", "mamba_checkpoint", "keep_lock")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    KEEP_LOCK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: bytes
    lock_id: int
    allocation_id: int
    session_id: str
    request_id: str
    mamba_checkpoint: bool
    keep_lock: bool
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[bytes] = ..., lock_id: _Optional[int] = ..., allocation_id: _Optional[int] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., mamba_checkpoint: _Optional[bool] = ..., keep_lock: _Optional[bool] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("inserted_tokens", "reused_tokens")
    INSERTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inserted_tokens: int
    reused_tokens: int
    def __init__(self, inserted_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lock_id", "allocation_id")
    LOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    lock_id: int
    allocation_id: int
    def __init__(self, lock_id: _Optional[int] = ..., allocation_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("released_refs",)
    RELEASED_REFS_FIELD_NUMBER: _ClassVar[int]
    released_refs: int
    def __init__(self, released_refs: _Optional[int] = ...) -> None: ...

class OpStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class BatchOp(_message.Message):
    __slots__ = ("attach", "heartbeat", "match_prefix", "prefetch_status", "cancel_prefetch", "allocate", "insert", "release", "close_session", "stats")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    MATCH_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_STATUS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    INSERT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    attach: AttachRequest
    heartbeat: HeartbeatRequest
    match_prefix: MatchPrefixRequest
    prefetch_status: PrefetchStatusRequest
    cancel_prefetch: CancelPrefetchRequest
    allocate: AllocateRequest
    insert: InsertRequest
    release: ReleaseRequest
    close_session: CloseSessionRequest
    stats: StatsRequest
    def __init__(self, attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ..., match_prefix: _Optional[_Union[MatchPrefixRequest, _Mapping]] = ..., prefetch_status: _Optional[_Union[PrefetchStatusRequest, _Mapping]] = ..., cancel_prefetch: _Optional[_Union[CancelPrefetchRequest, _Mapping]] = ..., allocate: _Optional[_Union[AllocateRequest, _Mapping]] = ..., insert: _Optional[_Union[InsertRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., close_session: _Optional[_Union[CloseSessionRequest, _Mapping]] = ..., stats: _Optional[_Union[StatsRequest, _Mapping]] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("status", "attach", "heartbeat", "match_prefix", "prefetch_status", "cancel_prefetch", "allocate", "insert", "release", "close_session", "stats")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    MATCH_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_STATUS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    INSERT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    status: OpStatus
    attach: AttachResponse
    heartbeat: HeartbeatResponse
    match_prefix: MatchPrefixResponse
    prefetch_status: PrefetchStatusResponse
    cancel_prefetch: CancelPrefetchResponse
    allocate: AllocateResponse
    insert: InsertResponse
    release: ReleaseResponse
    close_session: CloseSessionResponse
    stats: StatsResponse
    def __init__(self, status: _Optional[_Union[OpStatus, _Mapping]] = ..., attach: _Optional[_Union[AttachResponse, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatResponse, _Mapping]] = ..., match_prefix: _Optional[_Union[MatchPrefixResponse, _Mapping]] = ..., prefetch_status: _Optional[_Union[PrefetchStatusResponse, _Mapping]] = ..., cancel_prefetch: _Optional[_Union[CancelPrefetchResponse, _Mapping]] = ..., allocate: _Optional[_Union[AllocateResponse, _Mapping]] = ..., insert: _Optional[_Union[InsertResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., close_session: _Optional[_Union[CloseSessionResponse, _Mapping]] = ..., stats: _Optional[_Union[StatsResponse, _Mapping]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[BatchOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[BatchOp, _Mapping]]] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[BatchResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("tier", "member", "capacity_pages", "used_pages", "locked_pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    member: str
    capacity_pages: int
    used_pages: int
    locked_pages: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., member: _Optional[str] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., locked_pages: _Optional[int] = ...) -> None: ...

class TierCounts(_message.Message):
    __slots__ = ("device", "host", "storage")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    device: int
    host: int
    storage: int
    def __init__(self, device: _Optional[int] = ..., host: _Optional[int] = ..., storage: _Optional[int] = ...) -> None: ...

class PrefetchCounts(_message.Message):
    __slots__ = ("running", "done", "cancelled", "timed_out", "failed")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    running: int
    done: int
    cancelled: int
    timed_out: int
    failed: int
    def __init__(self, running: _Optional[int] = ..., done: _Optional[int] = ..., cancelled: _Optional[int] = ..., timed_out: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("lookups", "hit_tokens", "evictions", "backups", "prefetches", "l3_errors", "expired_leases")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    L3_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hit_tokens: TierCounts
    evictions: TierCounts
    backups: TierCounts
    prefetches: PrefetchCounts
    l3_errors: int
    expired_leases: int
    def __init__(self, lookups: _Optional[int] = ..., hit_tokens: _Optional[_Union[TierCounts, _Mapping]] = ..., evictions: _Optional[_Union[TierCounts, _Mapping]] = ..., backups: _Optional[_Union[TierCounts, _Mapping]] = ..., prefetches: _Optional[_Union[PrefetchCounts, _Mapping]] = ..., l3_errors: _Optional[int] = ..., expired_leases: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools", "counters")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    counters: Counters
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ...) -> None: ...
