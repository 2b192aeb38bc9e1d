"""L3 call latency as Prometheus sees it: the histogram family built from a snapshot, and a
real `hicache serve` on the file backend scraped after backups, lookups and a deep probe."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from hicache.controller.base import L3Op, L3OpLatency, L3Outcome, L3Stats, StatsSnapshot
from hicache.metrics import l3_families

from .daemonkit import PAGE, Daemon, free_port, scrape, tokens

MakeDaemon = Callable[..., Daemon]


class _Families(Collector):
    def __init__(self, snap: StatsSnapshot) -> None:
        self._snap = snap

    def collect(self):  # type: ignore[no-untyped-def]
        yield from l3_families(self._snap)


def exposition(snap: StatsSnapshot) -> str:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Families(snap))
    return generate_latest(registry).decode()


def test_snapshot_becomes_a_cumulative_histogram_with_sum_and_count() -> None:
    snap = StatsSnapshot(pools=(), counters={}, l3=(L3Stats(
        backend="mooncake",
        bounds=(0.001, 0.01),
        ops=(L3OpLatency(L3Op.GET, L3Outcome.OK, (2, 0, 1), 3.5),
             L3OpLatency(L3Op.PUT, L3Outcome.UNAVAILABLE, (0, 1, 0), 0.005)),
        bytes_read=4096, bytes_written=0, corrupt=3, corrupt_removed=2,
    ),))
    text = exposition(snap)
    get = 'backend="mooncake",op="get",outcome="ok"'
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines['hicache_l3_op_seconds_bucket{backend="mooncake",le="0.001",op="get",outcome="ok"}'] == "2.0"
    assert lines['hicache_l3_op_seconds_bucket{backend="mooncake",le="0.01",op="get",outcome="ok"}'] == "2.0"
    assert lines['hicache_l3_op_seconds_bucket{backend="mooncake",le="+Inf",op="get",outcome="ok"}'] == "3.0"
    assert lines[f"hicache_l3_op_seconds_count{{{get}}}"] == "3.0"
    assert lines[f"hicache_l3_op_seconds_sum{{{get}}}"] == "3.5"
    put = 'backend="mooncake",op="put",outcome="unavailable"'
    assert lines[f"hicache_l3_op_seconds_count{{{put}}}"] == "1.0"
    assert lines['hicache_l3_bytes_total{backend="mooncake",op="get"}'] == "4096.0"
    assert lines['hicache_l3_bytes_total{backend="mooncake",op="put"}'] == "0.0"
    assert lines['hicache_l3_corrupt_objects_total{action="found",backend="mooncake"}'] == "3.0"
    assert lines['hicache_l3_corrupt_objects_total{action="removed",backend="mooncake"}'] == "2.0"
    assert "# TYPE hicache_l3_op_seconds histogram" in text


def test_no_backend_no_series() -> None:
    text = exposition(StatsSnapshot(pools=(), counters={}))
    assert "hicache_l3_op_seconds_bucket" not in text and "hicache_l3_bytes_total{" not in text


def samples(text: str, name: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample of `name` in an exposition."""
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.MULTILINE)
    return {labels: float(value) for labels, value in pattern.findall(text)}


def test_served_metrics_show_l3_latency_after_traffic(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    port = free_port()
    d = make_daemon("storage.backend=file", f"storage.file.path={tmp_path / 'l3'}",
                    "write.l1_to_l2=write_through", "write.l2_to_l3=write_through",
                    f"metrics.port={port}")
    prompt = tokens(4 * PAGE, start=70_000)
    with d.client() as c:
        c.attach(map_pools=False)
        m = c.match(prompt, "tenant-secret-ns", lock=True, allocate_tokens=4 * PAGE)
        c.insert(prompt, "tenant-secret-ns", lock_id=m.lock_id, allocation_id=m.allocation_id)
        deadline = time.monotonic() + 15
        while c.stats().counters["backups_storage"] < 4:
            assert time.monotonic() < deadline, c.stats().counters
            time.sleep(0.02)
        c.match(tokens(2 * PAGE, start=90_000))  # beyond L1/L2: asks L3 (exists)
        assert c.health(deep=True)[0].healthy

    text = scrape(port)
    counts = samples(text, "hicache_l3_op_seconds_count")
    for op in ("put", "exists", "probe_deep"):
        assert counts.get(f'backend="file",op="{op}",outcome="ok"', 0) >= 1, (op, counts)
    put_buckets = {
        labels: v for labels, v in samples(text, "hicache_l3_op_seconds_bucket").items()
        if 'op="put"' in labels
    }
    assert put_buckets['backend="file",le="+Inf",op="put",outcome="ok"'] == \
        counts['backend="file",op="put",outcome="ok"']
    assert put_buckets['backend="file",le="10.0",op="put",outcome="ok"'] >= 1
    values = [v for labels, v in sorted(put_buckets.items(), key=lambda kv: _le(kv[0]))]
    assert values == sorted(values)  # cumulative
    assert samples(text, "hicache_l3_op_seconds_sum")['backend="file",op="put",outcome="ok"'] > 0
    assert samples(text, "hicache_l3_bytes_total")['backend="file",op="put"'] > 0
    assert "tenant-secret-ns" not in text


def _le(labels: str) -> float:
    le = re.search(r'le="([^"]+)"', labels)
    assert le is not None
    return float(le.group(1))
