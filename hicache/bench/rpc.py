"""`hicache bench rpc`: what the gRPC control plane costs, against one empty call.

One daemon (`hicache serve` as a subprocess, default geometry, a private unix socket) and,
in one run:
- *empty*: the standard grpc.health.v1 Check, the cheapest unary call the server has;
- *round*: one request's whole life as an engine sends it: MatchPrefix (lock, allocate the
  output's page) + Insert, for a 4,096-token prompt. Each round's prompt is a shared
  prefix plus one round-specific page, so the match hits 4,032 tokens in L1 and the insert
  adds one page: the steady state of a multi-turn workload;
- *batched*: the same rounds, 16 at a time: one Batch of 16 MatchPrefix, one Batch of 16
  Insert; the figure is per round (two calls / 16);
- rounds per second with 1 and 8 client processes (each its own engine and connection).

Ratios are per-round time over one empty call's, both medians of the same run. The three
series are timed in alternating blocks (each after a few untimed calls of its own kind), so
that other load on the machine during the run weighs on all of them alike; the target
figures (`ratios`) are these.

Also reported, for information (`ratios_interleaved`): the same empty calls and rounds
alternating call by call, so that both meet the daemon in the same state. In blocks, the
empty calls run back to back on caches warm for the health check alone, while a round's
two calls alternate between two larger paths; interleaved, an empty call pays what a
probe between real requests pays (and any background work a round leaves behind).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hicache.argtypes import address, output_file, positive_float, positive_int
from hicache.bench.services import serving_daemon
from hicache.client import Client, insert_op, match_op

PROMPT_TOKENS = 4096
BATCH = 16
SEED = 0
BLOCKS = 10  # the empty calls, rounds and batches alternate in this many blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=positive_int, default=2000, help="timed empty calls and rounds")
    parser.add_argument("--seconds", type=positive_float, default=3.0, help="duration of each throughput run")
    parser.add_argument("--processes", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--target", type=address, help="use a running daemon instead of starting one")
    parser.add_argument("--json", metavar="FILE", type=output_file, help="write the figures as JSON")


def _percentiles(samples: list[float]) -> dict[str, float]:
    xs = sorted(samples)
    return {
        "p50_us": statistics.median(xs) * 1e6,
        "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6,
        "n": len(xs),
    }


def _timed(fn: Callable[[], object], n: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


class Workload:
    """Prompts of PROMPT_TOKENS tokens: a shared prefix plus one page unique to the round."""

    def __init__(self, client: Client, page_size: int, salt: int, run: int = 0) -> None:
        """`salt`: one per workload of a run; `run`: one per run (a run against a daemon
        that served an earlier one must not find its prompts cached)."""
        self.client = client
        self.page = page_size
        rng = np.random.default_rng(SEED)
        self.prefix = rng.integers(1, 1 << 30, PROMPT_TOKENS - page_size, dtype=np.uint32)
        self.salt = salt
        self.run = run
        self.n = 0
        self._ready: deque[bytes] = deque()
        self._prime()

    def _prime(self) -> None:
        """Make sure the shared prefix is in the tree (the first round of a conversation)."""
        prefix = self.prefix.tobytes()
        m = self.client.match(prefix, lock=True)
        missing = len(self.prefix) - m.device_tokens
        if not missing:
            self.client.release(lock_id=m.lock_id)
            return
        a = self.client.allocate(missing, lock_id=m.lock_id)
        self.client.insert(prefix, lock_id=m.lock_id, allocation_id=a.allocation_id)

    def prepare(self, n: int) -> None:
        """Build the next `n` prompts now, so that timed rounds measure the requests
        rather than the workload generator (an engine has its prompt before it asks)."""
        self._ready.extend(self._make_prompt() for _ in range(n))

    def _make_prompt(self) -> bytes:
        self.n += 1
        tail = np.full(self.page, (self.salt << 20) + self.n, dtype=np.uint32)
        tail[-1] = self.run  # (the page is unique to the round, and to the run)
        return np.concatenate([self.prefix, tail]).tobytes()

    def next_prompt(self) -> bytes:
        return self._ready.popleft() if self._ready else self._make_prompt()

    def round(self) -> None:
        tokens = self.next_prompt()
        m = self.client.match(tokens, lock=True, allocate_tokens=len(tokens) // 4)
        self.client.insert(tokens, lock_id=m.lock_id, allocation_id=m.allocation_id)

    def batched(self) -> None:
        prompts = [self.next_prompt() for _ in range(BATCH)]
        matches = self.client.batch(
            [match_op(t, lock=True, allocate_tokens=len(t) // 4) for t in prompts]
        )
        for result in matches:
            if isinstance(result, Exception):
                raise result
        inserts = [
            insert_op(t, lock_id=m.lock_id, allocation_id=m.allocation_id)
            for t, m in zip(prompts, matches, strict=True)
        ]
        for result in self.client.batch(inserts):
            if isinstance(result, Exception):
                raise result


def _worker(target: str, salt: int, run: int, seconds: float, start_at: float, out: Any) -> None:
    with Client(target, engine_id=f"bench-{salt}") as client:
        work = Workload(client, client.attach(map_pools=False).info.page_size, salt, run)
        for _ in range(20):
            work.round()
        while time.time() < start_at:
            time.sleep(0.001)
        done = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            work.round()
            done += 1
        out.put(done)


def throughput(target: str, processes: int, seconds: float, run: int | None = None,
               first_salt: int = 100) -> float:
    """Rounds per second of `processes` client processes, workloads salted from
    `first_salt` on, in `run` (None: a new one): each throughput run its own prompts (one
    replaying another's would time cached hits, not rounds). RuntimeError naming a
    worker that failed."""
    import queue as queue_mod

    if run is None:
        run = _new_run()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 2.0 + 0.3 * processes  # after every worker's start-up
    procs = [
        ctx.Process(target=_worker, args=(target, first_salt + i, run, seconds, start_at, queue))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    counts: list[int] = []
    deadline = time.monotonic() + 60 + seconds
    try:
        while len(counts) < len(procs):
            try:
                counts.append(queue.get(timeout=0.5))
            except queue_mod.Empty:
                failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode]
                if failed:
                    i, code = failed[0]
                    raise RuntimeError(f"rounds_per_s ({processes} processes): client process "
                                       f"{i} exited {code}; see its output above") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rounds_per_s ({processes} processes): no result "
                                       f"within {60 + seconds:g} s") from None
    finally:
        for p in procs:
            if p.exitcode is None and len(counts) < len(procs):
                p.terminate()
        for p in procs:
            p.join()
    return sum(counts) / seconds




def _new_run() -> int:
    """A run's own token value: a daemon given with --target may have served other runs
    (their prompts are cached there)."""
    return secrets.randbits(31) or 1


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    n_batches = max(20, args.calls // BATCH)
    blocks = max(1, min(BLOCKS, n_batches // 2))
    run = _new_run()
    with Client(target, engine_id="bench-main") as client:
        page = client.attach(map_pools=False).info.page_size
        work = Workload(client, page, salt=1, run=run)
        work.prepare(2 * args.calls + 50 + blocks * 10 + (n_batches + 5 + blocks) * BATCH)
        _timed(client.serving, 0)
        _timed(work.round, 0)
        _timed(work.batched, 0, warmup=5)
        # The three series are timed in alternating blocks, so that a change in the
        # machine's load during the run (other processes) weighs on all three alike.
        empty: list[float] = []
        rounds: list[float] = []
        batches: list[float] = []
        mixed: tuple[list[float], list[float]] = ([], [])
        for calls, n in zip(_split(args.calls, blocks), _split(n_batches, blocks), strict=True):
            empty += _timed(client.serving, calls, warmup=5)
            rounds += _timed(work.round, calls, warmup=5)
            batches += _timed(work.batched, n, warmup=1)
            _interleaved(client.serving, work.round, calls, mixed)
    per_round = [t / BATCH for t in batches]
    figures: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "batch": BATCH,
        "empty_call": _percentiles(empty),
        "round": _percentiles(rounds),
        "batched_round": _percentiles(per_round),
        "rounds_per_s": {str(n): throughput(target, n, args.seconds, run, 100 + 256 * k)
                         for k, n in enumerate(args.processes)},
        "cpus": os.cpu_count(),
    }
    e = figures["empty_call"]["p50_us"]
    figures["ratios"] = {
        "round_vs_empty": figures["round"]["p50_us"] / e,
        "batched_round_vs_empty": figures["batched_round"]["p50_us"] / e,
    }
    figures["interleaved"] = {"empty_call": _percentiles(mixed[0]), "round": _percentiles(mixed[1])}
    figures["ratios_interleaved"] = {
        "round_vs_empty": figures["interleaved"]["round"]["p50_us"]
        / figures["interleaved"]["empty_call"]["p50_us"],
    }
    return figures


def _interleaved(first: Callable[[], object], second: Callable[[], object], n: int,
                 out: tuple[list[float], list[float]]) -> None:
    """`n` calls of each, alternating call by call (after a few untimed pairs)."""
    for _ in range(5):
        first()
        second()
    for _ in range(n):
        start = time.perf_counter()
        first()
        middle = time.perf_counter()
        second()
        out[0].append(middle - start)
        out[1].append(time.perf_counter() - middle)


def run(args: argparse.Namespace) -> int:
    if args.target:
        figures = measure(args.target, args)
    else:
        with tempfile.TemporaryDirectory(prefix="hicache-bench-") as tmp:
            target = f"unix://{Path(tmp) / 'bench.sock'}"
            with serving_daemon(["--listen", target, "--set", "metrics.port=0"], target,
                                Path(tmp) / "daemon.log"):
                figures = measure(target, args)
    rows = [("empty call (health Check)", figures["empty_call"]),
            (f"round: MatchPrefix+alloc + Insert, {PROMPT_TOKENS} tokens", figures["round"]),
            (f"round in Batch of {BATCH} (per round)", figures["batched_round"])]
    print(f"{'':52} {'p50 us':>9} {'p99 us':>9}")
    for name, f in rows:
        print(f"{name:52} {f['p50_us']:9.0f} {f['p99_us']:9.0f}")
    for n, rate in figures["rounds_per_s"].items():
        print(f"rounds/s with {n} client process(es): {rate:,.0f}")
    r = figures["ratios"]
    print(f"round / empty call: {r['round_vs_empty']:.2f}x (target <= 2.5x)")
    print(f"batched round / empty call: {r['batched_round_vs_empty']:.2f}x (target <= 0.5x)")
    mixed = figures["interleaved"]
    print(f"for information, interleaved call by call: empty call {mixed['empty_call']['p50_us']:.0f} us, "
          f"round {mixed['round']['p50_us']:.0f} us, "
          f"{figures['ratios_interleaved']['round_vs_empty']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0
