"""Configuration: `hicache.yaml` loaded once into a tree of frozen dataclasses.

Every mistake is a `ConfigError` that names the key path, the bad value and what is
allowed. Environment variables are read here and nowhere else (`apply_env`).

The schema *is* the dataclasses below: the generic builder walks their fields and type
hints, so a key added to a dataclass is parsed, type-checked and documented in
`hicache config check` without further code. Cross-field rules live in each class's
`_validate(path)`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import ipaddress
import math
import mmap
import os
import re
import reprlib
import stat
import types
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hicache.endpoint import parse_address, split_host_port
from hicache.errors import ConfigError, InvalidArgument
from hicache.keys import chain_seed
from hicache.types import (
    ComponentKind,
    EvictionPolicy,
    HostLayout,
    L1Device,
    PageHash,
    PrefetchPolicy,
    StorageBackendName,
    WritePolicy,
)

MAX_FILE_THREADS = 64  # storage.file.threads
GiB = 1 << 30
UINT32_MAX = (1 << 32) - 1
MAX_LEASE_MS = UINT32_MAX  # lease_ms is a uint32 in the protocol
# At 10 ms, 1 request in 20 lapsed between heartbeats and the lease sweep took most of a
# core; at 50 ms none lapsed (tests/daemon/test_limits_review.py).
MIN_LEASE_MS = 100
# A call's request message: under half a second, a loaded machine stalling the reader
# between its call's arrival and the read could cancel calls whose message had come.
MIN_MESSAGE_TIMEOUT_S = 0.5
MAX_MESSAGE_TIMEOUT_S = 86400.0
MIN_MOONCAKE_SEGMENT = 16 << 20  # the least global segment Mooncake's setup accepts
MAX_L1_PAGES = (1 << 31) - 1  # an L1 page id travels as an int32 (MemberPages.page_ids)
MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's largest message (an int32 length)
L2_PAGE_HEADER_BYTES = 64  # a page_first L2 slot starts with its L3 object's header (a test
# checks it is the object format's HEADER_BYTES, which lives with the storage code) ...
L2_SLOT_ALIGN = 64  # ... and is padded to a cache line (and an int64 boundary)
MESSAGE_SLACK_BYTES = 1 << 20  # a message's fields besides its token or page-id bytes
MAX_TOKEN_CHARS = 4096  # server.tokens[].token
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # server.tokens[].name
MAX_TTL_S = (1 << 31) - 1  # storage.redis.ttl_s: ~68 years
MAX_TOKENS_PER_REQUEST = 1 << 28  # 1 GiB of token bytes: well inside gRPC's 2 GiB limit

_MEMBER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ComponentConfig:
    """One component's geometry. Token components (FULL, SWA) store a page per
    `page_size` tokens; MAMBA stores one state slot per checkpoint."""

    layers: int = 1
    bytes_per_token_per_layer: int = 0
    window_tokens: int = 0
    state_bytes_per_layer: int = 0

    def _validate(self, path: str) -> None:
        _positive(self.layers, f"{path}.layers")


@dataclass(frozen=True)
class SidecarConfig:
    """A pool that follows its anchor component's page ids and never votes on reuse."""

    anchor: ComponentKind = ComponentKind.FULL
    layers: int = 1
    bytes_per_token_per_layer: int = 0
    state_bytes_per_layer: int = 0

    def _validate(self, path: str) -> None:
        _positive(self.layers, f"{path}.layers")


@dataclass(frozen=True)
class MemberSpec:
    """A resolved pool of a family: a component or one of its sidecars (derived, not in YAML)."""

    name: str
    component: ComponentKind
    anchor: ComponentKind
    layers: int
    bytes_per_page_per_layer: int
    window_tokens: int

    @property
    def bytes_per_page(self) -> int:
        return self.layers * self.bytes_per_page_per_layer


