"""`hicache bench gpu`: the CUDA path end to end (exits 0 with a note without CUDA).

1. A daemon-side process (this one) creates the L1 pools in GPU memory, writes the content
   oracle into some pages and exports them over CUDA IPC; a second process opens the
   handles, verifies those pages byte for byte and writes others, which this process checks.
2. L1<->L2 family copies (pinned L2, copy stream, an event per layer) of `--pages` pages of
   64 KiB, timed against a plain torch copy of the same bytes between the same pinned
   buffer and the GPU. Ratios are ours / plain throughput. Then the bytes are checked: random
   content goes L1 -> L2, L1 is zeroed, and L2 -> L1 must bring it back exactly.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import textwrap
import time
import zlib
from typing import Any

import numpy as np
import torch

from hicache.argtypes import output_file, positive_int
from hicache.bench.services import ServiceError
from hicache.config import build_config
from hicache.types import ComponentKind

SEED = 0
PAGES_CHECKED = 8

ENGINE = textwrap.dedent(
    """
    import pickle, sys, zlib
    import numpy as np, torch
    from hicache.tiers.device import attach_device_pools
    from hicache.bench.gpu import oracle
    descs = pickle.loads(sys.stdin.buffer.read())
    views = attach_device_pools(descs)
    full = views["full"]
    ok = all(torch.equal(full[l][p].cpu(), oracle(p, l, full[l].shape[1]))
             for p in range(8) for l in range(len(full)))
    for l in range(len(full)):
        for p in range(8, 16):
            full[l][p] = oracle(p, l, full[l].shape[1]).cuda()
    torch.cuda.synchronize()
    print("ENGINE_READ_OK" if ok else "ENGINE_READ_BAD", flush=True)
    """
)


def oracle(page: int, layer: int, width: int) -> torch.Tensor:
    """Bytes a test engine writes for (full, page, layer)."""
    rng = np.random.default_rng(zlib.crc32(f"full/{page}/{layer}".encode()))
    return torch.from_numpy(rng.integers(0, 256, width, dtype=np.uint8))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=4096, help="pages per family copy")
    parser.add_argument("--repeat", type=positive_int, default=9, help="timed runs per figure (median)")
    parser.add_argument("--json", metavar="FILE", type=output_file, help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ServiceError("CUDA is not available on this machine: nothing to measure")
    from hicache.tiers.cuda import CudaCopyEngine, CudaDevicePools
    from hicache.tiers.host import build_host_pools

    torch.manual_seed(SEED)
    cfg = build_config(
        {"tiers": {"l1": {"tokens": 2 * args.pages * 64}, "l2": {"ratio": 1.5, "layout": "page_first"}}}
    )
    device = CudaDevicePools.create(cfg)
    host = build_host_pools(cfg, pin=True)
    engine = CudaCopyEngine(device, host)
    figures: dict[str, Any] = {"pages": args.pages, "pinned": host.pinned}
    try:
        figures["ipc_ok"] = _ipc_round_trip(device)
        figures.update(_time_copies(device, host, engine, args.pages, args.repeat))
    finally:
        engine.close()
        host.close()
        device.close()
    print(f"gpu bench: CUDA IPC round trip {'ok' if figures['ipc_ok'] else 'FAILED'}, "
          f"L1 -> L2 -> L1 bytes {'exact' if figures['copies_ok'] else 'WRONG'}")
    print(f"{'copy':<10} {'ours GB/s':>10} {'plain GB/s':>11} {'ratio':>6}")
    for name in ("l1_to_l2", "l2_to_l1"):
        print(
            f"{name:<10} {figures[name]:>10.2f} {figures[name + '_plain']:>11.2f} "
            f"{figures['ratios'][name]:>6.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if figures["ipc_ok"] and figures["copies_ok"] else 1


def _ipc_round_trip(device: Any) -> bool:
    for layer in range(device.member("full").layers):
        rows = device.layer("full", layer)
        for p in range(PAGES_CHECKED):
            rows[p] = oracle(p, layer, rows.shape[1]).cuda()
    torch.cuda.synchronize()
    out = subprocess.run(
        [sys.executable, "-c", ENGINE],
        input=pickle.dumps(device.descriptors()),
        capture_output=True,
        timeout=300,
    )
    if b"ENGINE_READ_OK" not in out.stdout:
        print(out.stderr.decode()[-2000:], file=sys.stderr)
        return False
    return all(
        torch.equal(device.layer("full", layer)[p].cpu(), oracle(p, layer, device.layer("full", layer).shape[1]))
        for layer in range(device.member("full").layers)
        for p in range(PAGES_CHECKED, 2 * PAGES_CHECKED)
    )


def _time_copies(device: Any, host: Any, engine: Any, pages: int, repeat: int) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    alloc = device.allocator(ComponentKind.FULL)
    churn = alloc.allocate(alloc.total)
    rng.shuffle(churn)
    alloc.free(churn)
    dev_ids = alloc.allocate(pages)
    host_ids = host.allocator(ComponentKind.FULL).allocate(pages)
    nbytes = pages * device.member("full").bytes_per_page
    # The plain baseline moves the same bytes between the same pinned L2 buffer and the GPU.
    pinned = torch.from_numpy(host.buffer_view()[:nbytes])
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    runs = {
        "l1_to_l2": lambda: engine.device_to_host(ComponentKind.FULL, dev_ids, host_ids),
        "l2_to_l1": lambda: engine.host_to_device(ComponentKind.FULL, host_ids, dev_ids),
        "l1_to_l2_plain": lambda: pinned.copy_(gpu, non_blocking=True),
        "l2_to_l1_plain": lambda: gpu.copy_(pinned, non_blocking=True),
    }
    for fn in runs.values():
        timed(fn)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            samples[name].append(timed(fn))
    out: dict[str, Any] = {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}
    out["ratios"] = {
        name: out[name] / out[f"{name}_plain"] for name in ("l1_to_l2", "l2_to_l1")
    }
    out["copies_ok"] = _round_trip_exact(device, engine, dev_ids, host_ids)
    return out


def _round_trip_exact(device: Any, engine: Any, dev_ids: np.ndarray, host_ids: np.ndarray) -> bool:
    """Random bytes L1 -> L2, L1 zeroed, L2 -> L1: the same bytes back (every layer)."""
    index = torch.from_numpy(dev_ids).cuda()
    layers = [device.layer("full", layer) for layer in range(device.member("full").layers)]
    expected = []
    for rows in layers:
        content = torch.randint(0, 256, (len(dev_ids), rows.shape[1]), dtype=torch.uint8, device="cuda")
        rows.index_copy_(0, index, content)
        expected.append(content)
    torch.cuda.synchronize()
    engine.device_to_host(ComponentKind.FULL, dev_ids, host_ids)
    for rows in layers:
        rows.index_fill_(0, index, 0)
    torch.cuda.synchronize()
    engine.host_to_device(ComponentKind.FULL, host_ids, dev_ids)
    torch.cuda.synchronize()
    return all(torch.equal(rows.index_select(0, index), want)
               for rows, want in zip(layers, expected, strict=True))
