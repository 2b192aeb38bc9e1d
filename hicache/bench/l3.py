"""`hicache bench l3` (and the L3 half of `hicache bench tiers`): each L3 backend vs its raw
client moving the same bytes in the same batches.

4,096 objects of 64 KiB payload (+ the 64-byte header, which the raw side moves too) from a
pool mapped like L2's (anonymous, huge pages advised) standing in for L2. Ours: `put_from` /
`get_into` (headers, checksums and verification included). Raw: file `os.write` /
`readinto` of plain files (in the same fan-out folders as ours, created before timing for
both); Mooncake `batch_put_from` / `batch_get_into` on the same registered buffer; Redis
pipelined `SET` / `GET` (copying each value into its slot, as ours must). The benchmark
starts its own redis-server and mooncake_master on free loopback ports. Fixed seed, a
warm-up round, then ours and raw alternate `--l3-repeat` times; each figure is the median,
ratio = ours / raw throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.argtypes import one_of, output_file, positive_int
from hicache.bench.services import ServiceError, start_mooncake_master, start_redis
from hicache.config import (
    FileStorageConfig,
    MooncakeStorageConfig,
    RedisStorageConfig,
    StorageConfig,
)
from hicache.tiers.storage import HEADER_BYTES, GetStatus, PutStatus, StorageBackend, build_backend
from hicache.tiers.storage.integrity import key_digest
from hicache.types import StorageBackendName

SEED = 0
BACKENDS = ("file", "mooncake", "redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--l3-objects", type=positive_int, default=4096, help="objects per run")
    parser.add_argument("--l3-object-kib", type=positive_int, default=64, help="payload KiB per object")
    parser.add_argument("--l3-batch", type=positive_int, default=256, help="objects per call")
    parser.add_argument("--l3-repeat", type=positive_int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--l3-backends", type=one_of(BACKENDS), default=",".join(BACKENDS),
                        help="comma-separated: " + ", ".join(BACKENDS))
    parser.add_argument(
        "--l3-dir", default=None, help="file backend directory (default: a temp dir)"
    )
    parser.add_argument("--l3-json", metavar="FILE", type=output_file, help="write the figures as JSON")


class _Pool:
    """Slots of header + payload in memory mapped like the L2 pool's (tiers/host.py): an
    anonymous mapping advised to use huge pages, so that hashing and copying pages meets
    the TLB as it does in the daemon (hashing 4,096 cold pages of 64 KiB measured ~10 %
    slower on 4 KiB pages here)."""

    def __init__(self, n: int, payload: int, seed: int | None) -> None:
        self.slot = HEADER_BYTES + payload
        size = n * self.slot
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # ignored where THP is off, as in the daemon
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.memory = np.frombuffer(self._map, dtype=np.uint8)
        self.pages = self.memory.reshape(n, self.slot)
        if seed is not None:
            rng = np.random.default_rng(seed)
            self.pages[:, HEADER_BYTES:] = rng.integers(0, 256, (n, payload), dtype=np.uint8)

    def addr(self, i: int) -> int:
        return int(self.memory.ctypes.data) + i * self.slot


class _Case:
    """One backend: our backend plus the raw operations on the same service."""

    def __init__(
        self, name: str, backend: StorageBackend, src: _Pool, dst: _Pool, batch: int
    ) -> None:
        self.name, self.backend, self.src, self.dst, self.batch = name, backend, src, dst, batch
        self.run = 0

    def batches(self, keys: list[str]) -> list[range]:
        return [
            range(lo, min(lo + self.batch, len(keys))) for lo in range(0, len(keys), self.batch)
        ]

    def keys(self, tag: str) -> list[str]:
        self.run += 1
        return [f"bench/{tag}/{self.run}/{i:08d}" for i in range(len(self.src.pages))]

    def ours_put(self, keys: list[str]) -> None:
        for b in self.batches(keys):
            out = self.backend.put_from([keys[i] for i in b], [self.src.pages[i] for i in b])
            assert all(s is PutStatus.STORED for s in out), out

    def ours_get(self, keys: list[str]) -> None:
        for b in self.batches(keys):
            out = self.backend.get_into([keys[i] for i in b], [self.dst.pages[i] for i in b])
            assert all(s is GetStatus.HIT for s in out), out

    def cleanup(self, keys: list[str]) -> None:
        self.backend.delete(keys)


def _timed(fn: Callable[[list[str]], None], keys: list[str]) -> float:
    t0 = time.perf_counter()
    fn(keys)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- raw sides


def _fan_out_tree(root: str) -> None:
    """Create `root/<00..ff>/<00..ff>`, the file backend's fan-out folders (outside timing)."""
    for a in range(256):
        for b in range(256):
            os.makedirs(os.path.join(root, f"{a:02x}", f"{b:02x}"), exist_ok=True)