@dataclass(frozen=True)
class ModelConfig:
    id: str = "demo-model"
    kv_dtype: str = "bfloat16"
    page_size: int = 64
    tp_size: int = 1
    components: Mapping[ComponentKind, ComponentConfig] = field(
        default_factory=lambda: {
            ComponentKind.FULL: ComponentConfig(layers=4, bytes_per_token_per_layer=256)
        }
    )
    sidecars: Mapping[str, SidecarConfig] = field(default_factory=dict)

    def _validate(self, path: str) -> None:
        _positive(self.page_size, f"{path}.page_size")
        _positive(self.tp_size, f"{path}.tp_size")
        if not self.id:
            raise ConfigError(f"{path}.id: must be a non-empty string")
        if not self.kv_dtype.strip():  # (part of every L3 key's seed, like the id)
            raise ConfigError(f"{path}.kv_dtype: must be a non-empty string (e.g. bfloat16)")
        if ComponentKind.FULL not in self.components:
            raise ConfigError(
                f"{path}.components: 'full' is required (got {sorted(k.value for k in self.components)})"
            )
        for kind, comp in self.components.items():
            cpath = f"{path}.components.{kind.value}"
            if kind is ComponentKind.MAMBA:
                _positive(comp.state_bytes_per_layer, f"{cpath}.state_bytes_per_layer")
                _zero(comp.bytes_per_token_per_layer, f"{cpath}.bytes_per_token_per_layer", "mamba")
            else:
                _positive(comp.bytes_per_token_per_layer, f"{cpath}.bytes_per_token_per_layer")
                _zero(comp.state_bytes_per_layer, f"{cpath}.state_bytes_per_layer", kind.value)
            if kind is ComponentKind.SWA:
                _positive(comp.window_tokens, f"{cpath}.window_tokens")
                if comp.window_tokens % self.page_size:
                    raise ConfigError(
                        f"{cpath}.window_tokens: {comp.window_tokens} is not a multiple of "
                        f"model.page_size ({self.page_size})"
                    )
            else:
                _zero(comp.window_tokens, f"{cpath}.window_tokens", kind.value)
        for name, side in self.sidecars.items():
            spath = f"{path}.sidecars.{name}"
            if not _MEMBER_NAME.fullmatch(name):
                # (names a shared-memory segment and every L3 key of the member)
                raise ConfigError(
                    f"{path}.sidecars: name {_brief(name)} must be 1-32 ASCII letters, digits, '_' or '-'"
                )
            if name in {k.value for k in ComponentKind}:
                raise ConfigError(f"{spath}: a sidecar may not take a component's name ({name!r})")
            if side.anchor not in self.components:
                raise ConfigError(
                    f"{spath}.anchor: {side.anchor.value!r} is not a configured component; "
                    f"allowed: {sorted(k.value for k in self.components)}"
                )
            if side.anchor is ComponentKind.MAMBA:
                _positive(side.state_bytes_per_layer, f"{spath}.state_bytes_per_layer")
                _zero(side.bytes_per_token_per_layer, f"{spath}.bytes_per_token_per_layer",
                      "mamba-anchored sidecar")
            else:
                _positive(side.bytes_per_token_per_layer, f"{spath}.bytes_per_token_per_layer")
                _zero(side.state_bytes_per_layer, f"{spath}.state_bytes_per_layer",
                      f"{side.anchor.value}-anchored sidecar")

    @functools.cached_property
    def members(self) -> tuple[MemberSpec, ...]:
        """Every pool of every family, as this daemon holds it: each component, then its
        sidecars (sorted by name). With `tp_size` N a page's row holds all N ranks' shards
        (rank r's at r x the shard's bytes): a page moves between tiers, and is stored in
        L3, for the whole group at once."""
        if self.tp_size == 1:
            return self.rank_members
        return tuple(dataclasses.replace(m, bytes_per_page_per_layer=m.bytes_per_page_per_layer * self.tp_size)
                     for m in self.rank_members)

    @functools.cached_property
    def rank_members(self) -> tuple[MemberSpec, ...]:
        """`members` as one tensor-parallel rank sees them (its shard of each row): the
        geometry an engine's rank attaches to (the configured bytes are per rank)."""
        out: list[MemberSpec] = []
        for kind in self.component_kinds:
            comp = self.components[kind]
            out.append(
                MemberSpec(
                    name=kind.value,
                    component=kind,
                    anchor=kind,
                    layers=comp.layers,
                    bytes_per_page_per_layer=self._page_bytes(
                        kind, comp.bytes_per_token_per_layer, comp.state_bytes_per_layer
                    ),
                    window_tokens=comp.window_tokens,
                )
            )
            for name in sorted(n for n, s in self.sidecars.items() if s.anchor is kind):
                side = self.sidecars[name]
                out.append(
                    MemberSpec(
                        name=name,
                        component=kind,
                        anchor=kind,
                        layers=side.layers,
                        bytes_per_page_per_layer=self._page_bytes(
                            kind, side.bytes_per_token_per_layer, side.state_bytes_per_layer
                        ),
                        window_tokens=0,
                    )
                )
        return tuple(out)

    @functools.cached_property
    def geometry(self) -> str:
        """The KV geometry as one canonical string (page size; each pool's component,
        layers, bytes per page per layer and window), part of every page hash's seed with
        `id` and `kv_dtype`: daemons that differ in it never share L3 objects."""
        pools = ";".join(
            f"{m.name}={m.component.value}:{m.layers}x{m.bytes_per_page_per_layer}w{m.window_tokens}"
            for m in self.members
        )
        # (tp 1 adds nothing: the seeds of existing L3 objects stay as they were)
        tp = f";tp{self.tp_size}" if self.tp_size > 1 else ""
        return f"page{self.page_size};{pools}{tp}"

    def chain_seed(self, namespace: str) -> PageHash:
        """The page-hash chain's seed for `namespace` (`keys.chain_seed` of this model's
        id, KV dtype and geometry): what every L3 key of the namespace continues from."""
        return chain_seed(namespace, self.id, self.kv_dtype, self.geometry)

    def _page_bytes(self, kind: ComponentKind, per_token: int, state: int) -> int:
        return state if kind is ComponentKind.MAMBA else per_token * self.page_size

    def family(self, kind: ComponentKind) -> tuple[MemberSpec, ...]:
        return self._families[kind]

    @functools.cached_property
    def _families(self) -> dict[ComponentKind, tuple[MemberSpec, ...]]:
        return {k: tuple(m for m in self.members if m.component is k) for k in ComponentKind}

    @functools.cached_property
    def component_kinds(self) -> tuple[ComponentKind, ...]:
        """Active components in canonical order (FULL first)."""
        return tuple(k for k in ComponentKind if k in self.components)


# --------------------------------------------------------------------------- tiers


@dataclass(frozen=True)
class L1Config:
    tokens: int = 65536
    size_gb: float | None = None
    mamba_slots: int = 256
    device: L1Device = L1Device.AUTO

    def _validate(self, path: str) -> None:
        _positive(self.tokens, f"{path}.tokens")
        _positive(self.mamba_slots, f"{path}.mamba_slots")
        if self.size_gb is not None:
            _positive(self.size_gb, f"{path}.size_gb")


@dataclass(frozen=True)
class L2Config:
    ratio: float = 2.0
    size_gb: float | None = None
    layout: HostLayout = HostLayout.AUTO
    reserve_gb: float = 2.0
    prefetch_fraction: float = 0.25

    def _validate(self, path: str) -> None:
        if self.ratio <= 1:
            raise ConfigError(f"{path}.ratio: {self.ratio!r} must be > 1 (L2 holds L1 and more)")
        if self.size_gb is not None:
            _positive(self.size_gb, f"{path}.size_gb")
        if self.reserve_gb < 0:
            raise ConfigError(f"{path}.reserve_gb: {self.reserve_gb!r} must be >= 0")
        if not 0 < self.prefetch_fraction <= 1:
            raise ConfigError(
                f"{path}.prefetch_fraction: {self.prefetch_fraction!r} must be in (0, 1]"
            )


@dataclass(frozen=True)
class TiersConfig:
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)


@dataclass(frozen=True)
class EvictionConfig:
    policy: EvictionPolicy = EvictionPolicy.LRU
    closed_session_tombstones: int = 4096
    max_open_sessions: int = 65536

    def _validate(self, path: str) -> None:
        _positive(self.closed_session_tombstones, f"{path}.closed_session_tombstones")
        _positive(self.max_open_sessions, f"{path}.max_open_sessions")


# Longest an L1 page's write-through copy may wait for others to share its flush.
MAX_BATCH_MS = 1000.0


