"""`hicache bench tiers`: L1<->L2 family copies vs one contiguous copy of the same bytes,
plus (from `hicache.bench.l3`, when present) each L3 backend vs its raw client.

Copy half: the default model geometry (FULL, 4 layers x 16 KiB per page-layer = 64 KiB
pages), 4,096 pages moved per copy. L1 ids are what a used allocator hands out (a random
sample of a twice-as-large pool), L2 ids what a fresh one does. Baseline: torch ``copy_``
of a contiguous tensor of the same size. Ours and the baseline alternate, after a warm-up,
and each figure is the median of `--repeat` runs; ratios are ours / raw throughput.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.argtypes import output_file, positive_int
from hicache.config import build_config
from hicache.tiers.copy import CpuCopyEngine
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import build_host_pools
from hicache.types import ComponentKind

PAGE_BYTES = 64 << 10
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=4096, help="pages per family copy")
    parser.add_argument("--repeat", type=positive_int, default=9, help="timed runs per figure (median)")
    parser.add_argument("--skip-l3", action="store_true", help="only the L1<->L2 half")
    parser.add_argument("--json", metavar="FILE", type=output_file, help="write the figures as JSON")
    l3 = _l3_module()
    if l3 is not None:
        l3.add_arguments(parser)


def _l3_module() -> Any:
    try:
        return importlib.import_module("hicache.bench.l3")
    except ImportError:
        return None


def _time_s(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_copies(pages: int, repeat: int, layout: str) -> dict[str, float]:
    """GB/s of both family copy directions and of the raw contiguous copy, in one run."""
    cfg = build_config(
        {
            "tiers": {
                "l1": {"tokens": 2 * pages * 64},
                "l2": {"ratio": 1.5, "layout": layout, "reserve_gb": 0.5},
            }
        }
    )
    spec = cfg.model.members[0]
    assert spec.bytes_per_page == PAGE_BYTES, spec
    rng = np.random.default_rng(SEED)
    device = ShmDevicePools.create(cfg, f"bench{os.getpid()}")
    host = build_host_pools(cfg)
    engine = CpuCopyEngine(device, host)
    try:
        alloc = device.allocator(ComponentKind.FULL)
        churn = alloc.allocate(alloc.total)
        rng.shuffle(churn)
        alloc.free(churn)  # a used pool: the next batch is scattered over all of L1
        dev_ids = alloc.allocate(pages)
        host_ids = host.allocator(ComponentKind.FULL).allocate(pages)
        for layer in range(spec.layers):
            device.layer(spec.name, layer).fill_(layer + 1)
            host.layer(spec.name, layer).fill_(0)
        nbytes = pages * PAGE_BYTES
        src = torch.ones(nbytes // 8, dtype=torch.int64)
        dst = torch.zeros_like(src)
        runs: dict[str, Callable[[], object]] = {
            "raw": lambda: dst.copy_(src),
            "l1_to_l2": lambda: engine.device_to_host(ComponentKind.FULL, dev_ids, host_ids),
            "l2_to_l1": lambda: engine.host_to_device(ComponentKind.FULL, host_ids, dev_ids),
        }
        for fn in runs.values():  # warm-up: fault every page in, start the threads
            fn()
            fn()
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeat):  # interleaved, so machine noise hits all three alike
            for name, fn in runs.items():
                samples[name].append(_time_s(fn))
        for layer in range(spec.layers):  # the copies really moved the bytes
            assert bool((host.layer(spec.name, layer)[host_ids[:8]] == layer + 1).all())
        return {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}
    finally:
        engine.close()
        host.close()
        device.close()


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(SEED)
    figures: dict[str, Any] = {"pages": args.pages, "page_bytes": PAGE_BYTES, "copies": {}}
    ratios: dict[str, float] = {}
    rows: list[tuple[str, str, float, float, float]] = []
    for layout in ("page_first", "layer_first"):
        gbps = measure_copies(args.pages, args.repeat, layout)
        figures["copies"][layout] = gbps
        for direction in ("l1_to_l2", "l2_to_l1"):
            ratio = gbps[direction] / gbps["raw"]
            key = direction if layout == "page_first" else f"{direction}_{layout}"
            ratios[key] = ratio
            rows.append((direction, layout, gbps[direction], gbps["raw"], ratio))
    notes: list[str] = []
    l3 = None if args.skip_l3 else _l3_module()
    if args.skip_l3:
        notes.append("L3 half skipped (--skip-l3)")
    elif l3 is None:
        notes.append("L3 half skipped: hicache.bench.l3 is not installed")
    else:
        l3_result = l3.run_l3(args)
        if args.l3_json:
            Path(args.l3_json).write_text(json.dumps(l3_result, indent=2))
        ratios.update(l3_result.get("ratios", {}))
        figures["l3"] = {k: v for k, v in l3_result.items() if k != "ratios"}
    figures["ratios"] = ratios
    figures["notes"] = notes

    print(f"tiers bench: {args.pages} pages x {PAGE_BYTES >> 10} KiB, median of {args.repeat}")
    print(f"{'copy':<10} {'L2 layout':<12} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6}")
    for direction, layout, ours, raw, ratio in rows:
        print(f"{direction:<10} {layout:<12} {ours:>10.2f} {raw:>9.2f} {ratio:>6.2f}")
    for key, value in ratios.items():
        if not key.startswith(("l1_to_l2", "l2_to_l1")):
            print(f"{key:<23} {'':>10} {'':>9} {value:>6.2f}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
