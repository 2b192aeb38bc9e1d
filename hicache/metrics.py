"""Prometheus metrics of the daemon, served over HTTP on `metrics.port` (0 disables).

Three sources:
- RPC latency, observed by the interceptor per (method, code): `hicache_rpc_seconds`.
- Configuration reloads (`hicache.reload`), counted by outcome:
  `hicache_config_reloads_total{outcome}`, `hicache_config_last_reload_successful`.
- Everything the core counts, read from `CacheService.stats()` / `health()` at scrape time
  by `CoreCollector`, so the core stays the one owner of its counters and a scrape always
  sees one consistent snapshot. That includes the L3 call latencies the controller keeps
  (`hicache_l3_op_seconds{backend,op,outcome}`, exported as a real histogram).

Labels are fixed vocabularies (method, code, tier, member, op, outcome, backend): never a
namespace (it can identify a tenant) and never anything from credentials.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hicache.controller.base import CacheService, StatsSnapshot
from hicache.convert import canonical_counters

log = logging.getLogger("hicache.metrics")

RPC_BUCKETS = (
    50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3, 0.1, 0.5, 2.0
)

# Canonical counter groups (`convert.canonical_counters`): key prefix -> (name, label, help).
_LABELLED: tuple[tuple[str, str, str, str], ...] = (
    ("hit_tokens_", "hicache_hit_tokens", "tier", "matched tokens by the tier they were found in"),
    ("evictions_", "hicache_evictions", "tier", "pages evicted from each tier"),
    ("backups_", "hicache_backups", "tier", "pages backed up into each tier"),
    ("prefetches_", "hicache_prefetches", "outcome", "L3->L2 prefetches by outcome"),
)
_NAME_OK = re.compile(r"[a-z_][a-z0-9_]*")


class RpcMetrics:
    """RPC latency histograms by method and status code (label children cached)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._hist = Histogram(
            "hicache_rpc_seconds",
            "RPC latency by method and status code",
            ("method", "code"),
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def observe(self, method: str, code: str, seconds: float) -> None:
        child = self._children.get((method, code))
        if child is None:
            with self._lock:
                child = self._children.setdefault(
                    (method, code), self._hist.labels(method=method, code=code)
                )
        child.observe(seconds)


class ReloadMetrics:
    """Configuration reloads by outcome, and whether the last one succeeded (1 before any:
    the configuration the daemon started with is in effect)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._reloads = Counter("hicache_config_reloads", "configuration reloads (SIGHUP) by outcome",
                                ("outcome",), registry=registry)
        for outcome in ("applied", "failed"):
            self._reloads.labels(outcome=outcome)
        self._last_ok = Gauge("hicache_config_last_reload_successful",
                              "1 when the last configuration reload succeeded (or none was tried)",
                              registry=registry)
        self._last_ok.set(1)

    def observe(self, ok: bool) -> None:
        self._reloads.labels(outcome="applied" if ok else "failed").inc()
        self._last_ok.set(1 if ok else 0)


class CoreCollector(Collector):
    """Reads the core's stats and backend health at each scrape."""

    def __init__(self, core: CacheService) -> None:
        self._core = core

    def collect(self) -> Iterator[Any]:
        try:
            snap = self._core.stats()
        except Exception:  # a scrape must never take the daemon down
            log.exception("metrics: stats() failed")
            return
        yield from pool_families(snap)
        yield from counter_families(snap)
        yield from l3_families(snap)
        try:
            backends = self._core.health(False)
        except Exception:
            log.exception("metrics: health() failed")
            return
        healthy = GaugeMetricFamily(
            "hicache_backend_healthy", "1 while the L3 backend is healthy", labels=("backend",)
        )
        latency = GaugeMetricFamily(
            "hicache_backend_probe_latency_seconds",
            "latency of the last health probe of the L3 backend",
            labels=("backend",),
        )
        for b in backends:
            healthy.add_metric((b.name,), 1.0 if b.healthy else 0.0)
            latency.add_metric((b.name,), b.latency_ms / 1e3)
        yield healthy
        yield latency


def pool_families(snap: StatsSnapshot) -> Iterator[GaugeMetricFamily]:
    names = {
        "capacity_pages": "pool capacity in pages (MAMBA: state slots)",
        "used_pages": "pages holding data or allocated",
        "locked_pages": "pages held by locks or allocations (not evictable)",
    }
    for attr, help_text in names.items():
        fam = GaugeMetricFamily(f"hicache_pool_{attr}", help_text, labels=("tier", "member"))
        for p in snap.pools:
            fam.add_metric((p.tier, p.member), float(getattr(p, attr)))
        yield fam


def l3_families(snap: StatsSnapshot) -> Iterator[Any]:
    """L3 call latency histograms (cumulative `le` buckets, _sum, _count) per backend, op and
    outcome, the object bytes each backend read and stored, and the corrupt objects it
    found (each a miss) and removed."""
    latency = HistogramMetricFamily(
        "hicache_l3_op_seconds",
        "latency of L3 backend calls by operation and outcome",
        labels=("backend", "op", "outcome"),
    )
    moved = CounterMetricFamily(
        "hicache_l3_bytes", "object bytes read (op=get) and stored (op=put) in L3",
        labels=("backend", "op"),
    )
    corrupt = CounterMetricFamily(
        "hicache_l3_corrupt_objects",
        "L3 objects that failed verification on read (found; each a miss) and of those the "
        "ones removed from the store so that a good copy can be written again",
        labels=("backend", "action"),
    )
    for l3 in snap.l3:
        corrupt.add_metric((l3.backend, "found"), float(l3.corrupt))
        corrupt.add_metric((l3.backend, "removed"), float(l3.corrupt_removed))
        bounds = [floatToGoString(b) for b in l3.bounds] + ["+Inf"]
        for s in l3.ops:
            buckets = list(zip(bounds, s.cumulative_counts, strict=True))
            latency.add_metric((l3.backend, s.op.value, s.outcome.value), buckets, s.sum_seconds)
        moved.add_metric((l3.backend, "get"), float(l3.bytes_read))
        moved.add_metric((l3.backend, "put"), float(l3.bytes_written))
    yield latency
    yield moved
    yield corrupt


def counter_families(snap: StatsSnapshot) -> Iterator[Any]:
    canonical, extras = canonical_counters(snap.counters)
    grouped = {
        prefix: CounterMetricFamily(name, help_text, labels=(label,))
        for prefix, name, label, help_text in _LABELLED
    }
    singles: list[Any] = []
    for key, value in sorted(canonical.items()):
        prefix = next((p for p in grouped if key.startswith(p)), None)
        if key == "prefetches_running":
            singles.append(GaugeMetricFamily("hicache_prefetches_running", "prefetches in progress", value=value))
        elif prefix is not None:
            grouped[prefix].add_metric((key[len(prefix) :],), float(value))
        else:
            singles.append(CounterMetricFamily(f"hicache_{key}", f"core counter {key}", value=value))
    for key, value in sorted(extras.items()):
        if not _NAME_OK.fullmatch(key):
            continue
        if key.startswith("active_") or key.endswith("_running"):
            singles.append(GaugeMetricFamily(f"hicache_{key}", f"core gauge {key}", value=value))
        else:
            singles.append(CounterMetricFamily(f"hicache_{key}", f"core counter {key}", value=value))
    yield from grouped.values()
    yield from singles


class Metrics:
    """The daemon's registry; `serve(port)` exposes it over HTTP."""

    def __init__(self, core: CacheService | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc = RpcMetrics(self.registry)
        self.reloads = ReloadMetrics(self.registry)
        if core is not None:
            self.registry.register(CoreCollector(core))
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP exporter; returns the bound port (0 = disabled, nothing started)."""
        if port == 0:
            return 0
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server, self._thread = server, thread
        bound: int = server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