@dataclass(frozen=True)
class WriteConfig:
    l1_to_l2: WritePolicy = WritePolicy.WRITE_THROUGH
    l2_to_l3: WritePolicy = WritePolicy.WRITE_THROUGH_SELECTIVE
    selective_threshold: int = 2
    # L1->L2 write-through copies wait to be flushed together: until this many pages wait
    # or this long after the first (whichever comes first); anything that needs them
    # (an L1 allocation short of room, Flush, shutdown) flushes them at once.
    l1_to_l2_batch_pages: int = 16
    l1_to_l2_batch_ms: float = 10.0

    def _validate(self, path: str) -> None:
        _positive(self.selective_threshold, f"{path}.selective_threshold")
        _positive(self.l1_to_l2_batch_pages, f"{path}.l1_to_l2_batch_pages")
        if not 0 <= self.l1_to_l2_batch_ms <= MAX_BATCH_MS:
            raise ConfigError(f"{path}.l1_to_l2_batch_ms: {self.l1_to_l2_batch_ms!r} must be in "
                              f"[0, {MAX_BATCH_MS}] (0: every copy at once)")


@dataclass(frozen=True)
class PrefetchConfig:
    policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    threshold_tokens: int = 256
    timeout_base_s: float = 2.0
    timeout_per_ki_token_s: float = 0.1
    timeout_max_s: float = 30.0

    def _validate(self, path: str) -> None:
        _positive(self.threshold_tokens, f"{path}.threshold_tokens")
        for name in ("timeout_base_s", "timeout_per_ki_token_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: {getattr(self, name)!r} must be >= 0")
        _positive(self.timeout_max_s, f"{path}.timeout_max_s")

    def timeout_for(self, tokens: int) -> float:
        """Seconds a `timeout` prefetch of `tokens` tokens may take."""
        return min(
            self.timeout_max_s,
            self.timeout_base_s + self.timeout_per_ki_token_s * tokens / 1024,
        )


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class FileStorageConfig:
    path: str = "/tmp/hicache"
    capacity_gb: float | None = None
    fsync: bool = False
    # Threads per call (existence checks, reads, writes); None: by filesystem (file.py).
    threads: int | None = None

    def _validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(f"{path}.path: must be a non-empty directory path")
        if self.capacity_gb is not None:
            _positive(self.capacity_gb, f"{path}.capacity_gb")
        if self.threads is not None and not 1 <= self.threads <= MAX_FILE_THREADS:
            raise ConfigError(f"{path}.threads: {self.threads!r} must be in [1, {MAX_FILE_THREADS}] "
                              "(or null: by filesystem)")


@dataclass(frozen=True)
class MooncakeStorageConfig:
    master: str | None = None
    metadata_server: str | None = None
    protocol: str = "tcp"
    device: str = ""
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 128 << 20
    local_hostname: str = "127.0.0.1"

    def _validate(self, path: str) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"{path}.protocol: {_brief(self.protocol)} is not one of ['rdma', 'tcp']")
        _positive(self.global_segment_size, f"{path}.global_segment_size")
        if self.global_segment_size < MIN_MOONCAKE_SEGMENT:
            # (Mooncake's setup refuses it, saying so only in its own log: -600 here)
            raise ConfigError(f"{path}.global_segment_size: {self.global_segment_size} bytes is "
                              f"under the {MIN_MOONCAKE_SEGMENT} (16 MiB) Mooncake mounts")
        _positive(self.local_buffer_size, f"{path}.local_buffer_size")


@dataclass(frozen=True)
class RedisStorageConfig:
    url: str = "redis://127.0.0.1:6379/0"
    ttl_s: int | None = None
    batch: int = 256
    pool_size: int = 8

    def _validate(self, path: str) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            scheme, sep, _ = self.url.partition("://")  # (not the URL: it may hold a password)
            got = f"scheme {one_line(scheme)}" if sep else "no scheme"
            raise ConfigError(
                f"{path}.url: must start with redis://, rediss:// or unix:// (got {got})"
            )
        from redis.connection import parse_url  # (what the backend connects by)

        try:
            parse_url(self.url)
        except ValueError as e:
            # (not redis-py's text for a port: it quotes the URL's text there, which may
            # be a password typed without its '@')
            said = str(e)
            reason = (said if said.startswith("Invalid value for") else
                      "its port is no number in [0, 65535] (a password holding '/', '?' or "
                      "'#' must be percent-encoded)" if "port" in said.lower() else
                      "redis-py cannot read it")
            raise ConfigError(f"{path}.url: {reason} (the URL is not shown: it may hold a "
                              "password)") from None
        if self.ttl_s is not None:
            _positive(self.ttl_s, f"{path}.ttl_s")
            if self.ttl_s > MAX_TTL_S:  # (Redis refuses an expiry past its clock's range)
                raise ConfigError(f"{path}.ttl_s: {_number_text(self.ttl_s)} is over {MAX_TTL_S}")
        _positive(self.batch, f"{path}.batch")
        _positive(self.pool_size, f"{path}.pool_size")