def _raw_file(case: _Case, root: str) -> tuple[Callable[[list[str]], None], ...]:
    """Plain files in the same fan-out layout as ours (one file per key, named by the key's
    digest), written with `os.write` and read with `readinto`: no header work, no temp
    file and rename, no existence check. NOTE: not one flat folder: creating thousands of
    files in one fresh folder measured 3-4x slower here than in the fan-out tree, which
    made the raw side, not ours, the slow one."""
    raw_dir = os.path.join(root, "raw")
    _fan_out_tree(raw_dir)
    _fan_out_tree(os.path.join(root, "ours"))  # both sides start from the same tree

    def path(key: str) -> str:
        h = key_digest(key).hex()
        return f"{raw_dir}/{h[0:2]}/{h[2:4]}/{h}.kv"

    def put(keys: list[str]) -> None:
        for b in case.batches(keys):
            for i in b:
                fd = os.open(path(keys[i]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, memoryview(case.src.pages[i]))
                finally:
                    os.close(fd)

    def get(keys: list[str]) -> None:
        for b in case.batches(keys):
            for i in b:
                with open(path(keys[i]), "rb", buffering=0) as f:
                    f.readinto(memoryview(case.dst.pages[i]))

    def clean(keys: list[str]) -> None:
        for key in keys:
            os.unlink(path(key))

    return put, get, clean


def _raw_mooncake(case: _Case) -> tuple[Callable[[list[str]], None], ...]:
    store = case.backend.store  # type: ignore[attr-defined]
    size = case.src.slot

    def put(keys: list[str]) -> None:
        for b in case.batches(keys):
            codes = store.batch_put_from(
                [keys[i] for i in b], [case.src.addr(i) for i in b], [size] * len(b)
            )
            assert all(c == 0 for c in codes), codes

    def get(keys: list[str]) -> None:
        for b in case.batches(keys):
            codes = store.batch_get_into(
                [keys[i] for i in b], [case.dst.addr(i) for i in b], [size] * len(b)
            )
            assert all(c == size for c in codes), codes

    def clean(keys: list[str]) -> None:
        store.batch_remove(keys, True)

    return put, get, clean


def _raw_redis(case: _Case) -> tuple[Callable[[list[str]], None], ...]:
    client = case.backend.client  # type: ignore[attr-defined]

    def put(keys: list[str]) -> None:
        for b in case.batches(keys):
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.set(keys[i], memoryview(case.src.pages[i]))
            pipe.execute()

    def get(keys: list[str]) -> None:
        for b in case.batches(keys):
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.get(keys[i])
            for i, value in zip(b, pipe.execute(), strict=True):
                case.dst.pages[i] = np.frombuffer(value, dtype=np.uint8)

    def clean(keys: list[str]) -> None:
        for b in case.batches(keys):
            client.delete(*[keys[i] for i in b])

    return put, get, clean


# ----------------------------------------------------------------------------- driver


def _measure(
    case: _Case, raw: tuple[Callable[[list[str]], None], ...], repeat: int
) -> dict[str, float]:
    raw_put, raw_get, raw_clean = raw
    nbytes = len(case.src.pages) * case.src.slot
    times: dict[str, list[float]] = {"ours_put": [], "ours_get": [], "raw_put": [], "raw_get": []}
    for r in range(repeat + 1):  # round 0 is the warm-up
        for side in ("ours", "raw") if r % 2 == 0 else ("raw", "ours"):
            keys = case.keys(side)
            put, get, clean = (
                (case.ours_put, case.ours_get, case.cleanup) if side == "ours" else raw
            )
            os.sync()  # no write-back of the previous round inside this one's timing
            t_put = _timed(put, keys)
            t_get = _timed(get, keys)
            if r == 0:
                np.testing.assert_array_equal(
                    case.dst.pages[:, HEADER_BYTES:], case.src.pages[:, HEADER_BYTES:]
                )
            case.dst.pages[:] = 0
            clean(keys)
            if r > 0:
                times[f"{side}_put"].append(t_put)
                times[f"{side}_get"].append(t_get)
    del raw_put, raw_get, raw_clean
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}  # GB/s


