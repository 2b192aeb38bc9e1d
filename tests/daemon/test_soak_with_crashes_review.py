"""Soak review: several engine processes against one daemon, some killed with SIGKILL
mid-request and replaced (the same engine id with a new instance, or a new id).

The daemon serves a hybrid model (FULL + SWA + MAMBA) with a small L1 and L2 and a file
L3 (write-through), so eviction, L3 backups and prefetches all happen; `server.lease_ms`
is short so killed engines lapse quickly. Each engine process runs multi-turn
conversations sharing system prefixes, writes oracle KV (`KvOracle`) into every page it
is allocated before `Insert`, checks every page a match or a `Load` hands back, and now
and then uses sessions, prefetch (without a lock, polled), `Load`, `keep_lock` +
`mamba_checkpoint` inserts and a `Batch` for the final insert; every few requests its
heartbeat must report no lock or allocation (it holds none between requests: anything
else is a handle leaked into it, e.g. by a dead predecessor's late request). Each engine
writes its figures to a JSON file after every request (a killed one's stay). Standby
processes (imports done) take over a killed engine's id at once, so restarts within the
lease (`engine_restarts`) happen as well as lapses.

At the end: no engine saw a wrong byte; once every engine is gone and the leases lapsed
the daemon holds no lock or allocation (metrics gauges, Stats locked pages); it still
serves, its backends are healthy (shallow and deep), `hicache health` / `hicache stats`
agree, lapses + restarts equal the engine processes that attached, a SIGTERM then stops
it cleanly (exit 0, no shared memory left) and its log holds no traceback. A second test
kills an engine with its `Load` streaming and restarts it under its id at once.

`HICACHE_SOAK_S` lengthens the soak (default 35 s), `HICACHE_SOAK_SEED` picks the seed,
`HICACHE_SOAK_ENGINES` the number of engine processes at once (default 4),
`HICACHE_SOAK_PREFETCH` the prefetch policy (default timeout), `HICACHE_SOAK_L1_TO_L2` and
`HICACHE_SOAK_L2_TO_L3` the write policies (default write_through),
`HICACHE_SOAK_KILL_EVERY` the mean seconds between kills (default 2).
Engine workloads are deterministic by seed; kill times follow the seed too, but where a
kill lands in a request depends on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

PS = 4  # model.page_size
HYBRID = (
    "model.page_size=4",
    "model.components={full: {layers: 2, bytes_per_token_per_layer: 8},"
    " swa: {layers: 2, bytes_per_token_per_layer: 4, window_tokens: 8},"
    " mamba: {layers: 2, state_bytes_per_layer: 64}}",
)
SMALL = (
    "tiers.l1.tokens=256",  # 64 pages per paged pool
    "tiers.l1.mamba_slots=16",
    "tiers.l2.ratio=1.5",
    f"write.l1_to_l2={os.environ.get('HICACHE_SOAK_L1_TO_L2', 'write_through')}",
    f"write.l2_to_l3={os.environ.get('HICACHE_SOAK_L2_TO_L3', 'write_through')}",
    "prefetch.threshold_tokens=4",
    f"prefetch.policy={os.environ.get('HICACHE_SOAK_PREFETCH', 'timeout')}",
    "server.lease_ms=1500",
)
SHARED_PREFIXES = 3
PREFIX_TOKENS = 22  # 5.5 pages
HISTORY_CAP = 88  # tokens: a conversation longer than this starts over
CONVERSATIONS = 3  # per engine, interleaved
WORLD_SEED = 20261202  # the shared prefixes (the same for every engine and seed)


# ------------------------------------------------------------------------- engine process


def _u32(a: np.ndarray) -> bytes:
    return np.asarray(a, dtype="<u4").tobytes()


class _Report:
    def __init__(self, path: Path, engine_id: str, seed: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "engine_id": engine_id,
            "seed": seed,
            "pid": os.getpid(),
            "requests": 0,
            "done": 0,
            "pages_checked": 0,
            "wrong_bytes": 0,
            "pages_missing": 0,
            "reattaches": 0,
            "errors": {},
            "failures": [],
            "traceback": None,
            "prefetches": 0,
            "loads": 0,
            "keep_lock_inserts": 0,
            "sessions_closed": 0,
            "finished": False,
        }

    def error(self, e: BaseException) -> None:
        name = type(e).__name__
        self.data["errors"][name] = self.data["errors"].get(name, 0) + 1
        samples = self.data.setdefault("error_samples", [])
        if len(samples) < 5:
            samples.append(f"{name}: {e}")

    def failure(self, **what: Any) -> None:
        if len(self.data["failures"]) < 10:
            self.data["failures"].append(what)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def engine_main(target: str, seed: int, out: str) -> int:
    """One engine process: imports everything, then reads `ENGINE_ID DEADLINE` from stdin
    (a standby the supervisor starts ahead, so a replacement attaches within a lease of
    its predecessor's death), runs conversations until DEADLINE (time.time()), writes its
    figures to `out`. End of input before a line: exits at once (never attached)."""
    from hicache.bench.oracle import KvOracle
    from hicache.client import Client, insert_op, match_op
    from hicache.controller.base import PrefetchState
    from hicache.errors import (
        FailedPrecondition,
        HicacheError,
        NotFound,
        ResourceExhausted,
        Unavailable,
    )

    Path(out).with_suffix(".ready").touch()  # (imported: the supervisor may start the clock)
    line = sys.stdin.readline().split()
    if not line:
        return 0
    engine_id, deadline = line[0], float(line[1])
    rng = np.random.default_rng(seed)
    world = np.random.default_rng(WORLD_SEED)
    shared = [world.integers(1, 1 << 24, PREFIX_TOKENS) for _ in range(SHARED_PREFIXES)]
    rep = _Report(Path(out), engine_id, seed)
    client = Client(target, engine_id=engine_id, timeout_s=20)
    att = client.attach()
    oracle = KvOracle(att.info, att.pools)
    rep.save()  # attached: the daemon counts this process's lease from here
    mamba = {m.name for m in att.info.members if m.component.value == "mamba"}

    def check(tokens: bytes, pages: Any, n_pages: int, where: str, turn: int) -> None:
        before = (oracle.wrong_bytes, oracle.pages_missing)
        oracle.verify(tokens, pages, n_pages)
        rep.data["pages_checked"] = oracle.pages_checked
        rep.data["wrong_bytes"] = oracle.wrong_bytes
        rep.data["pages_missing"] = oracle.pages_missing
        if (oracle.wrong_bytes, oracle.pages_missing) != before:
            rep.failure(
                where=where,
                turn=turn,
                tokens=len(tokens) // 4,
                n_pages=n_pages,
                wrong=oracle.wrong_bytes - before[0],
                missing=oracle.pages_missing - before[1],
                pages={k: [int(x) for x in v] for k, v in pages.items()},
            )

    def release_quietly(lock_id: int, allocation_id: int) -> None:
        for kw in ({"lock_id": lock_id}, {"allocation_id": allocation_id}):
            if next(iter(kw.values())):
                with contextlib.suppress(HicacheError):
                    client.release(**kw)

    def request(turn: int, prompt: np.ndarray, full: np.ndarray, session: str) -> None:
        pb, fb = _u32(prompt), _u32(full)
        if rng.random() < 0.3:
            m0 = client.match(pb, prefetch=True, session_id=session)
            if m0.prefetch_id:
                rep.data["prefetches"] += 1
                end = time.monotonic() + 3.0
                while client.prefetch_status(m0.prefetch_id).state is PrefetchState.RUNNING:
                    if time.monotonic() > end:
                        client.cancel_prefetch(m0.prefetch_id)
                        break
                    time.sleep(0.005)
        m = client.match(pb, lock=True, allocate_tokens=len(full), session_id=session)
        try:
            start = m.device_tokens // PS
            check(pb, m.device_pages, start, "match", turn)
            if m.host_tokens and rng.random() < 0.8:
                *_, last = list(client.load(m.lock_id))
                rep.data["loads"] += 1
                assert last.device_tokens is not None and last.device_pages is not None
                check(pb, last.device_pages, last.device_tokens // PS, "load", turn)
            for name, ids in m.pages.items():
                want = 1 if name in mamba else -(-len(full) // PS) - start
                if len(ids) != want or (np.asarray(ids) < 0).any():
                    rep.failure(
                        where="allocation",
                        turn=turn,
                        member=name,
                        ids=[int(x) for x in ids],
                        want=want,
                    )
                    raise AssertionError(f"allocation of {name}: {list(ids)}, want {want} ids")
            prompt_pages = len(prompt) // PS
            if prompt_pages > start and rng.random() < 0.3:
                # Prefill, a mid-request insert with a checkpoint, then decode on.
                oracle.write(pb, m.pages, start)
                client.insert(
                    pb,
                    lock_id=m.lock_id,
                    allocation_id=m.allocation_id,
                    session_id=session,
                    keep_lock=True,
                    mamba_checkpoint=True,
                )
                rep.data["keep_lock_inserts"] += 1
                rest = {
                    n: (ids if n in mamba else ids[prompt_pages - start :])
                    for n, ids in m.pages.items()
                }
                oracle.write(fb, rest, prompt_pages)
            else:
                oracle.write(fb, m.pages, start)
            if rng.random() < 0.2:
                time.sleep(float(rng.uniform(0, 0.05)))  # a wider window for a kill
            final = {"lock_id": m.lock_id, "allocation_id": m.allocation_id}
            if rng.random() < 0.25:  # a scheduler step: the insert and a lookup in one Batch
                done, _ = client.batch(
                    [
                        insert_op(fb, session_id=session, mamba_checkpoint=True, **final),
                        match_op(fb[: len(pb)]),
                    ]
                )
                if isinstance(done, BaseException):
                    raise done
                rep.data["batches"] = rep.data.get("batches", 0) + 1
            else:
                client.insert(fb, session_id=session, mamba_checkpoint=True, **final)
        except BaseException:
            release_quietly(m.lock_id, m.allocation_id)
            raise

    # A few conversations interleaved (a wider working set: more of it leaves L1 and L2).
    histories = [np.empty(0, dtype=np.uint32) for _ in range(CONVERSATIONS)]
    sessions = [""] * CONVERSATIONS
    conversations = 0
    turn = 0
    try:
        while time.time() < deadline:
            k = turn % CONVERSATIONS
            history, session = histories[k], sessions[k]
            if len(history) == 0 or len(history) > HISTORY_CAP:
                if session and rng.random() < 0.7:
                    try:
                        client.close_session(session)
                        rep.data["sessions_closed"] += 1
                    except HicacheError as e:
                        rep.error(e)
                conversations += 1
                history = shared[int(rng.integers(SHARED_PREFIXES))]
                session = f"{engine_id}-{seed}-{conversations}" if rng.random() < 0.4 else ""
                histories[k], sessions[k] = history, session
            prompt = np.concatenate([history, rng.integers(1, 1 << 24, int(rng.integers(3, 20)))])
            full = np.concatenate([prompt, rng.integers(1, 1 << 24, int(rng.integers(1, 9)))])
            turn += 1
            rep.data["requests"] += 1
            try:
                request(turn, prompt, full, session)
                rep.data["done"] += 1
                histories[k] = full
            except (ResourceExhausted, Unavailable) as e:
                rep.error(e)
                time.sleep(0.02)
            except (NotFound, FailedPrecondition) as e:
                rep.error(e)
                if (
                    client.detached is not None
                    or "lease expired" in str(e)
                    or "not attached" in str(e)
                ):
                    att = client.attach()
                    oracle.pools = att.pools
                    rep.data["reattaches"] += 1
            if turn % 5 == 0 or time.time() >= deadline:
                # Between requests this engine holds nothing: anything the daemon holds
                # for it is a leak (e.g. a dead predecessor's request landing after this
                # process's Attach released what the predecessor held).
                try:
                    hb = client.heartbeat()
                except HicacheError as e:
                    rep.error(e)
                else:
                    if hb.locks or hb.allocations:
                        rep.data["phantom_handles"] = rep.data.get("phantom_handles", 0) + 1
                        rep.failure(
                            where="heartbeat", turn=turn, locks=hb.locks, allocations=hb.allocations
                        )
            rep.save()
        rep.data["finished"] = True
    except BaseException:
        rep.data["traceback"] = traceback.format_exc()
        rep.save()
        return 1
    finally:
        client.close()
    rep.save()
    return 0


# ------------------------------------------------------------------------- the soak


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in the metrics"
    return float(m.group(1))


class Soak:
    """A daemon and a supervisor of engine processes."""

    def __init__(self, tmp: Path, seed: int, seconds: float, engines: int) -> None:
        from .daemonkit import Daemon, free_port

        self.tmp = tmp
        self.seed = seed
        self.seconds = seconds
        self.engines = engines
        self.rng = random.Random(seed)
        self.metrics_port = free_port()
        self.daemon = Daemon(
            tmp,
            *HYBRID,
            *SMALL,
            "storage.backend=file",
            f"storage.file.path={tmp / 'l3'}",
            f"metrics.port={self.metrics_port}",
        )
        self.runs: list[dict[str, Any]] = []  # every engine process started
        self.kills = 0

    def _spawn(self) -> dict[str, Any]:
        n = len(self.runs)
        out = self.tmp / f"engine-{n}.json"
        seed = self.seed * 1000 + n
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
            ),
        )
        log = open(self.tmp / f"engine-{n}.log", "wb")  # noqa: SIM115 (closed in run)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "daemon.test_soak_with_crashes_review",
                self.daemon.target,
                str(seed),
                str(out),
            ],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        run = {
            "engine_id": None,
            "seed": seed,
            "proc": proc,
            "out": out,
            "log": log,
            "killed": False,
        }
        self.runs.append(run)
        return run

    def start_engine(self, engine_id: str, deadline: float) -> dict[str, Any]:
        """The standby (spawned earlier, torch imported) becomes `engine_id` now."""
        run = self.standby.pop(0) if self.standby else self._spawn()
        run["engine_id"] = engine_id
        assert run["proc"].stdin is not None
        run["proc"].stdin.write(f"{engine_id} {deadline!r}\n".encode())
        run["proc"].stdin.close()
        return run

    def run(self) -> None:
        self.daemon.start()
        # Every engine process imports torch first: on a loaded machine that can take longer
        # than the soak. The clock starts once the first engines are ready to attach, so the
        # soak's seconds are spent on requests whatever the machine's load.
        self.standby: list[dict[str, Any]] = [self._spawn() for _ in range(self.engines + 2)]
        ready_by = time.monotonic() + 120
        while (time.monotonic() < ready_by
               and not all(r["out"].with_suffix(".ready").exists()
                           for r in self.standby[: self.engines])):
            time.sleep(0.1)
        deadline = time.time() + self.seconds
        live = [self.start_engine(f"engine-{i}", deadline) for i in range(self.engines)]
        fresh = self.engines
        while True:
            pause = self.rng.uniform(0.5, 1.5) * float(
                os.environ.get("HICACHE_SOAK_KILL_EVERY", "2")
            )
            if time.time() + pause > deadline - 4:
                break
            time.sleep(pause)
            slot = self.rng.randrange(len(live))
            victim = live[slot]
            if not victim["out"].exists() and victim["proc"].poll() is None:
                continue  # not attached yet (still importing): a kill then tests nothing
            if victim["proc"].poll() is None:
                victim["proc"].send_signal(signal.SIGKILL)
                victim["killed"] = True
                self.kills += 1
            victim["proc"].wait(timeout=30)
            if self.rng.random() < 0.5:
                engine_id = victim["engine_id"]  # the same engine restarted
            else:
                engine_id = f"engine-{fresh}"
                fresh += 1
            live[slot] = self.start_engine(engine_id, deadline)
            self.standby.append(self._spawn())
        for run in self.standby:  # never attached
            assert run["proc"].stdin is not None
            run["proc"].stdin.close()
        for run in self.runs:
            try:
                run["proc"].wait(timeout=max(60.0, deadline - time.time() + 60))
            except subprocess.TimeoutExpired:
                run["proc"].kill()
                run["proc"].wait()
                run["hung"] = True
            run["log"].close()

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for run in self.runs:
            if run["engine_id"] is None:
                continue  # a standby never used
            data = json.loads(run["out"].read_text()) if run["out"].exists() else {}
            out.append(
                {
                    **data,
                    "killed": run["killed"],
                    "rc": run["proc"].returncode,
                    "hung": run.get("hung", False),
                    "engine_id": run["engine_id"],
                    "seed": run["seed"],
                    "log": Path(run["log"].name).read_text(errors="replace")[-3000:],
                }
            )
        return out

    def metrics(self) -> str:
        from .daemonkit import scrape

        return scrape(self.metrics_port)

    def close(self) -> None:
        for run in self.runs:
            if run["proc"].poll() is None:
                run["proc"].kill()
                run["proc"].wait()
        self.daemon.close()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def test_engines_killed_mid_request_leave_nothing_held_and_no_wrong_byte(tmp_path: Path) -> None:
    from hicache.client import Client

    from .daemonkit import run_cli

    seed = _env_int("HICACHE_SOAK_SEED", 1)
    soak = Soak(tmp_path, seed, _env_int("HICACHE_SOAK_S", 35), _env_int("HICACHE_SOAK_ENGINES", 4))
    try:
        soak.run()
        reports = soak.reports()
        ctx = f"seed={seed}; reports without logs: " + json.dumps(
            [{k: v for k, v in r.items() if k not in ("log", "failures")} for r in reports]
        )
        # Every engine: no wrong byte, no page missing from a reply; the survivors ran
        # to their end without a traceback.
        for r in reports:
            assert (
                r.get("wrong_bytes", 0) == 0
                and r.get("pages_missing", 0) == 0
                and not r.get("phantom_handles")
            ), f"seed={seed} engine {r['engine_id']} (seed {r['seed']}): {r['failures']}"
            assert not r["hung"], f"seed={seed}: engine {r['engine_id']} hung:\n{r['log']}"
            if not r["killed"]:
                assert r["rc"] == 0 and r.get("finished"), (
                    f"seed={seed}: engine {r['engine_id']} rc={r['rc']}: "
                    f"{r.get('traceback')}\n{r['log']}"
                )
        survivors = [r for r in reports if not r["killed"]]
        assert sum(r["pages_checked"] for r in survivors) > 0, ctx
        assert soak.kills >= 3, ctx

        # Once every engine is gone and its lease lapsed: nothing held, every lapse or
        # restart counted (one per process, plus an engine's re-attach after a lapse).
        # (A process killed before it attached left no report and no lease.)
        attached = [r for r in reports if "pid" in r]
        expected = len(attached) + sum(r["reattaches"] for r in attached)
        with Client(soak.daemon.target, timeout_s=10) as probe:
            end = time.monotonic() + 60
            while True:
                text = soak.metrics()
                stats = probe.stats()
                held = (
                    _metric(text, "hicache_active_locks"),
                    _metric(text, "hicache_active_allocations"),
                    sum(p.locked_pages for p in stats.pools),
                )
                ended = stats.counters["expired_leases"] + _metric(
                    text, "hicache_engine_restarts_total"
                )
                if (held == (0, 0, 0) and ended >= expected) or time.monotonic() > end:
                    break
                time.sleep(0.25)
            assert held == (0, 0, 0), f"held (locks, allocations, locked pages) {held}; {ctx}"
            assert ended == expected, f"lapses + restarts {ended} != {expected}; {ctx}"
            # (read again, both now that every lapse is in: the scrape above came before
            # the Stats call, and a lease could lapse in between)
            text, stats = soak.metrics(), probe.stats()
            assert _metric(text, "hicache_expired_leases_total") == stats.counters["expired_leases"]
            assert probe.serving() and probe.serving("hicache.v1.HiCache")
            assert all(b.healthy for b in probe.health()), probe.health()
            assert all(b.healthy for b in probe.health(deep=True)), probe.health(deep=True)
            counters = stats.counters
            # What the soak is for happened: eviction, L3 backups, prefetches.
            assert counters["evictions_device"] > 0 and counters["backups_storage"] > 0, counters
            assert sum(r.get("prefetches", 0) for r in reports) > 0, ctx
        assert soak.daemon.proc is not None and soak.daemon.proc.poll() is None
        health = run_cli("health", "--target", soak.daemon.target, "--json")
        assert health.returncode == 0, health.stdout + health.stderr
        cli = run_cli("stats", "--target", soak.daemon.target, "--json")
        assert cli.returncode == 0, cli.stdout + cli.stderr
        report = json.loads(cli.stdout)
        assert report["counters"]["expired_leases"] >= stats.counters["expired_leases"]
        for p in report["pools"]:
            assert p["locked_pages"] == 0 and 0 <= p["used_pages"] <= p["capacity_pages"], p
        totals = {
            k: sum(r.get(k, 0) for r in reports)
            for k in (
                "requests",
                "done",
                "pages_checked",
                "prefetches",
                "loads",
                "keep_lock_inserts",
                "sessions_closed",
                "reattaches",
                "batches",
            )
        }
        errors: dict[str, int] = {}
        for r in reports:
            for k, v in r.get("errors", {}).items():
                errors[k] = errors.get(k, 0) + v
        print(
            f"soak seed={seed}: {len(reports)} engines, {soak.kills} killed, {totals}, errors {errors}, restarts "
            f"{_metric(text, 'hicache_engine_restarts_total')}, "
            f"counters {report['counters']}"
        )
        # A clean stop after the soak: exit 0, its shared memory gone.
        pid = soak.daemon.proc.pid
        assert soak.daemon.stop(signal.SIGTERM) == 0, soak.daemon.log()[-6000:]
        left = sorted(p.name for p in Path("/dev/shm").glob(f"hicache-*-{pid}-*"))
        assert not left, f"seed={seed}: shared memory left after a clean stop: {left}"
        log = soak.daemon.log()
        for bad in ("Traceback", "failed unexpectedly"):
            assert bad not in log, f"seed={seed}: {bad!r} in the daemon log:\n{log[-6000:]}"
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(engine_main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))


LOAD_THEN_DIE = """
import os, sys
import numpy as np
from hicache.client import Client
c = Client(sys.argv[1], engine_id="victim")
c.attach()
prompt = np.frombuffer(bytes.fromhex(sys.argv[2]), dtype="<u4").tobytes()
m = c.match(prompt, lock=True, allocate_tokens=len(prompt) // 4 + 8, prefetch=True)
assert m.host_tokens > 0, m
stream = c.load(m.lock_id)
next(stream)
print("loading", flush=True)
os.kill(os.getpid(), 9)
"""


def test_an_engine_killed_mid_load_and_restarted_at_once_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    """A process killed with its Load streaming (and a prefetch of the rest running),
    replaced at once under its engine id: the restart releases the lock under the copy;
    nothing stays held, the prefix reads back right, the daemon logs no traceback."""
    from hicache.bench.oracle import KvOracle
    from hicache.client import Client

    from .daemonkit import Daemon, free_port

    port = free_port()
    d = Daemon(
        tmp_path,
        *HYBRID,
        *SMALL,
        "storage.backend=file",
        f"storage.file.path={tmp_path / 'l3'}",
        f"metrics.port={port}",
    ).start()
    try:
        rng = np.random.default_rng(11)
        prompt = _u32(rng.integers(1, 1 << 24, 30 * PS))
        with d.client(engine_id="writer") as w:
            att = w.attach()
            oracle = KvOracle(att.info, att.pools)

            def put(tokens: bytes) -> None:
                m = w.match(tokens, lock=True, allocate_tokens=len(tokens) // 4)
                oracle.write(tokens, m.pages, m.device_tokens // PS)
                w.insert(
                    tokens, lock_id=m.lock_id, allocation_id=m.allocation_id, mamba_checkpoint=True
                )

            put(prompt)
            for _ in range(3):  # push it out of L1 (L2 keeps it)
                put(_u32(rng.integers(1, 1 << 24, 20 * PS)))
            w.flush(timeout_s=10)
            assert w.match(prompt).host_tokens > 0
            child = subprocess.run(
                [sys.executable, "-c", LOAD_THEN_DIE, d.target, prompt.hex()],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
            with Client(d.target, engine_id="victim", timeout_s=20) as heir:
                heir.attach(map_pools=False)
                hb = heir.heartbeat()
                assert (hb.locks, hb.allocations) == (0, 0)
            from .daemonkit import scrape

            end = time.monotonic() + 30
            while True:
                text = scrape(port)
                held = (
                    _metric(text, "hicache_active_locks"),
                    _metric(text, "hicache_active_allocations"),
                    sum(p.locked_pages for p in w.stats().pools),
                )
                if held == (0, 0, 0) or time.monotonic() > end:
                    break
                time.sleep(0.2)
            assert held == (0, 0, 0), held
            assert _metric(text, "hicache_engine_restarts_total") == 1
            m = w.match(prompt, lock=True)
            try:
                pages, n = m.device_pages, m.device_tokens
                if m.host_tokens:
                    *_, last = list(w.load(m.lock_id))
                    assert last.device_pages is not None and last.device_tokens is not None
                    pages, n = last.device_pages, last.device_tokens
                assert n > 0
                oracle.verify(prompt, pages, n // PS)
            finally:
                w.release(lock_id=m.lock_id)
            assert oracle.wrong_bytes == 0 and oracle.pages_missing == 0
        assert d.proc is not None and d.proc.poll() is None
        log = d.log()
        for bad in ("Traceback", "failed unexpectedly"):
            assert bad not in log, log[-6000:]
    finally:
        d.close()