@dataclass(frozen=True)
class StorageConfig:
    backend: StorageBackendName = StorageBackendName.NONE
    timeout_s: float = 5.0
    required: bool = False
    file: FileStorageConfig = field(default_factory=FileStorageConfig)
    mooncake: MooncakeStorageConfig = field(default_factory=MooncakeStorageConfig)
    redis: RedisStorageConfig = field(default_factory=RedisStorageConfig)

    def _validate(self, path: str) -> None:
        _positive(self.timeout_s, f"{path}.timeout_s")
        if self.backend is StorageBackendName.MOONCAKE:
            for key in ("master", "metadata_server"):
                if not getattr(self.mooncake, key):
                    raise ConfigError(
                        f"{path}.mooncake.{key}: required with storage.backend=mooncake "
                        f"(or set {MOONCAKE_ENV[key]})"
                    )


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class TokenConfig:
    token: str = ""
    namespaces: tuple[str, ...] = ()
    name: str | None = None  # the tenant: engines, sessions and locks belong to it

    def _validate(self, path: str) -> None:
        if self.name is not None and not _TENANT_NAME.fullmatch(self.name):
            # (value hidden: a token put in the name's place by mistake would be shown)
            raise ConfigError(f"{path}.name: must be 1-64 letters, digits, '_', '.' or '-' "
                              "(value hidden)")
        if len(self.token) < 16:
            raise ConfigError(f"{path}.token: must be at least 16 characters (value hidden)")
        if len(self.token) > MAX_TOKEN_CHARS:  # (gRPC refuses metadata past 16 KiB: no call would pass)
            raise ConfigError(f"{path}.token: at most {MAX_TOKEN_CHARS} characters, to fit in a "
                              "call's metadata (value hidden)")
        if self.token != self.token.strip() or not header_value(self.token):
            # (a presented token is stripped: one with spaces around could never match)
            raise ConfigError(f"{path}.token: printable ASCII without surrounding spaces (value hidden)")
        if not self.namespaces:
            raise ConfigError(f"{path}.namespaces: list at least one namespace (or '*')")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "unix:///tmp/hicache.sock"
    probe_listen: str | None = None
    socket_mode: str = "0660"
    tls_cert: str | None = None
    tls_key: str | None = None
    tokens: tuple[TokenConfig, ...] = ()
    tokens_file: str | None = None  # the tokens from a file of their own (a mounted Secret)
    lease_ms: int = 30000
    shutdown_flush_s: float = 10.0
    max_tokens_per_request: int = 1 << 20
    message_timeout_s: float = 30.0  # a call's request message must arrive within this

    def _validate(self, path: str) -> None:
        if self.listen.startswith("unix://"):
            try:
                parse_address(self.listen)  # (the rule the daemon and the CLI parse by)
            except InvalidArgument as e:
                raise ConfigError(f"{path}.listen: {e}") from None
        else:
            _host_port(self.listen, f"{path}.listen", "is neither unix:///path nor host:port")
        if self.probe_listen is not None:
            _host_port(self.probe_listen, f"{path}.probe_listen", "is not host:port")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ConfigError(
                f"{path}.socket_mode: {_brief(self.socket_mode)} is not an octal mode like '0660'"
            ) from None
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"{path}.socket_mode: {self.socket_mode!r} is out of range")
        for key in ("tls_cert", "tls_key", "tokens_file"):  # ('' is no path: plaintext would follow)
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ConfigError(f"{path}.{key}: an empty path; leave it out (null) for none")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"{path}.tls_cert/tls_key: give both or neither")
        seen: set[str] = set()
        for i, entry in enumerate(self.tokens):
            if entry.token in seen:  # (the last entry would win: a silent widening)
                raise ConfigError(f"{path}.tokens[{i}].token: the same token is listed twice (value hidden)")
            seen.add(entry.token)
        _positive(self.lease_ms, f"{path}.lease_ms")
        if self.lease_ms < MIN_LEASE_MS:
            raise ConfigError(f"{path}.lease_ms: {self.lease_ms} is under {MIN_LEASE_MS} (a "
                              "client heartbeats every lease_ms / 3, which a call must fit in)")
        if self.lease_ms > MAX_LEASE_MS:
            raise ConfigError(f"{path}.lease_ms: {self.lease_ms} is over {MAX_LEASE_MS} "
                              "(a uint32 on the wire)")
        _positive(self.shutdown_flush_s, f"{path}.shutdown_flush_s")
        if not MIN_MESSAGE_TIMEOUT_S <= self.message_timeout_s <= MAX_MESSAGE_TIMEOUT_S:
            raise ConfigError(f"{path}.message_timeout_s: {self.message_timeout_s!r} is not within "
                              f"{MIN_MESSAGE_TIMEOUT_S:g}-{MAX_MESSAGE_TIMEOUT_S:g} s (a day)")
        _positive(self.max_tokens_per_request, f"{path}.max_tokens_per_request")
        if self.max_tokens_per_request > MAX_TOKENS_PER_REQUEST:
            raise ConfigError(
                f"{path}.max_tokens_per_request: {self.max_tokens_per_request} is over "
                f"{MAX_TOKENS_PER_REQUEST} (gRPC messages are limited to 2 GiB, 4 bytes a token)"
            )

    def tcp_listeners(self) -> list[tuple[str, str, int]]:
        """(key, host, port) of each TCP address the server listens on."""
        out = []
        for key in ("listen", "probe_listen"):
            address = getattr(self, key)
            if address is not None and not address.startswith("unix://"):
                host_port = split_host_port(address)
                if host_port is not None:  # (validated already)
                    out.append((f"server.{key}", *host_port))
        return out

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)


def _same_socket(host: str, other: str) -> bool:
    """Whether listeners on these two hosts of one port collide: the same address, a
    wildcard of their family (`0.0.0.0` every IPv4 address; `[::]`, dual stack, every
    address), or a host name, which may resolve to the other's address (`localhost`:
    127.0.0.1 and ::1). Only two different literal addresses can share a port."""
    if host == other:
        return True
    a, b = _ip_literal(host), _ip_literal(other)
    if a is None or b is None:
        return True
    if a.is_unspecified or b.is_unspecified:
        dual_stack = any(x.version == 6 and x.is_unspecified for x in (a, b))
        return dual_stack or a.version == b.version
    return a == b


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None  # a host name (or empty: every address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 9400

    def _validate(self, path: str) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{path}.port: {self.port!r} must be in [0, 65535] (0 disables)")


# --------------------------------------------------------------------------- root