def _open(
    name: str, args: argparse.Namespace, tmp: str, cleanup: list[Callable[[], object]]
) -> StorageBackend:
    nbytes = args.l3_objects * (HEADER_BYTES + args.l3_object_kib * 1024)
    if name == "file":
        cfg = StorageConfig(
            backend=StorageBackendName.FILE, file=FileStorageConfig(path=os.path.join(tmp, "ours"))
        )
    elif name == "redis":
        server = start_redis()
        cleanup.append(server.close)
        cfg = StorageConfig(
            backend=StorageBackendName.REDIS,
            timeout_s=30.0,
            redis=RedisStorageConfig(url=server.url, batch=args.l3_batch),
        )
    else:
        master = start_mooncake_master()
        cleanup.append(master.close)
        cfg = StorageConfig(
            backend=StorageBackendName.MOONCAKE,
            timeout_s=30.0,
            mooncake=MooncakeStorageConfig(
                master=master.master,
                metadata_server=master.metadata_server,
                global_segment_size=2 * nbytes + (64 << 20),
                local_buffer_size=64 << 20,
            ),
        )
    backend = build_backend(cfg)
    cleanup.append(backend.close)
    return backend


def run_l3(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every backend in `--l3-backends`; figures in GB/s plus `ratios` (ours/raw)."""
    payload = args.l3_object_kib * 1024
    src, dst = _Pool(args.l3_objects, payload, SEED), _Pool(args.l3_objects, payload, None)
    out: dict[str, Any] = {
        "objects": args.l3_objects,
        "object_bytes": src.slot,
        "batch": args.l3_batch,
    }
    ratios: dict[str, float] = {}
    skipped: dict[str, str] = {}
    tmp = args.l3_dir or tempfile.mkdtemp(prefix="hicache-bench-l3-")
    for name in [n.strip() for n in args.l3_backends.split(",") if n.strip()]:
        cleanup: list[Callable[[], object]] = []
        try:
            backend = _open(name, args, tmp, cleanup)
            for pool in (src, dst):
                backend.register_host_buffer(int(pool.memory.ctypes.data), pool.memory.nbytes)
            case = _Case(name, backend, src, dst, args.l3_batch)
            raw = (
                _raw_file(case, tmp)
                if name == "file"
                else (_raw_mooncake(case) if name == "mooncake" else _raw_redis(case))
            )
            figures = _measure(case, raw, args.l3_repeat)
        except (ServiceError, ImportError) as e:
            skipped[name] = str(e)
            continue
        finally:
            for fn in reversed(cleanup):
                fn()
        out[name] = figures
        ratios[f"{name}_put"] = figures["ours_put"] / figures["raw_put"]
        ratios[f"{name}_get"] = figures["ours_get"] / figures["raw_get"]
    if args.l3_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    out["ratios"] = ratios
    if skipped:
        out["skipped"] = skipped
    return out


def run(args: argparse.Namespace) -> int:
    result = run_l3(args)
    print(
        f"L3: {result['objects']} objects of {result['object_bytes']} bytes, batch {result['batch']} (GB/s, median)"
    )
    print(
        f"{'backend':<10}{'ours put':>10}{'raw put':>10}{'ratio':>8}{'ours get':>10}{'raw get':>10}{'ratio':>8}"
    )
    for name in BACKENDS:
        if name not in result:
            continue
        f, r = result[name], result["ratios"]
        print(
            f"{name:<10}{f['ours_put']:>10.2f}{f['raw_put']:>10.2f}{r[name + '_put']:>8.2f}"
            f"{f['ours_get']:>10.2f}{f['raw_get']:>10.2f}{r[name + '_get']:>8.2f}"
        )
    for name, why in result.get("skipped", {}).items():
        print(f"{name}: skipped ({why})")
    if args.l3_json:
        with open(args.l3_json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
