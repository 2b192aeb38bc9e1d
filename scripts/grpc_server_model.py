#!/usr/bin/env python3
"""Sync `grpc.server` vs `grpc.aio` server: the measurement behind hicache's server model.

Each server runs in its own process on a private unix socket and answers one trivial
unary method (empty bytes in, empty bytes out), so the figures are the gRPC stack's own
cost. For each model, in one run: the p50/p99 latency of one client calling in a loop,
then calls per second with 1 and 8 client processes (each its own channel).

    .venv/bin/python scripts/grpc_server_model.py [--calls 2000] [--seconds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/bench.Echo/Empty"
WORKERS = 32  # hicache.server.WORKERS


def _identity(b: bytes) -> bytes:
    return b


def _serve_sync(target: str) -> None:
    def empty(_request: bytes, _context: grpc.ServicerContext) -> bytes:
        return b""

    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Empty": grpc.unary_unary_rpc_method_handler(empty, _identity, _identity)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(target)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def _serve_aio(target: str) -> None:
    async def empty(_request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
        return b""

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler("bench.Echo", {
            "Empty": grpc.unary_unary_rpc_method_handler(empty, _identity, _identity)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(target)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _client_loop(target: str, seconds: float) -> None:
    """A client process: call for `seconds`, print the count."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(METHOD, _identity, _identity)
        for _ in range(50):
            call(b"")
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            call(b"")
            n += 1
    print(n, flush=True)


def _latency(target: str, calls: int) -> dict[str, float]:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(METHOD, _identity, _identity)
        for _ in range(100):
            call(b"")
        xs = []
        for _ in range(calls):
            t = time.perf_counter()
            call(b"")
            xs.append(time.perf_counter() - t)
    xs.sort()
    return {"p50_us": statistics.median(xs) * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6}


def _throughput(target: str, processes: int, seconds: float) -> float:
    procs = [
        subprocess.Popen([sys.executable, __file__, "--client", target, "--seconds", str(seconds)],
                         stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    total = sum(int(p.communicate()[0].split()[-1]) for p in procs)
    return total / seconds


def measure(model: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    target = f"unix://{workdir}/{model}.sock"
    server = subprocess.Popen([sys.executable, __file__, "--serve", model, "--target", target],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = _latency(target, args.calls)
        for n in args.processes:
            out[f"calls_per_s_{n}p"] = _throughput(target, n, args.seconds)
        return out
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--serve", choices=["sync", "aio"], help=argparse.SUPPRESS)
    p.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        (_serve_sync if args.serve == "sync" else _serve_aio)(args.target)
        return 0
    if args.client:
        _client_loop(args.client, args.seconds)
        return 0
    with tempfile.TemporaryDirectory(prefix="hicache-grpc-model-") as tmp:
        results = {model: measure(model, args, Path(tmp)) for model in ("sync", "aio")}
    cols = ["p50_us", "p99_us", *(f"calls_per_s_{n}p" for n in args.processes)]
    print(f"{'server':8}" + "".join(f"{c:>18}" for c in cols))
    for model, r in results.items():
        print(f"{model:8}" + "".join(f"{r[c]:>18.0f}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