@dataclass(frozen=True)
class HicacheConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    write: WriteConfig = field(default_factory=WriteConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def _validate(self, path: str) -> None:
        self._check_ports()
        if self.tiers.l2.layout is HostLayout.LAYER_FIRST and self.storage.backend is not StorageBackendName.NONE:
            raise ConfigError(
                "tiers.l2.layout: layer_first cannot serve an L3 backend (objects are whole "
                f"pages; storage.backend is {self.storage.backend.value}): use auto or page_first"
            )
        # (a ratio a hair over 1 rounds to L1's own size)
        by = (f"tiers.l2.size_gb: {self.tiers.l2.size_gb} GiB" if self.tiers.l2.size_gb is not None
              else f"tiers.l2.ratio: {self.tiers.l2.ratio!r}")
        for kind in self.model.component_kinds:
            l1, l2 = self.pages_for(kind), self.l2_pages_for(kind)
            if l2 <= l1:
                what = "slots" if kind is ComponentKind.MAMBA else "pages"
                raise ConfigError(
                    f"{by} gives {l2} {what} per {kind.value} pool, not more than L1's {l1}: "
                    "L2 must hold L1 and more"
                )
        if ComponentKind.MAMBA in self.model.component_kinds and self.tiers.l1.mamba_slots < 2:
            # A request continuing a checkpoint in L1 copies it into a slot of its own
            # while its match keeps the checkpoint locked: one slot would fail them all.
            raise ConfigError(
                f"tiers.l1.mamba_slots: {self.tiers.l1.mamba_slots} with a mamba component; "
                "at least 2 (a request copies the checkpoint it continues into its own slot)"
            )
        for name, pages in (("tiers.l1 (tokens or size_gb)", self.l1_pages),
                            ("tiers.l1.mamba_slots", self.tiers.l1.mamba_slots)):
            if pages > MAX_L1_PAGES:
                raise ConfigError(
                    f"{name}: {pages} pages per L1 pool, over {MAX_L1_PAGES} "
                    "(page ids travel as int32)"
                )
        if self.prefetch.threshold_tokens < self.model.page_size:
            raise ConfigError(
                f"prefetch.threshold_tokens: {self.prefetch.threshold_tokens} is below one page "
                f"(model.page_size = {self.model.page_size})"
            )
        if self.server.max_tokens_per_request < self.model.page_size:
            raise ConfigError(
                f"server.max_tokens_per_request: {self.server.max_tokens_per_request} is below "
                f"one page (model.page_size = {self.model.page_size}): no request could "
                "hold a whole page, so nothing would be cached"
            )
        if self.prefetch.threshold_tokens > self.server.max_tokens_per_request:
            raise ConfigError(
                f"prefetch.threshold_tokens: {self.prefetch.threshold_tokens} is over "
                f"server.max_tokens_per_request ({self.server.max_tokens_per_request}): no "
                "request could start a prefetch"
            )
        if self.max_reply_bytes > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"server.max_tokens_per_request: {self.server.max_tokens_per_request} tokens "
                f"can need a reply of {self.max_reply_bytes} bytes ({len(self.model.members)} "
                f"members, page_size {self.model.page_size}), over gRPC's {MAX_MESSAGE_BYTES}"
            )

    @property
    def max_request_bytes(self) -> int:
        """The largest request a call may send: `max_tokens_per_request` token ids."""
        return 4 * self.server.max_tokens_per_request + MESSAGE_SLACK_BYTES

    @property
    def max_reply_bytes(self) -> int:
        """The largest reply one call can need: a MatchPrefix listing the matched and the
        allocated pages of every member (4 bytes a page id), no more pages than a request's
        tokens or an L1 pool hold. (A Batch's reply holds the replies of all its ops.)"""
        pages = min(-(-self.server.max_tokens_per_request // self.model.page_size),
                    max(self.l1_pages, self.tiers.l1.mamba_slots))
        return 2 * len(self.model.members) * 4 * pages + MESSAGE_SLACK_BYTES

    # Derived sizes -----------------------------------------------------------------

    @property
    def l1_pages(self) -> int:
        """Pages of each token component's L1 pool."""
        page = self.model.page_size
        if self.tiers.l1.size_gb is None:
            return max(1, self.tiers.l1.tokens // page)
        token_bytes = sum(
            m.bytes_per_page for m in self.model.members if m.component is not ComponentKind.MAMBA
        )
        mamba_bytes = sum(
            m.bytes_per_page for m in self.model.members if m.component is ComponentKind.MAMBA
        ) * self.tiers.l1.mamba_slots
        budget = int(self.tiers.l1.size_gb * GiB) - mamba_bytes
        if budget < token_bytes:
            raise ConfigError(
                f"tiers.l1.size_gb: {self.tiers.l1.size_gb} GiB does not hold one page of every pool"
            )
        return budget // token_bytes

    def l2_pages(self, l1_pages: int) -> int:
        """Pages of each L2 pool: ratio x L1 (rounded up, as MAMBA's slots are: 100 x 2.3
        is 230, not the 229 its float product truncates to), or as many as `size_gb`
        holds with each page's L2 slot (`l2_slot_bytes`: a page_first slot's header and
        padding too, or the pools overran the budget)."""
        l2 = self.tiers.l2
        if l2.size_gb is None:
            return ratio_of(l1_pages, l2.ratio)
        slots = [l2_slot_bytes(m, self.host_layout) for m in self.model.members]
        budget = int(l2.size_gb * GiB)
        # Each member's region starts on an OS page (`HostBufferPools`): the rounding
        # counts against the budget too.
        pages = budget // sum(slots)
        while pages > 1 and sum(-(-pages * b // OS_PAGE) * OS_PAGE for b in slots) > budget:
            pages -= 1
        return max(1, pages)

    def pages_for(self, kind: ComponentKind) -> int:
        """L1 pool size (in pages or slots) of a component."""
        if kind is ComponentKind.MAMBA:
            return self.tiers.l1.mamba_slots
        return self.l1_pages

    def _check_ports(self) -> None:
        """Two listeners on one port: the second cannot bind, and the daemon would find out
        only once its pools are built. The metrics server binds every address (0.0.0.0)."""
        listeners = self.server.tcp_listeners()
        if self.metrics.port:
            listeners.append(("metrics.port", "0.0.0.0", self.metrics.port))
        for i, (key, host, port) in enumerate(listeners):
            for other, other_host, other_port in listeners[:i]:
                if port == other_port and _same_socket(host, other_host):
                    raise ConfigError(f"{key}: port {port} is also {other}'s: give each "
                                      "listener its own port")

    def l2_pages_for(self, kind: ComponentKind) -> int:
        """L2 pool size (in pages or slots) of a component: MAMBA's slots are `ratio` x
        L1's slots, or (with `size_gb`) as many as a token pool's pages."""
        if kind is ComponentKind.MAMBA and self.tiers.l2.size_gb is None:
            return ratio_of(self.tiers.l1.mamba_slots, self.tiers.l2.ratio)
        return self.l2_pages(self.l1_pages)

    @property
    def host_layout(self) -> HostLayout:
        if self.tiers.l2.layout is not HostLayout.AUTO:
            return self.tiers.l2.layout
        if self.storage.backend is StorageBackendName.NONE:
            return HostLayout.LAYER_FIRST
        return HostLayout.PAGE_FIRST


# --------------------------------------------------------------------------- loading

MOONCAKE_ENV = {
    "master": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device": "MOONCAKE_DEVICE",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
}


def default_config_text() -> str:
    """The embedded `hicache.yaml` (shipped inside the package)."""
    return resources.files("hicache").joinpath("hicache.yaml").read_text()


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: typing.Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> HicacheConfig:
    """Load `path` (or the embedded default), apply `KEY=VALUE` overrides and the Mooncake
    environment variables, validate, and return the frozen configuration."""
    if path is None:
        text, source = default_config_text(), "embedded hicache.yaml"
    else:
        source = one_line(os.fspath(path))
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {source}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"cannot read configuration file {source}: not UTF-8 (byte {e.start})"
            ) from None
        except ValueError as e:  # a NUL in the name
            raise ConfigError(f"cannot read configuration file {source}: {e}") from None
    raw = parse_yaml(text, source)
    for item in overrides:
        apply_override(raw, item)
    from_env = apply_env(raw, os.environ if env is None else env)
    tokens_file = _read_tokens_file(raw)
    try:
        return build_config(raw)
    except ConfigError as e:
        if tokens_file is not None and str(e).startswith("server.tokens"):
            raise ConfigError(f"server.tokens_file ({tokens_file}): {e}") from None
        # A value the environment supplied is named by its variable too: the file the
        # operator reads shows nothing (or null) at that key.
        for key, var in from_env.items():
            if str(e).startswith(f"{key}:"):
                raise ConfigError(f"{e} (the value came from {var})") from None
        raise


def _read_tokens_file(raw: dict[str, Any]) -> str | None:
    """With `server.tokens_file`, its list becomes `server.tokens` in `raw` (each entry
    validated as one given inline); returns the file's name for messages (None without).
    YAML errors there never quote the file's lines: they hold the tokens."""
    server = raw.get("server")
    path = server.get("tokens_file") if isinstance(server, dict) else None
    if not isinstance(path, str) or not path.strip():
        return None  # (a wrong type or an empty path: the validation names it)
    assert isinstance(server, dict)
    source = one_line(path)
    if server.get("tokens"):
        raise ConfigError("server.tokens and server.tokens_file: give the tokens in one place, "
                          "not both (values hidden)")
    data = read_named_file(path, "server.tokens_file", ConfigError, regular=True)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"server.tokens_file: cannot read {source}: not UTF-8 text") from None
    try:
        tokens = _load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"server.tokens_file ({source}): not valid YAML: {_yaml_problem(e)}") from None
    if tokens is not None and not isinstance(tokens, list):
        raise ConfigError(f"server.tokens_file ({source}): must hold a YAML list of "
                          f"{{token, namespaces, name}} entries, got {type(tokens).__name__}")
    if not tokens:  # (read as no tokens, it would turn authentication off)
        raise ConfigError(f"server.tokens_file ({source}): lists no token; list at least one "
                          "(or leave tokens_file out for no authentication)")
    server["tokens"] = tokens
    return source


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the
    last one silently: a second `storage:` section would drop the first). Each mapping's
    own keys are checked once, before merge keys (`<<: *anchor`) are folded into it:
    PyYAML rewrites a merged node in place, so checking after would see its merged
    keys again, and a mapping only ever merged would never be checked."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A scalar PyYAML cannot convert (`2020-02-30` read as a date, `!!int abc`) raised
        ValueError and the like, not a YAML error: it becomes one, with where it is (not
        the value: it may be a token)."""
        try:
            return super().construct_object(node, deep)  # type: ignore[no-untyped-call]
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
            kind = str(node.tag).rsplit(":", 1)[-1]
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read a {kind} value ({type(e).__name__})", node.start_mark
            ) from None

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # (`<<: *anchor` is not a key of its own)
                if key_node.tag == "tag:yaml.org,2002:value":
                    key: Any = "="  # (PyYAML turns the `=` value key into the string "=")
                else:
                    key = self.construct_object(key_node)  # type: ignore[no-untyped-call]
                try:
                    duplicate = key in seen
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found an unhashable key ({type(key).__name__})", key_node.start_mark
                    ) from None
                if duplicate:  # (named when it is one of ours: any other may be a token)
                    shown = f" {key!r}" if key in _schema_keys() else ""
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key{shown}", key_node.start_mark
                    )
                seen.add(key)
        super().flatten_mapping(node)  # type: ignore[no-untyped-call]


# Numbers as YAML 1.2's core schema reads them, not PyYAML's 1.1 rules: `1e3` and `1.5E-3`
# are numbers (1.1 needs a dot and a signed exponent), `0100` is 100 (1.1: octal 64),
# `0o100` is 64 (1.1: a string), `1:30` is no number (1.1: 90, base 60), `0b101` neither.
# Kept from 1.1: `_` between digits (`131_072`) and the yes/no/on/off booleans.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.VERBOSE),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    text = text.lstrip("+-")
    if text.startswith("0o"):
        return sign * int(text[2:], 8)
    if text.startswith("0x"):
        return sign * int(text[2:], 16)
    return sign * int(text, 10)


_StrictLoader.add_constructor(_INT, _construct_int)


def _plain_leaf(parts: typing.Sequence[str]) -> bool:
    """Whether `parts` (a dotted key, split) name a setting of the schema that is neither a
    section nor secret."""
    tp: Any = HicacheConfig
    for part in parts:
        if not (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
            return False
        fields = {f.name for f in dataclasses.fields(tp)}
        if part not in fields:
            return False
        hint = typing.get_type_hints(tp)[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        tp = args[0] if _optional(hint) and len(args) == 1 else hint
    return not dataclasses.is_dataclass(tp) and not _may_hold_secret(".".join(parts))


@functools.cache
def _schema_keys() -> frozenset[str]:
    """Every key name the configuration has (at any level)."""
    names: set[str] = set()

    def visit(tp: Any) -> None:
        for f in dataclasses.fields(tp):
            names.add(f.name)
            hint = typing.get_type_hints(tp)[f.name]
            for arg in (hint, *typing.get_args(hint), *(a for t in typing.get_args(hint)
                                                         for a in typing.get_args(t))):
                if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                    visit(arg)

    visit(HicacheConfig)
    return frozenset(names)


def _load_yaml(text: str) -> Any:
    """`text` read by the strict loader; RecursionError (nesting deeper than Python's
    stack) as a YAML error."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # (a SafeLoader subclass)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    try:
        raw = _load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b.c=value`: set a key by its dotted path; the value is parsed as YAML, so it is
    typed and then validated exactly like the file."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {one_line(item)}: expected KEY=VALUE with a dotted key")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {one_line(key)}: a dotted key has an empty part")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {one_line(key)}: {one_line('.'.join(parts[: i + 1]))} "
                              "is not a section")
        node = nxt
    try:  # (the file's loader: a duplicate key is refused here too)
        node[parts[-1]] = _load_yaml(value) if value.strip() else ""
    except yaml.YAMLError as e:
        # Shown only under a known, non-secret key: a mistyped secret key (server.token,
        # storage.redis.URL) may hold a secret as well.
        shown = repr(value) if _plain_leaf(parts) else "(value hidden)"
        raise ConfigError(f"--set {one_line(key)}: value {shown} is not valid YAML: "
                          f"{_yaml_problem(e)}") from None


def apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Fill Mooncake settings from the standard environment variables; YAML wins. Returns
    the keys filled (dotted path -> variable)."""
    if not any(v in env for v in MOONCAKE_ENV.values()):
        return {}
    storage = raw.get("storage")
    if storage is None:  # (an empty `storage:` means the defaults)
        storage = raw["storage"] = {}
    if not isinstance(storage, dict):
        raise ConfigError(f"storage: expected a mapping, got {_brief(storage)}")
    section = storage.get("mooncake")
    if section is None:
        section = storage["mooncake"] = {}
    if not isinstance(section, dict):
        raise ConfigError(f"storage.mooncake: expected a mapping, got {_brief(section)}")
    filled: dict[str, str] = {}
    for key, var in MOONCAKE_ENV.items():
        if var in env and section.get(key) in (None, ""):
            value: Any = env[var]
            if key == "global_segment_size":
                # ASCII digits only, as for ports: int() also takes other scripts' digits.
                if not re.fullmatch(r"[0-9]+", value.strip()):
                    raise ConfigError(f"{var}: {_brief(value)} is not an integer byte count "
                                      "(ASCII digits)")
                value = int(value)
            section[key] = value
            filled[f"storage.mooncake.{key}"] = var
    return filled


def build_config(raw: Mapping[str, Any]) -> HicacheConfig:
    cfg = _build(HicacheConfig, raw, "")
    assert isinstance(cfg, HicacheConfig)
    return cfg


def _build(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    shown = path or "<root>"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _build(inner, value, path)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{shown}: expected a mapping, got {_show(value, shown)}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields), key=str)
        if unknown:
            key = "(a key, hidden)" if _secret(path) else one_line(unknown[0])
            raise ConfigError(f"{_join(path, key)}: unknown key; allowed: {sorted(fields)}")
        # An explicit `key: null` on a field that is not optional means "the default" (the
        # reference hicache.yaml uses it for keys that the environment may supply).
        kwargs = {
            name: _build(hints[name], value[name], _join(path, name))
            for name in fields
            if name in value and (value[name] is not None or _optional(hints[name]))
        }
        factory: Any = tp
        obj = factory(**kwargs)
        validate = getattr(obj, "_validate", None)
        if validate is not None:
            validate(path)
        return obj
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{shown}: expected a list, got {_show(value, shown)}")
        (inner, _) = typing.get_args(tp)
        return tuple(_build(inner, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict):
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{shown}: expected a mapping, got {_show(value, shown)}")
        key_tp, val_tp = typing.get_args(tp)
        return {
            _build(key_tp, k, path): _build(val_tp, v, _join(path, one_line(k)))
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = [m.value for m in tp]
        if value not in allowed:
            raise ConfigError(f"{shown}: {_show(value, shown)} is not one of {allowed}")
        return tp(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{shown}: expected true or false, got {_show(value, shown)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{shown}: expected an integer, got {_show(value, shown)}")
        if not -MAX_INT <= value <= MAX_INT:  # (sizes multiply: keep them to 64 bits)
            raise ConfigError(f"{shown}: {_number_text(value)} is out of range (|n| <= 2**63 - 1)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{shown}: expected a number, got {_show(value, shown)}")
        # Every number here is a size, a time or a ratio: finite, and within what the
        # code computing with it (pool sizes, timed waits) can take.
        limit = _float_limit(path)
        if isinstance(value, int) and abs(value) > limit:  # (an int past a float's range)
            raise ConfigError(f"{shown}: {_number_text(value)} is over {limit:g}")
        if not math.isfinite(value):
            raise ConfigError(f"{shown}: {value!r} is not a finite number")
        if abs(value) > limit:
            raise ConfigError(f"{shown}: {value!r} is over {limit:g}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            hint = ""
            if shown.endswith("socket_mode") and isinstance(value, int):
                hint = " (YAML reads an unquoted 0660 as a number: quote it, '0660')"
            raise ConfigError(f"{shown}: expected a string, got {_show(value, shown)}{hint}")
        try:  # (a lone surrogate, which YAML's escapes can make: no file name or key holds it)
            value.encode()
        except UnicodeEncodeError:
            raise ConfigError(f"{shown}: not valid Unicode text (a lone surrogate)") from None
        if "\x00" in value:  # (YAML's "\0": no file name, address or id holds one)
            raise ConfigError(f"{shown}: holds a NUL character")
        return value
    raise TypeError(f"config schema: unsupported type {tp!r} at {shown}")


OS_PAGE = mmap.PAGESIZE  # the L2 pools' regions start on OS pages


def l2_slot_bytes(spec: MemberSpec, layout: HostLayout) -> int:
    """Bytes one page of `spec` takes in L2: header and payload padded to a cache line
    (`page_first`, the layout of L3 objects), or the payload (`layer_first`, where a page's
    layers are apart). The one rule: the host pools lay out by it (`tiers.sizing`)."""
    if layout is HostLayout.PAGE_FIRST:
        return -(-(L2_PAGE_HEADER_BYTES + spec.bytes_per_page) // L2_SLOT_ALIGN) * L2_SLOT_ALIGN
    return spec.bytes_per_page


def ratio_of(count: int, ratio: float) -> int:
    """`count` x `ratio`, rounded up; a float product a hair over a whole number (from the
    ratio's binary form) counts as that number."""
    return math.ceil(round(count * ratio, 6))


def _host_port(value: str, path: str, problem: str) -> None:
    if split_host_port(value) is None:  # (the rule the daemon and the CLI parse by)
        raise ConfigError(f"{path}: {_brief(value)} {problem}")


MAX_INT = (1 << 63) - 1
# Upper bounds of float keys by the ending of their name: durations (timed waits take at
# most `threading.TIMEOUT_MAX`), sizes in GiB (1 PiB), and any other number (ratios).
_FLOAT_LIMITS = (("_s", 86400.0), ("_ms", 86400e3), ("_gb", float(1 << 20)))
_FLOAT_LIMIT = 1e12


def _float_limit(path: str) -> float:
    for suffix, limit in _FLOAT_LIMITS:
        if path.endswith(suffix):
            return limit
    return _FLOAT_LIMIT


def _number_text(value: int) -> str:
    """An integer for a message: a huge one by its size, not its 400 digits."""
    text = str(value)
    return text if len(text) <= 24 else f"a {len(text.lstrip('-'))}-digit number"


def header_value(text: str) -> bool:
    """Whether `text` can travel as a gRPC metadata value (a bearer token, an engine id):
    printable ASCII. Anything else fails every call INTERNAL "Invalid metadata"."""
    return text.isascii() and text.isprintable()


def read_named_file(path: str, what: str, error: Callable[[str], Exception],
                    regular: bool = False) -> bytes:
    """The bytes of a file that a setting or an option (`what`) names; `error(message)`,
    naming both, when it cannot be read (a missing file, a directory, a NUL in the name).
    `regular`: anything but a regular file (after links) is refused unread: the daemon's
    own files, where a FIFO or a device would hold the reading thread for good (a pipe is
    fine for a command's `--token-file <(...)`)."""
    try:
        if regular and not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{what}={one_line(path)}: not a regular file")
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise error(f"{what}={one_line(path)}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise error(f"{what}={one_line(path)}: cannot read it ({e})") from None


def one_line(key: object) -> str:
    """A key or file name as a message shows it: as written, or quoted when it is not
    printable (a newline in it would split the one-line error)."""
    text = str(key)
    return text if text.isprintable() else repr(text)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any, path: str = "") -> str:
    if _may_hold_secret(path):
        return f"{type(value).__name__} (value hidden)"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{_number_text(value)} (int)"
    return f"{_brief(value)} ({type(value).__name__})"


# How a value shows in a message: bounded, however large (YAML aliases can make a 2 KB
# file hold a list of 9**10 strings, shared: a plain repr would never finish).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 3
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 6
_SHOWN.maxstring = _SHOWN.maxother = 160


def _brief(value: object) -> str:
    """`repr(value)`, bounded (see `_SHOWN`)."""
    return _SHOWN.repr(value)


# Keys whose values are never printed: the bearer tokens, and the URLs that may hold a
# password (Redis's; the Mooncake metadata server's, an HTTP or etcd URL). A configuration
# error goes to stderr, which systemd sends to the journal.
SECRET_KEYS = ("server.tokens", "storage.redis.url", "storage.mooncake.metadata_server")


def redact_url(url: str) -> str:
    """The URL without its credentials (`user:password@`) and without a `password=` (or
    `username=`) query parameter, which redis-py takes too. The credentials end at an `@`
    inside the authority (up to the first `/`, `?` or `#`); a password holding one of those
    (not escaped) ends at the last `@` followed by a host: then everything before that `@`
    is hidden. An `@` in the path or query of a URL whose authority is a host is no
    credential."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    at = -1
    if "@" in authority:
        at = authority.rindex("@")
    elif "@" in rest and (authority or not rest.startswith("/")) and not _URL_HOST.fullmatch(authority):
        candidates = [i for i, ch in enumerate(rest) if ch == "@"]
        at = next((i for i in reversed(candidates)
                   if _URL_HOST.fullmatch(re.split(r"[/?#]", rest[i + 1 :], maxsplit=1)[0])),
                  candidates[-1])
    host, q, query = rest[at + 1 :].partition("?")
    if q:
        params = [p if urllib.parse.unquote(p.split("=", 1)[0]).lower()
                  not in ("password", "username") else f"{p.split('=', 1)[0]}=***"
                  for p in query.split("&")]
        host = f"{host}?{'&'.join(params)}"
    return f"{scheme}{sep}{'***@' if at >= 0 else ''}{host}"


