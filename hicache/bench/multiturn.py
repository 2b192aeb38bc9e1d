"""`hicache bench multiturn`: multi-turn serving against a real daemon, with a content
oracle (every reused byte checked) and a hit-rate oracle (the best any cache could do).

Each client is a conversation: round 0 sends the shared prefix plus `--input-tokens`;
every later round sends the whole history plus new input. Per request the simulated
engine matches (with prefetch), waits for the prefetch per the policy, loads what L2
holds, allocates, writes KV for every new page (prompt and `--output-tokens` generated
ids) into the mapped L1 pool and inserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hicache.argtypes import (
    UsageError,
    address,
    nonnegative_int,
    one_of,
    output_file,
    positive_float,
    positive_int,
)
from hicache.bench.oracle import KvOracle
from hicache.bench.services import serving_daemon
from hicache.controller.base import PrefetchState

CONFIGS: dict[str, dict[str, Any]] = {
    "l1": {"l2_ratio": 1.01, "l3": "none"},
    "l1+l2": {"l3": "none"},
    "l1+l2+l3": {},
}


@dataclass
class RoundFigures:
    round: int
    hit_rate: float
    device_hit_rate: float
    host_hit_rate: float
    storage_hit_rate: float
    ceiling: float
    ttft_proxy_ms: float


@dataclass
class RunFigures:
    rounds: list[RoundFigures] = field(default_factory=list)
    pages_checked: int = 0
    wrong_bytes: int = 0
    wall_s: float = 0.0
    effective_input_tokens_per_s: float = 0.0
    modelled_s: float | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=address,
                   help="an already running daemon (unix:///path or host:port)")
    p.add_argument("--clients", type=positive_int, default=16)
    p.add_argument("--rounds", type=positive_int, default=8)
    p.add_argument("--input-tokens", type=positive_int, default=512)
    p.add_argument("--shared-prefix-tokens", type=nonnegative_int, default=1024)
    p.add_argument("--output-tokens", type=nonnegative_int, default=64)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--components", default="full", choices=["full", "full,swa", "full,swa,mamba"])
    p.add_argument("--swa-window", type=positive_int, default=256)
    p.add_argument("--sidecars", action="store_true", help="add an indexer sidecar to FULL")
    p.add_argument("--kv-bytes-per-token", type=positive_int, default=16, help="per layer; small so runs fit here")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--l1-tokens", type=positive_int, default=16384)
    p.add_argument("--l2-ratio", type=positive_float, default=2.0)
    p.add_argument("--l2-tokens", type=positive_int, help="overrides --l2-ratio")
    p.add_argument("--l3", default="file", choices=["none", "file", "mooncake", "redis"])
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--prefetch-policy", default="wait_complete",
                   choices=["best_effort", "wait_complete", "timeout"])
    p.add_argument("--concurrency", type=positive_int, default=1, help="engine processes")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--prefill-tokens-per-s", type=positive_float, help="model uncached tokens as compute")
    p.add_argument("--compare", type=one_of(tuple(CONFIGS)),
                   help="comma list of l1, l1+l2, l1+l2+l3 run one after another")
    p.add_argument("--json", metavar="FILE", type=output_file)
    p.add_argument("--plot", metavar="FILE.png", type=output_file)
    p.add_argument("--no-progress", action="store_true")


# ---------------------------------------------------------------------------- daemon


def _daemon_config(args: argparse.Namespace, overrides: dict[str, Any], tmp: Path,
                   services: dict[str, Any]) -> dict[str, Any]:
    kinds = args.components.split(",")
    b = args.kv_bytes_per_token
    comps: dict[str, Any] = {"full": {"layers": args.layers, "bytes_per_token_per_layer": b}}
    if "swa" in kinds:
        comps["swa"] = {"layers": args.layers, "bytes_per_token_per_layer": b, "window_tokens": args.swa_window}
    if "mamba" in kinds:
        comps["mamba"] = {"layers": args.layers, "state_bytes_per_layer": 4 * b}
    sidecars = {"indexer": {"anchor": "full", "layers": args.layers, "bytes_per_token_per_layer": max(1, b // 8)}} \
        if args.sidecars else {}
    l3 = overrides.get("l3", args.l3)
    ratio = overrides.get("l2_ratio", args.l2_ratio)
    l2: dict[str, Any] = {"ratio": ratio, "reserve_gb": 0.5}
    if args.l2_tokens and "l2_ratio" not in overrides:
        l2["ratio"] = args.l2_tokens / args.l1_tokens
    storage: dict[str, Any] = {"backend": l3}
    if l3 == "file":
        storage["file"] = {"path": str(tmp / "l3")}
    elif l3 == "redis":
        storage["redis"] = {"url": services["redis"].url}
    elif l3 == "mooncake":
        m = services["mooncake"]
        storage["mooncake"] = {"master": m.master, "metadata_server": m.metadata_server}
    return {
        "model": {"page_size": args.page_size, "components": comps, "sidecars": sidecars},
        "tiers": {"l1": {"tokens": args.l1_tokens, "mamba_slots": max(64, 4 * args.clients)}, "l2": l2},
        "write": {"l1_to_l2": args.write_policy, "l2_to_l3": "write_through"},
        "prefetch": {"policy": args.prefetch_policy, "threshold_tokens": args.page_size},
        "storage": storage,
        "server": {"listen": f"unix://{tmp}/hicache.sock", "lease_ms": 60000},
        "metrics": {"port": 0},
    }


@contextmanager
def _daemon(cfg: dict[str, Any], tmp: Path) -> Iterator[str]:
    path = tmp / "hicache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    target = cfg["server"]["listen"]
    with serving_daemon(["--config", str(path)], target, tmp / "daemon.log"):
        yield target


@contextmanager
def _services(args: argparse.Namespace, needed: set[str]) -> Iterator[dict[str, Any]]:
    from hicache.bench.services import start_mooncake_master, start_redis

    started: dict[str, Any] = {}
    try:
        if "redis" in needed:
            started["redis"] = start_redis()
        if "mooncake" in needed:
            started["mooncake"] = start_mooncake_master()
        yield started
    finally:
        for svc in started.values():
            svc.close()


# ---------------------------------------------------------------------------- workload


def _workload(args: argparse.Namespace) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[list[np.ndarray]]]:
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, 150_000, args.shared_prefix_tokens, dtype=np.uint32)
    inputs = [[rng.integers(0, 150_000, args.input_tokens, dtype=np.uint32) for _ in range(args.rounds)]
              for _ in range(args.clients)]
    outputs = [[rng.integers(0, 150_000, args.output_tokens, dtype=np.uint32) for _ in range(args.rounds)]
               for _ in range(args.clients)]
    return [shared] * args.clients, inputs, outputs


def ceiling_tokens(r: int, c: int, history: int, prompt: int, args: argparse.Namespace) -> int:
    """Best reuse any cache could give: the previous turn (prompt + output) page-aligned;
    in round 0 the shared prefix once another client inserted it (not with MAMBA: no
    checkpoint sits at the prefix's end)."""
    p = args.page_size
    if r == 0:
        if c == 0 or "mamba" in args.components:
            return 0
        return min(args.shared_prefix_tokens, prompt) // p * p
    return min(history, prompt) // p * p


def _engine(target: str, args: argparse.Namespace, clients: list[int], result_q: Any) -> None:
    """One engine process: runs its clients' requests round by round, reports figures."""
    from hicache.client import Client

    shared, inputs, outputs = _workload(args)
    with Client(target, timeout_s=120) as client:
        att = client.attach()
        oracle = KvOracle(att.info, att.pools, namespace="")
        histories = {c: np.empty(0, dtype=np.uint32) for c in clients}
        for r in range(args.rounds):
            for c in clients:
                prefix = shared[c] if r == 0 else histories[c]
                prompt = np.concatenate([prefix, inputs[c][r]]).astype("<u4")
                out = outputs[c][r].astype("<u4")
                *reuse, ttft = _request(client, oracle, prompt, out, args)
                ceiling = ceiling_tokens(r, c, len(histories[c]), len(prompt), args)
                result_q.put((r, c, len(prompt), ceiling, *reuse, ttft))
                histories[c] = np.concatenate([prompt, out])
            result_q.put(("round-done", r, len(clients)))
        result_q.put(("checked", oracle.pages_checked, oracle.wrong_bytes))


def _request(client: Any, oracle: KvOracle, prompt: np.ndarray, output: np.ndarray,
             args: argparse.Namespace) -> tuple[int, int, int, int, float]:
    """One request: reused tokens (all, device, host, storage) and the TTFT proxy, the
    time from the match through the prefetch and the load (not the oracle's checks and
    writes, nor the Allocate and Insert after the first token)."""
    ps = args.page_size
    tokens = prompt.tobytes()
    t0 = time.perf_counter()
    m = client.match(tokens, lock=True, prefetch=True)
    device, host = m.device_tokens, m.host_tokens
    if m.prefetch_id:
        while True:
            info = client.prefetch_status(m.prefetch_id)
            if info.state is not PrefetchState.RUNNING:
                break
            if args.prefetch_policy == "best_effort":
                client.cancel_prefetch(m.prefetch_id)
                break
            time.sleep(0.001)
        client.release(lock_id=m.lock_id)
        m = client.match(tokens, lock=True)
    reused, pages = m.device_tokens, m.device_pages
    if m.host_tokens:
        *_, last = list(client.load(m.lock_id))
        reused, pages = last.device_tokens, last.device_pages
    ttft = time.perf_counter() - t0
    oracle.verify(tokens, pages, reused // ps)
    full = np.concatenate([prompt, output]).astype("<u4").tobytes()
    new_tokens = len(full) // 4 - reused
    alloc = client.allocate(new_tokens, lock_id=m.lock_id)
    oracle.write(full, alloc.pages, reused // ps)
    client.insert(full, lock_id=m.lock_id, allocation_id=alloc.allocation_id, mamba_checkpoint=True)
    storage = max(0, reused - device - host)
    return reused, min(device, reused), min(host, max(0, reused - device)), storage, ttft


# ---------------------------------------------------------------------------- driver


def run_config(args: argparse.Namespace, name: str, overrides: dict[str, Any]) -> RunFigures:
    import multiprocessing as mp

    l3 = overrides.get("l3", args.l3)
    with tempfile.TemporaryDirectory(prefix="hicache-mt-") as tmpdir, \
            _services(args, {l3} & {"redis", "mooncake"}) as services:
        tmp = Path(tmpdir)
        cfg = _daemon_config(args, overrides, tmp, services)
        ctx = _daemon(cfg, tmp) if not args.target else _nullctx(args.target)
        with ctx as target:
            q: Any = mp.get_context("spawn").Queue()
            groups = [list(range(i, args.clients, args.concurrency)) for i in range(args.concurrency)]
            procs = [mp.get_context("spawn").Process(target=_engine, args=(target, args, g, q)) for g in groups if g]
            t0 = time.perf_counter()
            for p in procs:
                p.start()
            figures = _collect(q, args, name, procs)
            for p in procs:
                p.join()
                if p.exitcode:
                    raise RuntimeError(f"engine process exited with {p.exitcode}")
            figures.wall_s = time.perf_counter() - t0
    prompt_tokens = sum(_prompt_len(args, r) for r in range(args.rounds)) * args.clients
    figures.effective_input_tokens_per_s = prompt_tokens / figures.wall_s
    return figures


@contextmanager
def _nullctx(target: str) -> Iterator[str]:
    yield target


def _prompt_len(args: argparse.Namespace, r: int) -> int:
    return args.shared_prefix_tokens + (r + 1) * args.input_tokens + r * args.output_tokens


def _collect(q: Any, args: argparse.Namespace, name: str, procs: list[Any]) -> RunFigures:
    """The engines' figures as they report them; RuntimeError as soon as an engine
    process has ended without reporting (it failed: an unreachable daemon, a bug)."""
    import queue

    engines = len(procs)
    per_round: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(args.rounds)}
    figures = RunFigures()
    checked = 0
    done_rounds: dict[int, int] = {}
    total = args.clients * args.rounds
    seen = 0
    modelled = 0.0
    while checked < engines:
        try:
            item = q.get(timeout=1.0)
        except queue.Empty:
            # (an engine that reported puts its last message before it exits)
            ended = [p for p in procs if p.exitcode is not None]
            if any(p.exitcode for p in ended) or len(ended) == engines:
                codes = ", ".join(str(p.exitcode) for p in ended)
                raise RuntimeError(f"{name}: an engine process ended without reporting "
                                   f"(exit codes {codes}); see its output above") from None
            continue
        if item[0] == "checked":
            figures.pages_checked += item[1]
            figures.wrong_bytes += item[2]
            checked += 1
            continue
        if item[0] == "round-done":
            done_rounds[item[1]] = done_rounds.get(item[1], 0) + item[2]
            continue
        r, _c, prompt, ceiling, reused, device, host, storage, ttft = item
        per_round[r].append((prompt, ceiling, reused, device, host, storage, ttft))
        seen += 1
        if args.prefill_tokens_per_s:
            modelled += (prompt - reused) / args.prefill_tokens_per_s + ttft
        if not args.no_progress:
            bar = "#" * int(30 * seen / total)
            print(f"\r{name:>9} [{bar:<30}] {seen}/{total}", end="", file=sys.stderr, flush=True)
    if not args.no_progress:
        print(file=sys.stderr)
    for r, rows in per_round.items():
        prompt = sum(x[0] for x in rows) or 1
        figures.rounds.append(RoundFigures(
            round=r,
            hit_rate=sum(x[2] for x in rows) / prompt,
            device_hit_rate=sum(x[3] for x in rows) / prompt,
            host_hit_rate=sum(x[4] for x in rows) / prompt,
            storage_hit_rate=sum(x[5] for x in rows) / prompt,
            ceiling=sum(x[1] for x in rows) / prompt,
            ttft_proxy_ms=1e3 * sum(x[6] for x in rows) / max(1, len(rows)),
        ))
    if args.prefill_tokens_per_s:
        figures.modelled_s = modelled
    return figures


def _table(name: str, f: RunFigures) -> str:
    lines = [f"== {name}: {f.wall_s:.1f} s, {f.effective_input_tokens_per_s:,.0f} prompt tokens/s, "
             f"{f.pages_checked} page-layers checked, {f.wrong_bytes} wrong bytes",
             f"{'round':>5} {'hit':>7} {'device':>7} {'host':>7} {'storage':>8} {'ceiling':>8} {'of ceil':>8} {'ttft ms':>8}"]
    for r in f.rounds:
        frac = r.hit_rate / r.ceiling if r.ceiling else 1.0
        lines.append(f"{r.round:>5} {r.hit_rate:7.1%} {r.device_hit_rate:7.1%} {r.host_hit_rate:7.1%} "
                     f"{r.storage_hit_rate:8.1%} {r.ceiling:8.1%} {frac:8.1%} {r.ttft_proxy_ms:8.2f}")
    return "\n".join(lines)


def _plot(results: dict[str, RunFigures], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, f in results.items():
        xs = [r.round for r in f.rounds]
        ax1.plot(xs, [100 * r.hit_rate for r in f.rounds], marker="o", label=name)
        ax2.plot(xs, [r.ttft_proxy_ms for r in f.rounds], marker="o", label=name)
    first = next(iter(results.values()))
    ax1.plot([r.round for r in first.rounds], [100 * r.ceiling for r in first.rounds], "k--", label="ceiling")
    ax1.set(xlabel="round", ylabel="hit rate (%)", title="prefix hit rate per round", ylim=(0, 100))
    ax2.set(xlabel="round", ylabel="ms", title="TTFT proxy (match+prefetch+load) per request")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    names = args.compare.split(",") if args.compare else ["run"]
    if args.compare and args.target:
        raise UsageError("--compare starts a daemon per configuration; it cannot use --target")
    if args.l2_tokens is not None and args.l2_tokens <= args.l1_tokens:
        raise UsageError(f"--l2-tokens: {args.l2_tokens} must exceed --l1-tokens ({args.l1_tokens})")
    if args.l2_tokens is None and args.l2_ratio <= 1:  # (checked before a daemon starts)
        raise UsageError(f"--l2-ratio: {args.l2_ratio} must be above 1 (L2 holds L1 and more)")
    if "swa" in args.components.split(",") and args.swa_window % args.page_size:
        raise UsageError(f"--swa-window: {args.swa_window} is not a multiple of --page-size "
                         f"({args.page_size})")
    if args.plot:
        try:  # (checked before the runs, not after them)
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'hicache[plot]'") from None
    results: dict[str, RunFigures] = {}
    for name in names:
        results[name] = run_config(args, name, CONFIGS.get(name, {}))
        print(_table(name, results[name]))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "configs": {n: asdict(f) for n, f in results.items()}}, indent=2, default=str))
    if args.plot:
        _plot(results, args.plot)
    wrong = sum(f.wrong_bytes for f in results.values())
    if wrong:
        print(f"FAILED: {wrong} wrong bytes served", file=sys.stderr)
        return 1
    return 0


__all__ = ["add_arguments", "ceiling_tokens", "run"]