# A URL's host[:port] (a name, an IPv4 address or a bracketed IPv6 one); not a bare
# `:digits` (an empty user and a numeric password before a `?` look like that).
_URL_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.%]+\]|[A-Za-z0-9._%-]+)(?::[0-9]*)?")


def _secret(path: str) -> bool:
    """Whether `path` lies in one of `SECRET_KEYS`."""
    return any(path == key or path.startswith((f"{key}[", f"{key}.")) for key in SECRET_KEYS)


def _may_hold_secret(path: str) -> bool:
    """`_secret`, or a section above one of `SECRET_KEYS`: a value given there (a list or
    a string where a mapping belongs) may hold the secret."""
    return _secret(path) or path in ("", "<root>") or any(
        key.startswith(f"{path}.") for key in SECRET_KEYS)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What a YAML error says, with where, but not the snippet of the file PyYAML quotes:
    that line may hold a token."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = "; ".join(str(x) for x in (e.context, e.problem) if x) or type(e).__name__
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what
    if isinstance(e, yaml.reader.ReaderError):  # a byte or character YAML does not allow
        what = (f"character {e.character!r}" if isinstance(e.character, str)
                else f"byte 0x{e.character:02x}")
        return f"{what} at position {e.position}: {e.reason}"
    return str(e) or type(e).__name__


def _positive(value: float, path: str) -> None:
    if value <= 0:
        raise ConfigError(f"{path}: {value!r} must be > 0")


def _zero(value: float, path: str, kind: str) -> None:
    if value:
        raise ConfigError(f"{path}: not used by a {kind} component (got {_brief(value)})")


def to_plain(cfg: Any) -> Any:
    """The configuration as plain YAML-able data (enums as their values)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {to_plain(k): to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, tuple):
        return [to_plain(v) for v in cfg]
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg
